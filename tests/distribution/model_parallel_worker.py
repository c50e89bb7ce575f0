"""A 2 x 2 mesh on four JAX host devices (for tests): the batch split over
"batch", the kernels over "model". Started by
`tests/distribution/test_data_parallel_local.py` in a process of its own, since
the number of host devices is fixed when JAX starts.

    python -m tests.distribution.model_parallel_worker

Exits 0 when `fit` with gradaccum equals one device on the large batch,
without falling back, with device-local accumulators sharded over both axes
and the gradients all-reduced over the batch axis only in the apply branch.
"""

from __future__ import annotations

import os
import warnings

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import keras  # noqa: E402

from gradaccum import accumulate  # noqa: E402
from tests.distribution.test_data_parallel_local import FALLBACK, _all_reduces, _optimized_train_step  # noqa: E402
from tests.helpers import assert_states_close, fit, full_state, make_data, make_mlp  # noqa: E402

N, B = 4, 8
# Wide enough that each device's share of a kernel's gradient (out: 8 x 3)
# is larger than the activations the model axis sums in the forward pass
# (out: B/2 rows x 3).
WIDTH = 16


def main() -> None:
    x, y = make_data(B * N * 2)
    reference = make_mlp(widths=(WIDTH,))
    reference_opt = keras.optimizers.Adam(1e-2)
    fit(reference, reference_opt, x, y, B * N)

    assert len(jax.devices()) == 4, jax.devices()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices())
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["mlp/hidden0/kernel"] = (None, "model")
    layouts["mlp/out/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
    with distribution.scope(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = make_mlp(widths=(WIDTH,))
        opt = accumulate(keras.optimizers.Adam(1e-2), N)
        fit(model, opt, x, y, B)
        outside, _ = _all_reduces(_optimized_train_step(model, x[:B], y[:B]))
    assert not [w for w in caught if FALLBACK in str(w.message)]
    specs = {v.path: tuple(v.value.sharding.spec) for v in opt.variables if "gradaccum_accumulator" in v.path}
    assert specs["gradaccum_accumulator_0"] == ("batch", None, "model"), specs
    assert specs["gradaccum_accumulator_2"] == ("batch", "model", None), specs
    # Every micro-step: scalars, and the partial sums of the output layer's
    # activations over the model axis (one device's rows x 3 outputs); no
    # gradient, whose smallest kernel share is (WIDTH / 2) x 3.
    assert max(outside) <= (B // 2) * 3 < (WIDTH // 2) * 3, outside
    assert_states_close(full_state(reference, reference_opt), full_state(model, opt))


if __name__ == "__main__":
    main()
