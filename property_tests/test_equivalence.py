"""Accumulated training equals large-batch training, across the drawn space.

Drawn: every Keras 3 optimizer with random valid hyperparameters, clipping,
weight decay, EMA and LR schedules; `n`; `reduction`; micro-batch size;
model shape (Dense, Conv2D, Embedding with sparse gradients, two inputs);
which heads (and so which variables) get `None` gradients on which
micro-steps; eager, `tf.function` and `tf.function(jit_compile=True)`.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given

from property_tests.harness import (
    assert_finite,
    assert_states_close,
    run_reference,
    run_subject,
    scaled,
)
from property_tests.strategies import cases


def _accumulators_empty(opt) -> bool:
    state = opt._self_state
    return int(state.micro_step) == 0 and all(
        not np.any(a.numpy()) for a in state.accumulators
    )


@scaled(40)
@given(case=cases())
def test_accumulated_equals_large_batch(case):
    """Weights, every optimizer variable and `iterations` match large batch.

    `run_subject` also checks every in-between micro-step bit-identical.
    With `reduction="sum"` the reference loss is the sum of the n micro-batch
    mean losses, i.e. n times the mean result's gradient. Micro-steps after
    the last full cycle (`case.extra`) must not show in the state at all.
    """
    reference, _, _ = run_reference(case)
    assert_finite(reference)
    subject, _, opt = run_subject(case)
    assert int(subject["iterations"]) == case.cycles
    if case.extra == 0:
        assert _accumulators_empty(opt)
    assert_states_close(reference, subject)

