"""`micro_batch_size="auto"` on TensorFlow as users feed `fit`: a `tf.data`
pipeline whose batches have no static size (`drop_remainder=False`), and
XLA (`jit_compile=True`) with a `memory_limit` on a masked `Embedding` whose
last batch is ragged. Each equals plain `fit` on the same batches."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from gradaccum._auto_size import search_of
from gradaccum._backend.memory import out_of_memory_above
from tests.helpers import as_int, assert_states_close, full_state, internal_core, make_data, make_mlp
from tests.helpers.models import TOKENS_T as T
from tests.helpers.models import TOKENS_VOCAB as VOCAB
from tests.helpers.models import make_tokens_model

B = 8


def _runs(make_model, wrap, data, loss="mse", above=None, logs=True, optimizer=lambda: keras.optimizers.Adam(1e-2),
          **compile_kwargs):
    """Plain `fit(data)` and the same with `wrap(optimizer)`; `logs=False`
    where the micro-batches' losses divide by other counts than their
    samples (masked tokens), whose logged mean is not the batch's (as the
    guide says)."""
    runs = []
    for w in (lambda o: o, wrap):
        model, opt = make_model(), w(optimizer())
        model.compile(optimizer=opt, loss=loss, **compile_kwargs)
        if above is not None and w is wrap:
            with out_of_memory_above(above):
                model.fit(data, shuffle=False, verbose=0)
        else:
            model.fit(data, shuffle=False, verbose=0)
        runs.append((full_state(model, opt), model.history.history, opt))
    (reference, ref_history, _), (subject, history, opt) = runs
    assert_states_close(reference, subject)
    if logs:
        np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-6)
    return opt


@pytest.mark.parametrize("jit", (False, True), ids=("graph", "xla"))
def test_a_dataset_without_a_static_batch_size_equals_plain_fit(jit):
    x, y = make_data(3 * B + 5)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=False)
    opt = _runs(make_mlp, lambda o: accumulate(o, micro_batch_size="auto"), data, above=3, jit_compile=jit)
    assert opt.micro_batch_size == 2 and as_int(opt.iterations) == 4


def _tokens(samples):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, T + 1, size=samples)
    mask = np.arange(T)[None, :] < lengths[:, None]
    x = np.where(mask, rng.integers(1, VOCAB, size=mask.shape), 0).astype("int32")
    return x, rng.integers(0, 4, size=mask.shape).astype("int32")


@pytest.mark.parametrize(("limit", "chosen"), ((2**40, B), (None, B)))
def test_xla_with_a_memory_limit_on_masked_tokens_and_a_ragged_batch_equals_plain_fit(limit, chosen):
    x, y = _tokens(3 * B + 5)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    opt = _runs(make_tokens_model, lambda o: accumulate(o, micro_batch_size="auto", memory_limit=limit), data,
                loss=keras.losses.SparseCategoricalCrossentropy(), jit_compile=True)
    assert opt.micro_batch_size == chosen and as_int(opt.iterations) == 4
    assert search_of(internal_core(opt)).compilations == 2


def test_xla_with_a_memory_limit_that_runs_out_anyway_on_masked_tokens_equals_plain_fit():
    x, y = _tokens(3 * B + 5)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    opt = _runs(make_tokens_model, lambda o: accumulate(o, micro_batch_size="auto", memory_limit=2**40), data,
                loss=keras.losses.SparseCategoricalCrossentropy(), above=3, logs=False, jit_compile=True)
    assert opt.micro_batch_size == 2 and as_int(opt.iterations) == 4


def test_xla_with_a_fixed_size_larger_than_a_ragged_last_batch_equals_plain_fit():
    """The loop over full micro-batches runs none for the last batch of 5
    samples, but XLA compiles it for that batch's shape all the same. The
    batch's size is not known while the step is traced, so the Embedding's
    slices are added into rows (warned): SGD, whose update of summed rows
    is the large batch's."""
    x, y = _tokens(3 * B + 5)
    with pytest.warns(RuntimeWarning, match=r"'emb/embeddings'.*micro_batch_size"):
        opt = _runs(make_tokens_model, lambda o: accumulate(o, micro_batch_size=B),
                    tf.data.Dataset.from_tensor_slices((x, y)).batch(B),
                    loss=keras.losses.SparseCategoricalCrossentropy(), jit_compile=True,
                    optimizer=lambda: keras.optimizers.SGD(0.5, momentum=0.8))
    assert as_int(opt.iterations) == 4
