"""Distribution through Keras's own engine on JAX: `DataParallel` over two
devices equals one device on the large batch, and the replicas agree."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from tests.helpers import BACKEND, as_int, assert_states_close, fit, full_state, make_data, make_mlp
from tests.helpers.devices import two_devices

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution runs on JAX")

N, B = 4, 8  # B: the global micro-batch, split over the two devices


@pytest.mark.parametrize("jit", (True, False))
def test_data_parallel_equals_one_device_on_the_large_batch(jit):
    x, y = make_data(B * N * 3)
    ref_model, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(ref_model, ref_opt, x, y, B * N, jit_compile=jit)

    distribution = keras.distribution.DataParallel(devices=two_devices())
    with distribution.scope():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), N)
        fit(model, opt, x, y, B, jit_compile=jit)
    assert as_int(opt.iterations) == 3
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))
    # Every variable but the accumulators is replicated, and the two devices
    # hold the same values. The accumulators are device-local: one entry
    # per device, each device holding its own (its variable's size).
    for v in list(model.weights) + list(opt.variables):
        shards = [np.asarray(s.data) for s in v.value.addressable_shards]
        assert len(shards) == 2, v.path
        if "gradaccum_accumulator" in v.path:
            assert v.shape[0] == 2 and all(s.shape == (1, *v.shape[1:]) for s in shards), v.path
        else:
            assert np.array_equal(shards[0], shards[1]), v.path
