"""`accumulate(opt, micro_batch_size="auto")`: the largest micro-batch whose
train step fits, and a step that runs out of memory run again smaller with
nothing lost. Every run equals plain `fit(batch_size=B)`: weights, every
optimizer variable, `iterations` and the logs (metrics count each sample
once)."""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle

import keras
import numpy as np
import pytest

from gradaccum import accumulate, accumulating
from gradaccum._auto_size import search_of
from gradaccum._backend.memory import out_of_memory_above
from tests.helpers import (
    BACKEND,
    JIT,
    as_int,
    assert_states_close,
    core_of,
    fit,
    full_state,
    internal_core,
    make_data,
    make_mlp,
)
from tests.micro_batching.test_micro_batching import _pair as _split_pair

B = 8


def _pair(wrap, x, y, batch=B, make_model=make_mlp, **compile_kwargs):
    """Plain `fit(batch_size=batch)` and the same with `wrap(optimizer)` (see
    `tests.micro_batching.test_micro_batching`)."""
    return _split_pair(lambda: keras.optimizers.Adam(1e-2), None, x, y, make_model, wrap=wrap, batch=batch,
                       **compile_kwargs)


def _assert_logs_equal(ref_history, history):
    # The loss tracker (a metric) weighs each sample once.
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-6)


@pytest.mark.parametrize("jit", JIT)
def test_auto_fits_the_batch_and_equals_plain_fit(jit, caplog):
    x, y = make_data(3 * B + 5)
    with caplog.at_level(logging.INFO, logger="gradaccum"):
        reference, subject, ref_history, history, opt = _pair(
            lambda o: accumulate(o, micro_batch_size="auto"), x, y, jit_compile=jit
        )
    # A tiny model fits whole: the chosen size is the batch's, logged once,
    # after two compilations where it is predicted (halves, then the batch).
    assert opt.micro_batch_size == B and opt.n == 1
    assert search_of(internal_core(opt)).compilations == (2 if BACKEND == "jax" else 0)
    how = "predicted" if BACKEND == "jax" else "probed from the batch"
    assert [r.getMessage() for r in caplog.records if "chose" in r.getMessage()] == [
        f'gradaccum: micro_batch_size="auto" chose {B} ({how}).'
    ]
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)
    _assert_logs_equal(ref_history, history)


_EXECUTIONS = {
    "tensorflow": (pytest.param({}, id="graph"), pytest.param({"jit_compile": True}, id="xla"),
                   pytest.param({"run_eagerly": True}, id="eager")),
    "jax": (pytest.param({"jit_compile": True}, id="xla"), pytest.param({"jit_compile": False}, id="traced")),
}.get(BACKEND, (pytest.param({}, id="eager"),))


@pytest.mark.parametrize("compile_kwargs", _EXECUTIONS)
def test_out_of_memory_runs_the_batch_again_smaller_and_loses_nothing(compile_kwargs):
    """Micro-batches above 3 samples run out of memory (the backend's own
    error; eagerly on the step's last micro-batch, after the others wrote
    their gradients, counters and metrics). The batch of 8 runs as 8, 4,
    then 2 (3 would leave a ragged micro-batch): the run equals plain
    `fit`, and the logs count each sample once."""
    x, y = make_data(3 * B + 5)
    with out_of_memory_above(3):
        reference, subject, ref_history, history, opt = _pair(
            lambda o: accumulate(o, micro_batch_size="auto"), x, y, **compile_kwargs
        )
    assert opt.micro_batch_size == 2
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)
    _assert_logs_equal(ref_history, history)


@pytest.mark.skipif(BACKEND == "torch", reason="Keras's PyTorch trainer takes steps_per_execution=1 only")
def test_steps_per_execution_runs_each_batch_again_on_its_own():
    x, y = make_data(3 * B + 5)
    with out_of_memory_above(5):
        reference, subject, ref_history, history, opt = _pair(
            lambda o: accumulate(o, micro_batch_size="auto"), x, y, steps_per_execution=3
        )
    assert opt.micro_batch_size == 4
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, subject)
    _assert_logs_equal(ref_history, history)


def test_a_step_that_does_not_fit_at_one_sample_says_so():
    x, y = make_data(2 * B)
    model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto")
    before = [keras.ops.convert_to_numpy(w).copy() for w in model.weights]
    with out_of_memory_above(0), pytest.raises(MemoryError, match=r"even at micro-batches of 1 sample"):
        fit(model, opt, x, y, B)
    assert as_int(opt.iterations) == 0
    for w, old in zip(model.weights, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(w), old)


def _step_bytes(size, batch, x, y):
    """What XLA's memory analysis gives the train step of `fit` (JAX's, or
    TensorFlow's compiled with XLA) split into micro-batches of `size` (the
    search's measure, taken by hand)."""
    from gradaccum._backend.memory import step_bytes

    model, opt = _wide_model(), accumulate(keras.optimizers.SGD(1e-2), micro_batch_size=size)
    fit(model, opt, x[:batch], y[:batch], batch, jit_compile=True)
    state = None if BACKEND == "tensorflow" else model._get_jax_state(
        trainable_variables=True, non_trainable_variables=True, optimizer_variables=True, metrics_variables=True
    )
    data = (x[:batch], y[:batch])
    if BACKEND == "tensorflow":
        import tensorflow as tf

        data = tuple(tf.constant(t) for t in data)
    return step_bytes(model.train_step, state, data)


def _wide_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu", name="hidden0"),
                             keras.layers.Dense(256, activation="relu", name="hidden1"),
                             keras.layers.Dense(8, name="out")], name="wide")


@pytest.mark.skipif(BACKEND == "torch", reason="XLA's compiled memory analysis of the train step")
def test_memory_limit_predicts_the_largest_size_that_fits(caplog):
    """Activations dominate: the limit is the step's bytes at micro-batches
    of 128 (4 of the batch of 512); 3 micro-batches of 171 do not fit. The
    size is predicted (compiled, not run: a probe of the whole batch would
    run out of memory here) on JAX and on TensorFlow with XLA, from two
    compilations: the step split into halves and into quarters, the bytes'
    line through them (the whole batch, traced without the loop, lies off
    that line: through it and the halves TensorFlow's line gave 64). SGD,
    whose step follows the gradient: Adam's normalised step turns the
    float32 rounding of this wide layer's summed micro-batches into
    differences above the tolerance on components that cancel, with any
    fixed size too."""
    batch = 512
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2 * batch, 64)).astype("float32"), rng.normal(size=(2 * batch, 8)).astype("float32")
    limit = _step_bytes(128, batch, x, y)
    assert _step_bytes(171, batch, x, y) > limit
    with out_of_memory_above(128), caplog.at_level(logging.INFO, logger="gradaccum"):
        reference, subject, _, _, opt = _split_pair(
            lambda: keras.optimizers.SGD(1e-2), None, x, y, _wide_model, batch=batch, jit_compile=True,
            wrap=lambda o: accumulate(o, micro_batch_size="auto", memory_limit=limit),
        )
    assert [r.getMessage() for r in caplog.records if "chose" in r.getMessage()] == [
        'gradaccum: micro_batch_size="auto" chose 128 (predicted).'
    ]
    assert opt.micro_batch_size == 128 and search_of(internal_core(opt)).compilations == 2
    assert_states_close(reference, subject)
    with pytest.raises(MemoryError, match=r"needs \d+ bytes .* has 1000 bytes \(memory_limit\)"):
        fit(_wide_model(), accumulate(keras.optimizers.SGD(1e-2), micro_batch_size="auto", memory_limit=1000),
            x, y, batch, jit_compile=True)


def test_configs_copies_and_files_keep_auto_and_the_size_chosen(tmp_path):
    x, y = make_data(2 * B)
    model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto", memory_limit=2**30)
    assert opt.micro_batch_size == "auto" and opt.memory_limit == 2**30
    # Where the size is probed, the limit is not used, and a warning says so.
    probed = pytest.warns(
        RuntimeWarning, match="memory_limit=1073741824 predicts the size on JAX and on TensorFlow with jit_compile=True"
    )
    with out_of_memory_above(4), probed if BACKEND != "jax" else contextlib.nullcontext():
        fit(model, opt, x, y, B)
    assert opt.micro_batch_size == 4
    config = keras.saving.serialize_keras_object(opt)
    assert config["config"]["micro_batch_size"] == "auto"
    again = keras.saving.deserialize_keras_object(config)
    assert again.micro_batch_size == 4 and again.memory_limit == 2**30
    assert copy.deepcopy(opt).micro_batch_size == 4
    assert pickle.loads(pickle.dumps(opt)).micro_batch_size == 4
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.micro_batch_size == 4 and loaded.optimizer.memory_limit == 2**30


def test_accumulating_chooses_for_code_you_do_not_own():
    x, y = make_data(3 * B)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, B)
    model = make_mlp()
    with accumulating(micro_batch_size="auto"), out_of_memory_above(5):
        fit(model, keras.optimizers.Adam(1e-2), x, y, B)
    assert core_of(model.optimizer).micro_batch_size == 4
    assert_states_close(full_state(reference, ref_opt), full_state(model, model.optimizer))


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution's data parallelism runs on JAX")
def test_data_parallel_runs_the_batch_again_smaller_and_equals_one_device():
    """Keras's JAX `fit` empties the model's variables while it holds their
    state apart; the train function traced anew for the smaller size reads
    their shardings all the same."""
    from tests.helpers.devices import two_devices

    x, y = make_data(4 * B)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, 2 * B)
    with keras.distribution.DataParallel(devices=two_devices()).scope():
        model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto")
        with out_of_memory_above(4):
            fit(model, opt, x, y, 2 * B)
    assert opt.micro_batch_size == 4
    assert as_int(opt.iterations) == 2
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    (
        ({"micro_batch_size": "big"}, ValueError, r"or \"auto\".*micro_batch_size='big'"),
        ({"micro_batch_size": "auto", "n": 2}, ValueError, "not both"),
        ({"micro_batch_size": "auto", "memory_limit": 0}, ValueError, "memory_limit=0"),
        ({"micro_batch_size": "auto", "memory_limit": -5}, ValueError, "memory_limit=-5"),
        ({"micro_batch_size": "auto", "memory_limit": "8GB"}, TypeError, "memory_limit='8GB'"),
        ({"micro_batch_size": "auto", "memory_limit": 1.5e9}, TypeError, "memory_limit=1500000000.0"),
        ({"micro_batch_size": 4, "memory_limit": 2**30}, ValueError, r"memory_limit=1073741824.*micro_batch_size=4"),
    ),
)
def test_bad_auto_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        accumulate(keras.optimizers.SGD(), **kwargs)
    with pytest.raises(error, match=match), accumulating(**kwargs):
        pass
