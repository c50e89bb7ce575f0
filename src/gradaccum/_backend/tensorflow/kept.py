"""A variable's kept slices: its cycle's `tf.IndexedSlices` as the large
batch would hand them to the optimizer (`sparse="auto"` and `"slices"`).

Each micro-step's slices are split by whether they grow with the batch
(`growth`): grown slices are appended to the cycle's, fixed slices summed
into them (`buffers`). The update hands the optimizer one `tf.IndexedSlices`
of both (`Kept.read`), divided by the mean's divisor:

- Under several replicas, each replica keeps its own slices. The wrapped
  optimizer's all-reduce concatenates the replicas' slices, which is what
  one device holds for grown slices. Fixed slices are summed over replicas
  first and handed over by the first replica alone, so the optimizer sees
  one slice per index, as one device training on the large batch does.
- Eagerly no graph tells the kinds apart: a cycle's first micro-step keeps
  its slices as fixed ones, and the second decides from the index sets (the
  same: fixed, with a warning, since per-sample lookups whose ids happen to
  coincide read the same; else grown). The decision is kept.
- Where the slices cannot be kept exactly (XLA, which cannot grow a
  variable, with a slice count the trace does not know, or a schedule of
  `n`), the variable's slices are added into its rows instead, with a
  warning that names it.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from gradaccum._backend.tensorflow import distribution, growth, layouts, tensors
from gradaccum._backend.tensorflow.buffers import Buffer, saved_here
from gradaccum._backend.tensorflow.growth import FIXED, GROWS

_split = threading.local()


@contextlib.contextmanager
def split_into(count: int | None) -> Iterator[None]:
    """Within the block, a train step split into at most `count`
    micro-batches is traced (None: as many as its batch, of a size the
    trace does not know, holds): one cycle, whose grown slices a buffer
    must hold under XLA (`Kept.reserve`)."""
    _split.count, _split.active = count, True
    try:
        yield
    finally:
        _split.count, _split.active = None, False


def _split_length() -> int:
    """A split train step's micro-batches are one cycle (of `n` = 1)."""
    return getattr(_split, "count", None) or 1


def _endless(n: Any) -> str | None:
    """Why a cycle's grown slices have no bound known now (`n`: the variable
    holding an int `n`, or None), or None."""
    if n is None:
        return "schedule"
    # A split train step of a batch of unknown size is traced now.
    return "batch" if getattr(_split, "active", False) and _split.count is None else None


def _uncounted(counted: bool, n: Any) -> str | None:
    """Why slices are not kept under XLA (a split step's batch of unknown size before uncounted slices)."""
    return _endless(n) if counted or _endless(n) == "batch" else "count"


def _name(variable: Any) -> str:
    return getattr(variable, "path", None) or getattr(variable, "name", repr(variable))


class Kept:
    """One variable's kept slices (see the module docstring).

    Args:
        variable: The variable.
        accumulator: Its accumulator (for slices added into rows instead).
        family: The wrapped optimizer's family.
        n: The variable holding an int `n`, or None for a schedule.
        keep_all: Whether every slice grows (`sparse="slices"`).
        steps: Reads the current cycle's micro-steps so far (eagerly).
    """

    def __init__(self, variable: Any, accumulator: Any, family: Any, n: Any, keep_all: bool,
                 steps: Callable[[], int]):
        self.name = _name(variable)
        self._shape = [int(d) for d in variable.shape]
        self._dtype = tensors.accumulator_dtype(variable)
        self._accumulator = accumulator
        self._family, self._variable = family, variable
        self._n, self._keep_all, self._steps = n, keep_all, steps
        self.parts: dict[str, Buffer] = {}
        # Rows per micro-step of a grown part, where a trace knew it.
        self._step_rows: int | None = None
        # Added into rows instead (see the module docstring).
        self.rows_only = False
        # Eagerly: the kind decided from the index sets, once decided.
        self._eager_kind: str | None = None
        # Slices loaded before the parts they belong to existed.
        self._pending: dict[str, np.ndarray] | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------
    # A micro-step.

    def add(self, grad: tf.IndexedSlices, weight: Any, first: Any) -> None:
        """Keeps a micro-step's slices, weighted by `weight`."""
        parts = growth.split(grad, keep_all=self._keep_all)
        if parts is None:
            with self._lock:  # eagerly, a strategy's replicas are threads
                self._add_eagerly(grad, weight, first)
            return
        if any(part.unsure for part in parts):
            self._warn("unsure", layouts.unsure_warning(self.name, max(part.unsure for part in parts)))
        xla = tensors.compiled_by_xla()
        with tf.init_scope():
            self._prepare(parts, xla)
        if self.rows_only:
            tensors.scatter_into(self._accumulator, grad, weight, first)
            return
        for part in parts:
            self.parts[part.kind].write(self._weighted(part.values, weight), part.indices, first, self._n_now())
        for kind, buffer in self.parts.items():
            if kind not in {p.kind for p in parts}:
                buffer.forget_if(first)

    def _weighted(self, values: Any, weight: Any) -> tf.Tensor:
        values = tf.cast(values, self._dtype)
        return values if weight is None else values * tf.cast(weight, self._dtype)

    def _n_now(self) -> Any:
        return None if self._n is None else self._n.value()

    def _prepare(self, parts: list[growth.Part], xla: bool) -> None:
        """Creates what a traced micro-step's parts need (eagerly), or
        decides that they cannot be kept, and brings slices held in another
        layout into this one."""
        if self.rows_only:
            return
        for part in parts:
            if part.kind == GROWS and part.count is not None:
                self._step_rows = max(self._step_rows or 0, part.count)
            if xla and part.kind not in self.parts and (part.count is None or part.kind == GROWS and _endless(self._n)):
                self._fall_back(part)
                return
        if not self.parts:
            self._take_row_sums({p.kind for p in parts})
        for part in parts:
            if part.kind not in self.parts:
                self._create(part.kind, part.count or 0)
            elif part.kind == GROWS and part.count is not None:
                self.reserve()
        self._bring_into({p.kind for p in parts})

    def _create(self, kind: str, count: int) -> None:
        rows = count if kind == FIXED else count * self._cycle_length()
        with distribution.creation_scope(self._family.strategy()):
            self.parts[kind] = Buffer(kind, self._shape[1:], self._dtype, rows,
                                      self._family.model_variable(self._variable), self.name)

    def _cycle_length(self) -> int:
        return max(1 if self._n is None else int(self._n.numpy()), _split_length())

    def reserve(self) -> None:
        """Makes a grown part hold a whole cycle (eagerly), for the current
        `n`: XLA cannot grow it while a step runs."""
        grown = self.parts.get(GROWS)
        if grown is not None and self._step_rows:
            grown.reserve(self._step_rows * self._cycle_length())

    def _fall_back(self, part: growth.Part) -> None:
        self.rows_only = True
        self._pending_into_rows()
        self._warn("rows", layouts.xla_warning(self.name, _uncounted(part.count is not None, self._n)))

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------
    # Eagerly: the kinds from the index sets.

    def _add_eagerly(self, grad: tf.IndexedSlices, weight: Any, first: Any) -> None:
        values, indices = self._weighted(grad.values, weight), tf.cast(grad.indices, tf.int64)
        count = int(tf.shape(indices)[0])
        if bool(first):
            kind = self._eager_kind or FIXED
            if kind not in self.parts:
                self._create(kind, count)
            self._pending = None
            self.parts[kind].write(values, indices, True, self._n_now())
            for other, buffer in self.parts.items():
                if other != kind:
                    buffer.forget_if(tf.constant(True))
            return
        if self._pending is not None or not self.parts:
            # Resumed mid-cycle: the kinds are those of what was held.
            held = self._pending or {}
            kind = GROWS if "kept_values" in held else (self._eager_kind or FIXED)
            if not self.parts:
                self._take_row_sums({kind})
                kind = GROWS if self._pending and "kept_values" in self._pending else kind
            if kind not in self.parts:
                self._create(kind, count)
            self._bring_into({kind})
        grown, fixed = self.parts.get(GROWS), self.parts.get(FIXED)
        here = distribution.replica_id()
        if fixed is None or not len(fixed.held()[here][1]):
            if grown is None:
                self._create(GROWS, count)
                grown = self.parts[GROWS]
            grown.write(values, indices, False, self._n_now())
            return
        held_values, held_indices = fixed.held()[here]
        if self._eager_kind != GROWS and np.array_equal(held_indices, indices.numpy()):
            if self._eager_kind is None:
                self._eager_kind = FIXED
                self._warn("judged", layouts.judged_warning(self.name, held_values, values.numpy()))
            fixed.write(values, indices, False, None)
            return
        if self._eager_kind == FIXED:
            self._warn("changed", layouts.changed_warning(self.name))
        self._eager_kind = GROWS
        if grown is None:
            self._create(GROWS, count)
            grown = self.parts[GROWS]
        grown.write(tf.constant(held_values), tf.constant(held_indices), True, self._n_now())
        fixed.forget_if(tf.constant(True))  # this replica's own: each replica moves its own
        grown.write(values, indices, False, self._n_now())

    # ------------------------------------------------------------------
    # The update.

    def read(self, divisor: Any, local: bool = False) -> tf.IndexedSlices | None:
        """The cycle's slices for the optimizer, divided by `divisor` (None:
        undivided); None where they were added into rows. `local`: this
        replica's own, as its accumulator would hold them (no all-reduce)."""
        if self.rows_only:
            return None
        values, indices = [], []
        replicas = 1 if local else distribution.replicas_in_sync()
        for kind in (FIXED, GROWS):
            if kind not in self.parts:
                continue
            v, i = self.parts[kind].read()
            if divisor is not None:
                v = v / tf.cast(divisor, v.dtype)
            if kind == FIXED and replicas > 1:
                v = distribution.sum_over_replicas(v)
                if distribution.replica_id() != 0:
                    v, i = v[:0], i[:0]
            values.append(v)
            indices.append(i)
        return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), tf.constant(self._shape, tf.int64))

    def counters(self) -> list[Any]:
        """The variables a cycle's first micro-step that gives this variable no gradient zeroes:
        its parts' row counts (its accumulator, where its slices are added into rows)."""
        if self.rows_only:
            return [self._accumulator]
        return [buffer.filled for buffer in self.parts.values()]

    # ------------------------------------------------------------------
    # Eagerly: views, files, checkpoints.

    def view(self) -> tuple[tf.Tensor, tf.Tensor]:
        """The current cycle's slices, undivided, on every replica together."""
        saved, row, dtype = self.saved(), self._shape[1:], self._dtype.as_numpy_dtype
        values = [saved.get(k, np.zeros([0] + row, dtype)) for k in ("fixed_values", "kept_values")]
        indices = [saved.get(k, np.zeros([0], np.int64)) for k in ("fixed_indices", "kept_indices")]
        return tf.constant(np.concatenate(values)), tf.constant(np.concatenate(indices))

    def saved(self) -> dict[str, np.ndarray]:
        """What files hold of the current cycle's slices (held now, or loaded
        and waiting for a step): the grown ones of every replica side by
        side with each replica's count, the fixed ones summed over
        replicas, and the cycle's micro-steps so far (`steps`). Empty
        between cycles."""
        if self._pending is not None:
            return dict(self._pending)
        steps = self._steps()
        out: dict[str, np.ndarray] = {}
        if steps == 0:
            return out
        grown, fixed = self.parts.get(GROWS), self.parts.get(FIXED)
        if grown is not None:
            held = grown.held()
            if any(len(i) for _, i in held):
                out["kept_values"] = np.concatenate([v for v, _ in held])
                out["kept_indices"] = np.concatenate([i for _, i in held])
                out["kept_counts"] = np.array([len(i) for _, i in held], np.int64)
        if fixed is not None:
            held = fixed.held()
            if len(held[0][1]):
                out["fixed_values"] = np.sum([v for v, _ in held], axis=0)
                out["fixed_indices"] = held[0][1]
        if out:
            out["kept_steps"] = np.asarray(steps, np.int64)
        return out

    def load(self, saved: dict[str, np.ndarray]) -> None:
        """Holds what `saved` returned (eagerly): at once where its parts exist, else once a step made them."""
        self._pending = {k: np.asarray(v) for k, v in saved.items()}
        if self.rows_only:
            self._pending_into_rows()
        elif self.parts:
            self._bring_into(set(self.parts))

    def _pending_into_rows(self) -> None:
        """Adds loaded slices into the accumulator (slices now added into
        rows)."""
        pending, self._pending = self._pending, None
        if not pending:
            return
        rows = np.zeros(self._shape, self._dtype.as_numpy_dtype)
        for values, indices in (("kept_values", "kept_indices"), ("fixed_values", "fixed_indices")):
            if values in pending:
                np.add.at(rows, pending[indices].astype(np.int64), pending[values])
        for copy in distribution.copies(self._accumulator):
            copy.assign_add(rows / len(distribution.copies(self._accumulator)))

    def _take_row_sums(self, kinds: set[str]) -> None:
        """A partial cycle's row sums in the accumulator (dense gradients, or
        state saved with sparse="rows") when slices are first kept: as one
        grown slice per row, with a warning, where the slices grow; else
        refused (eagerly).

        Raises:
            ValueError: With sparse="slices", or for fixed slices.
        """
        if self._pending is not None or self._steps() == 0:
            return
        copies = distribution.copies(self._accumulator)
        rows = np.sum([c.numpy() for c in copies], axis=0)
        held = np.flatnonzero(np.any(rows.reshape(len(rows), -1) != 0, axis=1))
        if not len(held):
            return
        if self._keep_all or FIXED in kinds:
            raise layouts.row_sums_error(self.name)
        self._warn("row sums", layouts.row_sums_warning(self.name))
        self._pending = {"kept_values": rows[held], "kept_indices": held.astype(np.int64), "kept_steps": np.asarray(1)}
        for c in copies:
            c.assign(np.zeros_like(rows))

    def _bring_into(self, kinds: set[str]) -> None:
        """Puts loaded slices, or slices held in parts these `kinds` do not
        have (another trace, eager steps), into the parts of `kinds`.

        Raises:
            ValueError: Where that cannot be done exactly.
        """
        if self._pending is not None:
            data, self._pending = self._pending, None
        else:
            stray = [k for k, b in self.parts.items() if k not in kinds and any(len(i) for _, i in b.held())]
            if not stray or self._steps() == 0:
                return
            data = self.saved()
        replicas = len(distribution.copies(self._accumulator))
        empty = (np.zeros([0] + self._shape[1:], self._dtype.as_numpy_dtype), np.zeros([0], np.int64))
        grown, fixed = layouts.arrange(data, kinds, replicas, max(self._steps(), 1), empty, self.name)
        for kind, buffer in self.parts.items():
            if kind == GROWS and kind in kinds:
                buffer.hold(grown or [empty] * replicas)
            elif kind == FIXED and kind in kinds and fixed is not None:
                zeros = np.zeros_like(fixed[0])
                buffer.hold([(fixed[0] if r == 0 else zeros, fixed[1]) for r in range(replicas)])
            else:
                buffer.forget_if(tf.constant(True))


def saved_for_restore(kept: Kept) -> Callable[[], None]:
    """A variable's kept slices now (eagerly), and how to put them back
    where the step that ends its cycle raises (`gradaccum._atomic`).

    In a replica context of several replicas, this replica's own slices
    (`buffers.saved_here`): every replica's, read while another replica may
    have added this step's slices already, would make the result depend on
    which replica puts its values back last. Elsewhere, or while slices
    loaded from a file wait for a step (which puts them into every
    replica's buffers), all of them (`Kept.saved`).

    Args:
        kept: The variable's kept slices.

    Returns:
        A function that writes the saved slices back.
    """
    if kept._pending is None and distribution.replicas_in_sync() > 1:
        return saved_here(kept.parts)
    saved = kept.saved()
    return lambda: kept.load(saved)
