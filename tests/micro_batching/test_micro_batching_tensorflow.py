"""`accumulate(opt, micro_batch_size=m)` on TensorFlow: `fit(batch_size=B)`
equals plain `fit(batch_size=B)` in graph mode and under XLA, also for
`Embedding`s under Adam, whose `tf.IndexedSlices` gradients the large batch
takes slice by slice (token lookups side by side, position lookups summed:
the default `sparse="auto"` keeps them so within the step's micro-batches)."""

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from tests.distribution.test_communication_tensorflow import gradient_all_reduces as _gradient_all_reduces
from tests.helpers import MODES, assert_states_close, assert_states_equal, fit, full_state, make_data, make_mlp
from tests.helpers.distribute import mirrored, replica_states
from tests.sparse.test_sparse_exact_tensorflow import OPTIMIZERS, _data, _model

B, SIZE = 8, 3
gradient_all_reduces = _gradient_all_reduces  # a fixture


def _fit_pair(kind, samples, mode="masked", jit=False):
    x, y = _data(kind, samples=samples)
    reference = fit(_model(kind), OPTIMIZERS["adam"](), x, y, B, jit_compile=jit)
    model = _model(kind)
    opt = accumulate(OPTIMIZERS["adam"](), micro_batch_size=SIZE, mode=mode)
    fit(model, opt, x, y, B, jit_compile=jit)
    return full_state(reference, reference.optimizer), full_state(model, opt), opt


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["token", "both"])
def test_embeddings_under_adam_equal_plain_fit(kind, mode):
    # 3 batches and a ragged last one of 5: micro-batches of 3, 3, 2 (and 3, 2).
    reference, subject, opt = _fit_pair(kind, 3 * B + 5, mode)
    assert int(opt.iterations) == 4
    assert_states_close(reference, subject)


@pytest.mark.parametrize("kind", ["token", "both"])
def test_embeddings_under_adam_and_xla_equal_plain_fit(kind):
    # Batches of one size: the traced step knows it, and so how many slices
    # a cycle of its micro-batches holds.
    reference, subject, opt = _fit_pair(kind, 3 * B, jit=True)
    assert int(opt.iterations) == 3
    assert_states_close(reference, subject)


def test_xla_with_a_ragged_last_batch_says_which_variable_is_not_kept():
    """The traced step does not know the batch's size, so XLA cannot hold a
    cycle's token slices: they are added into rows, and a warning names the
    variable."""
    with pytest.warns(RuntimeWarning, match=r"'words/embeddings'.*micro_batch_size"):
        reference, subject, opt = _fit_pair("token", 3 * B + 5, jit=True)
    assert int(opt.iterations) == 4
    with pytest.raises(AssertionError):
        assert_states_close(reference, subject)


@pytest.mark.parametrize("jit", (False, True), ids=("graph", "xla"))
def test_dense_model_equals_plain_fit(jit):
    x, y = make_data(3 * B + 5)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, B, jit_compile=jit)
    model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=SIZE)
    fit(model, opt, x, y, B, jit_compile=jit)
    assert int(opt.iterations) == 4
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))


@pytest.mark.parametrize("mode", MODES)
def test_mirrored_strategy_equals_one_device_and_all_reduces_once_per_batch(mode, gradient_all_reduces):
    """Each replica computes its share of the batch in micro-batches (the
    micro-batch counts the samples of every replica, as `batch_size` does):
    the update equals plain fit on one device, the ragged last batch (3 and
    2 samples per replica, so 2 and 1 micro-batches) included, every replica
    holds the same values, and the gradients are all-reduced once per batch."""
    arm, per_replica = gradient_all_reduces
    strategy = mirrored()
    x, y = make_data(3 * B + 5)
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, ref_opt, x, y, B)
    with strategy.scope():
        model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=4, mode=mode)
    arm(model)
    fit(model, opt, x, y, B)
    assert int(opt.iterations.numpy()) == 4
    assert per_replica(strategy) == 4
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))
    first, second = replica_states(strategy, model, opt)
    assert_states_equal(first, second)


@pytest.mark.parametrize("samples", (4 * B, 3 * B + 4), ids=("whole", "ragged"))
@pytest.mark.parametrize("kind", ["token", "both"])
def test_embeddings_under_mirrored_strategy_equal_plain_fit(kind, samples):
    """Token and position lookups (their slices kept within each replica's
    micro-batches) under two replicas equal plain fit on one device, a
    ragged last batch (2 samples a replica) included."""
    strategy = mirrored()
    x, y = _data(kind, samples=samples)
    reference = fit(_model(kind), OPTIMIZERS["adam"](), x, y, B)
    with strategy.scope():
        model, opt = _model(kind), accumulate(OPTIMIZERS["adam"](), micro_batch_size=4)
    fit(model, opt, x, y, B)
    assert int(opt.iterations.numpy()) == 4
    assert_states_close(full_state(reference, reference.optimizer), full_state(model, opt))


@pytest.mark.parametrize(
    ("size", "wrap", "compile_kwargs", "match"),
    (
        (SIZE, lambda o: o, {}, r"micro_batch_size=3.*2 replicas.*multiple of 2"),
        (4, lambda o: o, {"run_eagerly": True}, r"micro_batch_size=4.*2 replicas.*run_eagerly.*n=k"),
        (4, keras.optimizers.LossScaleOptimizer, {}, r"micro_batch_size=4.*2 replicas.*LossScaleOptimizer.*n=k"),
        ("auto", lambda o: o, {"run_eagerly": True}, r"micro_batch_size='auto'.*2 replicas.*run_eagerly.*n=k"),
        ("auto", keras.optimizers.LossScaleOptimizer, {},
         r"micro_batch_size='auto'.*2 replicas.*LossScaleOptimizer.*n=k"),
    ),
    ids=("micro_batch_not_whole_shares", "eager", "loss_scale", "auto_eager", "auto_loss_scale"),
)
def test_mirrored_strategy_refuses_what_it_cannot_split(size, wrap, compile_kwargs, match):
    x, y = make_data(2 * B)
    with mirrored().scope():
        model, opt = make_mlp(), accumulate(wrap(keras.optimizers.Adam(1e-2)), micro_batch_size=size)
    before = model.get_weights()
    with pytest.raises(ValueError, match=match):
        fit(model, opt, x, y, B, **compile_kwargs)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_per_output_losses_log_the_batch_where_the_step_knows_its_size():
    """Keras weighs a batch's per-output losses by its static size: a
    `tf.data` batch of a size the trace knows (`drop_remainder=True`) makes
    each micro-batch's slice of a static size too, a ragged last one (2 of
    8) included, so the per-output losses log the batch's."""
    import tensorflow as tf

    from tests.micro_batching.test_micro_batching import _two_heads

    x, y = make_data(3 * B)
    labels = {"r": y, "c": (np.arange(len(x)) % 2).astype("int32")}
    runs = []
    for wrap in (lambda o: o, lambda o: accumulate(o, micro_batch_size=SIZE)):
        model, opt = _two_heads(), wrap(keras.optimizers.Adam(1e-2))
        model.compile(optimizer=opt, loss={"r": "mse", "c": "sparse_categorical_crossentropy"},
                      loss_weights={"r": 0.3, "c": 2.0})
        data = tf.data.Dataset.from_tensor_slices((x, labels)).batch(B, drop_remainder=True)
        history = model.fit(data, epochs=2, verbose=0).history
        runs.append((full_state(model, opt), history))
    (reference, ref_history), (subject, history) = runs
    assert_states_close(reference, subject)
    for name in ("loss", "r_loss", "c_loss"):
        np.testing.assert_allclose(history[name], ref_history[name], rtol=1e-6, err_msg=name)
