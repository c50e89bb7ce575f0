"""`accumulate(opt, micro_batch_size=m)`: `fit(batch_size=B)` splits each
batch into micro-batches of `m` inside the train step and equals plain
`fit(batch_size=B)`: weights, every optimizer variable, `iterations`, the
logs, and what counts updates (schedules, callbacks)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import accumulate, accumulating
from tests.helpers import (
    BACKEND,
    JIT,
    as_int,
    assert_states_close,
    core_of,
    fit,
    full_state,
    make_data,
    make_mlp,
    max_difference,
)
from tests.helpers.models import TOKENS_T as T
from tests.helpers.models import TOKENS_VOCAB as VOCAB
from tests.helpers.models import make_tokens_model as _tokens_model

B = 8


def _pair(make_optimizer, size, x, y, make_model=make_mlp, fit_kwargs=None, wrap=None, epochs=1, batch=B,
          **compile_kwargs):
    """Plain `fit(batch_size=batch)` and the same with `micro_batch_size=size`
    (or `wrap(optimizer)`):
    `(reference_state, subject_state, reference_history, subject_history, subject_opt)`."""
    wrap = wrap or (lambda opt: accumulate(opt, micro_batch_size=size))
    runs = []
    for make in (make_optimizer, lambda: wrap(make_optimizer())):
        model, opt = make_model(), make()
        fit(model, opt, x, y, batch, epochs=epochs, fit_kwargs=fit_kwargs, **compile_kwargs)
        runs.append((full_state(model, opt), model.history.history, opt))
    (reference, ref_history, _), (subject, history, opt) = runs
    return reference, subject, ref_history, history, opt


# Micro-batches that divide the batch, one that does not (a ragged last
# micro-batch), and one as large as the batch; 3 batches and a ragged last
# batch of 5 samples.
@pytest.mark.parametrize("size", (4, 3, B))
@pytest.mark.parametrize("jit", JIT)
def test_fit_equals_plain_fit_of_the_batch(size, jit, mode):
    x, y = make_data(3 * B + 5)
    reference, subject, ref_history, history, opt = _pair(
        lambda: keras.optimizers.Adam(1e-2), size, x, y,
        wrap=lambda o: accumulate(o, micro_batch_size=size, mode=mode), jit_compile=jit,
    )
    assert opt.micro_batch_size == size and opt.n == 1
    assert int(subject["iterations"]) == 4
    assert_states_close(reference, subject)
    # The loss tracker weighs each micro-batch by its samples: the logs are the batch's.
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-6)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile: PyTorch's `jit_compile=True`")
def test_torch_compile_equals_plain_fit():
    """Keras's PyTorch train step compiled with `torch.compile`, split (the
    last micro-batch and the last batch ragged)."""
    x, y = make_data(3 * B + 5)
    reference, subject, ref_history, history, opt = _pair(
        lambda: keras.optimizers.Adam(1e-2), 3, x, y, jit_compile=True
    )
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-6)


def test_split_is_the_large_batch_not_the_micro_batch():
    """The reference can fail: plain fit on batches of the micro-batch size
    is measurably off."""
    x, y = make_data(3 * B)
    reference, subject, _, _, _ = _pair(lambda: keras.optimizers.Adam(1e-2), 3, x, y)
    small = make_mlp()
    small_opt = keras.optimizers.Adam(1e-2)
    fit(small, small_opt, x, y, 3)
    assert_states_close(reference, subject)
    assert max_difference(reference, full_state(small, small_opt), "model/") > 1e-3




@pytest.mark.parametrize("weighted", (False, True), ids=("masked_tokens", "sample_weights"))
@pytest.mark.parametrize("jit", JIT)
def test_micro_batches_weigh_by_their_count(weighted, jit):
    """Micro-batches with different numbers of valid tokens (or sums of
    sample weights) weigh as in the batch's mean."""
    rng = np.random.default_rng(1)
    samples = 3 * B + 5
    lengths = rng.integers(1, T + 1, size=samples)
    mask = np.arange(T)[None, :] < lengths[:, None]
    x = np.where(mask, rng.integers(1, VOCAB, size=mask.shape), 0).astype("int32")
    y = rng.integers(0, 4, size=mask.shape).astype("int32")
    fit_kwargs = {}
    if weighted:
        fit_kwargs["sample_weight"] = rng.uniform(0.1, 3.0, size=mask.shape).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(
        reduction="mean_with_sample_weight" if weighted else "sum_over_batch_size"
    )
    reference, subject, _, _, opt = _pair(
        lambda: keras.optimizers.SGD(0.5, momentum=0.8), 3, x, y, make_model=_tokens_model,
        fit_kwargs=fit_kwargs, loss=loss, jit_compile=jit,
    )
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)


def test_schedules_and_callbacks_count_updates():
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)
    x, y = make_data(3 * B)
    seen = []
    callback = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
    reference, subject, _, _, opt = _pair(
        lambda: keras.optimizers.Adam(schedule), 3, x, y, fit_kwargs={"callbacks": [callback]}
    )
    assert_states_close(reference, subject)
    # Each run saw 3 batches: the subject's callback calls are the second three.
    assert seen == [0, 1, 2, 0, 1, 2]
    assert as_int(opt.iterations) == 3
    np.testing.assert_allclose(float(keras.ops.convert_to_numpy(opt.learning_rate)), 1e-2 * 0.5**3, rtol=1e-6)


def test_steps_per_epoch_counts_batches():
    x, y = make_data(6 * B)
    reference, subject, _, _, opt = _pair(
        lambda: keras.optimizers.Adam(1e-2), 3, x, y, fit_kwargs={"steps_per_epoch": 2}, epochs=2
    )
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)


def test_a_model_with_its_own_train_step_is_told_to_use_n():
    class Custom(keras.Sequential):
        def train_step(self, *args, **kwargs):
            return super().train_step(*args, **kwargs)

    x, y = make_data(2 * B)
    # A step that calls Keras's own is split as Keras's step.
    model = Custom([keras.Input((5,)), keras.layers.Dense(3)])
    opt = accumulate(keras.optimizers.SGD(0.1), micro_batch_size=3)
    fit(model, opt, x, y, B)
    assert as_int(opt.iterations) == 2
    # A custom loop's apply_gradients has no batch to split.
    layer = keras.layers.Dense(3)
    layer.build((None, 5))
    opt = accumulate(keras.optimizers.SGD(0.1), micro_batch_size=3)
    grads = [keras.ops.zeros(v.shape) for v in layer.trainable_variables]
    with pytest.raises(ValueError, match=r"micro_batch_size=3.*n=k"):
        opt.apply_gradients(zip(grads, layer.trainable_variables))


def test_accumulating_splits_code_you_do_not_own():
    x, y = make_data(3 * B)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, B)
    model = make_mlp()
    with accumulating(micro_batch_size=3):
        fit(model, keras.optimizers.Adam(1e-2), x, y, B)
    assert core_of(model.optimizer).micro_batch_size == 3
    assert_states_close(full_state(reference, ref_opt), full_state(model, model.optimizer))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    (
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size=0"),
        ({"micro_batch_size": -2}, ValueError, "micro_batch_size=-2"),
        ({"micro_batch_size": 2.5}, TypeError, "micro_batch_size=2.5"),
        ({"micro_batch_size": True}, TypeError, "micro_batch_size=True"),
        ({"micro_batch_size": 4, "n": 2}, ValueError, "not both"),
        ({}, TypeError, "micro_batch_size"),
    ),
)
def test_bad_micro_batch_size(kwargs, error, match):
    with pytest.raises(error, match=match):
        accumulate(keras.optimizers.SGD(), **kwargs)
    with pytest.raises(error, match=match), accumulating(**kwargs):
        pass


def test_config_keeps_micro_batch_size():
    opt = accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=3)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert again.micro_batch_size == 3 and again.n == 1


def _step_temp_bytes(size, batch):
    """XLA's temporary memory of the compiled JAX train step for `batch`
    samples, split into micro-batches of `size` (None: plain)."""
    import jax

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(8)])
    opt = keras.optimizers.Adam(1e-3)
    x, y = np.zeros((batch, 64), "float32"), np.zeros((batch, 8), "float32")
    fit(model, opt if size is None else accumulate(opt, micro_batch_size=size), x, y, batch, jit_compile=True)
    state = model._get_jax_state(
        trainable_variables=True, non_trainable_variables=True, optimizer_variables=True, metrics_variables=True
    )
    return jax.jit(model.train_step).lower(state, (x, y)).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled memory analysis of JAX's train step")
def test_step_memory_is_that_of_a_micro_batch():
    """One compiled body (`jax.lax.scan`): the step's temporary memory
    follows the micro-batch, not the batch."""
    plain = _step_temp_bytes(None, 1024)
    small, large = _step_temp_bytes(32, 256), _step_temp_bytes(32, 1024)
    assert large < plain / 4
    assert large <= small * 1.05
    assert _step_temp_bytes(128, 1024) > large


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution's data parallelism runs on JAX")
def test_data_parallel_equals_one_device_and_all_reduces_gradients_once_per_batch():
    from tests.distribution.test_data_parallel_local import _all_reduces, _optimized_train_step, _per_device
    from tests.helpers.devices import two_devices

    x, y = make_data(4 * B)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, 2 * B)
    with keras.distribution.DataParallel(devices=two_devices()).scope(), _per_device():
        model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=4)
        fit(model, opt, x, y, 2 * B)
        outside, inside = _all_reduces(_optimized_train_step(model, x[: 2 * B], y[: 2 * B]))
    assert as_int(opt.iterations) == 2
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))
    # Each micro-step exchanges scalars (its loss, its count); the gradients
    # are exchanged in the branch that applies the batch's update.
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert max(outside) < 8, outside
    assert sum(e for e in inside if e >= parameters) == parameters, inside


def test_n_cannot_be_set_with_micro_batch_size():
    opt = accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=3)
    with pytest.raises(ValueError, match=r"micro_batch_size=3.*n=4"):
        opt.n = 4
    assert opt.n == 1


def test_loss_scale_optimizer_equals_plain_fit():
    """Only finite, unscaled micro-gradients are accumulated; the loss-scale
    optimizer's own step counter counts micro-batches, as with `n`."""
    x, y = make_data(3 * B + 5)
    LSO = keras.optimizers.LossScaleOptimizer
    reference, subject, _, _, opt = _pair(lambda: LSO(keras.optimizers.Adam(1e-2)), 3, x, y)
    assert int(reference.pop("opt/step_counter")) == 4
    assert int(subject.pop("opt/step_counter")) == 3 * 3 + 2  # 3 batches of 3 micro-batches, one of 2
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)


@pytest.mark.parametrize(
    "compile_kwargs",
    (
        pytest.param({"run_eagerly": True}, id="eager"),
        pytest.param({"steps_per_execution": 2}, id="steps_per_execution", marks=pytest.mark.skipif(
            BACKEND == "torch", reason="Keras's PyTorch trainer takes steps_per_execution=1 only")),
    ),
)
def test_eager_and_multi_step_functions(compile_kwargs):
    x, y = make_data(3 * B + 5)
    reference, subject, _, _, opt = _pair(lambda: keras.optimizers.Adam(1e-2), 3, x, y, **compile_kwargs)
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)


def test_noise_scale_is_that_of_the_same_micro_batches_across_steps():
    """A split step's cycle is the cycle `n` forms of the same micro-batches
    across steps: the same noise scale, the same state."""
    x, y = make_data(4 * B)
    runs = []
    for wrap, batch in ((lambda o: accumulate(o, 4, noise_scale=True), 2),
                        (lambda o: accumulate(o, micro_batch_size=2, noise_scale=True), B)):
        model, opt = make_mlp(), wrap(keras.optimizers.Adam(1e-2))
        fit(model, opt, x, y, batch)
        runs.append((full_state(model, opt), opt.noise_scale))
    (across, across_noise), (split, split_noise) = runs
    assert split_noise is not None
    np.testing.assert_allclose(split_noise, across_noise, rtol=1e-5)
    assert_states_close(across, split)


def test_decorator_form():
    make = accumulate(micro_batch_size=3)
    assert repr(make) == "<gradaccum.accumulate(micro_batch_size=3) decorator>"
    assert make(keras.optimizers.Adam)(1e-2).micro_batch_size == 3
    with pytest.raises(TypeError, match=r"accumulate\(keras.optimizers.Adam\(1e-3\), micro_batch_size=3\)"):
        make_mlp().compile(optimizer=make, loss="mse")


@pytest.mark.parametrize("jit", JIT)
def test_compiled_metrics_log_the_batch(jit):
    """Metrics given to `compile` (built on the first micro-batch inside the
    traced step) log the batch's values, as plain `fit` does."""
    x, y = make_data(3 * B + 5)
    reference, subject, ref_history, history, _ = _pair(
        lambda: keras.optimizers.Adam(1e-2), 3, x, y, jit_compile=jit,
        metrics=["mae", "root_mean_squared_error"],
    )
    assert_states_close(reference, subject)
    for name in ("loss", "mae", "root_mean_squared_error"):
        np.testing.assert_allclose(history[name], ref_history[name], rtol=1e-6)


def _two_heads():
    """A regression head and a classification head on one hidden layer."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(inputs)
    outputs = {"r": keras.layers.Dense(3, name="r")(hidden),
               "c": keras.layers.Dense(2, activation="softmax", name="c")(hidden)}
    return keras.Model(inputs, outputs, name="two_heads")


@pytest.mark.parametrize("jit", JIT)
def test_multi_output_model_with_weighted_losses_equals_plain_fit(jit):
    """A dict of losses with `loss_weights` and no compiled metrics: the
    per-output loss trackers are built before the split step's loop. The
    logs hold the batch's losses, per output too (Keras weighs a batch's by
    its static size, which TensorFlow's traced step of arrays does not know:
    each batch weighs 1 there)."""
    x, y = make_data(3 * B + 5)
    labels = {"r": y, "c": (np.arange(len(x)) % 2).astype("int32")}
    reference, subject, ref_history, history, opt = _pair(
        lambda: keras.optimizers.Adam(1e-2), 3, x, labels, make_model=_two_heads, jit_compile=jit,
        loss={"r": "mse", "c": "sparse_categorical_crossentropy"}, loss_weights={"r": 0.3, "c": 2.0},
    )
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)
    assert sorted(history) == sorted(ref_history) == ["c_loss", "loss", "r_loss"]
    for name in history:
        np.testing.assert_allclose(history[name], ref_history[name], rtol=1e-6, err_msg=name)


class OwnLoss(keras.Sequential):
    """A model whose `compute_loss` is a mean of its own: it calls no Keras
    loss, so no loss count reaches the optimizer."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y - y_pred))


def _own_loss_model():
    keras.utils.set_random_seed(0)
    return OwnLoss([keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="hidden"),
                    keras.layers.Dense(3, name="out")], name="own_loss")


def _scalar_mse(y_true, y_pred):
    """A loss function that takes its own mean: Keras divides it by nothing."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


class _Reconstruction(keras.layers.Layer):
    """Adds the mean squared distance of its two inputs as a loss."""

    def call(self, inputs):
        output, target = inputs
        self.add_loss(keras.ops.mean(keras.ops.square(output - target)))
        return output


def _autoencoder():
    """A model whose only loss is an `add_loss` term: no compiled loss."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    output = keras.layers.Dense(5, name="dense")(inputs)
    return keras.Model(inputs, _Reconstruction(name="reconstruction")([output, inputs]), name="autoencoder")


@pytest.mark.parametrize("own", ("compute_loss", "loss_function", "add_loss"))
@pytest.mark.parametrize("jit", JIT)
def test_a_loss_of_its_own_weighs_micro_batches_by_their_samples(own, jit):
    """Micro-batches of 3, 3 and 2 samples (and 3, 2 in the ragged last
    batch) of a mean Keras does not take (a `compute_loss` of the model's
    own, a compiled loss function that returns a scalar, an `add_loss` term
    and no compiled loss): each weighs its samples, not alike."""
    x, y = make_data(3 * B + 5)
    make_model = {"compute_loss": _own_loss_model, "loss_function": make_mlp, "add_loss": _autoencoder}[own]
    loss = None if own == "add_loss" else _scalar_mse
    reference, subject, _, _, opt = _pair(
        lambda: keras.optimizers.Adam(1e-2), 3, x, y, make_model=make_model, jit_compile=jit, loss=loss
    )
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)


def _batches(x, y, size):
    """A generator of `fit`'s batches of `size` samples, the last ragged, for ever."""
    while True:
        for start in range(0, len(x), size):
            yield x[start:start + size], y[start:start + size]


def _two_inputs():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((5,), name="a"), keras.Input((2,), name="b")
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3, name="out")(hidden), name="two_inputs")


def _recurrent():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4, 5)), keras.layers.GRU(4, name="gru"), keras.layers.Dense(3, name="out")],
                            name="recurrent")


def _regularized():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)),
                             keras.layers.Dense(6, activation="tanh", kernel_regularizer="l2",
                                                activity_regularizer=keras.regularizers.L1(0.01), name="hidden"),
                             keras.layers.Dense(3, name="out")], name="regularized")


def _ordinary_script(feature, x, y):
    """`(make_model, fit_args, fit_kwargs, compile_kwargs)` of a script using `feature`."""
    rng = np.random.default_rng(2)
    arrays = {"batch_size": B, "shuffle": False}
    if feature == "generator":
        return make_mlp, (_batches(x, y, B),), {"steps_per_epoch": 4}, {}
    if feature == "dict_inputs_and_validation":
        inputs = {"a": x, "b": rng.normal(size=(len(x), 2)).astype("float32")}
        return _two_inputs, (inputs, y), dict(arrays, validation_split=0.25), {}
    if feature == "class_weight":
        labels = (np.arange(len(x)) % 3).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return make_mlp, (x, labels), dict(arrays, class_weight={0: 1.0, 1: 3.0, 2: 0.5}), {"loss": loss}
    if feature == "recurrent":
        return _recurrent, (rng.normal(size=(len(x), 4, 5)).astype("float32"), y), arrays, {}
    return _regularized, (x, y), arrays, {}


@pytest.mark.parametrize(
    "feature", ("generator", "dict_inputs_and_validation", "class_weight", "recurrent", "regularizers")
)
def test_ordinary_scripts_equal_plain_fit(feature):
    """Features of ordinary training scripts, with batches of 8 in
    micro-batches of 3 and a ragged last batch: weights, optimizer state and
    every logged value (validation's too) equal plain `fit`'s."""
    x, y = make_data(3 * B + 5)
    make_model, fit_args, fit_kwargs, compile_kwargs = _ordinary_script(feature, x, y)
    runs = []
    for wrap in (lambda o: o, lambda o: accumulate(o, micro_batch_size=3)):
        if feature == "generator":
            fit_args = (_batches(x, y, B),)
        model, opt = make_model(), wrap(keras.optimizers.Adam(1e-2))
        model.compile(optimizer=opt, **({"loss": "mse"} | compile_kwargs))
        history = model.fit(*fit_args, epochs=2, verbose=0, **fit_kwargs).history
        runs.append((full_state(model, opt), history))
    (reference, ref_history), (subject, history) = runs
    assert_states_close(reference, subject)
    assert sorted(history) == sorted(ref_history)
    for name in history:
        np.testing.assert_allclose(history[name], ref_history[name], rtol=1e-5, err_msg=name)


def test_keras_file_saved_between_epochs_resumes_as_plain_fit(tmp_path):
    """A `.keras` file keeps `micro_batch_size`; training resumed from it
    equals plain `fit` of both epochs without the interruption."""
    x, y = make_data(3 * B + 5)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, B, epochs=2)
    model = make_mlp()
    fit(model, accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=3), x, y, B)
    path = str(tmp_path / "between_epochs.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.micro_batch_size == 3
    loaded.fit(x, y, batch_size=B, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    assert as_int(loaded.optimizer.iterations) == 8
    assert_states_close(full_state(reference, ref_opt), full_state(loaded, loaded.optimizer))
