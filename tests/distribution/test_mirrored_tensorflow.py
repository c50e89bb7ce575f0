"""MirroredStrategy with two replicas equals single-device large-batch training.

The subject trains `accumulate(optimizer, n)` under a two-replica
`MirroredStrategy` on global micro-batches of `B` (each replica sees `B / 2`);
the reference trains the plain optimizer on one device on batches of `B * n`
with the same initial weights and data order. Weights, every optimizer
variable and `iterations` must agree to float32 rounding, every replica must
hold the same values after each apply step, and in-between micro-steps must
leave every replica's variables bit-identical.
"""


import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    core_of,
    dtype_policy,
    embedding_data,
    fit,
    full_state,
    gradients,
    make_data,
    make_embedding_model,
    make_mlp,
)
from tests.helpers.distribute import (
    RecordStates,
    check_micro_steps,
    custom_loop,
    distributed_batches,
    mirrored,
    replica_accumulators,
    replica_states,
)

N = 3
MICRO_BATCH = 4  # global: 2 samples per replica
CYCLES = 3
LR = 1e-2
# Thresholds far below the gradient norms of the first large batch (checked
# in `test_clipping_is_active`), so clipping acts on every update.
CLIPNORM = 0.05
GLOBAL_CLIPNORM = 0.05
CLIPVALUE = 0.01

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(LR, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(LR),
    "adamw": lambda: keras.optimizers.AdamW(LR, weight_decay=0.05),
    "adam_clipnorm": lambda: keras.optimizers.Adam(LR, clipnorm=CLIPNORM),
    "sgd_global_clipnorm": lambda: keras.optimizers.SGD(
        0.1, momentum=0.5, global_clipnorm=GLOBAL_CLIPNORM
    ),
    "sgd_clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=CLIPVALUE),
}


@pytest.fixture(scope="module")
def strategy():
    strategy = mirrored()
    assert strategy.num_replicas_in_sync == 2
    return strategy


def _data():
    return make_data(MICRO_BATCH * N * CYCLES)


def _reference_fit(make_optimizer, make_model=make_mlp, data=None):
    x, y = data if data is not None else _data()
    model, optimizer = make_model(), make_optimizer()
    fit(model, optimizer, x, y, MICRO_BATCH * N)
    return full_state(model, optimizer)


def _check_replicas_agree(strategy, model, optimizer):
    first, *others = replica_states(strategy, model, optimizer)
    assert others
    for other in others:
        assert_states_equal(first, other)


def test_clipping_is_active():
    """The clip thresholds above really clip, so the clipping tests can fail."""
    x, y = _data()
    grads = gradients(make_mlp(), x[: MICRO_BATCH * N], y[: MICRO_BATCH * N])
    assert min(float(tf.norm(g)) for g in grads) > 2 * CLIPNORM
    assert float(tf.linalg.global_norm(grads)) > 2 * GLOBAL_CLIPNORM
    assert max(float(tf.reduce_max(tf.abs(g))) for g in grads) > 2 * CLIPVALUE


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_matches_single_device_large_batch(strategy, name, mode):
    make_optimizer = OPTIMIZERS[name]
    reference = _reference_fit(make_optimizer)
    x, y = _data()
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(make_optimizer(), N, mode=mode)
    fit(model, optimizer, x, y, MICRO_BATCH)
    state = full_state(model, optimizer)
    assert state["iterations"] == CYCLES
    assert int(optimizer.micro_step) == 0
    assert_states_close(reference, state)
    _check_replicas_agree(strategy, model, optimizer)


def test_n1_is_the_plain_optimizer_under_two_replicas(strategy):
    """`n=1` hands gradients straight over: plain Keras, bit for bit.

    With clipping that is Keras's per-replica clipping (what plain Keras does
    under a strategy); only accumulated updates are clipped as on one device.
    """
    x, y = _data()
    states = []
    for wrap in (lambda o: o, lambda o: accumulate(o, 1)):
        with strategy.scope():
            model = make_mlp()
            optimizer = wrap(OPTIMIZERS["adam_clipnorm"]())
        fit(model, optimizer, x, y, MICRO_BATCH)
        states.append(full_state(model, optimizer))
    assert_states_equal(*states)


def test_fit_run_eagerly(strategy):
    reference = _reference_fit(OPTIMIZERS["adam"])
    x, y = _data()
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(OPTIMIZERS["adam"](), N)
    fit(model, optimizer, x, y, MICRO_BATCH, run_eagerly=True)
    assert_states_close(reference, full_state(model, optimizer))
    _check_replicas_agree(strategy, model, optimizer)


def test_fit_micro_steps_on_every_replica(strategy):
    """Per replica: in-between steps bit-identical, replicas equal, local sums."""
    x, y = _data()
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(OPTIMIZERS["adamw"](), N)
    recorder = RecordStates(strategy, optimizer)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(
        x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0, callbacks=[recorder]
    )
    assert len(recorder.states) == N * CYCLES + 1
    check_micro_steps(recorder.states, recorder.accumulators, N)


@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
def test_wrapped_outside_scope(strategy, built):
    """Optimizer created in the scope, `accumulate()` called outside it."""
    reference = _reference_fit(OPTIMIZERS["adam"])
    x, y = _data()
    with strategy.scope():
        model = make_mlp()
        inner = OPTIMIZERS["adam"]()
        if built:
            inner.build(model.trainable_variables)
    optimizer = accumulate(inner, N)
    fit(model, optimizer, x, y, MICRO_BATCH)
    assert_states_close(reference, full_state(model, optimizer))
    _check_replicas_agree(strategy, model, optimizer)


def test_optimizer_created_outside_scope_raises(strategy):
    """Plain Keras cannot use such an optimizer either; the error says why."""
    x, y = _data()
    optimizer = accumulate(OPTIMIZERS["adam"](), N)
    with strategy.scope():
        model = make_mlp()
    with pytest.raises(ValueError, match=r"created outside any .*strategy.scope"):
        fit(model, optimizer, x, y, MICRO_BATCH)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["adam", "adam_clipnorm"])
def test_custom_loop_matches_single_device_large_batch(strategy, name, mode):
    make_optimizer = OPTIMIZERS[name]
    x, y = _data()
    ref_model, ref_optimizer = make_mlp(), make_optimizer()
    custom_loop(
        tf.distribute.get_strategy(), ref_model, ref_optimizer, x, y, MICRO_BATCH * N
    )
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(make_optimizer(), N, mode=mode)
        optimizer.build(model.trainable_variables)
    states = [replica_states(strategy, model, optimizer)]
    accumulators = [replica_accumulators(strategy, optimizer)]

    def record(step):
        states.append(replica_states(strategy, model, optimizer))
        accumulators.append(replica_accumulators(strategy, optimizer))

    custom_loop(strategy, model, optimizer, x, y, MICRO_BATCH, on_step=record)
    assert len(states) == N * CYCLES + 1
    check_micro_steps(states, accumulators, N)
    state = full_state(model, optimizer)
    assert state["iterations"] == CYCLES
    assert_states_close(full_state(ref_model, ref_optimizer), state)


def test_custom_loop_unbuilt_optimizer_raises(strategy):
    """Keras cannot create slots inside `strategy.run` in a `tf.function`."""
    x, y = _data()
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(OPTIMIZERS["adam"](), N)

    @tf.function
    def step(xb, yb):
        def replica_step(xb, yb):
            grads = gradients(model, xb, yb)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=(xb, yb))

    with pytest.raises(ValueError, match=r"optimizer\.build"):
        step(x[:MICRO_BATCH], y[:MICRO_BATCH])


def _embedding_model():
    return make_embedding_model(vocab=40)


@pytest.mark.parametrize(
    "name, unique_per_cycle", [("adam", True), ("sgd_momentum", False)]
)
def test_embedding_sparse_gradients(strategy, name, unique_per_cycle):
    """`tf.IndexedSlices` gradients, scattered into each replica's accumulator.

    Keras 3 squares `IndexedSlices` values before summing repeated rows, so
    for Adam even plain large-batch training depends on row repeats (and
    under two replicas the all-reduce concatenates rows); Adam is checked
    with rows unique within a cycle, momentum SGD (linear in the gradient)
    with repeated rows.
    """
    x, y = embedding_data(MICRO_BATCH * N, CYCLES, unique_per_cycle)
    grads = gradients(_embedding_model(), x[:MICRO_BATCH], y[:MICRO_BATCH])
    assert isinstance(grads[0], tf.IndexedSlices)
    reference = _reference_fit(OPTIMIZERS[name], _embedding_model, (x, y))
    with strategy.scope():
        model = _embedding_model()
        optimizer = accumulate(OPTIMIZERS[name](), N)
    fit(model, optimizer, x, y, MICRO_BATCH)
    assert_states_close(reference, full_state(model, optimizer))
    _check_replicas_agree(strategy, model, optimizer)


# ----------------------------------------------------------------------
# LossScaleOptimizer under two replicas.

LSO = keras.optimizers.LossScaleOptimizer
# Half-precision rounding: plain mixed_float16 training of this MLP under two
# replicas differs from the same training on one device by 2.3e-5 absolute
# (measured); accumulated training under two replicas by at most 2.9e-5. A
# real bug moves values by about lr = 1e-2.
FP16_ATOL, FP16_RTOL = 5e-5, 1e-4

LSO_WRAPS = {
    "accumulate_lso": lambda mode: accumulate(LSO(OPTIMIZERS["adam"]()), N, mode=mode),
    "lso_accumulate": lambda mode: LSO(accumulate(OPTIMIZERS["adam"](), N, mode=mode)),
    "compile_auto_wrap": lambda mode: accumulate(OPTIMIZERS["adam"](), N, mode=mode),
}




def _scale(optimizer) -> float:
    return float(optimizer.dynamic_scale.numpy())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", sorted(LSO_WRAPS))
def test_loss_scale_optimizer_fit_mixed_float16(strategy, order, mode):
    x, y = _data()
    with dtype_policy("mixed_float16"):
        ref_model, ref_optimizer = make_mlp(), LSO(OPTIMIZERS["adam"]())
        fit(ref_model, ref_optimizer, x, y, MICRO_BATCH * N)
        with strategy.scope():
            model = make_mlp()
            model.compile(optimizer=LSO_WRAPS[order](mode), loss="mse")
        optimizer = model.optimizer
        recorder = RecordStates(strategy, optimizer, core_of(optimizer))
        model.fit(
            x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0, callbacks=[recorder]
        )
    assert isinstance(optimizer, LSO)
    assert _scale(optimizer) == _scale(ref_optimizer)
    reference = full_state(ref_model, ref_optimizer)
    state = full_state(model, optimizer)
    assert state["iterations"] == CYCLES
    # The scale's growth counter counts finite micro-batches (documented).
    assert int(reference.pop("opt/step_counter")) == CYCLES
    assert int(state.pop("opt/step_counter")) == N * CYCLES
    assert_states_close(reference, state, rtol=FP16_RTOL, atol=FP16_ATOL)
    # Per replica, the loss-scale optimizer's own counter moves on every
    # micro-step; everything else only on apply steps.
    for snapshot in recorder.states:
        for replica in snapshot:
            del replica["opt/step_counter"]
    check_micro_steps(recorder.states, recorder.accumulators, N)


@pytest.mark.parametrize(
    "order, poisoned",
    [
        ("accumulate_lso", "all"),
        ("accumulate_lso", "first"),
        ("lso_accumulate", "first"),
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_loss_scale_non_finite_micro_batch_dropped_on_every_replica(
    strategy, order, poisoned, mode
):
    """Micro-batch 4 of 10 is non-finite on every replica, or on the first.

    Reference: plain float32 training on one device on large batches formed
    from the 9 finite micro-batches. The loss-scale optimizer decides for all
    replicas at once, so the replica whose share was finite drops it too: the
    cycle waits on every replica, the scale halves, and no other variable
    moves on that step.

    Keras 3.15's LossScaleOptimizer takes that decision from the first
    replica's gradients only (it assumes they are already all-reduced), so a
    micro-batch that is non-finite on another replica alone reaches the inner
    optimizer, with or without accumulation; that case is not tested.
    """
    bad = 4
    x, y = make_data(MICRO_BATCH * (N * CYCLES + 1))
    keep = np.ones(len(x), bool)
    keep[bad * MICRO_BATCH : (bad + 1) * MICRO_BATCH] = False
    ref_model, ref_optimizer = make_mlp(), OPTIMIZERS["adam"]()
    fit(ref_model, ref_optimizer, x[keep], y[keep], MICRO_BATCH * N)

    with strategy.scope():
        model = make_mlp()
        optimizer = LSO_WRAPS[order](mode)
        optimizer.build(model.trainable_variables)
    core = core_of(optimizer)
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def replica_step(xb, yb, poison):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(
                per_example, global_batch_size=MICRO_BATCH
            )
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        if poisoned == "first":
            poison = tf.logical_and(poison, tf.equal(replica, 0))
        grads = [tf.where(poison, g * np.inf, g) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step(xb, yb, poison):
        strategy.run(replica_step, args=(xb, yb, poison))

    scale = _scale(optimizer)
    micro_steps = []
    for k, (xb, yb) in enumerate(distributed_batches(strategy, x, y, MICRO_BATCH)):
        before = replica_states(strategy, model, core)
        sums_before = replica_accumulators(strategy, core)
        step(xb, yb, tf.constant(k == bad))
        micro_steps.append(int(core.micro_step))
        if k == bad:
            for old, new in zip(before, replica_states(strategy, model, core)):
                assert_states_equal(old, new)
            sums_after = replica_accumulators(strategy, core)
            for old, new in zip(sums_before, sums_after):
                assert all(np.array_equal(a, b) for a, b in zip(old, new))
    assert micro_steps == [1, 2, 0, 1, 1, 2, 0, 1, 2, 0]
    assert _scale(optimizer) == scale / 2
    state = full_state(model, core)
    assert state["iterations"] == CYCLES
    assert_states_close(full_state(ref_model, ref_optimizer), state)
    _check_replicas_agree(strategy, model, core)
