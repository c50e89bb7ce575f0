"""`micro_batch_size="auto"` with a `memory_limit` under JAX's
`keras.distribution.DataParallel` on two devices, predicted and run again
smaller after an out-of-memory error: equal to plain `fit` on one device."""

from __future__ import annotations

import contextlib
import warnings

import keras
import pytest

from gradaccum import accumulate
from gradaccum._auto_size import search_of
from gradaccum._backend.memory import out_of_memory_above
from tests.helpers import as_int, assert_states_close, fit, full_state, internal_core, make_data, make_mlp
from tests.helpers.devices import two_devices

B = 8


@pytest.mark.parametrize(("limit", "above", "chosen"), ((2**40, None, 2 * B), (2**40, 4, 4)))
def test_data_parallel_with_a_memory_limit_equals_one_device(limit, above, chosen):
    x, y = make_data(4 * B + 6)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, 2 * B)
    with keras.distribution.DataParallel(devices=two_devices()).scope():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto", memory_limit=limit)
        with out_of_memory_above(above) if above else contextlib.nullcontext():
            fit(model, opt, x, y, 2 * B)
    assert opt.micro_batch_size == chosen
    assert search_of(internal_core(opt)).compilations == 2
    assert as_int(opt.iterations) == 3
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))


def test_data_parallel_with_a_memory_limit_below_the_variables_says_what_it_needs():
    x, y = make_data(2 * B)
    with keras.distribution.DataParallel(devices=two_devices()).scope():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto", memory_limit=100)
        with pytest.raises(MemoryError, match=r"needs \d+ bytes .* has 100 bytes \(memory_limit\)"):
            fit(model, opt, x, y, 2 * B)
    assert as_int(opt.iterations) == 0


def test_data_parallel_sizes_split_evenly_over_the_devices():
    """After running out of memory above 3 samples, the batch of 6 runs in
    micro-batches of 2 (1 a device), not 3, which two devices cannot share:
    each device computes its gradients on its own share, and the gradients
    are all-reduced once per batch (no warning that they are not)."""
    x, y = make_data(3 * 6)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, 6)
    with keras.distribution.DataParallel(devices=two_devices()).scope():
        model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto")
        with out_of_memory_above(3), warnings.catch_warnings():
            warnings.filterwarnings("error", message="gradaccum: the gradients are all-reduced on every micro-step")
            fit(model, opt, x, y, 6)
    assert opt.micro_batch_size == 2
    assert as_int(opt.iterations) == 3
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))
