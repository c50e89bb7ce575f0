"""`accumulate(opt, micro_batch_size="auto")` under a `tf.distribute`
strategy of two replicas (a MirroredStrategy on two logical CPUs): the size
counts the samples of a micro-batch over all replicas (as
`micro_batch_size=m` does), a multiple of the replicas, each computing an
equal share; a step that runs out of memory runs the same batch again
smaller with nothing lost. Every run equals plain `fit(batch_size=B)` on one
device: weights, every optimizer variable, `iterations` and the logs (plain
`fit` under the strategy takes the mean of each replica's mean, which a
ragged last batch of 3 and 2 samples a replica tells apart)."""

from __future__ import annotations

import contextlib
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from gradaccum._auto_size import search_of
from gradaccum._backend.memory import out_of_memory_above
from tests.helpers import (
    as_int,
    assert_states_close,
    assert_states_equal,
    fit,
    full_state,
    internal_core,
    make_data,
    make_mlp,
)
from tests.helpers.distribute import mirrored, replica_states

B = 8


def _one_device(x, y, **compile_kwargs):
    model, opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(model, opt, x, y, B, **compile_kwargs)
    return full_state(model, opt), model.history.history["loss"]


def _mirrored_auto(x, y, above=None, in_scope=False, **compile_kwargs):
    """Trains under two replicas; `in_scope` compiles and fits inside the
    strategy's scope, where the metrics' variables are replica-local."""
    strategy = mirrored()
    with strategy.scope():
        model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto")
    injected = contextlib.nullcontext() if above is None else out_of_memory_above(above)
    with injected, strategy.scope() if in_scope else contextlib.nullcontext():
        fit(model, opt, x, y, B, **compile_kwargs)
    first, second = replica_states(strategy, model, opt)
    assert_states_equal(first, second)
    return model, opt


@pytest.mark.parametrize(
    ("above", "chosen", "kwargs"),
    (
        (None, B, {}),
        (5, 4, {}),
        (3, 2, {}),
        (3, 2, {"steps_per_execution": 3}),
        (3, 2, {"in_scope": True}),
    ),
    ids=("fits", "above_5", "above_3", "steps_per_execution", "compiled_in_scope"),
)
def test_two_replicas_run_the_batch_again_smaller_and_equal_one_device(above, chosen, kwargs, caplog):
    """Micro-batches of more than `above` samples over both replicas (more
    than `above / 2` on a replica's device) run out of memory, after the
    step's first micro-batch wrote its metrics and accumulators. The batch
    of 8 (4 a replica) is probed whole, then runs again as 2 micro-batches
    of 4 (2 a replica), then 4 of 2 (1 a replica): never a size that leaves
    a replica a share of a sample. The ragged last batch of 5 (3 and 2 a
    replica) runs at the size chosen. The retry puts back every replica's
    copy of the metrics' replica-local variables where `fit` runs inside the
    strategy's scope."""
    x, y = make_data(3 * B + 5)
    reference, reference_loss = _one_device(x, y)
    with caplog.at_level(logging.INFO, logger="gradaccum"):
        model, opt = _mirrored_auto(x, y, above, **kwargs)
    chosen_logged = [r.getMessage() for r in caplog.records if "chose" in r.getMessage()]
    assert chosen_logged[0] == f'gradaccum: micro_batch_size="auto" chose {B} (probed from the batch).'
    assert len(chosen_logged) == {B: 1, 4: 2, 2: 3}[chosen]
    assert opt.micro_batch_size == chosen and search_of(internal_core(opt)).compilations == 0
    assert as_int(opt.iterations) == 4
    assert_states_close(reference, full_state(model, opt))
    np.testing.assert_allclose(model.history.history["loss"], reference_loss, rtol=1e-6)


def test_two_replicas_that_do_not_fit_one_sample_each_say_so():
    """The smallest size is one sample a replica: 2 over both."""
    x, y = make_data(2 * B)
    strategy = mirrored()
    with strategy.scope():
        model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto")
    before = model.get_weights()
    with out_of_memory_above(1), pytest.raises(MemoryError, match=r"even at micro-batches of 2 samples \(1 a replica"):
        fit(model, opt, x, y, B)
    assert as_int(opt.iterations) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_xla_under_two_replicas_fails_in_keras_itself_and_is_not_measured():
    """Keras compiles the whole `strategy.run` of two CPU replicas as one XLA
    cluster, which cannot reach the second replica's variables: plain `fit`
    fails. With "auto" the same error comes from the same place (the size is
    probed, not predicted from a per-replica trace the strategy does not
    run)."""
    x, y = make_data(2 * B)
    with mirrored().scope():
        plain, plain_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Trying to access resource"):
        fit(plain, plain_opt, x, y, B, jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Trying to access resource"):
        _mirrored_auto(x, y, jit_compile=True)


def test_a_size_chosen_on_one_device_that_replicas_cannot_share_is_chosen_again():
    """A config keeps the size chosen: 3 on one device (6 samples do not fit
    whole). Two replicas cannot share micro-batches of 3: the optimizer made
    from the config under the strategy probes again (6, which fits there)."""
    batch = 6
    x, y = make_data(3 * batch)
    model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto")
    with out_of_memory_above(3):
        fit(model, opt, x, y, batch)
    assert opt.micro_batch_size == 3
    reference = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(*reference, x, y, batch)
    strategy = mirrored()
    with strategy.scope():
        model = make_mlp()
        opt = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert opt.micro_batch_size == 3
    fit(model, opt, x, y, batch)
    assert opt.micro_batch_size == batch
    assert_states_close(full_state(*reference), full_state(model, opt))
