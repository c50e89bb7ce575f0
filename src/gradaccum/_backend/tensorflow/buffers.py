"""Buffers of a variable's kept slices, one kind each (`growth.GROWS` or
`growth.FIXED`), replica-local.

A buffer holds rows of values and their int64 indices, and `filled`, the
number of rows that hold the current cycle's slices. Nothing clears it
between cycles: a cycle's first micro-step writes from row 0 (grown) or
writes over it (fixed), as the accumulators are written over.

- Grown slices are appended: a micro-step scatters its rows after the
  `filled` ones. The buffer is allocated for a whole cycle when the count
  of a micro-step's slices is known while the step is traced (`n` times
  it, the rows the large batch's own gradient holds); without XLA it grows
  when a micro-step would pass its end. XLA cannot change a variable's
  shape: there the buffer keeps its size, the rows past `filled` are read
  as zeros (which no Keras 3 optimizer tells from absent slices), and a
  cycle that would pass its end reads as NaN, so that it cannot pass
  unnoticed.
- Fixed slices are summed: every micro-step of a cycle has the same
  indices, and adds its values into the buffer's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from gradaccum._backend.tensorflow import distribution
from gradaccum._backend.tensorflow.growth import FIXED, GROWS
from gradaccum._backend.tensorflow.tensors import compiled_by_xla, nothing, select


class Buffer:
    """One kind of slices of one variable, replica-local (see the module
    docstring). Create inside `distribution.creation_scope`.

    Args:
        kind: `GROWS` or `FIXED`.
        row: The shape of one row (the variable's shape without its first
            dimension).
        dtype: The values' dtype.
        rows: The rows to allocate.
        colocate_with: The variable the buffers are placed with.
        name: The variable's name, for messages.
    """

    def __init__(self, kind: str, row: Sequence[int], dtype: tf.DType, rows: int, colocate_with: Any, name: str):
        self.kind, self.row, self.name = kind, list(row), name
        shape = tf.TensorShape([None] + self.row)
        self.values = distribution.replica_local(
            tf.zeros([rows] + self.row, dtype), name=f"kept_{kind}_values", colocate_with=colocate_with, shape=shape
        )
        self.indices = distribution.replica_local(
            tf.zeros([rows], tf.int64), name=f"kept_{kind}_indices", colocate_with=colocate_with,
            shape=tf.TensorShape([None]),
        )
        self.filled = distribution.replica_local(
            tf.constant(0, tf.int64), name=f"kept_{kind}_filled", colocate_with=colocate_with
        )

    # ------------------------------------------------------------------
    # A micro-step (replica context, traced or eager).

    def write(self, values: tf.Tensor, indices: tf.Tensor, first: Any, n: Any) -> None:
        """Adds a micro-step's (weighted) slices: appended (grown) or summed
        (fixed); on a cycle's first micro-step they start the buffer.

        `n`: the cycle's length (a scalar tensor), or None where unknown
        (a schedule), for the size a grown buffer grows to.
        """
        if self.kind == GROWS:
            self._append(values, indices, first, n)
        else:
            self._sum(values, indices, first)

    def _append(self, values: tf.Tensor, indices: tf.Tensor, first: Any, n: Any) -> None:
        rows, index, filled = (distribution.local_copy(v) for v in (self.values, self.indices, self.filled))
        count = tf.shape(indices, out_type=tf.int64)[0]
        offset = select(first, tf.zeros_like(filled.value()), filled.value())
        end = offset + count
        if not compiled_by_xla():
            size = tf.shape(rows.value(), out_type=tf.int64)[0]

            def grow() -> None:
                target = end if n is None else tf.maximum(end, count * tf.cast(n, tf.int64))
                extra = target - size
                shape = tf.concat([[extra], tf.constant(self.row, tf.int64)], 0)
                rows.assign(tf.concat([rows.value(), tf.zeros(shape, rows.dtype)], 0),
                            read_value=False)
                index.assign(tf.concat([index.value(), tf.zeros([extra], tf.int64)], 0), read_value=False)

            if tf.executing_eagerly():
                if bool(end > size):
                    grow()
            else:
                tf.cond(end > size, grow, nothing)
        positions = offset + tf.range(count, dtype=tf.int64)
        rows.scatter_update(tf.IndexedSlices(tf.cast(values, rows.dtype), positions))
        index.scatter_update(tf.IndexedSlices(indices, positions))
        filled.assign(end, read_value=False)

    def _sum(self, values: tf.Tensor, indices: tf.Tensor, first: Any) -> None:
        rows, index, filled = (distribution.local_copy(v) for v in (self.values, self.indices, self.filled))
        values = tf.cast(values, rows.dtype)
        count = tf.shape(indices, out_type=tf.int64)[0]

        def start() -> None:
            rows.assign(values, read_value=False)
            index.assign(indices, read_value=False)
            filled.assign(count, read_value=False)

        if compiled_by_xla():
            # Static shapes: the buffer has this step's shape.
            rows.assign(select(first, values, rows.value() + values), read_value=False)
            index.assign(indices, read_value=False)
            filled.assign(count, read_value=False)
            return
        if tf.executing_eagerly():
            if bool(first):
                start()
            else:
                rows.assign_add(values, read_value=False)
            return

        def add() -> None:
            held = index.value()
            same = tf.cond(
                tf.equal(tf.size(held, out_type=tf.int64), count),
                lambda: tf.reduce_all(tf.equal(held, indices)),
                lambda: tf.constant(False),
            )
            check = tf.debugging.Assert(same, [
                f"gradaccum: the slices of variable {self.name!r} do not grow with the batch (their "
                "indices are not computed from the step's input data), but their indices changed "
                "within a cycle. Pass sparse=\"slices\" to keep every micro-step's slices."
            ])
            with tf.control_dependencies([check]):
                rows.assign_add(values, read_value=False)

        tf.cond(first, start, add)

    def forget_if(self, condition: Any) -> None:
        """Empties the buffer (for this cycle) if `condition`: a cycle's
        first micro-step that writes nothing into it."""
        filled = distribution.local_copy(self.filled)
        filled.assign(select(condition, tf.zeros_like(filled.value()), filled.value()), read_value=False)

    def read(self) -> tuple[tf.Tensor, tf.Tensor]:
        """This replica's slices of the cycle: `(values, indices)`."""
        values, indices = self.values.read_value(), self.indices.read_value()
        filled = self.filled.read_value()
        if not compiled_by_xla():
            return values[:filled], indices[:filled]
        size = tf.shape(values, out_type=tf.int64)[0]
        held = tf.reshape(tf.range(size) < filled, [-1] + [1] * len(self.row))
        values = tf.where(held, values, tf.zeros_like(values))
        if self.kind == GROWS:
            # Slices that did not fit: make the update NaN rather than wrong.
            values = tf.where(filled > size, tf.fill(tf.shape(values), tf.constant(np.nan, values.dtype)), values)
        return values, indices

    # ------------------------------------------------------------------
    # Eagerly, between steps.

    def held(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each replica's slices of the current cycle, as NumPy arrays."""
        out = []
        for values, indices, filled in zip(*(distribution.copies(v) for v in (self.values, self.indices, self.filled))):
            count = int(filled.numpy())
            out.append((values.numpy()[:count], indices.numpy()[:count]))
        return out

    def hold(self, per_replica: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """Makes each replica hold the given slices (eagerly), growing the
        buffer where it is too small."""
        for (v, i), values, indices, filled in zip(
            per_replica, *(distribution.copies(x) for x in (self.values, self.indices, self.filled))
        ):
            count, size = len(i), int(tf.shape(values)[0])
            # A fixed buffer has the shape of a micro-step's slices (XLA adds
            # into it); a grown one keeps the rows it has.
            size = count if self.kind == FIXED else max(count, size)
            rows = np.zeros([size] + self.row, values.dtype.as_numpy_dtype)
            rows[:count] = v
            index = np.zeros([size], np.int64)
            index[:count] = i
            values.assign(rows)
            indices.assign(index)
            filled.assign(count)

    def reserve(self, rows: int) -> None:
        """Grows each replica's buffer to `rows` rows at least (eagerly),
        keeping what it holds."""
        for values, indices in zip(distribution.copies(self.values), distribution.copies(self.indices)):
            size = int(tf.shape(values)[0])
            if size < rows:
                values.assign(tf.concat([values.value(), tf.zeros([rows - size] + self.row, values.dtype)], 0))
                indices.assign(tf.concat([indices.value(), tf.zeros([rows - size], tf.int64)], 0))

    def allocated_bytes(self) -> int:
        """The bytes its buffers hold, on every replica together."""
        variables = [c for v in (self.values, self.indices, self.filled) for c in distribution.copies(v)]
        return sum(int(tf.size(c)) * c.dtype.size for c in variables)


def saved_here(parts: Mapping[str, Buffer]) -> Callable[[], None]:
    """This replica's own copies of a variable's buffers (eagerly), and how
    to put them back: each replica puts back its own, since replicas run a
    step eagerly in turns and another one's copies may already hold this
    step's slices. A buffer created after this is emptied.

    Args:
        parts: The variable's buffers by kind (its live dictionary).

    Returns:
        A function that writes the saved copies back.
    """
    def own(buffer: Buffer) -> list[tf.Variable]:
        return [distribution.local_copy(v) for v in (buffer.values, buffer.indices, buffer.filled)]

    values = {kind: [tf.identity(copy) for copy in own(buffer)] for kind, buffer in parts.items()}

    def restore() -> None:
        for kind, buffer in parts.items():
            if kind in values:
                for copy, value in zip(own(buffer), values[kind]):
                    copy.assign(value, read_value=False)
            else:
                buffer.forget_if(tf.constant(True))

    return restore
