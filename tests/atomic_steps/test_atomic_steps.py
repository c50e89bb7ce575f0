"""A step that raises changes nothing, on every backend.

The wrapped optimizer's update fails on the step that ends a cycle (one
call of its update (`_backend_update_step` or `update_step`) raises, as a plain optimizer's update
would): the weights, the optimizer's variables, the accumulators and the
counters are as they were before that call, as a plain optimizer leaves
them; the same micro-batch retried then ends exactly as the large batch
without the failure.
"""

from __future__ import annotations

import keras
import pytest

from gradaccum import accumulate
from tests.helpers import (
    BACKEND,
    accumulation_arrays,
    assert_states_close,
    assert_states_equal,
    concat,
    fit,
    full_state,
    make_data,
    make_mlp,
    split,
    train_steps,
    whole_state,
)


class Injected(RuntimeError):
    """The failure a test injects."""


def fail_once(optimizer) -> None:
    """Makes the next call of the (wrapped) optimizer's update raise
    `Injected`; later calls run as before."""
    inner = getattr(optimizer, "__wrapped__", optimizer)
    # The first call of any of these methods raises, before anything is
    # written: `_backend_update_step` runs all variables at once (PyTorch's
    # fused update calls nothing else), `update_step` one variable
    # (TensorFlow's masked update calls it directly, as tf_keras's optimizer
    # does), `_resource_apply_dense` one variable of a tf_keras OptimizerV2.
    calls = []

    def failing(original):
        def call(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise Injected("the wrapped optimizer's update failed")
            return original(*args, **kwargs)

        return call

    for name in ("_backend_update_step", "update_step", "_resource_apply_dense"):
        if hasattr(inner, name):
            setattr(inner, name, failing(getattr(inner, name)))


def _fails_then_retried(model, opt, batches, at, failing=None):
    """Trains micro-batch `batches[at]` with the update of `failing` (the
    accumulating optimizer, unless given) failing once: checks that nothing
    changed, then trains `batches[at:]`."""
    before = whole_state(model, opt)
    fail_once(opt if failing is None else failing)
    with pytest.raises(Injected):
        train_steps(model, opt, batches[at : at + 1])
    assert_states_equal(before, whole_state(model, opt), "a failed apply step")
    train_steps(model, opt, batches[at:])


def _reference(batches, n):
    model = make_mlp()
    opt = keras.optimizers.Adam(1e-2)
    opt.build(model.trainable_variables)
    large = [concat(batches[k : k + n]) for k in range(0, len(batches), n)]
    return train_steps(model, opt, large)


def test_failed_apply_step_changes_nothing_and_its_retry_equals_the_large_batch(mode):
    x, y = make_data(24)
    batches = split(x, y, 4)  # two cycles of three
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 3, mode=mode)
    opt.build(model.trainable_variables)
    train_steps(model, opt, batches[:2])
    _fails_then_retried(model, opt, batches, 2)
    assert_states_close(_reference(batches, 3), full_state(model, opt))


def test_failed_apply_step_puts_back_the_noise_scale_and_bfloat16_sums():
    """The noise scale's estimates (measured before the update runs) and
    compensated bfloat16 accumulators are put back too."""
    x, y = make_data(36)
    batches = split(x, y, 4)  # three cycles of three
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 3, noise_scale=True, accumulator_dtype="bfloat16")
    opt.build(model.trainable_variables)
    train_steps(model, opt, batches[:5])
    assert "noise_cycles" in whole_state(model, opt)
    _fails_then_retried(model, opt, batches, 5)
    retried = whole_state(model, opt)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 3, noise_scale=True, accumulator_dtype="bfloat16")
    opt.build(model.trainable_variables)
    assert_states_equal(train_steps(model, opt, batches) | accumulation_arrays(opt), retried, "never failed")


def test_eager_in_between_steps_leave_the_update_alone(mode):
    """Eagerly, only the step that ends a cycle runs the wrapped optimizer's
    update: a failure in it cannot come on an in-between step, after that
    step's gradients were added."""
    x, y = make_data(24)
    batches = split(x, y, 4)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 3, mode=mode)
    opt.build(model.trainable_variables)
    fail_once(opt)
    train_steps(model, opt, batches[:2])
    before = whole_state(model, opt)
    with pytest.raises(Injected):
        train_steps(model, opt, batches[2:3])
    assert_states_equal(before, whole_state(model, opt), "a failed apply step")
    train_steps(model, opt, batches[2:])
    assert_states_close(_reference(batches, 3), full_state(model, opt))


@pytest.mark.skipif(
    BACKEND == "jax",
    reason="Keras's JAX `fit` leaves the model's variables without values after an exception in its "
    "step, with any optimizer; the custom loop above covers JAX",
)
def test_failed_apply_step_in_eager_fit_changes_nothing(mode):
    """`fit(run_eagerly=True)`: a micro-batch whose update fails, fitted
    again, ends as the large batch."""
    x, y = make_data(16)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 2, mode=mode)
    fit(model, opt, x[:4], y[:4], 4, run_eagerly=True)
    before = whole_state(model, opt)
    fail_once(opt)
    with pytest.raises(Injected):
        model.fit(x[4:8], y[4:8], batch_size=4, shuffle=False, verbose=0)
    assert_states_equal(before, whole_state(model, opt), "a failed apply step in fit")
    model.fit(x[4:], y[4:], batch_size=4, shuffle=False, verbose=0)
    reference = make_mlp()
    plain = keras.optimizers.Adam(1e-2)
    fit(reference, plain, x, y, 8, run_eagerly=True)
    assert_states_close(full_state(reference, plain), full_state(model, opt))


def test_failed_flush_changes_nothing(mode):
    """`flush()` of a partial cycle whose update fails: nothing changed,
    and flushing again applies the mean of the micro-batches held."""
    x, y = make_data(12)
    batches = split(x, y, 4)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4, mode=mode)
    opt.build(model.trainable_variables)
    train_steps(model, opt, batches)
    before = whole_state(model, opt)
    fail_once(opt)
    with pytest.raises(Injected):
        opt.flush()
    assert_states_equal(before, whole_state(model, opt), "a failed flush")
    opt.flush()
    assert_states_close(_reference(batches, 3), full_state(model, opt))


def _trained(n, seed=0, micro_steps=3):
    """A model fitted by `accumulate(Adam, n)` on `micro_steps` micro-batches."""
    x, y = make_data(4 * micro_steps)
    model = make_mlp(seed=seed)
    opt = accumulate(keras.optimizers.Adam(1e-2), n)
    fit(model, opt, x, y, 4)
    return model, opt


def test_weights_file_of_another_n_is_refused_before_any_weight_is_written(tmp_path):
    saved, _ = _trained(4)
    path = str(tmp_path / "n4.weights.h5")
    saved.save_weights(path)
    model, opt = _trained(2, seed=1)
    before = whole_state(model, opt)
    with pytest.raises(ValueError, match="n=4"):
        model.load_weights(path)
    assert_states_equal(before, whole_state(model, opt), "a refused file")


def test_plain_optimizer_loads_an_accumulating_weights_file(tmp_path):
    """Its slots and `iterations`, as a checkpoint restores them; the
    partial cycle, which a plain optimizer cannot hold, is dropped, warned."""
    saved, saved_opt = _trained(2, micro_steps=5)  # two cycles, then a micro-step
    path = str(tmp_path / "accumulating.weights.h5")
    saved.save_weights(path)
    model = make_mlp(seed=1)
    plain = keras.optimizers.Adam(1e-2)
    model.compile(optimizer=plain, loss="mse")
    plain.build(model.trainable_variables)
    with pytest.warns(UserWarning, match="1 micro-batch"):
        model.load_weights(path)
    assert int(keras.ops.convert_to_numpy(plain.iterations)) == 2
    assert_states_equal(full_state(saved, saved_opt), full_state(model, plain), "loaded into a plain optimizer")


def test_optimizer_store_of_another_model_is_refused_before_anything_is_loaded():
    """`load_own_variables` of a store saved for other variables: refused
    before the wrapped optimizer's slots or `iterations` are written."""
    x, y = make_data(12)
    other = make_mlp(widths=(6,))
    fit(other, accumulate(keras.optimizers.Adam(1e-2), 2), x, y, 4)
    store = {}
    other.optimizer.save_own_variables(store)
    model, opt = _trained(2, seed=1)
    before = whole_state(model, opt)
    with pytest.raises(ValueError, match="another model"):
        opt.load_own_variables(store)
    assert_states_equal(before, whole_state(model, opt), "a refused store")


@pytest.mark.skipif(
    BACKEND == "jax",
    reason="Keras's JAX LossScaleOptimizer runs its inner update in a `jax.lax.cond` even eagerly, and an "
    "exception there leaves traced values in the variables, with the plain optimizer too",
)
@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
def test_failed_apply_step_under_loss_scaling_changes_nothing(outside):
    """In either wrapping with a `LossScaleOptimizer`; retried, the run
    ends exactly as one that never failed."""
    x, y = make_data(24)
    batches = split(x, y, 4)

    def make():
        model, adam = make_mlp(), keras.optimizers.Adam(1e-2)
        if outside:
            opt = keras.optimizers.LossScaleOptimizer(accumulate(adam, 3))
        else:
            opt = accumulate(keras.optimizers.LossScaleOptimizer(adam), 3)
        opt.build(model.trainable_variables)
        return model, opt, adam

    model, opt, adam = make()
    train_steps(model, opt, batches[:2])
    _fails_then_retried(model, opt, batches, 2, failing=adam)
    never_failed, unfailed, _ = make()
    train_steps(never_failed, unfailed, batches)
    assert_states_equal(whole_state(never_failed, unfailed), whole_state(model, opt), "retried")
