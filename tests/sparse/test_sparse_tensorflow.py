"""Sparse gradients (`tf.IndexedSlices`): rows, and `sparse="slices"` against the large batch.

An `Embedding` hands the optimizer a `tf.IndexedSlices` with one slice per
token, so a row that occurs several times in a batch comes as several
slices. Keras 3 squares each slice before summing repeated rows (Adam's
second moment) and computes `global_clipnorm` over the slices, so on the
large batch these depend on how the rows repeat. `sparse="slices"` keeps the
cycle's slices and equals the large batch; `sparse="rows"` adds them into
rows, which equals it only for updates linear in the gradient. (The default,
`sparse="auto"`, is tested in `test_sparse_exact_tensorflow.py`.)
"""

import copy
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import accumulate
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    embedding_data,
    fit,
    fit_pair,
    full_state,
    gradients,
    make_embedding_model,
    max_difference,
)

N, B, CYCLES = 4, 4, 3
VOCAB, LENGTH = 12, 5


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 3, name="emb")(inputs)
    h = keras.layers.Flatten()(h)
    out = keras.layers.Dense(2, name="out")(h)
    return keras.Model(inputs, out, name="embed")


def _data(samples: int = B * N * CYCLES):
    # Few distinct tokens: every row repeats within a sequence, a micro-batch
    # and a cycle (row 0 in every sequence, as a segment embedding's).
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, size=(samples, LENGTH)).astype("int32")
    x[:, 0] = 0
    y = rng.normal(size=(samples, 2)).astype("float32")
    return x, y


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    # A clip that bites on every update (norms are ~0.5..2 here).
    "sgd_global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.05),
}


def _pair(make, sparse, mode, data=None):
    x, y = data or _data()
    reference = fit(_model(), make(), x, y, B * N)
    model = _model()
    opt = accumulate(make(), N, mode=mode, sparse=sparse)
    fit(model, opt, x, y, B)
    return full_state(reference, reference.optimizer), full_state(model, opt), model, opt


# ----------------------------------------------------------------------
# `sparse="rows"` (the default): an Embedding's slices added into rows.

ROWS_N = 3


def _rows_data(unique_per_cycle: bool):
    return embedding_data(B * ROWS_N, CYCLES, unique_per_cycle)


def _embedding_model():
    return make_embedding_model(vocab=40)


def test_embedding_gradients_are_sparse():
    x, y = _rows_data(False)
    model = _embedding_model()
    grads = gradients(model, x[:B], y[:B])
    assert isinstance(grads[0], tf.IndexedSlices)  # the case under test


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.Adam(1e-2),
        lambda: keras.optimizers.Adagrad(0.1),
        lambda: keras.optimizers.RMSprop(1e-2),
    ],
    ids=["adam", "adagrad", "rmsprop"],
)
@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradients_rows_unique_within_a_cycle(make, mode):
    """Non-linear optimizers: each embedding row occurs once per cycle.

    Keras 3 squares the values of an `IndexedSlices` gradient before summing
    repeated rows, so for Adam-like optimizers the large-batch result depends
    on how often a row repeats; the accumulated gradient holds the summed
    rows. With rows unique within a cycle the two agree exactly.
    """
    ref, acc, _, _ = fit_pair(
        make, n=ROWS_N, make_model=_embedding_model, data=_rows_data(True), mode=mode
    )
    assert_states_close(ref, acc)


@pytest.mark.parametrize(
    "make",
    [lambda: keras.optimizers.SGD(0.5), lambda: keras.optimizers.SGD(0.5, momentum=0.9)],
    ids=["sgd", "sgd_momentum"],
)
@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradients_with_repeated_rows(make, mode):
    """Optimizers linear in the gradient: repeated rows make no difference."""
    ref, acc, _, _ = fit_pair(
        make, n=ROWS_N, make_model=_embedding_model, data=_rows_data(False), mode=mode
    )
    assert_states_close(ref, acc)


# ----------------------------------------------------------------------
# `sparse="slices"`.


def test_the_case_under_test_has_repeated_rows():
    x, _ = _data()
    model = _model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x[:B]))
    grad = tape.gradient(loss, model.get_layer("emb").embeddings)
    assert isinstance(grad, tf.IndexedSlices)
    indices = grad.indices.numpy()
    assert len(np.unique(indices)) < len(indices)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_slices_equal_the_large_batch(name, mode):
    ref, sub, _, opt = _pair(OPTIMIZERS[name], "slices", mode)
    assert opt.sparse == "slices"
    assert int(sub["iterations"]) == CYCLES
    assert_states_close(ref, sub)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rows_differ_from_the_large_batch_where_the_readme_says(name):
    """The default sums repeated rows first: for Adam's second moment and a
    global clip over slices that is another gradient than the large batch's."""
    ref, sub, _, opt = _pair(OPTIMIZERS[name], "rows", "masked")
    assert opt.sparse == "rows"
    # Far beyond float32 rounding (the tolerance above is 1e-6 + 1e-5 rel).
    assert max_difference(ref, sub) > 1e-3
    with pytest.raises(AssertionError):
        assert_states_close(ref, sub)


@pytest.mark.parametrize("sparse", ["rows", "slices"])
def test_both_equal_the_large_batch_for_plain_sgd(sparse):
    """Linear in the gradient, no clip: summing rows first changes nothing."""
    ref, sub, _, _ = _pair(lambda: keras.optimizers.SGD(0.5, momentum=0.5), sparse, "masked")
    assert_states_close(ref, sub)


@pytest.mark.parametrize("mode", MODES)
def test_in_between_steps_change_nothing(mode):
    x, y = _data()
    model = _model()
    opt = accumulate(keras.optimizers.Adam(0.05, global_clipnorm=0.05), N, mode=mode, sparse="slices")
    model.compile(optimizer=opt, loss="mse")
    model.fit(x[: B * N], y[: B * N], batch_size=B, shuffle=False, verbose=0)  # one cycle
    for k in range(N - 1):
        before = full_state(model, opt)
        start = B * N + k * B
        model.train_on_batch(x[start : start + B], y[start : start + B])
        assert_states_equal(before, full_state(model, opt))
        held = opt.accumulation_state
        assert int(held.micro_step) == k + 1
    kept = [values for values, _ in opt.accumulation_state.kept_slices.values()]
    assert len(kept) == 1 and kept[0].numpy().shape[0] == (N - 1) * B * LENGTH
    model.train_on_batch(x[B * N + (N - 1) * B : 2 * B * N], y[B * N + (N - 1) * B : 2 * B * N])
    kept = [values for values, _ in opt.accumulation_state.kept_slices.values()]
    assert int(opt.iterations) == 2 and kept[0].numpy().shape[0] == 0


def _resume_pair(save, load, mode):
    """Uninterrupted: 2.5 cycles. Resumed: saved after 1.5 cycles, loaded
    into a new model, then 1 cycle more. Bit for bit."""
    x, y = _data()
    make = lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.05)  # noqa: E731
    whole = _model()
    whole_opt = accumulate(make(), N, mode=mode, sparse="slices")
    whole.compile(optimizer=whole_opt, loss="mse")
    whole.fit(x[: B * N * 5 // 2], y[: B * N * 5 // 2], batch_size=B, shuffle=False, verbose=0)

    first = _model()
    first.compile(optimizer=accumulate(make(), N, mode=mode, sparse="slices"), loss="mse")
    first.fit(x[: B * N * 3 // 2], y[: B * N * 3 // 2], batch_size=B, shuffle=False, verbose=0)
    assert int(first.optimizer.micro_step) == N // 2
    second = load(save(first), make, mode)
    assert second.optimizer.sparse == "slices"
    second.fit(x[B * N * 3 // 2 : B * N * 5 // 2], y[B * N * 3 // 2 : B * N * 5 // 2],
               batch_size=B, shuffle=False, verbose=0)
    assert int(second.optimizer.micro_step) == N // 2
    assert_states_equal(full_state(whole, whole_opt), full_state(second, second.optimizer))


@pytest.mark.parametrize("mode", MODES)
def test_keras_file_mid_cycle_resumes_bit_identically(mode, tmp_path):
    def save(model):
        path = str(tmp_path / "model.keras")
        model.save(path)
        return path

    def load(path, make, mode):
        return keras.models.load_model(path)

    _resume_pair(save, load, mode)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_mid_cycle_resumes_bit_identically(mode, tmp_path):
    def save(model):
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        return ckpt.save(str(tmp_path / "ckpt"))

    def load(path, make, mode):
        model = _model()
        opt = accumulate(make(), N, mode=mode, sparse="slices")
        model.compile(optimizer=opt, loss="mse")
        opt.build(model.trainable_variables)
        tf.train.Checkpoint(model=model, optimizer=opt).restore(path).assert_existing_objects_matched()
        return model

    _resume_pair(save, load, mode)


def test_weights_file_loaded_into_rows_adds_the_slices_into_rows(tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=accumulate(keras.optimizers.Adam(0.05), N, sparse="slices"), loss="mse")
    model.fit(x[: B * N // 2], y[: B * N // 2], batch_size=B, shuffle=False, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    (values, indices), = (
        (v.numpy(), i.numpy()) for v, i in model.optimizer.accumulation_state.kept_slices.values()
    )
    rows = _model()
    opt = accumulate(keras.optimizers.Adam(0.05), N, sparse="rows")
    rows.compile(optimizer=opt, loss="mse")
    opt.build(rows.trainable_variables)
    rows.load_weights(path)
    expected = np.zeros((VOCAB, 3), np.float32)
    np.add.at(expected, indices, values)
    emb = [i for i, v in enumerate(opt.accumulation_state.variables) if "emb" in v.path][0]
    np.testing.assert_array_equal(opt.accumulation_state.accumulators[emb].numpy(), expected)


@pytest.mark.parametrize("how", ["weights_file", "checkpoint"])
def test_a_partial_cycle_of_rows_is_refused_by_slices(how, tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=accumulate(keras.optimizers.Adam(0.05), N, sparse="rows"), loss="mse")
    model.fit(x[:B], y[:B], batch_size=B, shuffle=False, verbose=0)
    slices = _model()
    opt = accumulate(keras.optimizers.Adam(0.05), N, sparse="slices")
    slices.compile(optimizer=opt, loss="mse")
    opt.build(slices.trainable_variables)
    if how == "weights_file":
        path = str(tmp_path / "rows.weights.h5")
        model.save_weights(path)
        slices.load_weights(path)
    else:
        path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "c"))
        tf.train.Checkpoint(model=slices, optimizer=opt).restore(path)
    with pytest.raises(ValueError, match="partial cycle restored from state saved with sparse=.rows."):
        slices.fit(x[B : 2 * B], y[B : 2 * B], batch_size=B, shuffle=False, verbose=0)


def test_flush_applies_the_kept_slices_of_a_partial_cycle():
    """Two micro-batches, then `flush()`: the large batch of those two."""
    x, y = _data()
    make = lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.05)  # noqa: E731
    reference = fit(_model(), make(), x[: 2 * B], y[: 2 * B], 2 * B)
    model = _model()
    opt = accumulate(make(), N, sparse="slices")
    fit(model, opt, x[: 2 * B], y[: 2 * B], B)
    opt.flush()
    assert int(opt.iterations) == 1
    assert all(v.numpy().shape[0] == 0 for v, _ in opt.accumulation_state.kept_slices.values())
    assert_states_close(full_state(reference, reference.optimizer), full_state(model, opt))


def test_loss_scale_optimizer_keeps_slices_too():
    x, y = _data()
    reference = fit(_model(), keras.optimizers.Adam(0.05), x, y, B * N)
    model = _model()
    opt = accumulate(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05)), N, sparse="slices")
    fit(model, opt, x, y, B)
    ref, sub = full_state(reference, reference.optimizer), full_state(model, opt.inner_optimizer)
    assert_states_close(ref, {k: sub[k] for k in ref})


def test_setting_travels_and_bad_values_are_refused():
    opt = accumulate(keras.optimizers.Adam(), 2, sparse="slices")
    config = keras.saving.serialize_keras_object(opt)
    assert config["config"]["sparse"] == "slices"
    assert keras.saving.deserialize_keras_object(config).sparse == "slices"
    assert pickle.loads(pickle.dumps(opt)).sparse == "slices"
    assert copy.copy(opt).sparse == copy.deepcopy(opt).sparse == "slices"
    assert "sparse='slices'" in repr(opt)
    assert accumulate(keras.optimizers.Adam(), 2).sparse == "auto"
    assert accumulate(n=2, sparse="slices")(keras.optimizers.Adam)().sparse == "slices"
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with gradaccum.accumulating(2, sparse="slices"):
        model.compile(optimizer="adam", loss="mse")
    assert model.optimizer.sparse == "slices"
    for bad in ("dense", "Slices"):
        with pytest.raises(ValueError, match="`sparse` must be one of"):
            accumulate(keras.optimizers.Adam(), 2, sparse=bad)
        with pytest.raises(ValueError, match="`sparse` must be one of"), gradaccum.accumulating(2, sparse=bad):
            pass
    for bad in (True, None, 1):
        with pytest.raises(TypeError, match="`sparse` must be a string"):
            accumulate(keras.optimizers.Adam(), 2, sparse=bad)

