"""A variable's kept slices outside their buffers: as files hold them, moved
between layouts, and the warnings where they cannot be exact.

Files hold a cycle's slices as NumPy arrays (`KEYS`): the grown ones of
every replica side by side with each replica's count, the fixed ones summed
over replicas, and the cycle's micro-steps so far. Loaded where a step keeps
them in another layout (a partial cycle saved eagerly, or with
`sparse="slices"`), they are brought into it (`arrange`) where that is
exact, and refused where it is not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradaccum._backend.tensorflow.growth import FIXED, GROWS

KEYS = ("kept_values", "kept_indices", "kept_counts", "fixed_values", "fixed_indices", "kept_steps")

Slices = tuple[np.ndarray, np.ndarray]

SQUARES = (
    "Adam's, RMSprop's and Adagrad's second moment and `global_clipnorm`'s norm take the sum of "
    "the squares of a row's slices"
)


def arrange(data: dict[str, np.ndarray], kinds: set[str], replicas: int, steps: int, empty: Slices,
            name: str) -> tuple[list[Slices] | None, Slices | None]:
    """`data` (what `Kept.saved` returns) in the layout of `kinds`: the
    grown slices per replica, and the fixed ones (summed over replicas).

    Raises:
        ValueError: Where that cannot be done exactly: slices summed over
            several micro-steps to be kept apart, or kept slices whose
            micro-steps differ to be summed.
    """
    steps = int(data.get("kept_steps", steps))
    grown = split_grown(data, replicas)
    fixed = (data["fixed_values"], data["fixed_indices"]) if "fixed_values" in data else None
    if FIXED not in kinds and fixed is not None:
        if steps > 1:
            raise layout_error(name, "summed over its micro-steps", "kept apart")
        first = grown[0] if grown else empty
        rest = grown[1:] if grown else [empty] * (replicas - 1)
        grown = [(np.concatenate([fixed[0], first[0]]), np.concatenate([fixed[1], first[1]]))] + rest
        fixed = None
    if GROWS not in kinds and grown is not None and any(len(i) for _, i in grown):
        fixed = _sum_blocks(grown, fixed, steps, name)
        grown = None
    return grown, fixed


def split_grown(saved: dict[str, np.ndarray], replicas: int) -> list[Slices] | None:
    """Grown slices per replica: as saved where the replica count is the
    same, else all on the first replica."""
    if "kept_values" not in saved:
        return None
    values, indices = saved["kept_values"], saved["kept_indices"].astype(np.int64)
    counts = saved.get("kept_counts", np.array([len(indices)], np.int64))
    if len(counts) != replicas:
        counts = np.array([len(indices)] + [0] * (replicas - 1), np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return [(values[a:b], indices[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _sum_blocks(grown: list[Slices], fixed: Any, steps: int, name: str) -> Slices:
    """Grown slices whose micro-steps all have the same indices, summed."""
    total, indices = (None, None) if fixed is None else fixed
    for values, index in grown:
        if not len(index):
            continue
        if len(index) % steps:
            raise layout_error(name, "kept apart", "summed over its micro-steps")
        size = len(index) // steps
        blocks = index.reshape(steps, size)
        indices = blocks[0] if indices is None else indices
        if not all(np.array_equal(b, indices) for b in blocks):
            raise layout_error(name, "kept apart", "summed over its micro-steps")
        summed = values.reshape((steps, size) + values.shape[1:]).sum(axis=0)
        total = summed if total is None else total + summed
    return total, indices


def layout_error(name: str, held: str, wanted: str) -> ValueError:
    return ValueError(
        f"The current cycle's slices of variable {name!r} are {held} (restored from saved state, "
        f"or kept by another trace of the step), but this step keeps them {wanted}, and they cannot "
        "be brought into that form. Finish or `flush()` that cycle the way it was begun first."
    )


def row_sums_error(name: str) -> ValueError:
    return ValueError(
        f"Variable {name!r} received tf.IndexedSlices, kept as slices, while its accumulator "
        "holds a partial cycle's row sums (dense gradients earlier in the cycle, or a partial "
        "cycle restored from state saved with sparse=\"rows\"), which the update would leave out. "
        "Finish or `flush()` that cycle with sparse=\"rows\" first."
    )


def row_sums_warning(name: str) -> str:
    return (
        f"gradaccum: variable {name!r} holds a partial cycle's row sums (state saved with "
        "sparse=\"rows\"); they are kept as one slice per row, so this cycle's update for it sums "
        f"repeated rows of its earlier micro-steps as sparse=\"rows\" did: {SQUARES}."
    )


_XLA_REASONS = {
    "count": "the number of its slices per micro-step is not known while the step is traced",
    "schedule": "`n` is a schedule, so a cycle's slices have no known bound",
    "batch": "the train step is split into micro-batches (`micro_batch_size`) of a batch whose size "
             "is not known while the step is traced (a ragged last batch), so a cycle's slices have "
             "no known bound",
}


def xla_warning(name: str, reason: str) -> str:
    """Why variable `name`'s slices are added into rows under XLA: `reason`
    is `"count"`, `"schedule"` or `"batch"`."""
    why = _XLA_REASONS[reason]
    return (
        f"gradaccum: the tf.IndexedSlices of variable {name!r} cannot be kept under XLA "
        f"(`jit_compile=True`), which cannot grow a variable: {why}. They are added into its rows "
        f"instead, so this variable's updates can differ from the large batch's: {SQUARES}; a row's "
        "summed slices give the square of their sum instead, up to k times larger for a row with k "
        "similar slices in a cycle (and smaller where they cancel). Give the step static shapes (a "
        "batch size that divides the data, `drop_remainder=True`) or an int `n`, or compile without XLA."
    )


def unsure_warning(name: str, batch: int) -> str:
    """Variable `name`'s lookup by a constant spread over an input's first
    dimension alone, `batch` (the micro-batch size), read as the batch's
    where `batch > 1` and as a table's where it is 1."""
    if batch > 1:
        read, other = ("kept apart, one slice per id of every sample, as the batch's ids",
                       "a table's of its own whose length equals the micro-batch size, the large batch "
                       "sums them over the cycle, one slice per index")
        fix = ("use a micro-batch size other than that length, or look the table up with ids of another shape "
               "(one id of shape `(1,)`, broadcast after the lookup)")
    else:
        read, other = ("summed over the cycle, one slice per index, as for a table added to every sample",
                       "the batch's, the large batch keeps them apart")
        fix = "pass sparse=\"slices\" (every variable's slices kept apart) or use micro-batches of more than one sample"
    return (
        f"gradaccum: variable {name!r} is looked up with ids that are not computed from the batch but "
        f"spread one value over a shape whose first dimension is {batch}, the micro-batch size, and that "
        "matches no input beyond it: the step's graph cannot tell ids made from the batch's shape "
        "(`ops.zeros_like(ids[:, 0])`) from a table of its own. They are "
        f"{read}; if they are {other}: {SQUARES}. Then {fix}."
    )


def judged_warning(name: str, held: np.ndarray, new: np.ndarray) -> str:
    """Eagerly, equal index sets on two micro-steps read as positions: how
    much the sum of squares differs from reading them as tokens."""
    held, new = held.astype(np.float64), new.astype(np.float64)
    separate = float(np.sum(held**2) + np.sum(new**2))
    summed = float(np.sum((held + new) ** 2))
    change = abs(separate - summed) / max(summed, 1e-30)
    return (
        f"gradaccum: variable {name!r} received the same slice indices on two micro-steps of a "
        "cycle, run eagerly (no graph tells a lookup of the batch's ids from one that does not grow "
        "with the batch, such as positions): its slices are summed over the cycle, one slice per "
        "index, as for positions. If its ids are the batch's and merely coincide (all-zero segment "
        f"ids), the large batch keeps them apart: {SQUARES}, which here would differ by "
        f"{change:.1%} for these two micro-steps. Run the step in a `tf.function`, or pass "
        "sparse=\"slices\" to keep every slice."
    )


def changed_warning(name: str) -> str:
    return (
        f"gradaccum: variable {name!r} received the same slice indices on every micro-step "
        "so far, so its slices were summed as those of a lookup that does not grow with the "
        "batch; now they differ. This cycle's update for it is inexact (its earlier micro-steps "
        "count as one slice per index); later cycles keep every micro-step's slices."
    )
