"""Device-local accumulation under `keras.distribution.DataParallel` on JAX:
the compiled train step exchanges the gradients once per cycle, and the
result still equals one device training on the large batch.

Each equivalence test trains a reference on one device with the plain
optimizer on the large batch (n micro-batches), from the same initial
weights, on the same data in the same order.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from tests.helpers import BACKEND, MODES, assert_states_close, fit, full_state, gradients, make_data, make_mlp
from tests.helpers.devices import two_devices
from tests.helpers.hlo import all_reduces
from tests.helpers.models import TOKENS_T as T
from tests.helpers.models import TOKENS_VOCAB as VOCAB
from tests.helpers.models import make_tokens_model as _tokens_model

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution's data parallelism runs on JAX")

N, B = 4, 8  # B: the global micro-batch, split over the two devices


def _distribution():
    return keras.distribution.DataParallel(devices=two_devices())


def _hidden_kernel_laid_out(shape: tuple[int, ...], axes: list[str], kernel: tuple) -> Any:
    """`ModelParallel` over a mesh of the two devices, the batch split over
    its "batch" axis, the MLP's first kernel laid out as `kernel`."""
    mesh = keras.distribution.DeviceMesh(shape, axes, two_devices())
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["mlp/hidden0/kernel"] = kernel
    return keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")


FALLBACK = "all-reduced on every micro-step"


@contextlib.contextmanager
def _per_device():
    """Fails if a train step within falls back to all-reducing its gradients."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [str(w.message) for w in caught if FALLBACK in str(w.message)]


# ----------------------------------------------------------------------
# The compiled program.

def _all_reduces(hlo: str) -> tuple[list[int], list[int]]:
    """The element counts of the all-reduces of an optimized HLO module:
    `(outside conditional branches, inside them)`."""
    found = all_reduces(hlo)
    return [a.elements for a in found["outside"]], [a.elements for a in found["inside"]]


def _optimized_train_step(model, x, y) -> str:
    """The optimized HLO of `model`'s compiled train step on `(x, y)`, as
    `fit` compiles it."""
    import jax
    from keras.src.backend.jax.trainer import _distribute_data

    state = tuple(
        [v.value for v in variables]
        for variables in (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
                          model.metrics_variables)
    )
    return jax.jit(model.train_step).lower(state, _distribute_data((x, y))).compile().as_text()


# Both modes: the claim is that neither exchanges gradients in between
# (the shared `mode` fixture varies it on TensorFlow only).
@pytest.mark.parametrize("update_mode", MODES)
def test_in_between_micro_steps_exchange_no_gradient(update_mode):
    x, y = make_data(B * N)
    parameters = sum(int(np.prod(v.shape)) for v in make_mlp().trainable_variables)
    with _distribution().scope():
        plain = make_mlp()
        fit(plain, keras.optimizers.Adam(1e-2), x, y, B)
        model = make_mlp()
        fit(model, accumulate(keras.optimizers.Adam(1e-2), N, mode=update_mode), x, y, B)
        plain_outside, _ = _all_reduces(_optimized_train_step(plain, x[:B], y[:B]))
        outside, inside = _all_reduces(_optimized_train_step(model, x[:B], y[:B]))
    # Plain data parallelism all-reduces the gradients on every step (this
    # also checks that the HLO is read right).
    assert max(plain_outside) >= parameters
    # Accumulating, every step exchanges only scalars (the loss for the
    # logs, the micro-batch's count); the gradients, once per cycle, in the
    # branch that applies the update.
    assert max(outside) < 8, outside
    assert sum(e for e in inside if e >= parameters) == parameters, inside


# ----------------------------------------------------------------------
# Equal to one device on the large batch.


def _fit_pair(make_model, make_optimizer, wrap, x, y, loss="mse", sample_weight=None, per_device=True):
    """`(reference state, subject state, subject optimizer)`; with
    `per_device`, checks that the subject's steps did not fall back."""
    def run(model, optimizer, batch_size):
        model.compile(optimizer=optimizer, loss=loss)
        model.fit(x, y, batch_size=batch_size, sample_weight=sample_weight, shuffle=False, verbose=0)
        return full_state(model, optimizer)

    reference = run(make_model(), make_optimizer(), B * N)
    with _distribution().scope(), (_per_device() if per_device else contextlib.nullcontext()):
        optimizer = wrap(make_optimizer())
        subject = run(make_model(), optimizer, B)
    return reference, subject, optimizer




@pytest.mark.parametrize("weighted", (False, True), ids=("masked_tokens", "sample_weights"))
def test_devices_with_different_counts_weigh_as_the_large_batch(weighted):
    rng = np.random.default_rng(1)
    samples = B * N * 2
    # Each device's half of a micro-batch has its own number of valid tokens.
    lengths = np.where((np.arange(samples) // (B // 2)) % 2 == 0, T, 1 + np.arange(samples) % 2)
    mask = np.arange(T)[None, :] < lengths[:, None]
    x = np.where(mask, rng.integers(1, VOCAB, size=mask.shape), 0).astype("int32")
    y = rng.integers(0, 4, size=mask.shape).astype("int32")
    sample_weight = rng.uniform(0.1, 3.0, size=mask.shape).astype("float32") if weighted else None
    loss = keras.losses.SparseCategoricalCrossentropy(
        reduction="mean_with_sample_weight" if weighted else "sum_over_batch_size"
    )
    reference, subject, opt = _fit_pair(
        _tokens_model, lambda: keras.optimizers.SGD(0.5, momentum=0.8), lambda o: accumulate(o, N),
        x, y, loss=loss, sample_weight=sample_weight,
    )
    assert int(opt.iterations) == 2
    assert_states_close(reference, subject)


@pytest.mark.parametrize("outside", (False, True), ids=("accumulate_outside", "loss_scale_outside"))
def test_loss_scale_optimizer_ema_and_clipping_as_one_device(outside):
    x, y = make_data(B * N * 3)
    LSO = keras.optimizers.LossScaleOptimizer

    def make():
        return LSO(keras.optimizers.Adam(1e-2, global_clipnorm=0.05, use_ema=True, ema_momentum=0.5))

    def wrap(lso):
        return LSO(accumulate(lso.inner_optimizer, N)) if outside else accumulate(lso, N)

    reference, subject, opt = _fit_pair(make_mlp, make, wrap, x, y)
    # The scale's growth counter counts finite scaled backward passes:
    # micro-batches, not applied updates (documented), in either order.
    assert int(subject.pop("opt/step_counter")) == N * int(reference.pop("opt/step_counter"))
    assert_states_close(reference, subject)


def test_adaptive_gradient_clipping_clips_the_large_batch_gradient():
    from tests.helpers.agc import np_agc

    factor, eps = 0.01, 1e-3
    x, y = make_data(B * N * 3)
    model = make_mlp()
    reference = keras.optimizers.Adam(1e-2)
    reference.build(model.trainable_variables)
    clipped = 0
    for start in range(0, len(x), B * N):
        grads = []
        for g, v in zip(gradients(model, x[start:start + B * N], y[start:start + B * N]), model.trainable_variables):
            c, k, _ = np_agc(np.asarray(keras.ops.convert_to_numpy(g)), v.numpy(), factor, eps)
            clipped += k
            grads.append(keras.ops.convert_to_tensor(c))
        reference.apply(grads, model.trainable_variables)
    assert clipped > 0  # the clip bites
    with _distribution().scope(), _per_device():
        subject = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), N, agc=factor, agc_eps=eps)
        fit(subject, opt, x, y, B)
    assert_states_close(full_state(model, reference), full_state(subject, opt))


def test_custom_stateless_apply_loop_equals_the_large_batch():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    x, y = make_data(B * N * 2)
    reference = make_mlp()
    reference_opt = keras.optimizers.Adam(1e-2)
    fit(reference, reference_opt, x, y, B * N)

    distribution = _distribution()
    with distribution.scope():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), N)
        opt.build(model.trainable_variables)
    mse = keras.losses.MeanSquaredError()

    @jax.jit
    def step(trainable, optimizer_values, xb, yb):
        def loss(trainable):
            y_pred, _ = model.stateless_call(trainable, [], xb)
            return mse(yb, y_pred)

        return opt.stateless_apply(optimizer_values, jax.grad(loss)(trainable), trainable)

    split = NamedSharding(distribution.device_mesh.backend_mesh, PartitionSpec("batch"))
    trainable = [v.value for v in model.trainable_variables]
    optimizer_values = [v.value for v in opt.variables]
    for start in range(0, len(x), B):
        xb, yb = (jax.device_put(a[start:start + B], split) for a in (x, y))
        trainable, optimizer_values = step(trainable, optimizer_values, xb, yb)
    for variable, value in zip(model.trainable_variables + list(opt.variables), trainable + optimizer_values):
        variable.assign(value)
    assert_states_close(full_state(reference, reference_opt), full_state(model, opt))


def test_a_custom_loop_that_compiles_model_train_step_computes_per_device():
    """A loop of your own around `jax.jit(model.train_step)` gets the
    per-device step too, and equals the large batch."""
    import jax
    from keras.src.backend.jax.trainer import _distribute_data

    x, y = make_data(B * N * 2)
    reference = make_mlp()
    reference_opt = keras.optimizers.Adam(1e-2)
    fit(reference, reference_opt, x, y, B * N)
    parameters = sum(int(np.prod(v.shape)) for v in reference.trainable_variables)

    with _distribution().scope(), _per_device():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), N)
        model.compile(optimizer=opt, loss="mse")
        model.build((None, 5))
        opt.build(model.trainable_variables)
        groups = (model.trainable_variables, model.non_trainable_variables, opt.variables, model.metrics_variables)
        state = tuple([v.value for v in group] for group in groups)
        step = jax.jit(model.train_step)
        outside, _ = _all_reduces(step.lower(state, _distribute_data((x[:B], y[:B]))).compile().as_text())
        for start in range(0, len(x), B):
            _, state = step(state, _distribute_data((x[start:start + B], y[start:start + B])))
        for group, values in zip(groups, state):
            for variable, value in zip(group, values):
                variable.assign(value)
    assert max(outside) < 8 < parameters, outside
    assert_states_close(full_state(reference, reference_opt), full_state(model, opt))


# ----------------------------------------------------------------------
# Where the gradients cannot be computed per device.


def test_a_sum_loss_falls_back_with_a_warning_and_the_same_result():
    x, y = make_data(B * N * 2)
    loss = keras.losses.MeanSquaredError(reduction="sum")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference, subject, _ = _fit_pair(
            make_mlp, lambda: keras.optimizers.Adam(1e-2), lambda o: accumulate(o, N, reduction="sum"),
            x, y, loss=loss, per_device=False,
        )
    messages = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    assert len(messages) == 1 and "'sum' reduction" in messages[0], messages
    assert_states_close(reference, subject)


def test_a_layout_that_shards_a_variable_over_the_batch_axis_falls_back_with_a_warning():
    x, y = make_data(B * N * 2)
    distribution = _hidden_kernel_laid_out((2,), ["batch"], (None, "batch"))

    reference = make_mlp()
    reference_opt = keras.optimizers.Adam(1e-2)
    fit(reference, reference_opt, x, y, B * N)
    with distribution.scope(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), N)
        fit(model, opt, x, y, B)
    messages = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    assert len(messages) == 1 and "hidden0/kernel" in messages[0] and "batch axis" in messages[0], messages
    assert_states_close(full_state(reference, reference_opt), full_state(model, opt))


def test_model_parallel_whose_batch_axis_is_data_parallel():
    """A 2-D mesh: the batch split over "batch", a kernel over "model" (one
    device along it here); the accumulators keep the kernel's sharding."""
    x, y = make_data(B * N * 2)
    parameters = sum(int(np.prod(v.shape)) for v in make_mlp().trainable_variables)
    distribution = _hidden_kernel_laid_out((2, 1), ["batch", "model"], (None, "model"))

    reference = make_mlp()
    reference_opt = keras.optimizers.Adam(1e-2)
    fit(reference, reference_opt, x, y, B * N)
    with distribution.scope(), _per_device():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), N)
        fit(model, opt, x, y, B)
        outside, inside = _all_reduces(_optimized_train_step(model, x[:B], y[:B]))
    assert max(outside) < 8, outside
    assert sum(e for e in inside if e >= parameters) == parameters, inside
    assert_states_close(full_state(reference, reference_opt), full_state(model, opt))


def test_a_file_saved_mid_cycle_resumes_under_the_distribution(tmp_path):
    """Keras files hold each device-local accumulator's sum over devices;
    loaded, the sum goes into the first device's entry."""
    x, y = make_data(B * N * 3)
    reference = make_mlp()
    reference_opt = keras.optimizers.Adam(1e-2)
    fit(reference, reference_opt, x, y, B * N)
    half = B * (N + N // 2)  # a cycle and a half
    path = tmp_path / "mid_cycle.keras"
    with _distribution().scope(), _per_device():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), N)
        fit(model, opt, x[:half], y[:half], B)
        assert int(opt.micro_step) == N // 2
        model.save(path)
        loaded = keras.models.load_model(path)
        assert int(loaded.optimizer.micro_step) == N // 2
        local = [v for v in loaded.optimizer.variables if "gradaccum_accumulator" in v.path]
        assert local and all(v.shape[0] == 2 for v in local)
        loaded.fit(x[half:], y[half:], batch_size=B, shuffle=False, verbose=0)
    assert_states_close(full_state(reference, reference_opt), full_state(loaded, loaded.optimizer))


class _CountingDense(keras.layers.Dense):
    """A Dense layer whose forward pass changes a non-trainable variable
    (as BatchNormalization's statistics do) without changing its output."""

    def build(self, input_shape):
        super().build(input_shape)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, inputs, training=None):
        if training:
            self.calls.assign_add(1.0)
        return super().call(inputs)


def _counting_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((5,)), _CountingDense(8, activation="tanh", name="hidden0"), keras.layers.Dense(3, name="out"),
    ], name="mlp")


def test_a_forward_pass_that_changes_non_trainable_variables_falls_back_with_a_warning():
    x, y = make_data(B * N * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference, subject, _ = _fit_pair(
            _counting_mlp, lambda: keras.optimizers.Adam(1e-2), lambda o: accumulate(o, N), x, y, per_device=False,
        )
    messages = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    assert len(messages) == 1 and "non-trainable variables" in messages[0], messages
    # The counter counts forward passes: micro-batches here, large batches there.
    assert int(subject.pop("model/hidden0/calls")) == N * int(reference.pop("model/hidden0/calls"))
    assert_states_close(reference, subject)


def test_model_parallel_on_a_2x2_mesh_in_a_process_of_its_own():
    """Both mesh axes real: the kernels sharded over "model", the batch over
    "batch" (tests/distribution/model_parallel_worker.py, on four host devices)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run(
        [sys.executable, "-m", "tests.distribution.model_parallel_worker"], cwd=root, env=env, capture_output=True,
        text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
