"""The gradient noise scale (`noise_scale=True`) on the active backend.

Validated against an analytic value (linear regression with Gaussian inputs,
the weights held fixed by a zero learning rate) and against a brute-force
estimate on a real model; measuring changes nothing of the training, survives
a Keras file mid-cycle, and reaches `fit`'s logs.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import keras
import numpy as np
import pytest

import gradaccum
from gradaccum import accumulate
from tests.helpers import (
    BACKEND,
    JIT,
    assert_states_close,
    fit_pair,
    gradients,
    make_data,
    make_mlp,
    settings_of,
    values,
)

D, SIGMA = 10, 1.0


def _regression(samples: int, seed: int = 0):
    """A linear model y = x·w* + ε (x ~ N(0, I_D), ε ~ N(0, σ²)) whose
    weights sit at w* + δ, |δ| = 1. For the mean squared error the
    per-sample gradient is 2 (x·δ - ε) x, so (Isserlis) |G|² = 4 |δ|² and
    tr(Σ) = 4 ((D + 1) |δ|² + D σ²): B_simple = D + 1 + D σ² = 21."""
    rng = np.random.default_rng(seed)
    w_star = rng.normal(size=(D, 1)).astype("float32")
    x = rng.normal(size=(samples, D)).astype("float32")
    y = (x @ w_star + SIGMA * rng.normal(size=(samples, 1))).astype("float32")
    layers = [keras.Input((D,)), keras.layers.Dense(1, use_bias=False, name="linear")]
    model = keras.Sequential(layers, name="regression")
    model.layers[0].kernel.assign(w_star + np.full((D, 1), 1 / np.sqrt(D), "float32"))
    return model, x, y


ANALYTIC = {"noise_scale": D + 1 + D * SIGMA**2, "gradient_sq": 4.0, "gradient_trace": 4.0 * (D + 1 + D * SIGMA**2)}


def _measured(state) -> dict[str, float]:
    return {"noise_scale": state.noise_scale, "gradient_sq": state.gradient_sq, "gradient_trace": state.gradient_trace}


def _within(measured: dict[str, float], expected: dict[str, float], tolerance: float) -> None:
    for key, value in expected.items():
        assert abs(measured[key] - value) <= tolerance * value, (key, measured[key], value)


@pytest.mark.parametrize("jit", JIT[:1])  # eager JAX: the file test below
def test_fit_measures_the_analytic_noise_scale_of_linear_regression(jit):
    """Equal micro-batches of 8 samples, 8 per cycle, 300 cycles averaged
    (decay 0.99): within 10% of the analytic |G|², tr(Σ) and B_simple."""
    B, n, cycles = 8, 8, 300
    model, x, y = _regression(B * n * cycles)
    opt = accumulate(keras.optimizers.SGD(0.0), n, noise_scale=True, noise_decay=0.99)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    state = opt.accumulation_state
    assert state.noise_cycles == cycles
    assert state.noise_batch == pytest.approx(B)
    assert opt.noise_scale == state.noise_scale
    _within(_measured(state), ANALYTIC, 0.10)


def test_a_custom_loop_with_unequal_weighted_micro_batches_measures_it():
    """Micro-batches of 4, 12, 6 and 10 samples, each weighed by its size
    (the gradient of its mean loss): the estimators weigh them, and the
    noise scale is in samples."""
    sizes, cycles = (4, 12, 6, 10), 150
    model, x, y = _regression(sum(sizes) * cycles, seed=1)
    opt = accumulate(keras.optimizers.SGD(0.0), len(sizes), noise_scale=True, noise_decay=0.99)
    opt.build(model.trainable_variables)
    start = 0
    for _ in range(cycles):
        for size in sizes:
            grads = gradients(model, x[start : start + size], y[start : start + size])
            opt.apply(grads, model.trainable_variables, weight=float(size))
            start += size
    state = opt.accumulation_state
    assert state.noise_batch == pytest.approx(np.mean(sizes))
    _within(_measured(state), ANALYTIC, 0.10)


def _digits_model():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # A little training first: at initialisation the gradient dwarfs the noise.
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)
    return model, x, y, loss


def _squared_norm(grads) -> float:
    return float(sum(np.sum(np.square(g.astype(np.float64))) for g in values(grads)))


@pytest.mark.parametrize("seed", [0])
def test_digits_mlp_agrees_with_a_brute_force_estimate(seed):
    """On scikit-learn's digits, an MLP held fixed: the population is the
    data set, so |G|² is the squared norm of the full-data gradient, and
    E|G_B|² = |G|² + tr(Σ) / B over batches of B drawn with replacement
    gives tr(Σ) from 100 such batches of 64. The accumulating optimizer
    sees 100 cycles of 8 micro-batches of 16, drawn the same way. Both are
    estimates: 15% covers their sampling errors (measured: within 4% of
    each other for seeds 0 to 3)."""
    model, x, y, loss = _digits_model()
    rng = np.random.default_rng(seed)
    full = _squared_norm(gradients(model, x, y, loss=loss))
    big, batches = 64, 100
    draws = rng.integers(0, len(x), size=(batches, big))
    mean_big = np.mean([_squared_norm(gradients(model, x[i], y[i], loss=loss)) for i in draws])
    trace = big * (mean_big - full)
    brute = trace / full

    B, n, cycles = 16, 8, 100
    order = rng.integers(0, len(x), size=B * n * cycles)
    opt = accumulate(keras.optimizers.SGD(0.0), n, noise_scale=True, noise_decay=0.97)
    if BACKEND == "torch":
        # PyTorch's `fit` takes tens of milliseconds per step of this model
        # on the CPU; a custom loop (each micro-batch weighing its samples,
        # as `fit` weighs it) sees the same micro-batches far faster.
        opt.build(model.trainable_variables)
        for k in range(n * cycles):
            batch = order[k * B : (k + 1) * B]
            opt.apply(gradients(model, x[batch], y[batch], loss=loss), model.trainable_variables, weight=float(B))
    else:
        model.compile(optimizer=opt, loss=loss)
        model.fit(x[order], y[order], batch_size=B, shuffle=False, verbose=0)
    state = opt.accumulation_state
    assert brute > B  # the noise dominates a micro-batch: a meaningful comparison
    assert abs(state.noise_scale - brute) <= 0.15 * brute, (state.noise_scale, brute, full, trace)
    assert abs(state.gradient_sq - full) <= 0.15 * full, (state.gradient_sq, full)


def test_measuring_changes_nothing_of_the_training():
    """With the noise scale measured, the run still equals the plain
    optimizer on the large batch."""
    ref, acc, _, opt = fit_pair(
        lambda: keras.optimizers.Adam(1e-2), n=3, wrap=lambda o, n: accumulate(o, n, noise_scale=True)
    )
    assert_states_close(ref, acc)
    assert opt.noise_scale is not None


def test_none_before_a_cycle_is_measured_and_an_error_when_off():
    model = make_mlp()
    x, y = make_data(12)
    opt = accumulate(keras.optimizers.SGD(0.1), 3, noise_scale=True)
    assert opt.noise_scale is None  # not built
    opt.build(model.trainable_variables)
    for k in range(2):
        opt.apply(gradients(model, x[k * 4 : (k + 1) * 4], y[k * 4 : (k + 1) * 4]), model.trainable_variables)
        assert opt.noise_scale is None  # mid-cycle: nothing measured yet
        assert opt.accumulation_state.noise_scale is None
    opt.apply(gradients(model, x[8:], y[8:]), model.trainable_variables)
    assert isinstance(opt.noise_scale, float)
    assert opt.accumulation_state.noise_cycles == 1

    # A flushed cycle of one micro-batch has one batch size: nothing measured.
    single = accumulate(keras.optimizers.SGD(0.1), 3, noise_scale=True)
    single.build(model.trainable_variables)
    single.apply(gradients(model, x[:4], y[:4]), model.trainable_variables)
    single.flush()
    assert single.noise_scale is None

    plain = accumulate(keras.optimizers.SGD(0.1), 3)
    with pytest.raises(ValueError, match="noise_scale=True"):
        plain.noise_scale  # noqa: B018
    assert plain.accumulation_state is None or plain.accumulation_state.noise_scale is None


@pytest.mark.parametrize("jit", JIT)
def test_a_keras_file_saved_mid_cycle_resumes_the_measurement(tmp_path, jit):
    B, n = 4, 3
    x, y = make_data(B * n * 4 + B)  # 4 cycles and one micro-batch

    def compiled():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), n, noise_scale=True, noise_decay=0.5)
        model.compile(optimizer=opt, loss="mse", jit_compile=jit)
        return model, opt

    reference, ref_opt = compiled()
    reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    model, opt = compiled()
    split = B * (2 * n + 2)  # two cycles and two micro-batches of the third
    model.fit(x[:split], y[:split], batch_size=B, shuffle=False, verbose=0)
    path = str(tmp_path / "noise.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    assert loaded.optimizer.accumulation_state.noise_cycles == 2
    loaded.fit(x[split:], y[split:], batch_size=B, shuffle=False, verbose=0)
    expected, got = ref_opt.accumulation_state, loaded.optimizer.accumulation_state
    assert got.noise_cycles == expected.noise_cycles == 4
    for field in ("noise_scale", "gradient_sq", "gradient_trace", "noise_batch"):
        np.testing.assert_allclose(getattr(got, field), getattr(expected, field), rtol=1e-6, err_msg=field)


def test_the_settings_travel_in_configs_and_copies():
    import copy
    import pickle

    opt = accumulate(keras.optimizers.Adam(1e-3), 4, noise_scale=True, noise_decay=0.8)
    config = keras.saving.serialize_keras_object(opt)
    again = keras.saving.deserialize_keras_object(config)
    for other in (again, copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        settings = settings_of(other)
        assert (settings["noise_scale"], settings["noise_decay"]) == (True, 0.8)


def test_the_callback_logs_the_noise_scale_to_fit():
    x, y = make_data(4 * 3 * 4)
    model = make_mlp()
    model.compile(optimizer=accumulate(keras.optimizers.SGD(0.01), 3, noise_scale=True), loss="mse")
    history = model.fit(
        x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
        callbacks=[gradaccum.callbacks.GradientNoiseScale(update_freq=3, estimates=True)],
    )
    assert len(history.history["noise_scale"]) == 2
    assert history.history["noise_scale"][-1] == model.optimizer.noise_scale
    assert "gradient_trace" in history.history

    model = make_mlp()
    model.compile(optimizer=accumulate(keras.optimizers.SGD(0.01), 3), loss="mse")
    with pytest.raises(ValueError, match="noise_scale=True"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[gradaccum.callbacks.GradientNoiseScale()])


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"noise_scale": 1}, TypeError, "noise_scale=1 of type int"),
        ({"noise_scale": "yes"}, TypeError, "noise_scale='yes'"),
        ({"noise_decay": 1.0}, ValueError, "noise_decay=1.0"),
        ({"noise_decay": "0.9"}, TypeError, "noise_decay='0.9'"),
        ({"noise_scale": True, "reduction": "sum"}, ValueError, "reduction=\"mean\""),
        ({"accumulator_dtype": "float16"}, ValueError, "accumulator_dtype='float16'"),
        ({"accumulator_dtype": 32}, TypeError, "accumulator_dtype=32"),
        ({"accumulator_dtype": "bfloat16", "sparse": "slices"}, ValueError, "sparse='slices'"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(")):
        accumulate(keras.optimizers.SGD(0.1), 2, **kwargs)


@pytest.mark.parametrize("update_freq, error", [(0, ValueError), ("batch", ValueError), (True, TypeError)])
def test_a_bad_update_freq_is_refused(update_freq, error):
    with pytest.raises(error, match="update_freq"):
        gradaccum.callbacks.GradientNoiseScale(update_freq=update_freq)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch keeps the cycle's position on the host")
def test_measuring_reads_nothing_back_per_micro_step():
    from tests.architecture.test_host_reads import counting_reads

    with counting_reads() as reads:
        ref, acc, _, opt = fit_pair(
            lambda: keras.optimizers.Adam(1e-2), n=3, wrap=lambda o, n: accumulate(o, n, noise_scale=True)
        )
    assert reads == []
    assert_states_close(ref, acc)
    with counting_reads() as reads:
        assert opt.noise_scale is not None
    assert reads  # reading the estimate itself reads the device


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution runs on JAX")
def test_data_parallel_measures_the_global_batch():
    """Under `DataParallel` over two devices the gradients the optimizer sees
    are the global micro-batch's: the estimates are one device's. The
    estimators subtract nearly equal squared norms, which magnifies the
    all-reduce's float32 rounding: compared at 1e-4 relative."""
    import jax

    B, n = 8, 4
    model, x, y = _regression(B * n * 6)
    one = accumulate(keras.optimizers.SGD(0.01), n, noise_scale=True)
    model.compile(optimizer=one, loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    with keras.distribution.DataParallel(devices=jax.devices()[:2]).scope():
        model, _, _ = _regression(1)
        two = accumulate(keras.optimizers.SGD(0.01), n, noise_scale=True)
        model.compile(optimizer=two, loss="mse")
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    expected, got = one.accumulation_state, two.accumulation_state
    assert got.noise_cycles == expected.noise_cycles == 6
    for field in ("noise_scale", "gradient_sq", "gradient_trace", "noise_batch"):
        np.testing.assert_allclose(getattr(got, field), getattr(expected, field), rtol=1e-4, err_msg=field)


@pytest.mark.parametrize("order", ["accumulate_lso", "lso_accumulate"])
def test_loss_scaling_is_divided_out_first(order):
    """Inside a loss-scale optimizer (either order) the micro-gradients are
    measured unscaled: the estimates equal those of the unscaled run (the
    scale is a power of two, so unscaling is exact)."""
    B, n = 8, 4
    model, x, y = _regression(B * n * 5)
    plain = accumulate(keras.optimizers.SGD(0.01), n, noise_scale=True)
    model.compile(optimizer=plain, loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    model, _, _ = _regression(1)
    if order == "accumulate_lso":
        opt = accumulate(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), n, noise_scale=True)
    else:
        opt = keras.optimizers.LossScaleOptimizer(accumulate(keras.optimizers.SGD(0.01), n, noise_scale=True))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    accumulating = opt if order == "accumulate_lso" else opt.inner_optimizer
    expected, got = plain.accumulation_state, accumulating.accumulation_state
    assert got.noise_cycles == expected.noise_cycles == 5
    for field in ("noise_scale", "gradient_sq", "gradient_trace", "noise_batch"):
        np.testing.assert_allclose(getattr(got, field), getattr(expected, field), rtol=1e-6, err_msg=field)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.IndexedSlices are TensorFlow's")
def test_a_sparse_micro_gradient_is_measured_by_its_dense_value():
    """|g|² of a `tf.IndexedSlices` with repeated rows is that of the dense
    gradient (rows summed first), not the sum of its slices' squares."""
    import tensorflow as tf

    from gradaccum._backend.tensorflow import tensors

    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), tf.constant([0, 2, 0]), [4, 2])
    dense = tf.convert_to_tensor(slices)
    assert float(tensors.squared_norm([slices])) == pytest.approx(float(tf.reduce_sum(dense**2)), rel=1e-6)


def embedding_noise(sparse: str, run: str = "graph", scope: Any = None) -> Any:
    """The accumulation state after `fit` (`run`: "graph", "xla" or
    "eager") of an embedding model under SGD with the noise scale measured:
    5 lookups per sample among 8 ids, so that rows repeat within and across
    micro-batches; 4 cycles of 4."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 8, size=(64, 5)).astype("int32")
    y = rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(8, 3, name="words"),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        opt = accumulate(keras.optimizers.SGD(0.01), 4, noise_scale=True, sparse=sparse)
        model.compile(optimizer=opt, loss="mse", jit_compile=run == "xla", run_eagerly=run == "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    return opt.accumulation_state


def assert_same_estimates(kept: Any, rows: Any) -> None:
    assert kept.kept_slices, "the embedding's slices were not kept"
    assert kept.noise_cycles == rows.noise_cycles == 4
    for field in ("gradient_sq", "gradient_trace", "noise_scale"):
        np.testing.assert_allclose(getattr(kept, field), getattr(rows, field), rtol=1e-5, err_msg=field)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="kept tf.IndexedSlices are TensorFlow's")
@pytest.mark.parametrize("sparse, run", [("auto", "graph"), ("auto", "xla"), ("auto", "eager"), ("slices", "graph")])
def test_kept_slices_are_measured_as_their_rows_would_be(sparse, run):
    """Under the default sparse="auto" (and "slices") an embedding's slices
    are kept apart from its accumulator; the estimate still measures them,
    as the sums of their rows: the same as with sparse="rows" (under SGD,
    whose update is the same both ways)."""
    assert_same_estimates(embedding_noise(sparse, run), embedding_noise("rows", run))
