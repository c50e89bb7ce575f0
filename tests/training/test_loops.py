"""Custom training loops on the active backend: `apply` (every backend) and
`stateless_apply` inside `jax.jit` (JAX), against the plain optimizer on the
large batch; the cycle's surface (`micro_step`, `will_apply`, `flush`, `n`
as a schedule), weights, `reduction` and `None` gradients."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from tests.helpers import (
    BACKEND,
    as_int,
    assert_same,
    assert_states_close,
    full_state,
    gradients,
    make_data,
    make_mlp,
    max_difference,
    split,
    train_steps,
    values,
)
from tests.helpers.agc import train_clipped


def _sum_loss() -> keras.losses.Loss:
    return keras.losses.MeanSquaredError(reduction="sum")


def _train(opt_factory, batches, wrap=None, weights=None, loss=None):
    """Builds the optimizer, then applies it once per batch; returns the
    model's and optimizer's state, the model and the optimizer."""
    model = make_mlp()
    opt = opt_factory() if wrap is None else wrap(opt_factory())
    opt.build(model.trainable_variables)
    return train_steps(model, opt, batches, loss=loss, weights=weights), model, opt


def test_apply_loop_matches_large_batch(mode):
    x, y = make_data(48)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), split(x, y, [16] * 3))
    acc, _, opt = _train(
        lambda: keras.optimizers.Adam(1e-2), split(x, y, [4] * 12), lambda o: accumulate(o, 4, mode=mode)
    )
    assert_states_close(ref, acc)


def test_weighted_micro_batches_of_different_sizes():
    """Micro-batches of 2, 6, 4 and 4 samples, each weighed by its size: the
    mean over the cycle's 16 samples, the large batch's."""
    x, y = make_data(32)
    sizes = [2, 6, 4, 4] * 2
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), split(x, y, [16, 16]))
    acc, _, _ = _train(
        lambda: keras.optimizers.Adam(1e-2), split(x, y, sizes), lambda o: accumulate(o, 4),
        weights=[float(s) for s in sizes],
    )
    assert_states_close(ref, acc)
    unweighted, _, _ = _train(
        lambda: keras.optimizers.Adam(1e-2), split(x, y, sizes), lambda o: accumulate(o, 4)
    )
    assert max(float(np.max(np.abs(ref[k] - unweighted[k]))) for k in ref) > 1e-4


def test_reduction_sum_matches_summed_large_batch_loss():
    x, y = make_data(32)
    ref, _, _ = _train(lambda: keras.optimizers.SGD(1e-3), split(x, y, [16, 16]), loss=_sum_loss())
    acc, _, _ = _train(
        lambda: keras.optimizers.SGD(1e-3), split(x, y, [4] * 8),
        lambda o: accumulate(o, 4, reduction="sum"), loss=_sum_loss(),
    )
    assert_states_close(ref, acc)


def test_micro_step_will_apply_and_in_between_steps_change_nothing(mode):
    x, y = make_data(16)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4, mode=mode)
    opt.build(model.trainable_variables)
    before = values(model.trainable_variables) + values(opt.__wrapped__.variables)
    for k in range(3):
        assert as_int(opt.micro_step) == k
        assert not bool(keras.ops.convert_to_numpy(opt.will_apply))
        opt.apply(gradients(model, x[4 * k:4 * k + 4], y[4 * k:4 * k + 4]))
        assert_same(before, values(model.trainable_variables) + values(opt.__wrapped__.variables))
    assert bool(keras.ops.convert_to_numpy(opt.will_apply))
    opt.apply(gradients(model, x[12:], y[12:]))
    assert as_int(opt.micro_step) == 0
    assert as_int(opt.iterations) == 1


def test_accumulation_state_shows_the_sums_of_the_current_cycle():
    """`accumulation_state` holds, mid-cycle, the sum of the micro-gradients
    (computed here independently) and the micro-step count; after the
    apply step, zeros."""
    n, b = 3, 4
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(0.1), n)
    assert opt.accumulation_state is None
    opt.build(model.trainable_variables)
    x, y = make_data(b * n)
    expected = [np.zeros(v.shape, "float32") for v in model.trainable_variables]
    for k in range(n):
        grads = gradients(model, x[k * b : (k + 1) * b], y[k * b : (k + 1) * b])
        weight = float(k + 1)
        if k < n - 1:
            expected = [e + weight * g for e, g in zip(expected, values(grads))]
        opt.apply_gradients(zip(grads, model.trainable_variables), weight=weight)
        state = opt.accumulation_state
        if k < n - 1:
            assert as_int(state.micro_step) == k + 1
            assert float(keras.ops.convert_to_numpy(state.weight_total)) == sum(range(1, k + 2))
            for acc, e in zip(values(state.accumulators), expected):
                np.testing.assert_allclose(acc, e, rtol=1e-6, atol=1e-7)
    assert [id(v) for v in state.variables] == [id(v) for v in model.trainable_variables]
    assert as_int(state.micro_step) == 0 and float(keras.ops.convert_to_numpy(state.weight_total)) == 0.0
    assert all(not np.any(a) for a in values(state.accumulators))


def test_will_apply_marks_the_apply_steps():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 3)
    x, y = make_data(4)
    seen = []
    for _ in range(6):
        seen.append(bool(keras.ops.convert_to_numpy(opt.will_apply)))
        opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables))
    assert seen == [False, False, True, False, False, True]


def test_flush_applies_the_mean_of_what_was_accumulated():
    x, y = make_data(24)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), split(x, y, [16, 8]))
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    opt.build(model.trainable_variables)
    for xb, yb in split(x, y, [4] * 6):
        opt.apply(gradients(model, xb, yb))
    opt.flush()
    assert as_int(opt.micro_step) == 0
    assert_states_close(ref, full_state(model, opt))
    state = full_state(model, opt)
    opt.flush()  # an empty cycle: nothing changes
    assert_same(list(state.values()), list(full_state(model, opt).values()))


def test_n_as_a_schedule_of_applied_updates():
    """`n` is 2 for the first two updates, then 4."""
    x, y = make_data(48)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), split(x, y, [8, 8, 16, 16]))
    acc, _, opt = _train(
        lambda: keras.optimizers.Adam(1e-2), split(x, y, [4] * 12),
        lambda o: accumulate(o, lambda step: keras.ops.where(step < 2, 2, 4)),
    )
    assert acc["iterations"] == 4
    assert_states_close(ref, acc)


def test_none_gradients_leave_a_variable_out_as_the_large_batch_does():
    """A variable whose gradient is None in every micro-batch is not updated
    (no slot moves, no weight decay), as the plain optimizer skips it."""
    x, y = make_data(32)

    def run(sizes, wrap):
        model = make_mlp()
        opt = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
        opt = opt if wrap is None else wrap(opt)
        opt.build(model.trainable_variables)
        for xb, yb in split(x, y, sizes):
            grads = list(gradients(model, xb, yb))
            grads[0] = None  # the first kernel
            opt.apply(grads, model.trainable_variables)
        return full_state(model, opt), model

    ref, ref_model = run([16, 16], None)
    acc, model = run([4] * 8, lambda o: accumulate(o, 4))
    assert_states_close(ref, acc)
    assert_same(values(model.trainable_variables[:1]), values(make_mlp().trainable_variables[:1]))


# ----------------------------------------------------------------------
# JAX: `stateless_apply` inside `jax.jit`.


def _jitted_step(model, opt):
    """A `jax.jit` train step through `opt.stateless_apply`:
    `(trainable, optimizer_values, x, y, weight=None) -> (trainable, optimizer_values)`."""
    import jax

    others = [v.value for v in model.non_trainable_variables]
    loss = keras.losses.MeanSquaredError()

    @jax.jit
    def step(trainable, optimizer_values, xb, yb, weight=None):
        def of(values):
            y_pred, _ = model.stateless_call(values, others, xb, training=True)
            return loss(yb, y_pred)

        weighed = {} if weight is None else {"weight": weight}
        return opt.stateless_apply(optimizer_values, jax.grad(of)(trainable), trainable, **weighed)

    return step


def _write_back(model, opt, trainable, optimizer_values):
    for v, value in zip(model.trainable_variables, trainable):
        v.assign(value)
    for v, value in zip(opt.variables, optimizer_values):
        v.assign(value)


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply under jax.jit is JAX's")
def test_stateless_apply_inside_jit_matches_large_batch():
    x, y = make_data(48)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), split(x, y, [16] * 3))

    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    opt.build(model.trainable_variables)
    step = _jitted_step(model, opt)
    trainable = [v.value for v in model.trainable_variables]
    optimizer_values = [v.value for v in opt.variables]
    before = list(trainable)
    for k, (xb, yb) in enumerate(split(x, y, [4] * 12)):
        trainable, optimizer_values = step(trainable, optimizer_values, xb, yb)
        if k < 3:  # in between: the model is unchanged
            assert_same(values(before), values(trainable))
    assert step._cache_size() == 1
    _write_back(model, opt, trainable, optimizer_values)
    assert_states_close(ref, full_state(model, opt))
    assert as_int(opt.micro_step) == 0


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply under jax.jit is JAX's")
@pytest.mark.parametrize("loss_scaled", [False, True], ids=["plain", "loss_scaled"])
def test_stateless_apply_weighs_micro_batches_of_different_sizes(loss_scaled):
    """A loop that computes its own loss hands each micro-batch's size as
    `weight=`: micro-batches of 2, 6, 4 and 4 make the large batch of 16."""
    x, y = make_data(32)

    def make():
        adam = keras.optimizers.Adam(1e-2)
        return keras.optimizers.LossScaleOptimizer(adam) if loss_scaled else adam

    def train(opt, sizes, weighed):
        # Jitted for the reference too: Keras's loss-scale optimizer cannot
        # `apply` eagerly on JAX (its conditional leaks a tracer).
        model = make_mlp()
        opt.build(model.trainable_variables)
        step = _jitted_step(model, opt)
        trainable = [v.value for v in model.trainable_variables]
        optimizer_values = [v.value for v in opt.variables]
        for xb, yb in split(x, y, sizes):
            weight = np.float32(len(xb)) if weighed else None
            trainable, optimizer_values = step(trainable, optimizer_values, xb, yb, weight)
        _write_back(model, opt, trainable, optimizer_values)
        return full_state(model, opt)

    ref = train(make(), [16, 16], False)
    opt = accumulate(make(), 4)
    subject = train(opt, [2, 6, 4, 4] * 2, True)
    if loss_scaled:  # the scale's growth counter counts finite micro-batches
        assert as_int(subject.pop("opt/step_counter")) == 8 and as_int(ref.pop("opt/step_counter")) == 2
    assert_states_close(ref, subject)
    assert as_int(opt.micro_step) == 0
    # Unweighed, the micro-batches weigh alike: the test can fail.
    assert max_difference(ref, train(accumulate(make(), 4), [2, 6, 4, 4] * 2, False)) > 1e-4


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply under jax.jit is JAX's")
def test_jitted_micro_steps_transfer_nothing_to_or_from_the_host():
    """Once compiled, a micro-step moves nothing between host and device
    (`jax.transfer_guard`): the cycle's position is decided on the device."""
    import jax

    x, y = make_data(48)
    batches = [(jax.device_put(xb), jax.device_put(yb)) for xb, yb in split(x, y, [4] * 12)]
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    opt.build(model.trainable_variables)
    step = _jitted_step(model, opt)
    trainable = [v.value for v in model.trainable_variables]
    optimizer_values = [v.value for v in opt.variables]
    trainable, optimizer_values = step(trainable, optimizer_values, *batches[0])  # compiles
    with jax.transfer_guard("disallow"):
        for xb, yb in batches[1:]:
            trainable, optimizer_values = step(trainable, optimizer_values, xb, yb)
        jax.block_until_ready(trainable)
    assert step._cache_size() == 1
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), split(x, y, [16] * 3))
    _write_back(model, opt, trainable, optimizer_values)
    assert_states_close(ref, full_state(model, opt))


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply under jax.jit is JAX's")
def test_a_cycle_after_jit_starts_afresh_and_files_and_views_show_no_stale_sums():
    # Traced, the update leaves the applied cycle's sums in the accumulators
    # (clearing them would copy the parameters on every micro-step); the
    # next cycle's first micro-step writes over them, here eagerly.
    x, y = make_data(48)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), split(x, y, [16] * 3))

    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    opt.build(model.trainable_variables)
    step = _jitted_step(model, opt)
    batches = split(x, y, [4] * 12)
    trainable = [v.value for v in model.trainable_variables]
    optimizer_values = [v.value for v in opt.variables]
    for xb, yb in batches[:4]:  # one whole cycle, traced
        trainable, optimizer_values = step(trainable, optimizer_values, xb, yb)
    _write_back(model, opt, trainable, optimizer_values)
    raw = [v for v in opt.variables if "gradaccum_accumulator" in v.name]
    assert any(np.any(keras.ops.convert_to_numpy(v)) for v in raw), "nothing stale to test"
    store = {}
    opt.save_own_variables(store)
    saved = [k for k in store if "accumulator_" in k]
    assert saved and not any(np.any(store[k]) for k in saved)

    for xb, yb in batches[4:]:  # two more cycles, eagerly
        opt.apply(gradients(model, xb, yb), model.trainable_variables)
    assert_states_close(ref, full_state(model, opt))
    for xb, yb in batches[:2]:  # a cycle begun, then one not begun
        opt.apply(gradients(model, xb, yb), model.trainable_variables)
    assert all(np.any(keras.ops.convert_to_numpy(a)) for a in opt.accumulation_state.accumulators)
    opt.flush()
    assert not any(np.any(keras.ops.convert_to_numpy(a)) for a in opt.accumulation_state.accumulators)


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply under jax.jit is JAX's")
def test_stateless_apply_refuses_the_wrong_number_of_values():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    opt.build(model.trainable_variables)
    trainable = [v.value for v in model.trainable_variables]
    with pytest.raises(ValueError, match="optimizer_variables"):
        opt.stateless_apply([v.value for v in opt.__wrapped__.variables], trainable, trainable)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's core writes its variables directly")
def test_stateless_apply_is_refused_on_tensorflow():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    opt.build(model.trainable_variables)
    with pytest.raises(NotImplementedError, match="apply"):
        opt.stateless_apply([], [], [])


def test_adaptive_gradient_clipping_clips_the_large_batch_gradient():
    """AGC clips the accumulated gradient once per update, as it would clip
    the large batch's (NumPy reference, `tests.helpers.agc`)."""
    factor, eps = 0.01, 1e-3
    x, y = make_data(48)
    model = make_mlp()
    ref = keras.optimizers.Adam(1e-2)
    clipped, _ = train_clipped(model, ref, None, x, y, 16, factor, eps)
    assert clipped > 0  # the clip bites
    acc, _, _ = _train(
        lambda: keras.optimizers.Adam(1e-2), split(x, y, [4] * 12),
        lambda o: accumulate(o, 4, agc=factor, agc_eps=eps),
    )
    assert_states_close(full_state(model, ref), acc)


def test_apply_without_variables_needs_a_built_optimizer_and_matching_gradients():
    model = make_mlp()
    x, y = make_data(4)
    grads = gradients(model, x, y)
    opt = accumulate(keras.optimizers.SGD(1e-2), 2)
    with pytest.raises(ValueError, match="must already be built"):
        opt.apply(grads)
    opt.build(model.trainable_variables)
    with pytest.raises(ValueError, match="Received 1 gradients for an optimizer built for 4"):
        opt.apply(grads[:1])
    with pytest.raises(ValueError, match="Received 1 gradients for 4 variables"):
        opt.apply(grads[:1], model.trainable_variables)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is PyTorch's")
def test_a_torch_compiled_step_matches_large_batch():
    """A step compiled by `torch.compile` that calls `opt.apply`: the
    micro-step runs between the compiled graphs (its cycle position lives on
    the host), equal to the plain optimizer compiled the same way."""
    import torch

    x, y = make_data(48)

    def run(opt, batch):
        model = make_mlp()
        opt.build(model.trainable_variables)

        @torch.compile
        def step(xb, yb):
            model.zero_grad()
            keras.ops.mean((model(xb, training=True) - yb) ** 2).backward()
            with torch.no_grad():
                opt.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)

        for xb, yb in split(x, y, [batch] * (48 // batch)):
            step(torch.as_tensor(xb), torch.as_tensor(yb))
        return full_state(model, opt)

    ref = run(keras.optimizers.Adam(1e-2), 16)
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    assert_states_close(ref, run(opt, 4))
    assert as_int(opt.iterations) == 3 and as_int(opt.micro_step) == 0


@pytest.mark.skipif(BACKEND == "tensorflow", reason="stateless_apply is JAX's and PyTorch's")
@pytest.mark.parametrize("weight, error", [("4", TypeError), (-1.0, ValueError), ([4], TypeError)])
def test_stateless_apply_refuses_a_bad_weight_by_name(weight, error):
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    opt.build(model.trainable_variables)
    x, y = make_data(4)
    grads = gradients(model, x, y)
    with pytest.raises(error, match="weight"):
        opt.stateless_apply([v.value for v in opt.variables], grads, [v.value for v in model.trainable_variables],
                            weight=weight)
