"""Whether a `tf.IndexedSlices` gradient's slices grow with the batch.

Keras 3's TensorFlow optimizers take a `tf.IndexedSlices` gradient slice by
slice: a row's repeated slices are not summed first, so Adam's, RMSprop's
and Adagrad's second moment and `global_clipnorm`'s norm see the sum of the
slices' squares. What the large batch hands the optimizer therefore depends
on how its lookups form slices:

- A lookup whose ids come from the batch (token ids, segment ids: an
  `Embedding` applied to an input) gathers one slice per id of every sample.
  The large batch holds the micro-batches' slices side by side: its slices
  **grow** with the batch.
- A lookup whose ids do not (`Embedding(T)(ops.arange(T))` added to every
  sample, a relative-position bucket table) gathers one slice per id, its
  value already summed over the batch. The large batch holds the same ids,
  each with the values summed over every micro-batch: its slices are
  **fixed**.

In a traced step this is read off the graph (`split`), by one rule (stated
in docs/guides/sparse.md): a lookup's slices grow if its ids are the
batch's, that is computed from the step's input data (its arguments, an
iterator's elements, anything random; by value or through the batch
dimension of their shape) or a constant spread over the step's batch
dimension; every other lookup's slices (constants, ranges, variables,
sizes of other dimensions) are fixed. A variable used by several lookups
gets their slices concatenated; each part is judged on its own.

A constant is spread over the batch dimension when it spreads one value
(a fill, a broadcast, a tile, or a constant of one value) over a shape
whose first dimensions are those of one of the step's inputs: where the
data have a static batch size `B`, a shape taken from them is a constant
in the graph (`ops.zeros_like(ids)` is a constant of shape `(B, L)`). Where
the spread shape matches an input in two or more leading dimensions
(segment ids from `zeros_like`, positions broadcast to every sample), that
tells. Where it matches only in the first (a shape `(B,)`), a table of its
own whose length merely equals `B` looks the same: the part is `unsure`
(the caller warns) and is read as the batch's for `B > 1`, as a table's
(a `[CLS]`-like id of shape `(1,)`) for `B == 1`.

Eagerly there is no graph: `gradaccum._backend.tensorflow.kept` compares a
cycle's index sets instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

GROWS = "grows"
FIXED = "fixed"

# Ops that read a variable: what they give does not change with the batch
# (their resource input is a handle, not data).
_VARIABLE_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarHandleOp"})
# Ops that carry only the rank of their input.
_RANK_ONLY = frozenset({"Rank"})
# Ops that spread a value over a shape they are given.
_SPREADING = frozenset({"Fill", "BroadcastTo", "Tile", "ZerosLike", "OnesLike"})
# Ops that keep their first input's values, and elementwise ops (whose
# first dimension is their inputs', broadcast): what ids pass through.
_KEEPING = frozenset({"Identity", "Cast", "Reshape", "ExpandDims", "Squeeze"})
_ELEMENTWISE = frozenset({"AddV2", "Add", "Sub", "Mul", "FloorDiv", "FloorMod", "Maximum", "Minimum", "Neg", "Abs",
                          "SelectV2", "Select"})
# Ops that give the step's data (besides its arguments).
_DATA_SOURCES = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue",
                           "MultiDeviceIteratorGetNextFromShard"})
# Ops that call a function or branch: their outputs are taken to depend on
# all their inputs (what their bodies compute from constants alone is not
# data).
_CALLS = frozenset({"If", "StatelessIf", "Case", "StatelessCase", "While", "StatelessWhile",
                    "PartitionedCall", "StatefulPartitionedCall"})


class Part(NamedTuple):
    """The slices of one kind in a micro-step's gradient.

    Attributes:
        kind: `GROWS` or `FIXED`.
        values: Their values.
        indices: Their indices (int64).
        count: Their number where the graph knows it, else None.
        unsure: The micro-batch size where some of these slices' ids are a
            constant spread over an input's first dimension alone (they may
            be the batch's or a table's, see the module docstring), else 0.
    """

    kind: str
    values: Any
    indices: Any
    count: int | None
    unsure: int = 0


def split(grad: tf.IndexedSlices, keep_all: bool = False) -> list[Part] | None:
    """The gradient's slices by kind, at most one `Part` per kind (fixed
    first); None eagerly (no graph to read). With `keep_all` every slice
    grows (`sparse="slices"`)."""
    indices = tf.cast(grad.indices, tf.int64)
    if keep_all:
        return [Part(GROWS, grad.values, indices, _count(indices))]
    if tf.executing_eagerly():
        return None
    pieces = _pieces(grad.indices)
    grows = [_depends_on_batch(p) for p in pieces]
    shapes = [] if all(grows) else _data_shapes(indices.graph)
    judged = [(GROWS, 0) if g else _judge_constant(p, shapes) for p, g in zip(pieces, grows)]
    kinds = [kind for kind, _ in judged]
    if len(set(kinds)) == 1:
        return [Part(kinds[0], grad.values, indices, _count(indices), max(u for _, u in judged))]
    sizes = [tf.shape(p, out_type=tf.int64)[0] for p in pieces]
    values = tf.split(grad.values, tf.stack(sizes), num=len(pieces))
    index_parts = tf.split(indices, tf.stack(sizes), num=len(pieces))
    parts = []
    for kind in (FIXED, GROWS):
        chosen = [k for k, c in enumerate(kinds) if c == kind]
        counts = [_count(pieces[k]) for k in chosen]
        count = None if None in counts else sum(counts)
        parts.append(Part(kind, tf.concat([values[k] for k in chosen], 0),
                          tf.concat([index_parts[k] for k in chosen], 0), count,
                          max([judged[k][1] for k in chosen], default=0)))
    return parts


def _judge_constant(piece: tf.Tensor, shapes: list[tuple[int, ...]]) -> tuple[str, int]:
    """The kind of a lookup whose ids are not computed from the data, and
    its `unsure` (see `Part`), given the data's static `shapes`."""
    batches = {shape[0] for shape in shapes}
    batch = batches.pop() if len(batches) == 1 else None
    spread = None if batch is None else _spread(piece, batch)
    if spread is None:
        return FIXED, 0
    if len(spread) >= 2 and any(shape[:len(spread)] == spread for shape in shapes):
        return GROWS, 0
    return (GROWS if batch > 1 else FIXED), batch


def _data_shapes(graph: Any) -> list[tuple[int, ...]]:
    """The static shapes of the step's data (its arguments and an iterator's
    elements) whose first dimension the graph knows."""
    captured = {id(internal) for _, internal in getattr(graph, "captures", None) or []}
    data = [t for t in getattr(graph, "inputs", None) or [] if id(t) not in captured]
    data += [t for op in graph.get_operations() if op.type in _DATA_SOURCES for t in op.outputs]
    return [tuple(t.shape.as_list()) for t in data
            if t.dtype not in (tf.resource, tf.variant) and t.shape.rank and t.shape[0] is not None]


def _spread(ids: tf.Tensor, batch: int) -> tuple[int, ...] | None:
    """The shape constant `ids` spread one value over, where its first
    dimension is `batch` (see the module docstring), else None, followed
    back through the ops that keep their values (a gather's gradient
    flattens its ids)."""
    # Each tensor with the shape its values reach the lookup in (the
    # outermost of first dimension `batch`, through elementwise broadcasts).
    stack, seen = [(ids, None)], set()
    while stack:
        t, outer = stack.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        op = t.op
        if op.type in _KEEPING:
            stack.append((op.inputs[0], None))
            continue
        if not t.shape.rank or t.shape[0] != batch:
            continue
        outer = outer or tuple(t.shape.as_list())
        if op.type in _SPREADING:
            return outer
        if op.type == "Const":
            value = tf.get_static_value(t)
            if value is not None and (value == value.flat[0]).all():
                return outer
        elif op.type in _ELEMENTWISE:
            stack.extend((i, outer) for i in (op.inputs[1:] if op.type in ("SelectV2", "Select") else op.inputs))
    return None


def _count(tensor: Any) -> int | None:
    return tensor.shape[0] if tensor.shape.rank == 1 else None


def _pieces(indices: tf.Tensor) -> list[tf.Tensor]:
    """The lookups' index sets a gradient's indices concatenate (TensorFlow
    concatenates the slices of a variable's several lookups), else itself."""
    op = indices.op
    while op.type == "Identity":
        op = op.inputs[0].op
    if op.type == "ConcatV2" and len(op.inputs) > 2 and _static_axis(op.inputs[-1]) == 0:
        return list(op.inputs[:-1])
    return [indices]


def _static_axis(tensor: tf.Tensor) -> int | None:
    value = tf.get_static_value(tensor)
    return None if value is None else int(value)


def _depends_on_batch(tensor: tf.Tensor) -> bool:
    """Whether `tensor`, in the graph being traced, is computed from the
    step's input data, or from the batch dimension of its shape."""
    stack, seen = [tensor], set()
    while stack:
        t = stack.pop()
        key = (id(t.graph), t.name)
        if key in seen:
            continue
        seen.add(key)
        found = _source(t)
        if found is True:
            return True
        if found is not False:
            stack.extend(found)
    return False


def _source(t: tf.Tensor) -> bool | list[tf.Tensor]:
    """True if `t` is data, False if it is not, else the tensors it is
    computed from that decide it."""
    op = t.op
    if op.type == "Placeholder":
        return _captured(t)
    if op.type in _RANK_ONLY:
        return False
    if op.type in ("Shape", "ShapeN", "Size"):
        # The size of another tensor's dimensions: data if that tensor is.
        return list(op.inputs)
    if op.type == "StridedSlice" and op.inputs[0].op.type in ("Shape", "ShapeN"):
        dims = _sliced_dims(op)
        if dims is not None and 0 not in dims:
            return False  # sizes of dimensions other than the batch's
        return list(op.inputs[0].op.inputs)
    if op.type in _VARIABLE_READS:
        return [i for i in op.inputs if i.dtype != tf.resource]
    if op.type in _CALLS:
        return [i for i in op.inputs if i.dtype not in (tf.resource, tf.variant)]
    if op._is_stateful:  # iterators, random numbers, Python functions
        return True
    return list(op.inputs)


def _captured(t: tf.Tensor) -> bool | list[tf.Tensor]:
    """A placeholder: a step's argument (data), or a value captured from
    outside the function (a constant, a variable's handle, or a tensor of
    an enclosing graph, which decides)."""
    captures = getattr(t.graph, "captures", None) or []
    for external, internal in captures:
        if internal is t:
            if t.dtype in (tf.resource, tf.variant):
                return False
            if isinstance(external, tf.Tensor) and tf.is_symbolic_tensor(external):
                return [external]
            return False
    return True


def _sliced_dims(op: Any) -> set[int] | None:
    """The dimensions `shape[...]` selects, for a constant index or range
    (else None)."""
    begin, end, strides = (tf.get_static_value(op.inputs[k]) for k in (1, 2, 3))
    if begin is None or end is None or strides is None or len(begin) != 1:
        return None
    if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
        return None
    rank = op.inputs[0].shape[0]
    start, stop, step = int(begin[0]), int(end[0]), int(strides[0])
    if op.get_attr("shrink_axis_mask") & 1:
        return {start if start >= 0 else (None if rank is None else rank + start)} - {None} or None
    if rank is None or step == 0:
        return None
    if op.get_attr("begin_mask") & 1:
        start = 0 if step > 0 else rank - 1
    if op.get_attr("end_mask") & 1:
        stop = rank if step > 0 else -rank - 1
    return set(range(rank)[slice(start, stop, step)])
