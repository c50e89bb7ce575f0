"""`model.fit` equals the large batch when Keras normalizes a loss per batch.

Keras 3 divides a masked loss by the micro-batch's count of valid entries,
a `"mean_with_sample_weight"` loss by its sum of sample weights, and a
ragged last batch by its own size. The subject trains `accumulate(opt, n)`
with `fit` on micro-batches of `B`; the reference trains the plain optimizer
on batches of `B * n` from the same initial weights and data, unshuffled.
Weights, every optimizer variable and `iterations` must agree to float32
rounding: each micro-batch weighs the count its loss was divided by.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from gradaccum.callbacks import FlushPartialCycle
from tests.helpers import MODES, assert_states_close, fit, fit_pair, full_state, make_mlp, max_difference
from tests.helpers.distribute import mirrored

VOCAB, STEPS, CLASSES = 12, 10, 3
N, B = 4, 8

# Embedding gradients are `IndexedSlices` with repeated rows, which only
# optimizers linear in the gradient treat as the large batch does (README,
# "Sparse gradients with repeated rows"); the others train a head on a
# frozen embedding, whose mask is what matters here.
LINEAR = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.2, momentum=0.9, nesterov=True),
}
ADAPTIVE = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2, momentum=0.5),
}
OPTIMIZERS = {**LINEAR, **ADAPTIVE}

TOKEN_LOSS = "sparse_categorical_crossentropy"


def sequences(samples: int, seed: int = 0, max_length: int = STEPS):
    """Token sequences of random lengths 1..max_length, padded with 0."""
    rng = np.random.default_rng(seed)
    x = np.zeros((samples, STEPS), "int32")
    y = np.zeros((samples, STEPS), "int32")
    for i, length in enumerate(rng.integers(1, max_length + 1, size=samples)):
        x[i, :length] = rng.integers(1, VOCAB, size=length)
        y[i, :length] = rng.integers(0, CLASSES, size=length)
    return x, y


def token_model(head: str = "dense", train_embedding: bool = True, seed: int = 0) -> keras.Model:
    """Embedding(mask_zero=True) -> [GRU] -> Dense softmax, per token."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(
        VOCAB, 4, mask_zero=True, trainable=train_embedding, name="emb"
    )(inputs)
    if head == "gru":
        h = keras.layers.GRU(4, return_sequences=True, name="rnn")(h)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", name="out")(h)
    return keras.Model(inputs, outputs, name="tokens")


def mlp() -> keras.Model:
    return make_mlp(widths=(6,))


def compare(make_model, make_optimizer, x, y, loss, **kwargs):
    """`fit_pair` on these data: n=N, micro-batches of B."""
    return fit_pair(make_optimizer, N, micro_batch=B, make_model=make_model, data=(x, y), loss=loss, **kwargs)


def _token_model_for(name: str, head: str = "dense"):
    return lambda: token_model(head, train_embedding=name in LINEAR)


# ----------------------------------------------------------------------
# The count itself.


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight", "sum", None])
@pytest.mark.parametrize("weights", [None, "rows", "entries"])
@pytest.mark.parametrize("masked", [False, True])
def test_count_is_what_keras_divides_by(reduction, weights, masked):
    from keras.src.losses.loss import reduce_weighted_values

    from gradaccum._loss_counts import count_of

    rng = np.random.default_rng(0)
    values = tf.constant(rng.uniform(size=(4, 5)), tf.float32)
    sample_weight = {
        None: None,
        "rows": tf.constant(rng.uniform(size=(4, 1)), tf.float32),
        "entries": tf.constant(rng.uniform(size=(4, 5)), tf.float32),
    }[weights]
    mask = tf.constant(rng.uniform(size=(4, 5)) < 0.6) if masked else None
    loss = reduce_weighted_values(values, sample_weight, mask, reduction)
    count = count_of(values, sample_weight, mask, reduction)
    weighted = values
    if sample_weight is not None:
        weighted = weighted * sample_weight
    if mask is not None:
        weighted = weighted * tf.cast(mask, tf.float32)
    if reduction in ("sum", None):
        assert count.value is None
        return
    # Keras's loss is the weighted sum over exactly this count.
    np.testing.assert_allclose(float(loss) * float(count.value), float(tf.reduce_sum(weighted)), rtol=1e-5)
    plain = not masked and (reduction == "sum_over_batch_size" or weights is None)
    assert (count.per_row == 5) if plain else count.per_row is None


# ----------------------------------------------------------------------
# Masked sequences.


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_masked_tokens_match_large_batch(name):
    x, y = sequences(3 * N * B)
    # The micro-batches really hold different numbers of tokens.
    counts = (x != 0).reshape(-1, B, STEPS).sum(axis=(1, 2))
    assert counts.min() * 1.3 < counts.max()
    reference, state, _, opt = compare(_token_model_for(name), OPTIMIZERS[name], x, y, TOKEN_LOSS)
    assert state["iterations"] == 3
    assert int(opt.micro_step) == 0
    assert_states_close(reference, state)


EXECUTION = {
    "jit": dict(jit_compile=True),
    "run_eagerly": dict(run_eagerly=True),
    "steps_per_execution": dict(steps_per_execution=3),
}


@pytest.mark.parametrize(
    "execution, mode",
    [("run_eagerly", "masked"), ("steps_per_execution", "masked"), ("jit", "masked"), ("jit", "skip")],
)
@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_masked_tokens_execution_modes(name, execution, mode):
    x, y = sequences(3 * N * B, seed=1)
    reference, state, _, _ = compare(
        _token_model_for(name), OPTIMIZERS[name], x, y, TOKEN_LOSS, mode=mode, **EXECUTION[execution]
    )
    assert_states_close(reference, state)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_recurrent_head_matches_large_batch(name):
    x, y = sequences(2 * N * B, seed=2)
    reference, state, _, _ = compare(_token_model_for(name, "gru"), OPTIMIZERS[name], x, y, TOKEN_LOSS)
    assert_states_close(reference, state)


# ----------------------------------------------------------------------
# Sample weights, ragged batches, class weights.


def _regression(samples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = rng.normal(size=(samples, 3)).astype("float32")
    # Zero weights too: they count for nothing in the divisor.
    weights = rng.choice([0.0, 0.5, 1.0, 3.0], size=samples).astype("float32")
    return x, y, weights


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "rmsprop"])
def test_mean_with_sample_weight_matches_large_batch(name):
    x, y, weights = _regression(3 * N * B)
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    reference, state, _, _ = compare(
        mlp, OPTIMIZERS[name], x, y, loss, fit_kwargs=dict(sample_weight=weights)
    )
    assert_states_close(reference, state)


def test_masked_tokens_with_token_weights_mean_with_sample_weight():
    x, y = sequences(3 * N * B, seed=3)
    weights = np.random.default_rng(3).uniform(0.0, 2.0, size=x.shape).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight")
    reference, state, _, _ = compare(
        _token_model_for("sgd"), LINEAR["sgd"], x, y, loss, fit_kwargs=dict(sample_weight=weights)
    )
    assert_states_close(reference, state)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_ragged_last_micro_batch_matches_large_batch(name):
    # 58 samples: large batches of 32 and 26; micro-batches 8, 8, 8, 8 and
    # 8, 8, 8, 2, so the second cycle ends with a ragged micro-batch.
    x, y, _ = _regression(58)
    reference, state, _, opt = compare(mlp, OPTIMIZERS[name], x, y, "mse")
    assert state["iterations"] == 2
    assert int(opt.micro_step) == 0
    assert_states_close(reference, state)


def test_ragged_partial_cycle_flushed_matches_large_batch():
    # 44 samples: large batches of 32 and 12; micro-batches 8 x 4, then 8
    # and 4, which `FlushPartialCycle` applies at the end as one update.
    x, y = sequences(44, seed=4)
    reference, state, _, _ = compare(
        _token_model_for("adam"), ADAPTIVE["adam"], x, y, TOKEN_LOSS,
        subject_callbacks=[FlushPartialCycle(at="train_end")],
    )
    assert state["iterations"] == 2
    assert_states_close(reference, state)


def test_class_weight_with_ragged_batches_matches_large_batch():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(58, 5)).astype("float32")
    y = rng.integers(0, 3, size=58).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference, state, _, _ = compare(
        mlp, LINEAR["sgd_momentum"], x, y, loss, fit_kwargs=dict(class_weight={0: 1.0, 1: 3.0, 2: 0.25})
    )
    assert_states_close(reference, state)


# ----------------------------------------------------------------------
# Distribution, loss scaling, checkpoints.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_two_replicas_equal_one_device_on_the_concatenated_batch(name, mode):
    strategy = mirrored()
    x, y = sequences(3 * N * B, seed=6)
    make_model = _token_model_for(name)
    reference_opt = OPTIMIZERS[name]()
    reference = fit(make_model(), reference_opt, x, y, N * B, loss=TOKEN_LOSS)
    with strategy.scope():
        model = make_model()
        opt = accumulate(OPTIMIZERS[name](), N, mode=mode)
    model.compile(optimizer=opt, loss=TOKEN_LOSS)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)  # 4 sequences per replica
    assert_states_close(full_state(reference, reference_opt), full_state(model, opt))


@pytest.mark.parametrize("wrap_loss_scale", [False, True])
def test_two_replicas_run_eagerly(wrap_loss_scale):
    """Eagerly, each replica's step runs in a thread of its own too."""
    strategy = mirrored()
    x, y = sequences(2 * N * B, seed=12)
    make_model = _token_model_for("sgd")
    reference = fit(make_model(), LINEAR["sgd"](), x, y, N * B, loss=TOKEN_LOSS)
    with strategy.scope():
        model = make_model()
        inner = LINEAR["sgd"]()
        if wrap_loss_scale:
            inner = keras.optimizers.LossScaleOptimizer(inner)
        opt = accumulate(inner, N)
    model.compile(optimizer=opt, loss=TOKEN_LOSS, run_eagerly=True)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    for expected, actual in zip(reference.weights, model.weights):
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    assert int(opt.iterations.numpy()) == 2


@pytest.mark.parametrize(
    "order", ["accumulate_outside", "accumulate_inside"]
)
def test_loss_scaling_matches_large_batch(order):
    x, y = sequences(3 * N * B, seed=7)
    if order == "accumulate_outside":
        wrap = lambda opt: accumulate(keras.optimizers.LossScaleOptimizer(opt), N)  # noqa: E731
    else:
        wrap = lambda opt: keras.optimizers.LossScaleOptimizer(accumulate(opt, N))  # noqa: E731
    make_model = _token_model_for("sgd_momentum")
    reference_opt = LINEAR["sgd_momentum"]()
    reference = fit(make_model(), reference_opt, x, y, N * B, loss=TOKEN_LOSS)
    opt = wrap(LINEAR["sgd_momentum"]())
    model = fit(make_model(), opt, x, y, B, loss=TOKEN_LOSS)
    for expected, actual in zip(reference.weights, model.weights):
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    assert int(opt.iterations) == 3


def test_checkpoint_mid_cycle_resumes_with_its_counts(tmp_path):
    x, y = sequences(2 * N * B, seed=8)
    reference_opt = ADAPTIVE["adam"]()
    reference = fit(_token_model_for("adam")(), reference_opt, x, y, N * B, loss=TOKEN_LOSS)

    # One cycle and two micro-batches, saved mid-cycle ...
    first = accumulate(ADAPTIVE["adam"](), N)
    model = fit(_token_model_for("adam")(), first, x[: 6 * B], y[: 6 * B], B, loss=TOKEN_LOSS)
    assert int(first.micro_step) == 2
    path = tf.train.Checkpoint(model=model, optimizer=first).save(str(tmp_path / "ckpt"))

    # ... restored into a fresh model, which finishes the cycle.
    resumed = accumulate(ADAPTIVE["adam"](), N)
    model2 = _token_model_for("adam")()
    model2.compile(optimizer=resumed, loss=TOKEN_LOSS)
    resumed.build(model2.trainable_variables)
    tf.train.Checkpoint(model=model2, optimizer=resumed).restore(path).assert_consumed()
    model2.fit(x[6 * B :], y[6 * B :], batch_size=B, shuffle=False, verbose=0)
    assert_states_close(full_state(reference, reference_opt), full_state(model2, resumed))


# ----------------------------------------------------------------------
# Several losses.


def _two_heads(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(6, activation="tanh", name="h")(inputs)
    a = keras.layers.Dense(3, name="a")(h)
    b = keras.layers.Dense(2, name="b")(h)
    return keras.Model(inputs, {"a": a, "b": b}, name="heads")


def test_several_plain_mean_losses_with_a_ragged_batch_match_large_batch():
    """Counts that are each the batch size times a constant: exact."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(58, 5)).astype("float32")
    y = {"a": rng.normal(size=(58, 3)).astype("float32"), "b": rng.normal(size=(58, 2)).astype("float32")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: this combination is exact
        reference, state, _, _ = compare(
            _two_heads, ADAPTIVE["adam"], x, y, {"a": "mse", "b": "mae"}, loss_weights={"a": 1.0, "b": 0.5}
        )
    assert_states_close(reference, state)


def _token_and_sequence_heads(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 4, mask_zero=True, name="emb")(inputs)
    tokens = keras.layers.Dense(CLASSES, activation="softmax", name="tokens")(h)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    sequence = keras.layers.Dense(1, name="sequence")(pooled)
    return keras.Model(inputs, {"tokens": tokens, "sequence": sequence}, name="two")


def _fit_two(weigh_by: str, run_eagerly: bool = False):
    x, y = sequences(2 * N * B, seed=10)
    targets = {"tokens": y, "sequence": (x != 0).sum(axis=1, keepdims=True).astype("float32") / STEPS}
    model = _token_and_sequence_heads()
    opt = accumulate(keras.optimizers.SGD(0.5), N, weigh_by=weigh_by)
    model.compile(optimizer=opt, loss={"tokens": TOKEN_LOSS, "sequence": "mse"}, run_eagerly=run_eagerly)
    model.fit(x, targets, batch_size=B, shuffle=False, verbose=0)
    return full_state(model, opt)


def test_several_losses_with_unrelated_counts_warn_once_and_weigh_alike():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = _fit_two("count", run_eagerly=True)  # one loss computation per step
    ours = [w for w in caught if "gradaccum" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "weigh_by='batch'" in str(ours[0].message)
    assert_states_close(_fit_two("batch", run_eagerly=True), state)


# ----------------------------------------------------------------------
# The opt-out, explicit weights, and the setting itself.


def _equal_weights_custom_loop(x, y):
    """Accumulated, each micro-batch's masked mean weighing 1 (no `fit`)."""
    model = token_model()
    opt = accumulate(keras.optimizers.SGD(0.5), N)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for start in range(0, len(x), B):
        step(x[start : start + B], y[start : start + B])
    return full_state(model, opt)


def test_weigh_by_batch_weighs_every_micro_batch_alike():
    x, y = sequences(2 * N * B, seed=11)
    expected = _equal_weights_custom_loop(x, y)
    opt = accumulate(keras.optimizers.SGD(0.5), N, weigh_by="batch")
    model = fit(token_model(), opt, x, y, B, loss=TOKEN_LOSS)
    assert opt.weigh_by == "batch"
    assert_states_close(expected, full_state(model, opt))
    # And that is not the large batch on this data.
    reference_opt = keras.optimizers.SGD(0.5)
    reference = full_state(fit(token_model(), reference_opt, x, y, N * B, loss=TOKEN_LOSS), reference_opt)
    assert max_difference(reference, expected, "model/") > 1e-4


class _CustomStep(keras.Model):
    """A custom train step: `self.compute_loss`, then `optimizer.apply`,
    with `weight=self.weight` if that is not None."""

    weight = None

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        if self.weight is None:
            self.optimizer.apply(grads, self.trainable_variables)
        else:
            self.optimizer.apply(grads, self.trainable_variables, weight=self.weight)
        return {"loss": loss}


def _custom_step_model(weight):
    base = token_model()
    model = _CustomStep(base.inputs, base.outputs, name="tokens")
    model.weight = weight
    return model


def test_custom_train_step_gets_the_count_unless_it_passes_a_weight():
    x, y = sequences(2 * N * B, seed=11)
    # `self.compute_loss` hands the count over: the large batch.
    reference_opt = keras.optimizers.SGD(0.5)
    large_batch = full_state(fit(token_model(), reference_opt, x, y, N * B, loss=TOKEN_LOSS), reference_opt)
    opt = accumulate(keras.optimizers.SGD(0.5), N)
    model = fit(_custom_step_model(None), opt, x, y, B, loss=TOKEN_LOSS)
    assert_states_close(large_batch, full_state(model, opt))
    # An explicit weight wins: here every micro-batch weighs alike.
    opt = accumulate(keras.optimizers.SGD(0.5), N)
    model = fit(_custom_step_model(1.0), opt, x, y, B, loss=TOKEN_LOSS)
    assert_states_close(_equal_weights_custom_loop(x, y), full_state(model, opt))
