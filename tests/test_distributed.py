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
from tests.dist_support import (
    RecordStates,
    check_micro_steps,
    custom_loop,
    replica_accumulators,
    replica_states,
)
from tests.support import (
    assert_states_close,
    assert_states_equal,
    fit,
    full_state,
    make_data,
    make_embedding_model,
    make_mlp,
    mse_grads,
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
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
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
    grads = mse_grads(make_mlp(), x[: MICRO_BATCH * N], y[: MICRO_BATCH * N])
    assert min(float(tf.norm(g)) for g in grads) > 2 * CLIPNORM
    assert float(tf.linalg.global_norm(grads)) > 2 * GLOBAL_CLIPNORM
    assert max(float(tf.reduce_max(tf.abs(g))) for g in grads) > 2 * CLIPVALUE


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_matches_single_device_large_batch(strategy, name):
    make_optimizer = OPTIMIZERS[name]
    reference = _reference_fit(make_optimizer)
    x, y = _data()
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(make_optimizer(), N)
    fit(model, optimizer, x, y, MICRO_BATCH)
    state = full_state(model, optimizer)
    assert state["iterations"] == CYCLES
    assert int(optimizer.micro_step) == 0
    assert_states_close(reference, state)
    _check_replicas_agree(strategy, model, optimizer)


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


@pytest.mark.parametrize("name", ["adam", "adam_clipnorm"])
def test_custom_loop_matches_single_device_large_batch(strategy, name):
    make_optimizer = OPTIMIZERS[name]
    x, y = _data()
    ref_model, ref_optimizer = make_mlp(), make_optimizer()
    custom_loop(
        tf.distribute.get_strategy(), ref_model, ref_optimizer, x, y, MICRO_BATCH * N
    )
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(make_optimizer(), N)
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
            grads = mse_grads(model, xb, yb)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=(xb, yb))

    with pytest.raises(ValueError, match=r"optimizer\.build"):
        step(x[:MICRO_BATCH], y[:MICRO_BATCH])


def _sparse_data(unique_per_cycle: bool, vocab: int = 40):
    rng = np.random.default_rng(1)
    if unique_per_cycle:
        per_cycle = MICRO_BATCH * N * 3
        ids = [rng.permutation(vocab)[:per_cycle] for _ in range(CYCLES)]
        x = np.concatenate(ids).reshape(-1, 3).astype("int32")
    else:
        x = rng.integers(0, 8, size=(MICRO_BATCH * N * CYCLES, 3)).astype("int32")
    y = rng.normal(size=(len(x), 2)).astype("float32")
    return x, y


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
    x, y = _sparse_data(unique_per_cycle)
    grads = mse_grads(_embedding_model(), x[:MICRO_BATCH], y[:MICRO_BATCH])
    assert isinstance(grads[0], tf.IndexedSlices)
    reference = _reference_fit(OPTIMIZERS[name], _embedding_model, (x, y))
    with strategy.scope():
        model = _embedding_model()
        optimizer = accumulate(OPTIMIZERS[name](), N)
    fit(model, optimizer, x, y, MICRO_BATCH)
    assert_states_close(reference, full_state(model, optimizer))
    _check_replicas_agree(strategy, model, optimizer)
