"""A micro-step's run-time checks where it is traced, as where it runs eagerly.

A weight below 0 or not finite, passed as a tensor, raises where the
backend asserts at run time (eagerly, a `tf.function` without XLA,
PyTorch); under XLA and `jax.jit`, which have no run-time assertion, the
micro-step is refused: it accumulates nothing and changes no state. Either
way the weights, the optimizer's variables, the accumulators, `micro_step`
and `weight_total` are as before, and training on then equals never having
sent the bad micro-step: the plain optimizer on the large batch.

An `n` schedule's value below 1 raises where the backend asserts (a
`tf.function` without XLA leaves the state as it was), and is taken as 1,
warned about when traced, where it cannot.

Runs on TensorFlow (eager, graph, XLA), JAX (eager, `jax.jit` through
`stateless_apply`) and PyTorch (eager).
"""

from __future__ import annotations

import warnings

import keras
import pytest

from gradaccum import accumulate
from tests.helpers import (
    BACKEND,
    assert_states_close,
    assert_states_equal,
    embedding_data,
    full_state,
    gradients,
    internal_state,
    make_data,
    make_embedding_model,
    make_mlp,
    split,
    train_steps,
)

EXECUTIONS = {"tensorflow": ("eager", "graph", "xla"), "jax": ("eager", "jit")}.get(BACKEND, ("eager",))
# Where a bad weight raises; elsewhere (no run-time assertion) it is refused.
RAISES = {"eager", "graph"}


def _state(model, opt):
    """Everything a micro-step may write: the model's and the optimizer's
    variables, and the accumulation state as held (not as shown)."""
    state = full_state(model, opt)
    held = internal_state(opt)
    if held is not None:
        for i, accumulator in enumerate(held.accumulators):
            state[f"held/accumulator{i}"] = keras.ops.convert_to_numpy(accumulator)
        state["held/micro_step"] = keras.ops.convert_to_numpy(held.micro_step)
        state["held/weight_total"] = keras.ops.convert_to_numpy(held.weight_total)
        if held.took_part is not None:
            state["held/took_part"] = keras.ops.convert_to_numpy(held.took_part)
        for i, compensation in enumerate(held.compensations or []):
            state[f"held/compensation{i}"] = keras.ops.convert_to_numpy(compensation)
        for i, variable in enumerate(held.noise.variables() if held.noise is not None else []):
            state[f"held/noise{i}"] = keras.ops.convert_to_numpy(variable)
        for i, kept in held.kept.items():  # TensorFlow's kept slices
            for kind, buffer in kept.parts.items():
                for name in ("values", "indices", "filled"):
                    state[f"held/kept{i}/{kind}/{name}"] = keras.ops.convert_to_numpy(getattr(buffer, name))
    return state


def _runner(model, opt, execution):
    """`step(x, y, weight)`: one micro-step through `opt`, run as `execution`
    says, the weight passed as a tensor (traced where the step is)."""
    if BACKEND == "jax" and execution == "jit":
        import jax

        others = [v.value for v in model.non_trainable_variables]
        loss = keras.losses.MeanSquaredError()

        @jax.jit
        def jitted(trainable, optimizer_values, xb, yb, weight):
            def of(values):
                y_pred, _ = model.stateless_call(values, others, xb, training=True)
                return loss(yb, y_pred)

            return opt.stateless_apply(optimizer_values, jax.grad(of)(trainable), trainable, weight=weight)

        def step(x, y, weight):
            trainable, values = jitted(
                [v.value for v in model.trainable_variables], [v.value for v in opt.variables], x, y, weight
            )
            for v, value in zip(model.trainable_variables, trainable):
                v.assign(value)
            for v, value in zip(opt.variables, values):
                v.assign(value)

        return step

    def eager(x, y, weight):
        opt.apply(gradients(model, x, y), model.trainable_variables, weight=weight)

    if BACKEND != "tensorflow" or execution == "eager":
        return lambda x, y, weight: eager(x, y, keras.ops.convert_to_tensor(weight, "float32"))
    import tensorflow as tf

    traced = tf.function(eager, jit_compile=execution == "xla")
    return lambda x, y, weight: traced(tf.constant(x), tf.constant(y), tf.constant(weight, tf.float32))


def _refused(step, x, y, weight, execution):
    """Runs the bad micro-step: raises where the backend asserts, else runs."""
    if execution not in RAISES and BACKEND != "torch":
        step(x, y, weight)
        return
    with pytest.raises(Exception, match="weight") as raised:
        step(x, y, weight)
    assert raised.type.__name__ in ("ValueError", "InvalidArgumentError", "RuntimeError"), raised.type


@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")], ids=["negative", "nan", "inf"])
@pytest.mark.parametrize("at", [0, 2, 3], ids=["first", "between", "last"])
def test_a_bad_weight_changes_nothing_and_a_retry_equals_the_large_batch(execution, bad, at, mode):
    n, b = 4, 4
    x, y = make_data(b * n * 2)
    ref = train_steps(make_mlp(), keras.optimizers.Adam(1e-2), split(x, y, b * n))

    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), n, mode=mode)
    opt.build(model.trainable_variables)
    step = _runner(model, opt, execution)
    batches = split(x, y, b)
    for k, (xb, yb) in enumerate(batches):
        if k == n + at:  # in the second cycle, so that its accumulators hold the first's sums
            before = _state(model, opt)
            _refused(step, xb, yb, bad, execution)
            assert_states_equal(before, _state(model, opt))
        step(xb, yb, 1.0)
    assert_states_close(ref, full_state(model, opt))
    assert int(keras.ops.convert_to_numpy(opt.micro_step)) == 0


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a tf.function's graph, without XLA")
def test_an_asserted_weight_selects_no_gradient(mode):
    """Where the assertion stops a bad weight's micro-step before it writes
    (a graph without XLA), the refusal does not also select every gradient:
    the selects of a traced weight's micro-step do not grow with the
    variables (they made it 3x slower on a large model)."""
    import tensorflow as tf

    def selects(widths):
        model = make_mlp(widths=widths)
        opt = accumulate(keras.optimizers.Adam(1e-2), 4, mode=mode)
        opt.build(model.trainable_variables)
        x, y = make_data(4)

        def step(x, y, weight):
            opt.apply(gradients(model, x, y), model.trainable_variables, weight=weight)

        graph = tf.function(step).get_concrete_function(tf.constant(x), tf.constant(y), tf.constant(1.0)).graph
        return sum(op.type in ("Select", "SelectV2") for op in graph.get_operations())

    assert selects((8,) * 6) == selects((8,))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.IndexedSlices are TensorFlow's")
@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("sparse", ["auto", "slices", "rows"])
def test_a_bad_weight_leaves_kept_slices_as_they_were(execution, sparse):
    """Kept slices are appended, or replace the indices held, whatever the
    weight: a refused micro-step must not write them at all."""
    x, y = embedding_data(8, 2, unique_per_cycle=True)
    ref = train_steps(make_embedding_model(vocab=40), keras.optimizers.Adam(1e-2), split(x, y, 8))
    model = make_embedding_model(vocab=40)
    opt = accumulate(keras.optimizers.Adam(1e-2), 2, sparse=sparse)
    opt.build(model.trainable_variables)
    step = _runner(model, opt, execution)
    batches = split(x, y, 4)
    step(*batches[0], 1.0)
    before = _state(model, opt)
    _refused(step, *batches[1], float("nan"), execution)
    assert_states_equal(before, _state(model, opt))
    for xb, yb in batches[1:]:
        step(xb, yb, 1.0)
    assert_states_close(ref, full_state(model, opt))


@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize(
    "settings", [{"accumulator_dtype": "bfloat16"}, {"noise_scale": True}], ids=["compensated", "noise_scale"]
)
def test_a_bad_weight_leaves_the_other_sums_as_they_were(execution, settings):
    n, b = 2, 4
    x, y = make_data(b * n * 2)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), n, **settings)
    opt.build(model.trainable_variables)
    step = _runner(model, opt, execution)
    batches = split(x, y, b)
    for xb, yb in batches[:3]:
        step(xb, yb, 1.0)
    before = _state(model, opt)
    _refused(step, *batches[3], float("nan"), execution)
    assert_states_equal(before, _state(model, opt))


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_a_bad_weight_on_a_later_micro_step_is_refused_as_on_the_first(execution):
    """The same trace runs a valid and a bad weight: the check is a run-time one."""
    n, b = 2, 4
    x, y = make_data(b * n * 2)
    ref = train_steps(make_mlp(), keras.optimizers.Adam(1e-2), split(x, y, b * n))
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), n)
    opt.build(model.trainable_variables)
    step = _runner(model, opt, execution)
    (x0, y0), (x1, y1), (x2, y2), (x3, y3) = split(x, y, b)
    step(x0, y0, 1.0)
    before = _state(model, opt)
    _refused(step, x1, y1, float("nan"), execution)
    assert_states_equal(before, _state(model, opt))
    for xb, yb in ((x1, y1), (x2, y2), (x3, y3)):
        step(xb, yb, 1.0)
    assert_states_close(ref, full_state(model, opt))


def _falls_below_one(applied):
    """2 for the first cycle, then 0."""
    return keras.ops.where(keras.ops.less(applied, 1), 2, 0)


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_a_schedule_below_one_raises_or_is_taken_as_one_warned(execution):
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), _falls_below_one)
    opt.build(model.trainable_variables)
    step = _runner(model, opt, execution)
    x, y = make_data(12)
    batches = split(x, y, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for xb, yb in batches[:2]:
            step(xb, yb, 1.0)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 1
    traced_without_assertion = execution in ("xla", "jit")
    assert any("schedule is traced" in str(w.message) for w in caught) == (execution != "eager"), [
        str(w.message) for w in caught
    ]
    before = _state(model, opt)
    if traced_without_assertion:
        # Taken as 1: the micro-step is a whole cycle, as warned.
        step(*batches[2], 1.0)
        assert int(keras.ops.convert_to_numpy(opt.iterations)) == 2
        return
    with pytest.raises(Exception, match="schedule") as raised:
        step(*batches[2], 1.0)
    assert raised.type.__name__ in ("ValueError", "InvalidArgumentError"), raised.type
    assert_states_equal(before, _state(model, opt))



@pytest.mark.parametrize("jit_compile", [False, True] if BACKEND != "torch" else [False])
def test_a_schedule_below_one_in_fit(jit_compile, mode):
    """Without XLA it raises (at run time in TensorFlow's graph, eagerly on
    JAX and PyTorch), before the update: in either mode, also where the
    update's branch is decided in a merge call; under XLA it is taken as 1,
    warned."""
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), _falls_below_one, mode=mode)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    x, y = make_data(12)
    raises = not jit_compile
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if raises:
            with pytest.raises(Exception, match="schedule") as raised:
                model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
            assert raised.type.__name__ in ("ValueError", "InvalidArgumentError"), raised.type
            assert int(keras.ops.convert_to_numpy(opt.iterations)) == 1
            return
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert any("schedule is traced" in str(w.message) for w in caught)
    # Two micro-steps, then cycles of one.
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 2
