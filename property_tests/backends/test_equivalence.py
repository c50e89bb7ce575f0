"""Accumulated training equals large-batch training on the active backend.

The property of `property_tests/test_equivalence.py`, drawn the same way
(every Keras 3 optimizer with random hyperparameters, clipping, weight
decay, EMA and schedules; `n`, `reduction`, both modes, ragged weighted
micro-batches, heads left out of the loss), run eagerly with gradients taken
the backend's way. A float32 loss-scale optimizer joins in on PyTorch; on
JAX Keras's own loss-scale optimizer cannot run eagerly (its `apply` is a
stateful `ops.cond`), so there it is covered through `fit` and
`stateless_apply` (`tests/backends/test_mixed_precision.py`).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given

from property_tests.harness import (
    BACKEND,
    STEP_COUNTER,
    accumulating,
    assert_finite,
    assert_matches_large_batch,
    run_reference,
    run_subject,
    scaled,
)
from property_tests.strategies import cases

LOSS_SCALES = (None,) if BACKEND == "jax" else (None, None, None, "accumulate_lso", "lso_accumulate")


@scaled(25)
@given(case=cases(modes=("eager",), weighted=True, loss_scales=LOSS_SCALES))
def test_accumulated_equals_large_batch(case):
    """Weights, every optimizer variable and `iterations` match the large
    batch; `run_subject` checks every in-between micro-step bit-identical."""
    reference, _, _ = run_reference(case)
    assert_finite(reference)
    subject, _, opt = run_subject(case)
    assert int(subject["iterations"]) == case.cycles
    if case.extra == 0:
        state = accumulating(opt).accumulation_state
        assert int(np.asarray(state.micro_step)) == 0
    if case.loss_scale:
        assert int(reference.pop(STEP_COUNTER)) == case.cycles
        assert int(subject.pop(STEP_COUNTER)) == case.micro_steps
    assert_matches_large_batch(case, reference, subject)
