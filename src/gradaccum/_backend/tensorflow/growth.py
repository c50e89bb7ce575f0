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

In a traced step this is read off the graph (`split`): the indices grow if
they are computed from the step's input data (its arguments, an iterator's
elements, anything random), by value or through the batch dimension of
their shape; otherwise (constants, ranges, variables, sizes of other
dimensions) they are fixed. A variable used by several lookups gets their
slices concatenated; each part is judged on its own.

Where the step's data have a static batch size `B`, a shape taken from
them is a constant in the graph (`ops.zeros_like(ids)` is a constant of
shape `(B, L)`), and the constant no longer tells that it came from the
batch. Constant ids spread over a shape whose first dimension is `B` (a
fill, a broadcast, a tile, or a constant of one value: segment ids made
with `zeros_like`, positions broadcast to every sample) are therefore read
as the batch's: they grow. A table of its own (`ops.arange(T)`, relative
positions) is not spread, whatever its size. With `B == 1` every shape's
first dimension may be the batch's, so such ids are not told apart: they
are kept fixed, and the part says it is `unsure` (the caller warns).

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
        unsure: Whether some of these fixed slices' ids are spread over a
            first dimension of 1 with a micro-batch of 1: they may be the
            batch's (see the module docstring).
    """

    kind: str
    values: Any
    indices: Any
    count: int | None
    unsure: bool = False


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
    batch = None if all(grows) else _micro_batch_size(indices.graph)
    judged = [(GROWS, False) if g else _judge_constant(p, batch) for p, g in zip(pieces, grows)]
    kinds = [kind for kind, _ in judged]
    if len(set(kinds)) == 1:
        return [Part(kinds[0], grad.values, indices, _count(indices), any(u for _, u in judged))]
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
                          any(judged[k][1] for k in chosen)))
    return parts


def _judge_constant(piece: tf.Tensor, batch: int | None) -> tuple[str, bool]:
    """The kind of a lookup whose ids are not computed from the data, and
    whether it is unsure (see `Part`), for a micro-batch of `batch`."""
    if batch is None or not _spread(piece, batch):
        return FIXED, False
    return (GROWS, False) if batch > 1 else (FIXED, True)


def _micro_batch_size(graph: Any) -> int | None:
    """The first dimension the step's data share, where the graph knows it
    (else None): its arguments' and an iterator's elements'."""
    captured = {id(internal) for _, internal in getattr(graph, "captures", None) or []}
    data = [t for t in getattr(graph, "inputs", None) or [] if id(t) not in captured]
    data += [t for op in graph.get_operations() if op.type in _DATA_SOURCES for t in op.outputs]
    sizes = {t.shape[0] for t in data
             if t.dtype not in (tf.resource, tf.variant) and t.shape.rank and t.shape[0] is not None}
    return sizes.pop() if len(sizes) == 1 else None


def _spread(ids: tf.Tensor, batch: int) -> bool:
    """Whether constant `ids` are a value spread over a first dimension of
    `batch` (see the module docstring), followed back through the ops that
    keep their values (a gather's gradient flattens its ids)."""
    stack, seen = [ids], set()
    while stack:
        t = stack.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        op = t.op
        if op.type in _KEEPING:
            stack.append(op.inputs[0])
        elif not t.shape.rank or t.shape[0] != batch:
            continue
        elif op.type in _SPREADING:
            return True
        elif op.type == "Const":
            value = tf.get_static_value(t)
            if value is not None and (value == value.flat[0]).all():
                return True
        elif op.type in _ELEMENTWISE:
            stack.extend(op.inputs[1:] if op.type in ("SelectV2", "Select") else op.inputs)
    return False


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
