"""`model.fit` with per-batch loss normalization equals the large batch.

Drawn: token masks (random sequence lengths, or arbitrary holes, all-masked
sequences included), `n`, the micro-batch size, a partial last cycle that
`FlushPartialCycle` applies (so ragged micro-batches too), token weights
with `reduction="mean_with_sample_weight"`, the optimizer, and (on
TensorFlow) `mode`. The subject fits `accumulate(opt, n)` on micro-batches;
the reference fits the plain optimizer on batches `n` times larger, from
the same weights.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gradaccum import accumulate
from gradaccum.callbacks import FlushPartialCycle
from property_tests.harness import scaled
from tests.helpers import BACKEND, MODES, assert_states_close, full_state

VOCAB, STEPS, CLASSES = 8, 6, 3


@dataclasses.dataclass(frozen=True)
class Case:
    masks: tuple[tuple[bool, ...], ...]
    n: int
    micro_batch: int
    weights: tuple[tuple[float, ...], ...] | None
    optimizer: str
    mode: str


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(2, 4))
    micro_batch = draw(st.integers(1, 4))
    cycles = draw(st.integers(1, 2))
    # A partial last cycle of 0..n*B-1 samples, flushed at the end of fit.
    samples = cycles * n * micro_batch + draw(st.integers(0, n * micro_batch - 1))
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(0, STEPS), min_size=samples, max_size=samples))
        masks = tuple(tuple(t < k for t in range(STEPS)) for k in lengths)
    else:
        row = st.tuples(*[st.booleans()] * STEPS)
        masks = tuple(draw(st.lists(row, min_size=samples, max_size=samples)))
    weights = None
    if draw(st.booleans()):
        entry = st.sampled_from([0.0, 0.5, 1.0, 2.0])
        weights = tuple(
            draw(st.lists(st.tuples(*[entry] * STEPS), min_size=samples, max_size=samples))
        )
    return Case(
        masks=masks,
        n=n,
        micro_batch=micro_batch,
        weights=weights,
        optimizer=draw(st.sampled_from(["sgd_momentum", "adam"])),
        # The mode changes what runs on TensorFlow only.
        mode=draw(st.sampled_from(MODES if BACKEND == "tensorflow" else ("masked",))),
    )


def _optimizer(name: str) -> keras.optimizers.Optimizer:
    if name == "adam":
        # epsilon well above the rounding of a gradient component that
        # cancels to almost nothing (~1e-7 here): with Keras's 1e-7, Adam's
        # g / (|g| + epsilon) turns that rounding, which differs between
        # any two orders of summing the same tokens, into differences of
        # ~5e-6 in the weights, between two plain runs too. Counts that
        # were wrong would still change its steps by far more.
        return keras.optimizers.Adam(1e-2, epsilon=0.1)
    return keras.optimizers.SGD(0.3, momentum=0.8)


def _model(train_embedding: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 3, mask_zero=True, trainable=train_embedding, name="emb")(inputs)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", name="out")(h)
    return keras.Model(inputs, outputs, name="tokens")


def _fit(case: Case, optimizer, batch_size: int, x, y, callbacks=()):
    # Embedding gradients repeat rows; Adam treats those as the large batch
    # does only when frozen (README, "Sparse gradients with repeated rows").
    model = _model(train_embedding=case.optimizer != "adam")
    reduction = "sum_over_batch_size" if case.weights is None else "mean_with_sample_weight"
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction))
    sample_weight = None if case.weights is None else np.asarray(case.weights, "float32")
    model.fit(x, y, batch_size=batch_size, sample_weight=sample_weight, shuffle=False,
              verbose=0, callbacks=list(callbacks))
    return model


@scaled(10)
@given(case=cases())
def test_masked_and_weighted_tokens_match_large_batch(case: Case) -> None:
    rng = np.random.default_rng(len(case.masks))
    mask = np.asarray(case.masks, bool)
    x = np.where(mask, rng.integers(1, VOCAB, size=mask.shape), 0).astype("int32")
    y = rng.integers(0, CLASSES, size=mask.shape).astype("int32")

    reference_opt = _optimizer(case.optimizer)
    reference = _fit(case, reference_opt, case.n * case.micro_batch, x, y)
    opt = accumulate(_optimizer(case.optimizer), case.n, mode=case.mode)
    subject = _fit(case, opt, case.micro_batch, x, y, [FlushPartialCycle(at="train_end")])

    assert int(opt.micro_step) == 0
    assert_states_close(full_state(reference, reference_opt), full_state(subject, opt))
