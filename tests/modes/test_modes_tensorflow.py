"""`mode="masked"` and `mode="skip"` on TensorFlow: how each runs, and that both are exact.

That both modes give the same bits for every optimizer and feature is the
property in `property_tests/test_modes_tensorflow.py`; the `mode` argument itself is
checked on every backend in `tests/arguments/test_arguments.py`. Here:
`MirroredStrategy` with two replicas, how the masked update masks (no
snapshot of all state for Keras 3 optimizers, the snapshot as fallback,
nothing left behind), what the end of a cycle leaves for the next, and
tracing.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from gradaccum._backend.tensorflow import updates
from gradaccum._core import Core
from gradaccum._keras3 import Keras3Family
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    fit,
    fit_pair,
    full_state,
    make_data,
    make_embedding_model,
    make_mlp,
)
from tests.helpers.distribute import mirrored, replica_states

N, B, CYCLES = 3, 4, 3

# Weight decay, EMA and a constraint: state changed outside `update_step`.
def _adamw_ema():
    return keras.optimizers.AdamW(1e-2, weight_decay=0.1, use_ema=True, ema_momentum=0.5)


def _constrained_mlp():
    return make_mlp(kernel_constraint=keras.constraints.MaxNorm(0.5))


# ----------------------------------------------------------------------
# MirroredStrategy, two replicas on two logical CPUs (see conftest.py).


def _replica_copies(strategy, model, opt):
    """Every replica's copy of every model and optimizer variable."""
    return {
        f"{key}@{r}": value
        for r, state in enumerate(replica_states(strategy, model, opt))
        for key, value in state.items()
    }


class _Recorder(keras.callbacks.Callback):
    """Records `read()` before training and after every micro-step.

    One `fit` call for all micro-steps: `fit` ends by copying EMA values into
    the model (`finalize_variable_values`), so it must run once, as in the
    reference.
    """

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.states = []

    def on_train_begin(self, logs=None):
        self.states.append(self.read())

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(self.read())


def _assert_only_apply_steps_change_state(states, kernel="model/out/kernel"):
    for k in range(1, len(states)):
        if k % N:
            assert_states_equal(states[k - 1], states[k])
        else:
            assert not np.array_equal(states[k - 1][kernel], states[k][kernel]), k


@pytest.mark.parametrize("mode", MODES)
def test_mirrored_strategy_matches_large_batch(mode):
    strategy = mirrored()
    x, y = make_data(B * N * CYCLES)
    with strategy.scope():
        ref_model, ref_opt = _constrained_mlp(), _adamw_ema()
    fit(ref_model, ref_opt, x, y, B * N)

    with strategy.scope():
        model = _constrained_mlp()
        opt = accumulate(_adamw_ema(), N, mode=mode)
        opt.build(model.trainable_variables)
    recorder = _Recorder(lambda: _replica_copies(strategy, model, opt))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[recorder])
    assert len(recorder.states) == N * CYCLES + 1
    _assert_only_apply_steps_change_state(recorder.states, "model/out/kernel@0")
    assert int(opt.iterations.numpy()) == CYCLES
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))
    copies = _replica_copies(strategy, model, opt)
    for key, value in copies.items():
        if key.endswith("@1"):
            np.testing.assert_array_equal(value, copies[key[:-2] + "@0"], err_msg=key)
    _assert_no_masks_left(
        [c for v in model.weights + opt.variables for c in v.value.values]
    )


# ----------------------------------------------------------------------
# How the masked update masks.


# The write methods of `tf.Variable`: none may be left patched on a variable.
_WRITES = {"assign", "assign_add", "assign_sub", "scatter_add", "scatter_sub", "scatter_update", "scatter_nd_update"}


def _assert_no_masks_left(tf_variables):
    for v in tf_variables:
        assert not _WRITES & set(vars(v)), v.name


def _spy(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_keras3_optimizers_split_the_update_and_take_no_snapshot(monkeypatch):
    """No copy of all variables and optimizer state is made ahead of the update."""
    snapshots = _spy(monkeypatch, updates, "snapshot_update")
    masked = _spy(monkeypatch, updates, "split_apply")
    ref, acc, model, opt = fit_pair(_adamw_ema, n=N, make_model=_constrained_mlp)
    assert_states_close(ref, acc)
    assert masked and not snapshots
    _assert_no_masks_left([v.value for v in model.weights + opt.variables])


def test_masks_are_removed_after_the_step():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), N)
    fit(model, opt, *make_data(B), B)
    assert int(opt.micro_step) == 1
    _assert_no_masks_left([v.value for v in model.weights + opt.variables])
    # A write after training is a plain write.
    kernel = model.trainable_variables[0]
    kernel.assign(tf.ones(kernel.shape))
    np.testing.assert_array_equal(kernel.numpy(), np.ones(kernel.shape))


def test_snapshot_fallback_for_adapters_that_do_not_mask_writes(monkeypatch):
    monkeypatch.setattr(Keras3Family, "masks_writes", False)
    snapshots = _spy(monkeypatch, updates, "snapshot_update")
    masked = _spy(monkeypatch, updates, "split_apply")
    x, y = make_data(B * N * CYCLES)
    ref, _, _, _ = fit_pair(_adamw_ema, n=N, make_model=_constrained_mlp, data=(x, y))

    model = _constrained_mlp()
    opt = accumulate(_adamw_ema(), N)
    opt.build(model.trainable_variables)
    recorder = _Recorder(lambda: full_state(model, opt))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[recorder])
    _assert_only_apply_steps_change_state(recorder.states)
    assert snapshots and not masked
    assert_states_close(ref, full_state(model, opt))


def test_masked_update_keeps_the_sign_of_zero_and_non_finite_values():
    """An in-between step leaves -0.0, inf and NaN in state exactly as they were."""
    special = np.array([-0.0, 0.0, np.inf, -np.inf, np.nan, 1.5], "float32")
    var = keras.Variable(special)
    opt = keras.optimizers.SGD(1.0)
    opt.build([var])
    delta = tf.constant([1.0, -0.0, 2.0, 1.0, 1.0, np.nan], "float32")
    for keep in (False, True):
        var.assign(special)
        updates.split_apply(opt, [delta], [var], updates.Masking(tf.constant(keep), {}))
        got = var.numpy()
        if keep:
            np.testing.assert_array_equal(got, special - delta.numpy())
        else:
            # Bit for bit: -0.0 is not 0.0, and NaN keeps its bits.
            np.testing.assert_array_equal(got.view("uint32"), special.view("uint32"))
    assert int(opt.iterations.numpy()) == 1
    _assert_no_masks_left([var.value])


# ----------------------------------------------------------------------
# Between cycles.


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("saved, loaded", [("masked", "skip"), ("skip", "masked")])
def test_a_cycle_writes_over_the_sums_the_last_one_left(tmp_path, saved, loaded, jit):
    """No mode clears the accumulators when a cycle ends; the next cycle's
    first micro-step writes over them, in every mode.

    An embedding (its gradients scattered, rows repeating) and a dense
    layer, SGD with momentum: two cycles in one mode, a `tf.train.Checkpoint`
    (which holds the raw values: checked to be the last cycle's, not zeros),
    restored into an optimizer in the other mode, two more cycles. Against
    large-batch training over all four: a mode that added to what it
    restored would fail. The view shows zeros between cycles.
    """
    cycles = 4
    rng = np.random.default_rng(3)
    x = rng.integers(0, 8, size=(B * N * cycles, 3)).astype("int32")
    y = rng.normal(size=(len(x), 2)).astype("float32")
    half = len(x) // 2
    make = lambda: keras.optimizers.SGD(0.5, momentum=0.9)  # noqa: E731
    ref_model, ref_opt = make_embedding_model(), make()
    fit(ref_model, ref_opt, x, y, B * N, jit_compile=jit)

    # sparse="rows": the embedding's slices go into its accumulator (the
    # default keeps them in buffers of their own, tested in tests/sparse).
    model, opt = make_embedding_model(), accumulate(make(), N, mode=saved, sparse="rows")
    fit(model, opt, x[:half], y[:half], B, jit_compile=jit)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    reader = tf.train.load_checkpoint(path)
    held = [reader.get_tensor(key) for key, _ in tf.train.list_variables(path)
            if "gradient_accumulation/accumulators" in key]
    assert len(held) == len(model.trainable_variables)
    assert all(np.any(h) for h in held)
    state = opt.accumulation_state
    assert int(state.micro_step) == 0 and float(state.weight_total) == 0.0
    assert not any(np.any(a.numpy()) for a in state.accumulators)

    resumed, opt2 = make_embedding_model(), accumulate(make(), N, mode=loaded, sparse="rows")
    opt2.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=opt2).read(path).assert_existing_objects_matched()
    fit(resumed, opt2, x[half:], y[half:], B, jit_compile=jit)
    assert_states_close(full_state(ref_model, ref_opt), full_state(resumed, opt2))


def test_checkpoints_of_both_modes_hold_the_same_keys(tmp_path):
    model = make_embedding_model()

    def saved(mode):
        opt = accumulate(keras.optimizers.SGD(0.5, momentum=0.9), N, mode=mode)
        opt.build(model.trainable_variables)
        path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / mode))
        return sorted(key for key, _ in tf.train.list_variables(path))

    assert saved("skip") == saved("masked")


# ----------------------------------------------------------------------
# Tracing.


@pytest.mark.parametrize("mode", MODES)
def test_fit_traces_the_update_once_whatever_n(mode, monkeypatch):
    """Built before `fit`: one trace for all epochs, the last, smaller batch too."""
    traces = _spy(monkeypatch, Core, "step")
    for n in (2, 5):
        traces.clear()
        x, y = make_data(B * n * 2 + 2)  # a last batch of 2
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), n, mode=mode)
        opt.build(model.trainable_variables)
        fit(model, opt, x, y, B, epochs=3)
        assert len(traces) == 1, n


def test_fit_traces_an_unbuilt_optimizer_as_often_as_the_plain_one(monkeypatch):
    """Variables created on the first call make `tf.function` trace twice."""
    traces = _spy(monkeypatch, Core, "step")

    class CountingAdam(keras.optimizers.Adam):
        def apply(self, *args, **kwargs):
            plain.append(1)
            return super().apply(*args, **kwargs)

    plain = []
    x, y = make_data(B * N * 2)
    fit(make_mlp(), CountingAdam(1e-2), x, y, B, epochs=2)
    fit(make_mlp(), accumulate(keras.optimizers.Adam(1e-2), N), x, y, B, epochs=2)
    assert len(traces) == len(plain) == 2
