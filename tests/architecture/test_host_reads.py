"""On PyTorch a micro-step reads nothing back from the device in gradaccum's code.

On a GPU every `bool`, `item`, `int`, `float`, `tolist`, `numpy` or `cpu` of a
device tensor waits until the device has run everything queued before it.
The CPU cannot show that wait, so these tests count the reads instead: every
call of those methods whose caller, past PyTorch's and Keras's op wrappers,
is gradaccum's own code. Keras's own reads (its trainer's logs, a loss-scale
optimizer's `ops.cond`) are not gradaccum's and are not counted. Each test
also checks the training it counted against the plain optimizer on the large
batch, so that a path that reads nothing also computes the right thing.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import keras
import numpy as np
import pytest

import gradaccum
from gradaccum import accumulate
from gradaccum.callbacks import FlushPartialCycle
from tests.helpers import BACKEND, assert_states_close, fit, fit_pair, full_state, gradients, make_data, make_mlp

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch runs eagerly: JAX traces, TensorFlow has graphs")

READS = ("__bool__", "item", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu", "__array__")
PACKAGE = os.path.dirname(gradaccum.__file__) + os.sep


def _op_wrappers() -> tuple[str, ...]:
    import torch

    keras_src = os.path.join(os.path.dirname(keras.__file__), "src")
    return (
        os.path.dirname(torch.__file__) + os.sep,
        os.path.dirname(np.__file__) + os.sep,
        os.path.join(keras_src, "ops") + os.sep,
        os.path.join(keras_src, "backend") + os.sep,
    )


@contextlib.contextmanager
def counting_reads() -> Iterator[list[str]]:
    """Within the block, the list holds `file:line` of each read made by
    gradaccum's code."""
    import torch

    reads: list[str] = []
    wrappers = _op_wrappers()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str):
        original = originals[name]

        def method(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(wrappers):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
                reads.append(f"{name} at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
            return original(self, *args, **kwargs)

        return method

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_the_counter_sees_reads_in_gradaccum():
    """The counter counts what it should: a read in gradaccum's code."""
    opt = accumulate(keras.optimizers.SGD(0.1), 2)
    opt.build(make_mlp().trainable_variables)
    with counting_reads() as reads:
        int(opt.micro_step)  # a read in the test, not in gradaccum
        assert reads == []
        repr(opt)  # gradaccum's `repr` reads the micro-step
    assert reads


N, B, CYCLES = 3, 4, 3


def _counted_fit_pair(make_optimizer, wrap=None, **kwargs):
    with counting_reads() as reads:
        result = fit_pair(make_optimizer, n=N, micro_batch=B, cycles=CYCLES, wrap=wrap, **kwargs)
    return reads, result


@pytest.mark.parametrize("weigh_by", ["count", "batch"])
def test_fit_reads_nothing(weigh_by):
    reads, (ref, acc, _, _) = _counted_fit_pair(
        lambda: keras.optimizers.Adam(1e-2), wrap=lambda opt, n: accumulate(opt, n, weigh_by=weigh_by)
    )
    assert reads == []
    assert_states_close(ref, acc)


def test_fit_with_a_schedule_reads_nothing():
    """A schedule of `n` is called with the applied-update count as a Python
    int on PyTorch; returning a Python int, it reads nothing."""
    x, y = make_data(B * (2 + 2 + 4 + 4))
    schedule = lambda applied: 2 if applied < 2 else 4  # noqa: E731
    reference = make_mlp()
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    ref_model = reference
    ref_model.compile(optimizer=ref_opt, loss="mse")
    start = 0
    for n in (2, 2, 4, 4):
        ref_model.train_on_batch(x[start : start + B * n], y[start : start + B * n])
        start += B * n
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(0.1, momentum=0.9), schedule)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    with counting_reads() as reads:
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert reads == []
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))


def test_masked_token_loss_reads_nothing():
    """Each micro-batch weighs its count of valid tokens (on the device)."""

    def make_model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,), dtype="int32")
        h = keras.layers.Embedding(12, 4, mask_zero=True, name="emb")(inputs)
        outputs = keras.layers.Dense(3, name="out")(h)
        return keras.Model(inputs, outputs, name="tokens")

    rng = np.random.default_rng(0)
    x = rng.integers(0, 12, size=(B * N * CYCLES, 5)).astype("int32")
    x[rng.random(x.shape) < 0.4] = 0  # padding: different counts per micro-batch
    y = rng.integers(0, 3, size=(B * N * CYCLES, 5)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reads, (ref, acc, _, _) = _counted_fit_pair(
        lambda: keras.optimizers.Adam(1e-2), make_model=make_model, data=(x, y), loss=loss
    )
    assert reads == []
    assert_states_close(ref, acc)


@pytest.mark.parametrize("order", ["accumulate_lso", "lso_accumulate"])
def test_loss_scale_optimizer_reads_nothing_of_gradaccum(order):
    def wrap(opt, n):
        if order == "accumulate_lso":
            return accumulate(keras.optimizers.LossScaleOptimizer(opt), n)
        return keras.optimizers.LossScaleOptimizer(accumulate(opt, n))

    reads, (ref, acc, _, _) = _counted_fit_pair(lambda: keras.optimizers.Adam(1e-2), wrap=wrap)
    assert reads == []
    assert_states_close(
        {k: v for k, v in ref.items() if k.startswith("model/")},
        {k: v for k, v in acc.items() if k.startswith("model/")},
    )


def test_custom_loop_with_tensor_weights_and_flush_reads_nothing():
    """A custom loop passing each micro-batch's weight as a tensor, with a
    partial cycle flushed at the end, against the weighted large batch."""
    x, y = make_data(B * 5)
    weights = [1.0, 3.0, 2.0, 4.0, 2.0]  # cycles of 3, then 2 flushed
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(0.1, momentum=0.9), N)
    opt.build(model.trainable_variables)
    reference = make_mlp()
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    ref_opt.build(reference.trainable_variables)
    for cycle in ((0, 1, 2), (3, 4)):
        total = sum(weights[k] for k in cycle)
        sums = None
        for k in cycle:
            g = [np.asarray(keras.ops.convert_to_numpy(t)) * weights[k] for t in
                 gradients(reference, x[k * B : (k + 1) * B], y[k * B : (k + 1) * B])]
            sums = g if sums is None else [a + b for a, b in zip(sums, g)]
        ref_opt.apply([keras.ops.convert_to_tensor(t / total) for t in sums], reference.trainable_variables)
    with counting_reads() as reads:
        for k in range(5):
            grads = gradients(model, x[k * B : (k + 1) * B], y[k * B : (k + 1) * B])
            opt.apply(grads, model.trainable_variables, weight=keras.ops.convert_to_tensor(weights[k]))
        opt.flush()
    assert reads == []
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))


def test_resuming_from_a_keras_file_mid_cycle_reads_nothing(tmp_path):
    """The host's copy of the cycle's position is restored with the file."""
    x, y = make_data(B * N * CYCLES)
    reference = fit(make_mlp(), accumulate(keras.optimizers.Adam(1e-2), N), x, y, B)
    stop = 4  # one micro-batch into the second cycle
    model = fit(make_mlp(), accumulate(keras.optimizers.Adam(1e-2), N), x[: stop * B], y[: stop * B], B)
    path = str(tmp_path / "m.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    restored.optimizer.build(restored.trainable_variables)
    with counting_reads() as reads:
        restored.fit(x[stop * B :], y[stop * B :], batch_size=B, shuffle=False, verbose=0,
                     callbacks=[FlushPartialCycle()])
    assert reads == []
    assert_states_close(full_state(reference, reference.optimizer), full_state(restored, restored.optimizer))


def test_split_train_step_reads_nothing():
    """`micro_batch_size`: the micro-batch count comes from the batch's
    shape, and the cycle's position stays on the host."""
    with counting_reads() as reads:
        ref, acc, _, opt = fit_pair(
            lambda: keras.optimizers.Adam(1e-2), n=1, micro_batch=B * N, cycles=CYCLES,
            wrap=lambda o, n: accumulate(o, micro_batch_size=B - 1),
        )
    assert reads == []
    assert int(opt.iterations) == CYCLES
    assert_states_close(ref, acc)
