"""`gradaccum.layers.BatchNormalization`: moving statistics per applied update.

For a model whose first layer is this BatchNormalization, its moving mean
and variance depend on the inputs only, so after `k` cycles they must equal
those of `keras.layers.BatchNormalization` trained on the large batch
(`B * n`, same data order) to float32 rounding. Keras's own layer under
accumulation is measurably elsewhere (checked, so the equality can fail).
"""

from __future__ import annotations

import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from gradaccum.callbacks import FlushPartialCycle
from gradaccum.layers import BatchNormalization, follow, replace_batch_normalization
from tests.helpers import MODES, assert_states_equal, dtype_policy, full_state
from tests.helpers.distribute import mirrored

N = 4
B = 4
MOMENTUM = 0.8
RTOL, ATOL = 1e-6, 1e-6


def _data(samples: int, shape=(6,), seed: int = 0):
    rng = np.random.default_rng(seed)
    # Far from zero mean and unit variance, and different per channel, so
    # that errors in the pooled statistics show.
    scale = np.linspace(0.5, 4.0, shape[-1]).astype("float32")
    x = (rng.normal(size=(samples,) + shape) * scale + 2.0 * scale).astype("float32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    return x, y


def make_model(bn=BatchNormalization, shape=(6,), seed: int = 0, **bn_kwargs) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input(shape), bn(momentum=MOMENTUM, name="bn", **bn_kwargs)]
    if len(shape) > 1:
        layers += [keras.layers.Conv2D(3, 2, name="conv"), bn(momentum=MOMENTUM, name="bn2"),
                   keras.layers.Flatten(name="flat")]
    layers += [keras.layers.Dense(4, activation="relu", name="hidden"),
               bn(momentum=MOMENTUM, name="bn3"), keras.layers.Dense(1, name="out")]
    return keras.Sequential(layers, name="net")


def moving(model: keras.Model, name: str = "bn") -> tuple[np.ndarray, np.ndarray]:
    layer = model.get_layer(name)
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


def _fit(model, optimizer, x, y, batch, **kwargs):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, **kwargs)
    return model


def _large_batch(x, y, batch=B * N, shape=(6,), **bn_kwargs):
    return _fit(make_model(keras.layers.BatchNormalization, shape, **bn_kwargs),
                keras.optimizers.SGD(0.05), x, y, batch)


def assert_moving_close(reference, subject, name="bn"):
    for r, s, what in zip(moving(reference, name), moving(subject, name), ("mean", "variance")):
        np.testing.assert_allclose(s, r, rtol=RTOL, atol=ATOL, err_msg=what)


def distance(a, b, name="bn") -> float:
    return max(float(np.max(np.abs(p - q))) for p, q in zip(moving(a, name), moving(b, name)))


# ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_first_layer_moving_statistics_equal_the_large_batch(mode):
    x, y = _data(B * N * 3)
    reference = _large_batch(x, y)
    subject = _fit(make_model(), accumulate(keras.optimizers.SGD(0.05), N, mode=mode), x, y, B)
    assert_moving_close(reference, subject)
    # Keras's layer under accumulation is far from it.
    keras_layer = _fit(make_model(keras.layers.BatchNormalization),
                       accumulate(keras.optimizers.SGD(0.05), N, mode=mode), x, y, B)
    assert distance(reference, keras_layer) > 0.1
    # After whole cycles the pool is empty.
    assert float(subject.get_layer("bn").pooled_count.numpy()) == 0.0


@pytest.mark.parametrize(
    "compile_kwargs", [{}, dict(jit_compile=True), dict(run_eagerly=True)], ids=["graph", "xla", "eager"]
)
def test_split_step_moving_statistics_equal_the_large_batch(compile_kwargs):
    """`micro_batch_size`: the layer pools a batch's micro-batches and
    updates its moving statistics once per batch, as Keras's layer does on
    the whole batch (3 batches and a ragged last one); Keras's own layer in a
    split step updates them per micro-batch."""
    x, y = _data(B * N * 3 + 5)
    reference = _large_batch(x, y)
    subject = make_model()
    subject.compile(optimizer=accumulate(keras.optimizers.SGD(0.05), micro_batch_size=B), loss="mse",
                    **compile_kwargs)
    subject.fit(x, y, batch_size=B * N, shuffle=False, verbose=0)
    assert_moving_close(reference, subject)
    assert float(subject.get_layer("bn").pooled_count.numpy()) == 0.0
    keras_layer = _fit(make_model(keras.layers.BatchNormalization),
                       accumulate(keras.optimizers.SGD(0.05), micro_batch_size=B), x, y, B * N)
    assert distance(reference, keras_layer) > 0.1


@pytest.mark.parametrize(
    "compile_kwargs",
    [dict(run_eagerly=True), dict(jit_compile=True), dict(steps_per_execution=3)],
    ids=["eager", "xla", "steps_per_execution"],
)
def test_execution_modes(compile_kwargs):
    x, y = _data(B * N * 3)
    reference = _large_batch(x, y)
    model = make_model()
    model.compile(optimizer=accumulate(keras.optimizers.SGD(0.05), N), loss="mse", **compile_kwargs)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_moving_close(reference, model)


def test_conv_inputs_pool_over_batch_and_space():
    x, y = _data(B * N * 2, shape=(4, 4, 3))
    reference = _large_batch(x, y, shape=(4, 4, 3))
    subject = _fit(make_model(shape=(4, 4, 3)), accumulate(keras.optimizers.SGD(0.05), N), x, y, B)
    assert_moving_close(reference, subject)


def test_in_between_micro_steps_leave_moving_statistics_bit_identical():
    x, y = _data(B * N * 2)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append([v.numpy().copy() for v in self.model.get_layer("bn").weights])

    model = make_model()
    _fit(model, accumulate(keras.optimizers.SGD(0.05), N), x, y, B, callbacks=[Record()])
    initial = [np.zeros(6), np.ones(6)]
    for k, weights in enumerate(seen):
        previous = seen[k - 1] if k else None
        moving_now = weights[2:4]
        moving_before = previous[2:4] if previous is not None else initial
        if (k + 1) % N:
            for a, b in zip(moving_now, moving_before):
                assert np.array_equal(a, b), k
            assert float(weights[4]) == B * ((k % N) + 1)  # pooled_count
        else:
            assert not np.array_equal(moving_now[0], moving_before[0]), k


def test_ragged_micro_batches_and_flushed_partial_cycle():
    """60 samples, micro-batches of 8, n=2: the last cycle holds 8 + 4
    samples (ragged); 3 more cycles of 16. Then a partial cycle flushed."""
    x, y = _data(60)
    reference = _large_batch(x, y, batch=16)
    subject = _fit(make_model(), accumulate(keras.optimizers.SGD(0.05), 2), x, y, 8)
    assert_moving_close(reference, subject)
    # 56 samples with n=4: 3 whole cycles of 16 and one of 8, applied by
    # the flush at the end of training.
    x, y = _data(56, seed=1)
    reference = _large_batch(x, y, batch=16)
    subject = _fit(make_model(), accumulate(keras.optimizers.SGD(0.05), 4), x, y, 4,
                   callbacks=[FlushPartialCycle("train_end")])
    assert_moving_close(reference, subject)


def test_a_schedule_of_n_is_followed():
    """n=2 for the first update, then 3: large batches of 8, 12, 12."""
    x, y = _data(32)
    opt = accumulate(keras.optimizers.SGD(0.05), lambda step: tf.where(step < 1, 2, 3))
    subject = _fit(make_model(), opt, x, y, B)
    reference_layer = keras.layers.BatchNormalization(momentum=MOMENTUM)
    for start, stop in ((0, 8), (8, 20), (20, 32)):
        reference_layer(x[start:stop], training=True)
    for r, s in zip((reference_layer.moving_mean, reference_layer.moving_variance), moving(subject)):
        np.testing.assert_allclose(s, r.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("optimizer", ["plain", "n1"])
def test_without_accumulation_it_is_keras_layer_bit_for_bit(optimizer):
    x, y = _data(B * N * 2)

    def make_opt():
        sgd = keras.optimizers.SGD(0.05)
        return sgd if optimizer == "plain" else accumulate(sgd, 1)

    ours = _fit(make_model(), make_opt(), x, y, B)
    theirs = _fit(make_model(keras.layers.BatchNormalization), make_opt(), x, y, B)
    for layer in ("bn", "bn3"):
        for a, b in zip(moving(ours, layer), moving(theirs, layer)):
            assert np.array_equal(a, b), layer
    for a, b in zip(ours.get_layer("out").weights, theirs.get_layer("out").weights):
        assert np.array_equal(a.numpy(), b.numpy())


def test_custom_loop_follows_after_follow_and_flush_applies_the_pool():
    """Two whole cycles and two micro-batches, then `opt.flush()`: large
    batches of 16, 16 and 8."""
    x, _ = _data(B * (2 * N + 2))
    model = make_model()
    opt = accumulate(keras.optimizers.SGD(0.05), N)
    opt.build(model.trainable_variables)
    follow(model, opt)

    @tf.function
    def step(xb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True)))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for start in range(0, len(x), B):
        step(x[start : start + B])
    before_flush = moving(model)
    opt.flush()
    assert float(model.get_layer("bn").pooled_count.numpy()) == 0.0
    reference = keras.layers.BatchNormalization(momentum=MOMENTUM)
    for start in range(0, len(x), B * N):
        reference(x[start : start + B * N], training=True)
    for r, s_ in zip((reference.moving_mean, reference.moving_variance), moving(model)):
        np.testing.assert_allclose(s_, r.numpy(), rtol=RTOL, atol=ATOL)
    assert not np.array_equal(before_flush[0], moving(model)[0])
    # A second flush has nothing to apply.
    after = moving(model)
    opt.flush()
    for a, b in zip(after, moving(model)):
        assert np.array_equal(a, b)


def test_keras_file_mid_cycle_resumes_bit_identically():
    x, y = _data(B * N * 3)
    cut = B * (N + 2)
    straight = make_model()
    _fit(straight, accumulate(keras.optimizers.Adam(1e-2), N), x[:cut], y[:cut], B)
    straight.fit(x[cut:], y[cut:], batch_size=B, shuffle=False, verbose=0)

    saved = make_model()
    _fit(saved, accumulate(keras.optimizers.Adam(1e-2), N), x[:cut], y[:cut], B)
    assert float(saved.get_layer("bn").pooled_count.numpy()) == 2 * B
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    saved.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.get_layer("bn"), BatchNormalization)
    assert float(loaded.get_layer("bn").pooled_count.numpy()) == 2 * B
    loaded.fit(x[cut:], y[cut:], batch_size=B, shuffle=False, verbose=0)
    assert_states_equal(full_state(straight, straight.optimizer), full_state(loaded, loaded.optimizer))


def test_checkpoint_mid_cycle_resumes_bit_identically():
    x, y = _data(B * N * 3)
    cut = B * (N + 1)
    straight = make_model()
    _fit(straight, accumulate(keras.optimizers.SGD(0.05), N), x[:cut], y[:cut], B)
    straight.fit(x[cut:], y[cut:], batch_size=B, shuffle=False, verbose=0)

    first = make_model()
    _fit(first, accumulate(keras.optimizers.SGD(0.05), N), x[:cut], y[:cut], B)
    prefix = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
        os.path.join(tempfile.mkdtemp(), "ckpt")
    )
    second = make_model(seed=3)
    opt = accumulate(keras.optimizers.SGD(0.05), N)
    second.compile(optimizer=opt, loss="mse")
    opt.build(second.trainable_variables)
    tf.train.Checkpoint(model=second, optimizer=opt).restore(prefix).assert_consumed()
    second.fit(x[cut:], y[cut:], batch_size=B, shuffle=False, verbose=0)
    assert_states_equal(full_state(straight, straight.optimizer), full_state(second, opt))


def test_synchronized_under_mirrored_strategy_pools_across_replicas():
    """3 cycles and a partial one of 8 samples, flushed at the end of
    training from cross-replica context."""
    x, y = _data(B * N * 3 + 8)
    reference = _large_batch(x, y)
    with mirrored().scope():
        model = make_model(synchronized=True)
        model.compile(optimizer=accumulate(keras.optimizers.SGD(0.05), N), loss="mse")
    # 2 samples per replica.
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[FlushPartialCycle("train_end")])
    assert_moving_close(reference, model)


def test_mixed_float16():
    """Inputs are cast to float16 in both runs; the moments are float32
    (Keras upcasts), so the tolerance is float32's. The loss scale starts
    low enough that no micro-batch overflows: a dropped micro-batch is still
    pooled (its forward pass ran) but not counted by the optimizer (see the
    README)."""
    x, y = _data(B * N * 2)

    def make_opt():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=16.0)

    with dtype_policy("mixed_float16"):
        reference = _fit(make_model(keras.layers.BatchNormalization), make_opt(), x, y, B * N)
        opt = accumulate(make_opt(), N)
        subject = _fit(make_model(), opt, x, y, B)
    assert int(opt.iterations) == 2
    assert float(opt.dynamic_scale) == 16.0  # nothing dropped
    assert_moving_close(reference, subject)


def test_replace_batch_normalization_keeps_weights():
    x, y = _data(B * N * 2, shape=(4, 4, 3))
    original = _fit(make_model(keras.layers.BatchNormalization, shape=(4, 4, 3)),
                    keras.optimizers.SGD(0.05), x, y, B)
    copy = replace_batch_normalization(original)
    for name in ("bn", "bn2", "bn3"):
        assert type(copy.get_layer(name)) is BatchNormalization
        for a, b in zip(original.get_layer(name).weights, copy.get_layer(name).weights):
            assert np.array_equal(a.numpy(), b.numpy())
    for a, b in zip(original.get_layer("out").weights, copy.get_layer("out").weights):
        assert np.array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(original.predict(x, verbose=0), copy.predict(x, verbose=0))


def test_accumulating_can_create_this_layer_for_third_party_code():
    import gradaccum

    x, y = _data(B * N * 2)
    reference = _large_batch(x, y)

    def their_code():
        model = make_model(keras.layers.BatchNormalization)
        return _fit(model, keras.optimizers.SGD(0.05), x, y, B)

    with gradaccum.accumulating(n=N, batch_normalization=True):
        model = their_code()
    assert all(type(model.get_layer(name)) is BatchNormalization for name in ("bn", "bn3"))
    assert_moving_close(reference, model)
    # Outside the block, and without the argument, Keras's layer is Keras's.
    assert type(keras.layers.BatchNormalization()) is keras.layers.BatchNormalization
    with gradaccum.accumulating(n=N):
        assert type(keras.layers.BatchNormalization()) is keras.layers.BatchNormalization
    with pytest.raises(TypeError, match="batch_normalization"), gradaccum.accumulating(n=N, batch_normalization=1):
        pass


def test_masked_inputs_pool_the_valid_entries():
    """Sequences with padding: Keras's layer takes the moments over the
    valid time steps; the pool counts them, so cycles of sequences with
    different numbers of valid steps pool exactly."""
    rng = np.random.default_rng(4)
    x = rng.integers(1, 30, size=(B * N * 2, 5)).astype("int32")
    for i, length in enumerate(rng.integers(1, 6, size=len(x))):
        x[i, length:] = 0
    y = rng.normal(size=(len(x), 1)).astype("float32")

    def make(bn):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,), dtype="int32")
        h = keras.layers.Embedding(30, 3, mask_zero=True, name="emb")(inputs)
        h = bn(momentum=MOMENTUM, name="bn")(h)
        out = keras.layers.Dense(1, name="out")(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model(inputs, out, name="seq")

    # The embedding does not train (lr 0), so the statistics depend on the
    # data only.
    reference = _fit(make(keras.layers.BatchNormalization), keras.optimizers.SGD(0.0), x, y, B * N)
    subject = _fit(make(BatchNormalization), accumulate(keras.optimizers.SGD(0.0), N), x, y, B)
    for r, s_ in zip(moving(reference), moving(subject)):
        # Keras divides by the valid count plus its epsilon (1e-7): relative
        # 1e-7 / count, within float32 rounding.
        np.testing.assert_allclose(s_, r, rtol=RTOL, atol=ATOL)


def test_renorm_is_refused():
    with pytest.raises(ValueError, match="renorm"):
        BatchNormalization(renorm=True)
