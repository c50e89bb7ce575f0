"""tf_keras LossScaleOptimizer, around either optimizer family, both orders."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import (
    assert_states_close,
    assert_states_equal,
    core_of,
    dtype_policy,
    fit,
    full_state,
    make_data,
    make_mlp,
)
from tests.helpers.growing import (
    GROW_LEGACY,
    GROW_N,
    GROW_PATTERNS,
    grow_grads,
    grow_reference,
    grow_state,
    grow_variables,
)

N, B, CYCLES = 3, 4, 3
LSO = tf_keras.mixed_precision.LossScaleOptimizer
SCALE0 = 2.0**15  # tf_keras's default initial loss scale
# Half-precision rounding: forward and backward passes round to float16, and
# the micro-batch and large-batch runs round different partial sums; the
# measured difference on this MLP is below 3e-5. A real bug moves values by
# about lr = 1e-2.
FP16_ATOL, FP16_RTOL = 5e-5, 1e-4

KINDS = {
    "new": lambda: tf_keras.optimizers.Adam(1e-2),
    "legacy": lambda: tf_keras.optimizers.legacy.Adam(1e-2),
}
WRAPS = {
    "accumulate_lso": lambda make: accumulate(LSO(make()), N),
    "lso_accumulate": lambda make: LSO(accumulate(make(), N)),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    "order", ["accumulate_lso", "lso_accumulate", "compile_auto_wrap"]
)
def test_fit_equals_large_batch_mixed_float16(kind, order):
    make = KINDS[kind]
    x, y = make_data(B * N * CYCLES)
    with dtype_policy("mixed_float16"):
        ref_model, ref_opt = make_mlp(), LSO(make())
        fit(ref_model, ref_opt, x, y, B * N)
        model = make_mlp()
        # compile wraps a plain optimizer in a LossScaleOptimizer itself.
        opt = accumulate(make(), N) if order == "compile_auto_wrap" else WRAPS[order](make)
        fit(model, opt, x, y, B)
    assert isinstance(model.optimizer, LSO)
    # No micro-batch overflowed: the scale is where the reference's is.
    assert float(model.optimizer.loss_scale) == float(ref_opt.loss_scale) == SCALE0
    # The scale's growth counter counts finite scaled backward passes:
    # micro-batches, not applied updates (documented).
    assert int(ref_opt.dynamic_counter.numpy()) == CYCLES
    assert int(model.optimizer.dynamic_counter.numpy()) == N * CYCLES
    ref, acc = full_state(ref_model, ref_opt), full_state(model, model.optimizer)
    assert acc["iterations"] == CYCLES
    assert_states_close(ref, acc, rtol=FP16_RTOL, atol=FP16_ATOL)
    # Accumulators are float32 whatever the compute dtype.
    state = core_of(model.optimizer).accumulation_state
    assert all(a.dtype == tf.float32 for a in state.accumulators)


def _scaled_step(model, opt, x, y, poison=False):
    with tf.GradientTape() as tape:
        loss = tf_keras.losses.MeanSquaredError()(y, model(x, training=True))
        scaled = opt.get_scaled_loss(loss)
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
    grads = [tf.where(poison, g * np.inf, g) for g in grads]
    opt.apply_gradients(zip(grads, model.trainable_variables))


def _loop(opt, model, traced):
    step = lambda x, y, poison: _scaled_step(model, opt, x, y, poison)  # noqa: E731
    if traced:
        step = tf.function(step)
    def call(x, y, poison=False):
        step(tf.constant(x), tf.constant(y), tf.constant(poison))

    return call


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("order", sorted(WRAPS))
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_custom_loop_with_scaled_loss_equals_large_batch(kind, order, traced):
    """get_scaled_loss / get_unscaled_gradients in a float32 custom loop."""
    make = KINDS[kind]
    x, y = make_data(B * N * CYCLES)
    ref_model, ref_opt = make_mlp(), LSO(make())
    ref_step = _loop(ref_opt, ref_model, traced)
    for i in range(0, len(x), B * N):
        ref_step(x[i : i + B * N], y[i : i + B * N])
    model, opt = make_mlp(), WRAPS[order](make)
    step = _loop(opt, model, traced)
    for k, i in enumerate(range(0, len(x), B)):
        before = full_state(model, opt)
        step(x[i : i + B], y[i : i + B])
        # From the second cycle on (the first builds the slots).
        if k >= N and (k + 1) % N:
            assert_states_equal(before, full_state(model, opt))
    ref, acc = full_state(ref_model, ref_opt), full_state(model, opt)
    assert acc["iterations"] == CYCLES
    assert_states_close(ref, acc)


def _apply(model, opt, x, y):
    with tf.GradientTape() as tape:
        loss = tf_keras.losses.MeanSquaredError()(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


def _run_with_bad_micro_batch(kind, order, traced, bad=4, counted=False):
    """Micro-batch `bad` of 10 has non-finite gradients.

    Returns the reference state: plain float32 training on large batches of
    the 9 finite micro-batches (the dropped one is simply not there), with
    `iterations` one higher from the second update on if the skip is
    `counted`. Then the subject's optimizer and state, its states around the
    bad micro-batch, and its micro-step after every micro-batch.
    """
    make = KINDS[kind]
    x, y = make_data(B * (N * CYCLES + 1))
    micro = [(x[i : i + B], y[i : i + B]) for i in range(0, len(x), B)]
    finite = [m for k, m in enumerate(micro) if k != bad]
    ref_model, ref_opt = make_mlp(), make()
    for c in range(CYCLES):
        cycle = finite[c * N : (c + 1) * N]
        _apply(
            ref_model,
            ref_opt,
            np.concatenate([m[0] for m in cycle]),
            np.concatenate([m[1] for m in cycle]),
        )
        if counted and c == bad // N - 1:
            ref_opt.iterations.assign_add(1)
    model, opt = make_mlp(), WRAPS[order](make)
    step = _loop(opt, model, traced)
    micro_steps = []
    for k, (xb, yb) in enumerate(micro):
        if k == bad:
            before = full_state(model, opt)
        step(xb, yb, k == bad)
        if k == bad:
            around = (before, full_state(model, opt))
        micro_steps.append(int(core_of(opt).micro_step))
    ref = full_state(ref_model, ref_opt)
    return ref, opt, full_state(model, opt), around, micro_steps


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_non_finite_micro_batch_is_dropped_without_counting(kind, traced):
    ref, opt, acc, (before, after), micro_steps = _run_with_bad_micro_batch(
        kind, "accumulate_lso", traced
    )
    # Nothing moves, `iterations` included; only the scale halves.
    assert_states_equal(before, after)
    # The dropped micro-batch does not advance the cycle.
    assert micro_steps == [1, 2, 0, 1, 1, 2, 0, 1, 2, 0]
    assert float(opt.loss_scale) == SCALE0 / 2
    assert acc["iterations"] == CYCLES
    assert_states_close(ref, acc)


def _is_iterations(key):
    return key == "iterations" or key.rsplit("/", 1)[-1] in ("iter", "iteration")


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_lso_around_accumulate_counts_a_skipped_micro_batch_like_tf_keras(kind, traced):
    """`LSO(accumulate(opt))`, which compile builds: a documented difference.

    tf_keras's LossScaleOptimizer itself adds 1 to its inner optimizer's
    `iterations` for every step it skips; here that inner optimizer is the
    accumulating one, so a dropped micro-batch counts once in `iterations`
    (and so in learning-rate schedules and Adam's bias correction). Nothing
    else differs from `accumulate(LSO(opt))`.
    """
    ref, opt, acc, (before, after), micro_steps = _run_with_bad_micro_batch(
        kind, "lso_accumulate", traced, counted=True
    )
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert moved == {k for k in before if _is_iterations(k)}
    assert after["iterations"] == before["iterations"] + 1
    assert micro_steps == [1, 2, 0, 1, 1, 2, 0, 1, 2, 0]
    assert float(opt.loss_scale) == SCALE0 / 2
    assert acc["iterations"] == CYCLES + 1
    assert_states_close(ref, acc)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_proxy_is_still_the_loss_scale_optimizer(kind):
    inner = KINDS[kind]()
    lso = LSO(inner, dynamic=False, initial_scale=64.0)
    opt = accumulate(lso, 4)
    assert isinstance(opt, LSO)
    assert opt.__wrapped__ is lso
    assert isinstance(opt.inner_optimizer, AccumulatingOptimizer)
    assert opt.inner_optimizer.__wrapped__ is inner
    assert opt.n == 4 and opt.reduction == "mean"
    np.testing.assert_allclose(float(opt.get_scaled_loss(tf.constant(1.0))), 64.0)
    (g,) = opt.get_unscaled_gradients([tf.constant(64.0)])
    np.testing.assert_allclose(float(g), 1.0)
    opt.learning_rate = 0.25
    lr = tf_keras.backend.get_value(inner.learning_rate)
    np.testing.assert_allclose(float(lr), 0.25)
    assert opt.iterations is inner.iterations
    with pytest.raises(ValueError, match="accumulate twice"):
        accumulate(lso, 2)
    with pytest.raises(ValueError, match="accumulate twice"):
        accumulate(LSO(accumulate(KINDS[kind](), 2)), 2)


# ----------------------------------------------------------------------
# `LSO(accumulate(legacy_opt))` built lazily: the loss-scale optimizer drops
# `None` gradients, so the accumulating OptimizerV2 first meets only the
# variables that have gradients, and grows when others get theirs.

def _grow_step(opt, variables, k):
    opt.apply_gradients(zip(grow_grads(k), variables))


def _traced_grow_step(opt, variables):
    @tf.function
    def step(*grads):
        opt.apply_gradients(zip(grads, variables))

    return step


@pytest.mark.parametrize("kind", sorted(GROW_LEGACY))
@pytest.mark.parametrize("mode", ["masked", "skip"])
def test_loss_scale_optimizer_around_an_unbuilt_accumulating_optimizer(kind, mode):
    """`LSO(accumulate(legacy_opt))`, as tf_keras's `compile` builds it under
    `mixed_float16`, when the first micro-batches give a variable no gradient:
    the accumulating optimizer adds that variable when its first gradient
    comes, and trains as the plain one does on the cycles' mean gradients.
    """
    make = GROW_LEGACY[kind]
    variables = grow_variables()
    opt = LSO(accumulate(make(), GROW_N, mode=mode))
    core = opt.inner_optimizer
    for k in range(len(GROW_PATTERNS)):
        before = grow_state(variables, opt)
        _grow_step(opt, variables, k)
        after = grow_state(variables, opt)
        if (k + 1) % GROW_N:
            # In-between micro-step: nothing the optimizer had moves, and the
            # slots it adds for a new variable stay as created.
            assert_states_equal(before, {key: after[key] for key in before})
            added = [k for k in after if k not in before]
            slots = [k for k in added if k.startswith(("opt/a/", "opt/b/"))]
            assert all(not np.any(after[key]) for key in slots)
    state = core.accumulation_state
    assert [v.name for v in state.variables] == ["a:0", "b:0"]
    assert [tuple(a.shape) for a in state.accumulators] == [(2,), (3,)]
    acc = grow_state(variables, opt)
    assert acc["iterations"] == len(GROW_PATTERNS) // GROW_N
    assert_states_equal(grow_reference(make), acc)


@pytest.mark.parametrize("kind", sorted(GROW_LEGACY))
def test_growing_on_the_first_trace_of_a_tf_function(kind):
    """A `tf.function` may add variables on its first trace (one function
    per gradient pattern here, as one per task in multi-task training)."""
    make = GROW_LEGACY[kind]
    variables = grow_variables()
    opt = LSO(accumulate(make(), GROW_N))
    steps = {}
    for k, pattern in enumerate(GROW_PATTERNS):
        if pattern not in steps:
            steps[pattern] = _traced_grow_step(opt, variables)
        steps[pattern](*grow_grads(k))
    assert len(steps) == 3
    acc = grow_state(variables, opt)
    assert acc["iterations"] == len(GROW_PATTERNS) // GROW_N
    assert_states_equal(grow_reference(make), acc)


def test_growing_on_a_later_trace_of_a_tf_function_is_refused():
    """A retrace cannot create variables: the error says to build first."""
    variables = grow_variables()
    opt = LSO(accumulate(GROW_LEGACY["adam"](), GROW_N))
    step = _traced_grow_step(opt, variables)
    step(*grow_grads(0))  # "a-": traced for `a` only
    with pytest.raises(ValueError, match=r"first trace.*opt\.build\(model"):
        step(*grow_grads(2))  # "-b": traced anew, would add `b`
    core = opt.inner_optimizer
    state = core.accumulation_state
    assert len(state.variables) == len(state.accumulators) == 1
    # Built with all variables first, the same function works.
    variables = grow_variables()
    core = accumulate(GROW_LEGACY["adam"](), GROW_N)
    core.build(variables)
    opt = LSO(core)
    step = _traced_grow_step(opt, variables)
    for k in range(len(GROW_PATTERNS)):
        step(*grow_grads(k))
    acc = grow_state(variables, opt)
    assert_states_equal(grow_reference(GROW_LEGACY["adam"]), acc)


# Saved after this micro-step: mid-cycle, after `b` was added, with both
# accumulators holding gradients.
GROW_SAVE_AFTER = 4


def _grown_checkpoint(tmp_path, make):
    variables = grow_variables()
    opt = LSO(accumulate(make(), GROW_N))
    for k in range(GROW_SAVE_AFTER + 1):
        _grow_step(opt, variables, k)
    core = opt.inner_optimizer
    assert int(core.micro_step) == 1
    checkpoint = tf.train.Checkpoint(a=variables[0], b=variables[1], optimizer=opt)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    return path, [a.numpy() for a in core.accumulation_state.accumulators]


@pytest.mark.parametrize("kind", sorted(GROW_LEGACY))
@pytest.mark.parametrize("built", [True, False], ids=["built", "grows_again"])
def test_checkpoint_of_a_grown_accumulating_optimizer_resumes_the_cycle(
    tmp_path, kind, built
):
    """Restored into an optimizer built with all variables (in the order the
    saved one met them), or into an unbuilt one whose next step meets them
    in that order, the cycle resumes as if never interrupted."""
    make = GROW_LEGACY[kind]
    path, _ = _grown_checkpoint(tmp_path, make)
    variables = grow_variables()
    core = accumulate(make(), GROW_N)
    if built:
        core.build(variables)
    opt = LSO(core)
    checkpoint = tf.train.Checkpoint(a=variables[0], b=variables[1], optimizer=opt)
    status = checkpoint.restore(path)
    # Unbuilt, the first step after the restore builds the optimizer for
    # both variables ("ab"), and the deferred values land then.
    assert GROW_PATTERNS[GROW_SAVE_AFTER + 1] == "ab"
    for k in range(GROW_SAVE_AFTER + 1, len(GROW_PATTERNS)):
        _grow_step(opt, variables, k)
    status.assert_consumed()
    acc = grow_state(variables, opt)
    assert acc["iterations"] == len(GROW_PATTERNS) // GROW_N
    assert_states_equal(grow_reference(make), acc)


def test_restore_into_an_optimizer_that_has_not_met_a_saved_variable_is_refused(
    tmp_path,
):
    """Its accumulated gradients would be left out of the update."""
    make = GROW_LEGACY["adam"]
    path, saved = _grown_checkpoint(tmp_path, make)
    assert all(np.any(a) for a in saved)
    variables = grow_variables()
    opt = LSO(accumulate(make(), GROW_N))
    tf.train.Checkpoint(a=variables[0], b=variables[1], optimizer=opt).restore(path)
    before = [v.numpy() for v in variables]
    with pytest.raises(ValueError, match=r"not met yet.*opt\.build"):
        opt.apply_gradients([(tf.ones((2,)), variables[0])])
    # Refused before anything was added or applied.
    assert int(opt.inner_optimizer.micro_step) == 1
    state = opt.inner_optimizer.accumulation_state
    np.testing.assert_array_equal(state.accumulators[0].numpy(), saved[0])
    for v, value in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), value)


def test_traced_step_that_has_not_met_a_restored_variable_is_refused(tmp_path):
    path, saved = _grown_checkpoint(tmp_path, GROW_LEGACY["adam"])
    variables = grow_variables()
    opt = LSO(accumulate(GROW_LEGACY["adam"](), GROW_N))
    tf.train.Checkpoint(a=variables[0], b=variables[1], optimizer=opt).restore(path)
    before = [v.numpy() for v in variables]
    with pytest.raises(ValueError, match="not met yet"):
        _traced_grow_step(opt, variables)(tf.ones((2,)), None)
    # Refused while tracing: nothing ran.
    assert int(opt.inner_optimizer.micro_step) == 1
    state = opt.inner_optimizer.accumulation_state
    np.testing.assert_array_equal(state.accumulators[0].numpy(), saved[0])
    for v, value in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), value)


def test_nadam_step_cache_stays_in_step_after_a_dropped_micro_batch():
    """Documented difference from plain tf_keras after a skipped step.

    tf_keras's Nadam caches `_u_product` for the current step by a Python
    counter that should equal `iterations + 1`; a loss-scale optimizer that
    skips a step adds 1 to `iterations` but not to the counter, so the plain
    optimizer multiplies the product in once per variable on its next step.
    gradaccum keeps the counter at `iterations + 1`: the product gains one
    factor per applied step, as in plain training without skips.
    """
    beta_1 = 0.9
    make = lambda: tf_keras.optimizers.Nadam(0.1, beta_1=beta_1)  # noqa: E731
    bad = [tf.constant([np.inf, 1.0]), tf.constant([1.0, 1.0])]
    good = [tf.constant([0.5, -0.5]), tf.constant([0.25, 0.25])]
    products = {}
    for name in ("plain", "accumulating"):
        variables = [tf.Variable([1.0, 2.0]), tf.Variable([3.0, 4.0])]
        inner = make()
        core = inner if name == "plain" else accumulate(inner, 1)
        opt = LSO(core, initial_scale=1.0)
        core.build(variables)
        opt.apply_gradients(zip(bad, variables))  # skipped: non-finite
        assert int(inner.iterations.numpy()) == 1
        opt.apply_gradients(zip(good, variables))
        products[name] = float(inner._u_product.numpy())
    # The factor of the step applied at iterations == 1 (local step 2).
    u_t = beta_1 * (1.0 - 0.5 * 0.96**2)
    np.testing.assert_allclose(products["accumulating"], u_t, rtol=1e-6)
    np.testing.assert_allclose(products["plain"], u_t**2, rtol=1e-6)
