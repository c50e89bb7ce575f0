"""Custom training loops on the active backend: `apply` (every backend) and
`stateless_apply` inside `jax.jit` (JAX), against the plain optimizer on the
large batch; the cycle's surface (`micro_step`, `will_apply`, `flush`, `n`
as a schedule), weights, `reduction` and `None` gradients."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from tests.backends.helpers import BACKEND, assert_same, gradients, values
from tests.support import MODES, assert_states_close, full_state, make_data, make_mlp


def _sum_loss() -> keras.losses.Loss:
    return keras.losses.MeanSquaredError(reduction="sum")


def _train(opt_factory, batches, wrap=None, weights=None, loss=None):
    """Runs `opt.apply` once per batch; returns the model's and optimizer's
    state, the model and the optimizer."""
    model = make_mlp()
    opt = opt_factory() if wrap is None else wrap(opt_factory())
    opt.build(model.trainable_variables)
    for i, (x, y) in enumerate(batches):
        grads = gradients(model, x, y, loss=loss)
        if weights is None:
            opt.apply(grads, model.trainable_variables)
        else:
            opt.apply(grads, model.trainable_variables, weight=weights[i])
    return full_state(model, opt), model, opt


def _split(x, y, sizes):
    out, start = [], 0
    for size in sizes:
        out.append((x[start:start + size], y[start:start + size]))
        start += size
    return out


@pytest.mark.parametrize("mode", MODES)
def test_apply_loop_matches_large_batch(mode):
    x, y = make_data(48)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), _split(x, y, [16] * 3))
    acc, _, opt = _train(
        lambda: keras.optimizers.Adam(1e-2), _split(x, y, [4] * 12), lambda o: accumulate(o, 4, mode=mode)
    )
    assert_states_close(ref, acc)


@pytest.mark.parametrize("mode", MODES)
def test_weighted_micro_batches_of_different_sizes(mode):
    """Micro-batches of 2, 6, 4 and 4 samples, each weighed by its size: the
    mean over the cycle's 16 samples, the large batch's."""
    x, y = make_data(32)
    sizes = [2, 6, 4, 4] * 2
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), _split(x, y, [16, 16]))
    acc, _, _ = _train(
        lambda: keras.optimizers.Adam(1e-2), _split(x, y, sizes), lambda o: accumulate(o, 4, mode=mode),
        weights=[float(s) for s in sizes],
    )
    assert_states_close(ref, acc)
    unweighted, _, _ = _train(
        lambda: keras.optimizers.Adam(1e-2), _split(x, y, sizes), lambda o: accumulate(o, 4, mode=mode)
    )
    assert max(float(np.max(np.abs(ref[k] - unweighted[k]))) for k in ref) > 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_reduction_sum_matches_summed_large_batch_loss(mode):
    x, y = make_data(32)
    ref, _, _ = _train(lambda: keras.optimizers.SGD(1e-3), _split(x, y, [16, 16]), loss=_sum_loss())
    acc, _, _ = _train(
        lambda: keras.optimizers.SGD(1e-3), _split(x, y, [4] * 8),
        lambda o: accumulate(o, 4, reduction="sum", mode=mode), loss=_sum_loss(),
    )
    assert_states_close(ref, acc)


@pytest.mark.parametrize("mode", MODES)
def test_micro_step_will_apply_and_in_between_steps_change_nothing(mode):
    x, y = make_data(16)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4, mode=mode)
    opt.build(model.trainable_variables)
    before = values(model.trainable_variables) + values(opt.__wrapped__.variables)
    for k in range(3):
        assert int(keras.ops.convert_to_numpy(opt.micro_step)) == k
        assert not bool(keras.ops.convert_to_numpy(opt.will_apply))
        opt.apply(gradients(model, x[4 * k:4 * k + 4], y[4 * k:4 * k + 4]))
        assert_same(before, values(model.trainable_variables) + values(opt.__wrapped__.variables))
    assert bool(keras.ops.convert_to_numpy(opt.will_apply))
    opt.apply(gradients(model, x[12:], y[12:]))
    assert int(keras.ops.convert_to_numpy(opt.micro_step)) == 0
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 1


@pytest.mark.parametrize("mode", MODES)
def test_flush_applies_the_mean_of_what_was_accumulated(mode):
    x, y = make_data(24)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), _split(x, y, [16, 8]))
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4, mode=mode)
    opt.build(model.trainable_variables)
    for xb, yb in _split(x, y, [4] * 6):
        opt.apply(gradients(model, xb, yb))
    opt.flush()
    assert int(keras.ops.convert_to_numpy(opt.micro_step)) == 0
    assert_states_close(ref, full_state(model, opt))
    state = full_state(model, opt)
    opt.flush()  # an empty cycle: nothing changes
    assert_same(list(state.values()), list(full_state(model, opt).values()))


@pytest.mark.parametrize("mode", MODES)
def test_n_as_a_schedule_of_applied_updates(mode):
    """`n` is 2 for the first two updates, then 4."""
    x, y = make_data(48)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), _split(x, y, [8, 8, 16, 16]))
    acc, _, opt = _train(
        lambda: keras.optimizers.Adam(1e-2), _split(x, y, [4] * 12),
        lambda o: accumulate(o, lambda step: keras.ops.where(step < 2, 2, 4), mode=mode),
    )
    assert acc["iterations"] == 4
    assert_states_close(ref, acc)


@pytest.mark.parametrize("mode", MODES)
def test_none_gradients_leave_a_variable_out_as_the_large_batch_does(mode):
    """A variable whose gradient is None in every micro-batch is not updated
    (no slot moves, no weight decay), as the plain optimizer skips it."""
    x, y = make_data(32)

    def run(sizes, wrap):
        model = make_mlp()
        opt = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
        opt = opt if wrap is None else wrap(opt)
        opt.build(model.trainable_variables)
        for xb, yb in _split(x, y, sizes):
            grads = list(gradients(model, xb, yb))
            grads[0] = None  # the first kernel
            opt.apply(grads, model.trainable_variables)
        return full_state(model, opt), model

    ref, ref_model = run([16, 16], None)
    acc, model = run([4] * 8, lambda o: accumulate(o, 4, mode=mode))
    assert_states_close(ref, acc)
    assert_same(values(model.trainable_variables[:1]), values(make_mlp().trainable_variables[:1]))


def test_every_gradient_none_raises():
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(1e-2), 2)
    with pytest.raises(ValueError, match="No gradients"):
        opt.apply([None] * len(model.trainable_variables), model.trainable_variables)


def test_negative_weight_raises():
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(1e-2), 2)
    x, y = make_data(4)
    with pytest.raises(ValueError, match="weight"):
        opt.apply(gradients(model, x, y), model.trainable_variables, weight=-1.0)
    # PyTorch checks a tensor on the device, without reading it back: an
    # asynchronous assertion, which raises PyTorch's RuntimeError.
    with pytest.raises(RuntimeError if BACKEND == "torch" else ValueError, match="weight"):
        opt.apply(
            gradients(model, x, y), model.trainable_variables,
            weight=keras.ops.convert_to_tensor(-2.0),
        )


def test_sparse_slices_is_refused_by_name_off_tensorflow():
    if BACKEND == "tensorflow":
        pytest.skip("TensorFlow keeps slices (tests/test_sparse.py)")
    with pytest.raises(ValueError, match="sparse='slices'.*TensorFlow"):
        accumulate(keras.optimizers.SGD(1e-2), 2, sparse="slices")


# ----------------------------------------------------------------------
# JAX: `stateless_apply` inside `jax.jit`.


def _jitted_step(model, opt):
    """A `jax.jit` train step through `opt.stateless_apply`:
    `(trainable, optimizer_values, x, y) -> (trainable, optimizer_values)`."""
    import jax

    others = [v.value for v in model.non_trainable_variables]
    loss = keras.losses.MeanSquaredError()

    @jax.jit
    def step(trainable, optimizer_values, xb, yb):
        def of(values):
            y_pred, _ = model.stateless_call(values, others, xb, training=True)
            return loss(yb, y_pred)

        return opt.stateless_apply(optimizer_values, jax.grad(of)(trainable), trainable)

    return step


def _write_back(model, opt, trainable, optimizer_values):
    for v, value in zip(model.trainable_variables, trainable):
        v.assign(value)
    for v, value in zip(opt.variables, optimizer_values):
        v.assign(value)


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply under jax.jit is JAX's")
@pytest.mark.parametrize("mode", MODES)
def test_stateless_apply_inside_jit_matches_large_batch(mode):
    x, y = make_data(48)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), _split(x, y, [16] * 3))

    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4, mode=mode)
    opt.build(model.trainable_variables)
    step = _jitted_step(model, opt)
    trainable = [v.value for v in model.trainable_variables]
    optimizer_values = [v.value for v in opt.variables]
    before = list(trainable)
    for k, (xb, yb) in enumerate(_split(x, y, [4] * 12)):
        trainable, optimizer_values = step(trainable, optimizer_values, xb, yb)
        if k < 3:  # in between: the model is unchanged
            assert_same(values(before), values(trainable))
    assert step._cache_size() == 1
    _write_back(model, opt, trainable, optimizer_values)
    assert_states_close(ref, full_state(model, opt))
    assert int(keras.ops.convert_to_numpy(opt.micro_step)) == 0


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply under jax.jit is JAX's")
def test_jitted_micro_steps_transfer_nothing_to_or_from_the_host():
    """Once compiled, a micro-step moves nothing between host and device
    (`jax.transfer_guard`): the cycle's position is decided on the device."""
    import jax

    x, y = make_data(48)
    batches = [(jax.device_put(xb), jax.device_put(yb)) for xb, yb in _split(x, y, [4] * 12)]
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
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), _split(x, y, [16] * 3))
    _write_back(model, opt, trainable, optimizer_values)
    assert_states_close(ref, full_state(model, opt))


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply under jax.jit is JAX's")
def test_a_cycle_after_jit_starts_afresh_and_files_and_views_show_no_stale_sums():
    # Traced, the update leaves the applied cycle's sums in the accumulators
    # (clearing them would copy the parameters on every micro-step); the
    # next cycle's first micro-step writes over them, here eagerly.
    x, y = make_data(48)
    ref, _, _ = _train(lambda: keras.optimizers.Adam(1e-2), _split(x, y, [16] * 3))

    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    opt.build(model.trainable_variables)
    step = _jitted_step(model, opt)
    batches = _split(x, y, [4] * 12)
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


@pytest.mark.parametrize("mode", MODES)
def test_adaptive_gradient_clipping_clips_the_large_batch_gradient(mode):
    """AGC clips the accumulated gradient once per update, as it would clip
    the large batch's (NumPy reference, tests/agc_reference.py)."""
    from tests.agc_reference import np_agc

    factor, eps = 0.01, 1e-3
    x, y = make_data(48)
    model = make_mlp()
    ref = keras.optimizers.Adam(1e-2)
    ref.build(model.trainable_variables)
    clipped = 0
    for xb, yb in _split(x, y, [16] * 3):
        grads = []
        for g, v in zip(gradients(model, xb, yb), model.trainable_variables):
            c, k, _ = np_agc(np.asarray(keras.ops.convert_to_numpy(g)), v.numpy(), factor, eps)
            clipped += k
            grads.append(keras.ops.convert_to_tensor(c))
        ref.apply(grads, model.trainable_variables)
    assert clipped > 0  # the clip bites
    acc, _, _ = _train(
        lambda: keras.optimizers.Adam(1e-2), _split(x, y, [4] * 12),
        lambda o: accumulate(o, 4, mode=mode, agc=factor, agc_eps=eps),
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
