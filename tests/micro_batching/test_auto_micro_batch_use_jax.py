"""`micro_batch_size="auto"` with a `memory_limit` under JAX's
`keras.distribution.DataParallel` on two devices, predicted and run again
smaller after an out-of-memory error: equal to plain `fit` on one device."""

from __future__ import annotations

import contextlib

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
