"""Large-batch equivalence for tf_keras optimizers, drawn.

Every optimizer tf_keras ships, new (`tf_keras.optimizers.*`) and legacy
(`tf_keras.optimizers.legacy.*`, OptimizerV2), with random hyperparameters,
trained by `model.fit` (graph or `run_eagerly`) with `accumulate(opt, n)` on
micro-batches of B samples, against the plain optimizer fitted on batches of
B * n samples: same initial weights, same data order. Weights, every
optimizer variable and `iterations` must agree to float32 rounding (or, for
an entry where two equivalent plain runs already differ by more, within
`FLOOR_FACTOR` times that; see `property_tests.harness.rounding_floor`).
The trailing micro-batches of an unfinished cycle must leave no trace.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gradaccum import accumulate
from property_tests.harness import scaled
from property_tests.strategies import tf_keras_optimizers
from tests.helpers import (
    assert_finite,
    assert_states_close,
    fit,
    full_state,
    gradients,
    make_data,
    make_mlp,
    rounding_floor,
)


def _summed(spec, x, y, n: int, micro_batch: int) -> dict:
    """The plain optimizer, applied eagerly to the float32 mean of the
    micro-batch gradients of each large batch (no gradaccum involved)."""
    model, opt = make_mlp(), spec.make()
    batch = n * micro_batch
    for start in range(0, len(x), batch):
        total = None
        for k in range(start, start + batch, micro_batch):
            grads = gradients(model, x[k : k + micro_batch], y[k : k + micro_batch])
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        opt.apply_gradients(zip([t / n for t in total], model.trainable_variables))
    return full_state(model, opt)


@scaled(10)
@given(
    spec=tf_keras_optimizers(),
    n=st.integers(2, 4),
    micro_batch=st.integers(1, 4),
    cycles=st.integers(1, 3),
    extra=st.integers(0, 3),
    mode=st.sampled_from(["masked", "skip"]),
    run_eagerly=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fit_on_micro_batches_equals_the_large_batch(
    spec, n, micro_batch, cycles, extra, mode, run_eagerly, seed
):
    extra = min(extra, n - 1)
    x, y = make_data(micro_batch * (n * cycles + extra), seed=seed)
    full = micro_batch * n * cycles  # the reference sees whole batches only
    reference_model, reference_opt = make_mlp(), spec.make()
    fit(reference_model, reference_opt, x[:full], y[:full], micro_batch * n,
        run_eagerly=run_eagerly)
    reference = full_state(reference_model, reference_opt)
    assert_finite(reference)

    model = make_mlp()
    opt = accumulate(spec.make(), n, mode=mode)
    fit(model, opt, x, y, micro_batch, run_eagerly=run_eagerly)
    subject = full_state(model, opt)
    assert int(opt.micro_step) == extra
    try:
        assert_states_close(reference, subject)
    except AssertionError:
        summed = _summed(spec, x[:full], y[:full], n, micro_batch)
        assert_states_close(reference, subject, floor=rounding_floor(reference, summed))
