"""`sparse="auto"` (the default) equals Keras's large batch for sparse gradients.

Keras 3's TensorFlow optimizers take a `tf.IndexedSlices` gradient slice by
slice: a row's repeated slices are not summed first, so Adam's, RMSprop's
and Adagrad's second moment and `global_clipnorm`'s norm depend on how the
large batch's lookups form slices. A token embedding's grow with the batch
(the large batch holds the micro-batches' slices side by side); a position
embedding's (`Embedding(T)(ops.arange(T))`, added to every sample) do not
(the large batch holds one slice per position, summed over the batch). Every
test trains the plain optimizer on batches of `B * n` (the reference) and
`accumulate(optimizer, n)` on micro-batches of `B`, from the same weights on
the same data, and compares weights, every optimizer variable and
`iterations` (relative 1e-5 in float32).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from gradaccum import accumulate
from tests.helpers import MODES, assert_states_close, assert_states_equal, fit, full_state, internal_state
from tests.helpers.distribute import mirrored

N, B, CYCLES = 4, 4, 3
LENGTH, VOCAB, DIM = 5, 12, 3
# Below the gradient norms here: the clip acts on every update.
CLIP = 0.05


@keras.saving.register_keras_serializable(package="test_sparse_exact")
class PositionEmbedding(keras.layers.Layer):
    """Adds `Embedding(LENGTH)(arange(LENGTH))` to every sample, as the
    official Keras transformer examples do: one slice per position."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = keras.layers.Embedding(LENGTH, DIM, name="table")

    def build(self, input_shape):
        self.table.build((LENGTH,))

    def call(self, h):
        return h + self.table(ops.arange(LENGTH))


class TiedLogits(keras.layers.Layer):
    """Logits against a token embedding's own table (a dense gradient)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


@keras.saving.register_keras_serializable(package="test_sparse_exact")
class TokensAndFirstRow(keras.layers.Layer):
    """One table looked up twice: by the tokens, and by a constant id (a
    `[CLS]`-like row added to every position). TensorFlow concatenates the
    two lookups' slices: per micro-step, some grow with the batch, one does
    not."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = keras.layers.Embedding(VOCAB, DIM, name="table")

    def build(self, input_shape):
        self.table.build(input_shape)

    def call(self, tokens):
        return self.table(tokens) + self.table(ops.zeros((1,), "int32"))


@keras.saving.register_keras_serializable(package="test_sparse_exact")
class MadeIds(keras.layers.Layer):
    """Ids a model makes from the batch's shape: segment ids as
    `ops.zeros_like(tokens)` (BERT's default token types), or positions
    broadcast to every sample. `fit` traces its step with the batch's static
    shape, so they are constants in the graph; they grow with the batch."""

    def __init__(self, how: str, **kwargs):
        super().__init__(**kwargs)
        self.how = how
        self.table = keras.layers.Embedding(2 if how == "segments" else LENGTH, DIM, name="table")

    def build(self, input_shape):
        self.table.build(input_shape)

    def call(self, tokens):
        if self.how == "segments":
            return self.table(ops.zeros_like(tokens))
        return self.table(ops.broadcast_to(ops.arange(LENGTH), ops.shape(tokens)))

    def get_config(self):
        return {**super().get_config(), "how": self.how}


def _model(kind: str = "both") -> keras.Model:
    keras.utils.set_random_seed(0)
    if kind == "position":
        inputs = keras.Input((LENGTH, DIM))
        h = PositionEmbedding(name="positions")(inputs)
        return keras.Model(inputs, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(h)), name=kind)
    tokens = keras.Input((LENGTH,), dtype="int32")
    words = TokensAndFirstRow(name="words") if kind == "mixed" else keras.layers.Embedding(VOCAB, DIM, name="words")
    h = words(tokens)
    inputs = [tokens]
    if kind == "segments":
        segments = keras.Input((LENGTH,), dtype="int32")
        inputs.append(segments)
        h = h + keras.layers.Embedding(2, DIM, name="segments")(segments)
    if kind == "shared":
        h = h + words(ops.flip(tokens, axis=1))
    if kind in ("made_segments", "broadcast_positions"):
        h = h + MadeIds(kind.split("_")[0], name=kind)(tokens)
    if kind not in ("token", "made_segments", "broadcast_positions"):
        h = PositionEmbedding(name="positions")(h)
    if kind == "tied":
        h = TiedLogits(words, name="tied")(h)
    out = keras.layers.Dense(2, name="out")(keras.layers.Flatten()(h))
    return keras.Model(inputs if len(inputs) > 1 else tokens, out, name=kind)


def _data(kind: str = "both", samples: int = B * N * CYCLES):
    rng = np.random.default_rng(0)
    y = rng.normal(size=(samples, 2)).astype("float32")
    if kind == "position":
        return rng.normal(size=(samples, LENGTH, DIM)).astype("float32"), y
    # Few distinct tokens: rows repeat within a sample, a micro-batch, a cycle.
    x = rng.integers(0, 4, size=(samples, LENGTH)).astype("int32")
    if kind == "segments":
        x = [x, np.zeros_like(x)]  # one segment: every micro-step's ids alike
    return x, y


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.05, global_clipnorm=CLIP),
    "sgd_global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=CLIP),
}


def _pair(kind="both", make=OPTIMIZERS["adam"], mode="masked", strategy=None, data=None, **compile_kwargs):
    """(reference state, subject state, subject model, subject optimizer)."""
    x, y = data or _data(kind)
    reference = fit(_model(kind), make(), x, y, B * N, **compile_kwargs)
    if strategy is None:
        model, opt = _model(kind), accumulate(make(), N, mode=mode)
    else:
        with strategy.scope():
            model, opt = _model(kind), accumulate(make(), N, mode=mode)
    fit(model, opt, x, y, B, **compile_kwargs)
    return full_state(reference, reference.optimizer), full_state(model, opt), model, opt


def _assert_equal_to_the_large_batch(reference, subject, opt):
    assert opt.sparse == "auto"
    assert int(subject["iterations"]) == CYCLES
    assert_states_close(reference, subject)


# ----------------------------------------------------------------------
# The cases differ: neither summing rows nor keeping every slice is exact.


def test_the_cases_differ_from_rows_and_from_every_slice():
    """Where the default matters: on the model with tokens and positions,
    Adam ends far from the large batch with `"rows"` and with `"slices"`."""
    x, y = _data()
    reference = full_state(*(lambda m: (m, m.optimizer))(fit(_model(), OPTIMIZERS["adam"](), x, y, B * N)))
    for sparse in ("rows", "slices"):
        model, opt = _model(), accumulate(OPTIMIZERS["adam"](), N, sparse=sparse)
        fit(model, opt, x, y, B)
        subject = full_state(model, opt)
        assert max(float(np.max(np.abs(reference[k] - subject[k]))) for k in reference) > 1e-3
        with pytest.raises(AssertionError):
            assert_states_close(reference, subject)


# ----------------------------------------------------------------------
# model.fit, graph mode.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["token", "position", "both", "tied", "shared", "segments", "mixed", "made_segments",
                                  "broadcast_positions"])
def test_fit_equals_the_large_batch_for_every_kind_of_lookup(kind, mode):
    reference, subject, _, opt = _pair(kind, mode=mode)
    _assert_equal_to_the_large_batch(reference, subject, opt)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_equals_the_large_batch_for_every_optimizer(name, mode):
    reference, subject, _, opt = _pair("both", OPTIMIZERS[name], mode)
    _assert_equal_to_the_large_batch(reference, subject, opt)


@pytest.mark.parametrize("mode", MODES)
def test_in_between_micro_steps_change_nothing(mode):
    x, y = _data()
    model, opt = _model(), accumulate(OPTIMIZERS["adam_global_clipnorm"](), N, mode=mode)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x[: B * N], y[: B * N], batch_size=B, shuffle=False, verbose=0)
    for k in range(N - 1):
        before = full_state(model, opt)
        start = B * N + k * B
        model.train_on_batch(x[start : start + B], y[start : start + B])
        assert_states_equal(before, full_state(model, opt))
        assert int(opt.micro_step) == k + 1
    held = opt.accumulation_state
    variables = [v.path for v in held.variables]
    words, positions = variables.index("words/embeddings"), variables.index("positions/table/embeddings")
    # Token slices side by side; one summed slice per position.
    assert held.kept_slices[words][0].shape[0] == (N - 1) * B * LENGTH
    assert held.kept_slices[positions][0].shape[0] == LENGTH


def test_ids_made_from_the_shape_of_a_batch_of_one_grow_and_a_constant_is_kept_fixed_with_a_warning():
    """With micro-batches of 1, segment ids made with `zeros_like` fill the
    tokens' whole shape: the batch's, kept apart, exactly and silently. A
    `[CLS]`-like constant id of shape `(1,)` fills a first dimension of 1
    too but no input's shape: it may be the batch's or a table's, so it is
    kept fixed (what it is here), with one warning naming the variable."""
    x, y = _data(samples=N * 2)
    for kind, variable in (("made_segments", None), ("mixed", "'words/table/embeddings'")):
        reference = fit(_model(kind), OPTIMIZERS["adam"](), x, y, N)
        model, opt = _model(kind), accumulate(OPTIMIZERS["adam"](), N)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(model, opt, x, y, 1)
        messages = [str(w.message) for w in caught if "gradaccum" in str(w.message)]
        if variable is None:
            assert not messages
        else:
            assert len(messages) == 1
            assert variable in messages[0] and "micro-batch size" in messages[0]
        assert_states_close(full_state(reference, reference.optimizer), full_state(model, opt))


# ----------------------------------------------------------------------
# XLA.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind, name", [("both", "adam"), ("both", "rmsprop"), ("both", "adagrad"),
                                        ("both", "adam_global_clipnorm"), ("segments", "adam"), ("mixed", "adam"),
                                        ("made_segments", "adam")])
def test_xla_equals_the_large_batch(kind, name, mode):
    reference, subject, _, opt = _pair(kind, OPTIMIZERS[name], mode, jit_compile=True)
    _assert_equal_to_the_large_batch(reference, subject, opt)


def test_xla_buffers_hold_a_cycle_and_grow_with_n(recwarn):
    """XLA cannot grow a variable while a step runs: a grown buffer holds a
    whole cycle from the start, and setting a larger `n` grows it at once."""
    x, y = _data(samples=B * 10)
    reference, ref_opt = _model(), OPTIMIZERS["adam"]()
    reference.compile(optimizer=ref_opt, loss="mse", jit_compile=True)
    reference.fit(x[: B * 2], y[: B * 2], batch_size=B * 2, shuffle=False, verbose=0)
    reference.fit(x[B * 2 :], y[B * 2 :], batch_size=B * 8, shuffle=False, verbose=0)
    model, opt = _model(), accumulate(OPTIMIZERS["adam"](), 2)
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    model.fit(x[: B * 2], y[: B * 2], batch_size=B, shuffle=False, verbose=0)
    words = [v.path for v in opt.accumulation_state.variables].index("words/embeddings")
    grown = internal_state(opt).kept[words].parts["grows"]
    assert int(tf.shape(grown.values)[0]) == 2 * B * LENGTH
    opt.n = 8
    assert int(tf.shape(grown.values)[0]) == 8 * B * LENGTH
    model.fit(x[B * 2 :], y[B * 2 :], batch_size=B, shuffle=False, verbose=0)
    assert int(opt.iterations) == 2 and int(opt.micro_step) == 0
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))
    assert not [w for w in recwarn if "gradaccum" in str(w.message)]


def test_xla_with_a_slice_count_unknown_when_traced_warns_once_naming_the_variable():
    """A step traced with an unknown batch size gives token slices no known
    count; XLA cannot allocate them, so they are added into rows, with a
    warning that names the variable and says how far that can be off."""
    x, y = _data()
    model, opt = _model(), accumulate(OPTIMIZERS["adam"](), N)
    signature = [tf.TensorSpec([None, LENGTH], tf.int32), tf.TensorSpec([None, 2], tf.float32)]

    @tf.function(jit_compile=True, input_signature=signature)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = ops.mean((model(xb, training=True) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(0, len(x), B):
            step(x[k : k + B], y[k : k + B])
    messages = [str(w.message) for w in caught if "gradaccum" in str(w.message)]
    assert len(messages) == 1
    assert "'words/embeddings'" in messages[0] and "XLA" in messages[0] and "times larger" in messages[0]
    assert int(opt.iterations) == CYCLES


# ----------------------------------------------------------------------
# Custom training loops.


def _loop(model, opt, batch, wrap, kind="both"):
    x, y = _data(kind)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = ops.mean((model(xb, training=True) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step = wrap(step)
    for k in range(0, len(y), batch):
        step(x[k : k + batch], y[k : k + batch])
    return full_state(model, opt)


LOOPS = {
    "tf_function": tf.function,
    "xla": lambda f: tf.function(f, jit_compile=True),
    "unknown_batch": lambda f: tf.function(f, input_signature=[
        tf.TensorSpec([None, LENGTH], tf.int32), tf.TensorSpec([None, 2], tf.float32)]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_custom_loops_equal_the_large_batch(loop, mode):
    make = OPTIMIZERS["adam_global_clipnorm"]
    reference = _loop(_model(), make(), B * N, LOOPS[loop])
    opt = accumulate(make(), N, mode=mode)
    assert_states_close(reference, _loop(_model(), opt, B, LOOPS[loop]))
    assert int(opt.iterations) == CYCLES


@pytest.mark.parametrize("mode", MODES)
def test_eager_loops_judge_from_index_sets_and_warn_once(mode):
    """Eagerly no graph tells positions from tokens: equal index sets on a
    cycle's micro-steps are read as positions, with one warning naming the
    variable and the size of the difference the other reading would make."""
    make = OPTIMIZERS["adam"]
    reference = _loop(_model(), make(), B * N, lambda f: f)
    opt = accumulate(make(), N, mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        subject = _loop(_model(), opt, B, lambda f: f)
    assert_states_close(reference, subject)
    messages = [str(w.message) for w in caught if "gradaccum" in str(w.message)]
    assert len(messages) == 1
    assert "'positions/table/embeddings'" in messages[0] and "%" in messages[0]


# ----------------------------------------------------------------------
# MirroredStrategy, two replicas: equal to one device on the large batch.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind, name", [("both", "adam"), ("both", "adam_global_clipnorm"), ("both", "sgd_momentum"),
                                        ("segments", "rmsprop"), ("mixed", "adagrad"), ("made_segments", "adam")])
def test_mirrored_fit_equals_one_device_on_the_large_batch(kind, name, mode):
    reference, subject, _, opt = _pair(kind, OPTIMIZERS[name], mode, strategy=mirrored())
    _assert_equal_to_the_large_batch(reference, subject, opt)


@pytest.mark.parametrize("mode", MODES)
def test_mirrored_custom_loop_equals_one_device_on_the_large_batch(mode):
    strategy = mirrored()
    make = OPTIMIZERS["adam"]
    reference = _loop(_model(), make(), B * N, tf.function)
    with strategy.scope():
        model, opt = _model(), accumulate(make(), N, mode=mode)
        opt.build(model.trainable_variables)
    x, y = _data()
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(B))

    @tf.function
    def step(iterator):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = ops.sum((model(xb, training=True) - yb) ** 2) / (B * 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=next(iterator))

    iterator = iter(dataset)
    for _ in range(N * CYCLES):
        step(iterator)
    assert_states_close(reference, full_state(model, opt))


# ----------------------------------------------------------------------
# Partial cycles, files and checkpoints.


def test_flush_applies_a_partial_cycle_as_its_large_batch():
    x, y = _data()
    make = OPTIMIZERS["adam_global_clipnorm"]
    reference = fit(_model(), make(), x[: 2 * B], y[: 2 * B], 2 * B)
    model, opt = _model(), accumulate(make(), N)
    fit(model, opt, x[: 2 * B], y[: 2 * B], B)
    opt.flush()
    assert int(opt.iterations) == 1
    assert all(v.shape[0] == 0 for v, _ in opt.accumulation_state.kept_slices.values())
    assert_states_close(full_state(reference, reference.optimizer), full_state(model, opt))


def _resume(save, load, mode, kind="both", strategy=None, exact=True):
    """Uninterrupted: 2.5 cycles. Resumed: saved after 1.5 cycles, loaded
    into a new model, then 1 cycle more. Bit for bit (if `exact`)."""
    x, y = _data(kind)
    cut, end = B * N * 3 // 2, B * N * 5 // 2

    def part(data, a, b):
        return [d[a:b] for d in data] if isinstance(data, list) else data[a:b]

    def new():
        if strategy is None:
            return _model(kind), accumulate(OPTIMIZERS["adam_global_clipnorm"](), N, mode=mode)
        with strategy.scope():
            return _model(kind), accumulate(OPTIMIZERS["adam_global_clipnorm"](), N, mode=mode)

    whole, whole_opt = new()
    fit(whole, whole_opt, part(x, 0, end), y[:end], B)
    first, first_opt = new()
    fit(first, first_opt, part(x, 0, cut), y[:cut], B)
    assert int(first_opt.micro_step) == N // 2
    second = load(save(first), new)
    second.fit(part(x, cut, end), y[cut:end], batch_size=B, shuffle=False, verbose=0)
    assert int(second.optimizer.micro_step) == N // 2
    compare = assert_states_equal if exact else assert_states_close
    compare(full_state(whole, whole_opt), full_state(second, second.optimizer))


def _keras_file(tmp_path):
    def save(model):
        path = str(tmp_path / "model.keras")
        model.save(path)
        return path

    return save, lambda path, new: keras.models.load_model(path)


def _checkpoint(tmp_path):
    def save(model):
        return tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))

    def load(path, new):
        model, opt = new()
        model.compile(optimizer=opt, loss="mse")
        opt.build(model.trainable_variables)
        tf.train.Checkpoint(model=model, optimizer=opt).restore(path).assert_existing_objects_matched()
        return model

    return save, load


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["keras_file", "checkpoint"])
def test_mid_cycle_saves_resume_bit_identically(how, mode, tmp_path):
    save, load = (_keras_file if how == "keras_file" else _checkpoint)(tmp_path)
    _resume(save, load, mode)


@pytest.mark.parametrize("how", ["keras_file", "checkpoint"])
def test_mid_cycle_saves_resume_bit_identically_with_shared_tables(how, tmp_path):
    save, load = (_keras_file if how == "keras_file" else _checkpoint)(tmp_path)
    _resume(save, load, "skip", kind="mixed")


def test_a_mid_cycle_checkpoint_resumes_under_two_replicas(tmp_path):
    """Each replica keeps slices of its own, and a checkpoint holds each
    replica's. (Not bit for bit: a checkpoint holds the accumulators' sum
    over replicas, and a restore splits it.)"""
    save, load = _checkpoint(tmp_path)
    strategy = mirrored()

    def load_here(path, new):
        with strategy.scope():
            return load(path, new)

    _resume(save, load_here, "masked", strategy=strategy, exact=False)


def test_a_partial_cycle_loaded_into_rows_adds_its_slices_into_rows(tmp_path):
    x, y = _data()
    model, opt = _model(), accumulate(OPTIMIZERS["adam"](), N)
    fit(model, opt, x[: B * 2], y[: B * 2], B)
    held = opt.accumulation_state
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    rows_model, rows = _model(), accumulate(OPTIMIZERS["adam"](), N, sparse="rows")
    rows_model.compile(optimizer=rows, loss="mse")
    rows.build(rows_model.trainable_variables)
    rows_model.load_weights(path)
    for i, (values, indices) in held.kept_slices.items():
        expected = np.zeros(held.variables[i].shape, np.float32)
        np.add.at(expected, indices.numpy(), values.numpy())
        np.testing.assert_allclose(rows.accumulation_state.accumulators[i].numpy(), expected, rtol=1e-6)


# ----------------------------------------------------------------------
# Memory: no more than the large batch's own gradient.


def _slice_bytes(grad: tf.IndexedSlices) -> int:
    return int(tf.size(grad.values)) * grad.values.dtype.size + int(tf.size(grad.indices)) * 8


def test_kept_slices_hold_no_more_than_the_large_batch_gradient():
    x, y = _data()
    model, opt = _model(), accumulate(OPTIMIZERS["adam"](), N)
    fit(model, opt, x[: B * (N + 1)], y[: B * (N + 1)], B)
    large = _model()
    with tf.GradientTape() as tape:
        loss = ops.mean((large(x[: B * N]) - y[: B * N]) ** 2)
    grads = dict(zip([v.path for v in large.trainable_variables], tape.gradient(loss, large.trainable_variables)))
    state = internal_state(opt)
    assert sorted(state.kept) == sorted(i for i, v in enumerate(state.variables) if v.path in
                                        ("words/embeddings", "positions/table/embeddings"))
    for i, kept in state.kept.items():
        held = sum(part.allocated_bytes() for part in kept.parts.values())
        assert held <= _slice_bytes(grads[state.variables[i].path]) + 16  # + the row counts


# ----------------------------------------------------------------------
# The setting.


def test_auto_is_the_default_and_travels():
    import copy
    import pickle

    opt = accumulate(keras.optimizers.Adam(), 2)
    assert opt.sparse == "auto"
    config = keras.saving.serialize_keras_object(opt)
    assert config["config"]["sparse"] == "auto"
    assert keras.saving.deserialize_keras_object(config).sparse == "auto"
    assert pickle.loads(pickle.dumps(opt)).sparse == copy.deepcopy(opt).sparse == "auto"
    for bad in ("Auto", "dense", ""):
        with pytest.raises(ValueError, match="`sparse` must be one of \\('auto', 'rows', 'slices'\\)"):
            accumulate(keras.optimizers.Adam(), 2, sparse=bad)
    with pytest.raises(TypeError, match="`sparse` must be a string"):
        accumulate(keras.optimizers.Adam(), 2, sparse=None)
