"""Accumulated training on TensorFlow, across the drawn space: eagerly bit
for bit the plain optimizer on the summed micro-gradients, traced steps that
meet a variable late, and `tf.train.Checkpoint` at any micro-step.

The large-batch equivalence itself, drawn on every backend (TensorFlow's
executions included), is `property_tests/equivalence/test_equivalence.py`.
"""

from __future__ import annotations

import tensorflow as tf
from hypothesis import assume, example, given
from hypothesis import strategies as st

from property_tests.harness import (
    HEADS,
    STEP_COUNTER,
    Case,
    ModelSpec,
    OptimizerSpec,
    assert_matches_large_batch,
    run_reference,
    run_subject,
    run_summed,
    scaled,
)
from property_tests.strategies import cases
from tests.helpers import assert_finite, assert_states_equal


@scaled(10)
@given(case=cases(modes=("eager",), weighted=True))
def test_eager_accumulation_is_the_summed_micro_gradients_bit_for_bit(case):
    """Eagerly, the update is exactly the plain optimizer's on the float32
    (weighted) sum of the micro-batch gradients, divided as documented.

    The reference (`run_summed`) computes and sums the micro-batch gradients
    itself, without gradaccum. Repeated embedding rows are left out: summing
    an `IndexedSlices` gradient's rows adds them in another order. The
    subject adds `tf.IndexedSlices` into rows (`sparse="rows"`): kept as
    slices (the default), they reach the optimizer as slices, as in the
    large batch, not as the sum this reference takes, and some optimizers
    (Adafactor) round those otherwise (`tests/sparse/test_sparse_exact_tensorflow.py` holds
    them to the large batch).
    """
    assume(case.unique_ids or case.model.kind != "embedding")
    summed, _, _ = run_summed(case)
    assert_finite(summed)
    subject, _, _ = run_subject(case, sparse="rows")
    if case.loss_scale:
        summed.pop(STEP_COUNTER), subject.pop(STEP_COUNTER)
    assert_states_equal(summed, subject, "against the summed micro-gradients")


@scaled(8)
@given(case=cases(modes=("tf_function",), heads_vary_when_traced=True))
# Found by this property: the step for heads (0,) is traced on micro-step 0,
# before `head1` ever had a gradient; `head1` gets one on micro-step 2, and
# micro-step 3 (an apply step) ran the old trace, which neither applied nor
# cleared `head1`'s accumulator. That now raises instead.
@example(
    case=Case(
        model=ModelSpec(kind="dense", width=3, depth=1),
        optimizer=OptimizerSpec("SGD", (("learning_rate", 0.1),)),
        n=2,
        reduction="mean",
        micro_batch=1,
        cycles=2,
        extra=0,
        heads=((0,), (0, 1), (0, 1), (0,)),
        mode="tf_function",
        data_seed=0,
    )
)
def test_traced_loop_whose_none_pattern_changes_is_exact_or_refused(case):
    """A `tf.function` step retraced per set of heads (e.g. per task).

    Which variables take part in an update is decided when a step is traced.
    A trace made before some variable first received a gradient cannot
    apply that variable's accumulated sum; it must then refuse (raise), never
    train silently wrong. Any run that completes equals large batch.

    Drawn so that a head, once in the loss, is in it at least once in every
    later cycle: this property is about stale traces; a variable without a
    gradient in a whole cycle is drawn eagerly by the other properties, and
    traced in tests/training/test_semantics_tensorflow.py.
    """
    assume(_every_seen_head_in_every_later_cycle(case))
    reference, _, _ = run_reference(case)
    assert_finite(reference)
    try:
        subject, _, _ = run_subject(case)
    except tf.errors.InvalidArgumentError as error:
        assert "traced before variables" in error.message
        assert _has_stale_trace(case), "refused a run a stale trace cannot spoil"
        return
    assert_matches_large_batch(case, reference, subject)


def _every_seen_head_in_every_later_cycle(case) -> bool:
    seen: set[int] = set()
    for c in range(case.cycles):
        cycle = set().union(*case.heads[c * case.n : (c + 1) * case.n])
        if not seen <= cycle:
            return False
        seen |= cycle
    return True


def _has_stale_trace(case) -> bool:
    """Whether an apply step runs a trace that misses an accumulating variable.

    Mirrors the library's rule: a trace includes the variables seen (any
    gradient so far) when it was made; an apply step refuses if a variable
    left out of its trace holds an accumulated gradient.
    """
    heads_of = {h: {f"head{h}"} for h in range(HEADS)}
    seen: set[str] = set()
    traced: dict[tuple[int, ...], set[str]] = {}
    pending: set[str] = set()
    for i, heads in enumerate(case.heads):
        current = set().union(*(heads_of[h] for h in heads))
        seen |= current
        if heads not in traced:
            traced[heads] = set(seen)
        pending |= current
        if (i + 1) % case.n == 0:
            if pending - traced[heads]:
                return True
            pending = set()
    return False


@scaled(10)
@given(case=cases(max_cycles=2, weighted=True), data=st.data())
def test_checkpoint_restore_at_a_drawn_micro_step_changes_nothing(case, data):
    """Save after k micro-steps, restore into new objects, go on: same bits.

    The restored run continues in a second model and a freshly made
    optimizer (built before the restore, or after it), with a newly traced
    step; its final state must equal the uninterrupted run's exactly.
    """
    # Keras's own ScheduleFreeAdamW loses restored momenta when it is built
    # after the restore (tests/saving/test_saving_tensorflow.py pins that on the plain optimizer
    # and checks that the accumulating one does the same); left out here.
    assume(not (case.optimizer.family == "ScheduleFreeAdamW" and not case.build_first))
    stop = data.draw(st.integers(1, case.micro_steps), label="stop")
    uninterrupted, _, _ = run_subject(case)
    resumed, _, opt = run_subject(case, resume_at=stop if stop < case.micro_steps else None)
    assert_states_equal(uninterrupted, resumed, f"resumed after {stop} micro-steps")
