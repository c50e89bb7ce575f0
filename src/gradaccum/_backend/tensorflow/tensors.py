"""Tensor primitives of the accumulation: add, select, divide, clear.

Each is written for what it costs in memory on the step where it runs (see
each docstring): the accumulators are as large as the model, so a stray copy
of them is as large as the model too. Every branch here is a `tf.cond` that
synchronises nothing (no all-reduce, no `merge_call` inside).
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from gradaccum._backend.tensorflow.distribution import local_copy, replica_local


def nothing() -> None:
    """The empty branch of a `tf.cond`."""
    return None


def usable_here(tensor: Any) -> bool:
    """Whether `tensor` belongs where code runs now.

    An eager tensor is usable eagerly; a symbolic one in the graph that made
    it or in a graph nested in that one (a `tf.cond` branch, a loop body).
    Used where a value is handed from one call to a later one, so that a value
    left over from another `tf.function`, or from an eager call, is never
    captured into a graph as a constant.
    """
    if not tf.is_symbolic_tensor(tensor):
        return tf.executing_eagerly()
    if tf.executing_eagerly():
        return False
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if graph is tensor.graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def compiled_by_xla() -> bool:
    """Whether the code being traced now is compiled by XLA (`jit_compile`).

    XLA costs the end of a cycle the other way round: a `tf.cond` that
    writes a variable this step already wrote makes XLA copy the variable
    on every step, taken or not, where a `select` fuses into the write
    before it at no extra pass. Measured on 4.2M float32 elements, one add
    then a zeroing on an in-between step: 1.99 ms with a select, 5.11 ms
    with a `tf.cond` (and 7.50 ms against 1.73 ms the other way without
    XLA, where nothing fuses and a select is a pass of its own).
    """
    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def accumulator_dtype(variable: Any) -> tf.DType:
    """float64 for float64 variables, float32 for every other dtype."""
    dtype = tf.as_dtype(variable.dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32


def scatter_into(accumulator: tf.Variable, grad: tf.IndexedSlices, weight: Any, first: tf.Tensor) -> None:
    """Scatters `weight * grad` (or `grad`, for `weight=None`) into this
    replica's copy of `accumulator`, zeroed first on a cycle's first
    micro-step (`first`, a scalar boolean tensor; see `add_into`)."""
    values = tf.cast(grad.values, accumulator.dtype)
    if weight is not None:
        values = values * tf.cast(weight, accumulator.dtype)
    zero_if(first, [accumulator])
    local_copy(accumulator).scatter_add(tf.IndexedSlices(values, grad.indices, grad.dense_shape))


def add_into(
    accumulators: Sequence[tf.Variable],
    grads: Sequence[tf.Tensor],
    weight: Any,
    into_new: bool,
    first: tf.Tensor,
    hand_over: tf.Tensor | None = None,
) -> list[tf.Tensor] | None:
    """Adds `weight * grad` (or `grad`, for `weight=None`) to each accumulator,
    or on a cycle's first micro-step writes it over what the accumulator holds.

    The end of a cycle does not clear the accumulators (see
    `gradaccum._strategies`): they hold the last cycle's sums until the next
    cycle's first micro-step, which overwrites them. A gradient is added in
    place, or, with `into_new` and no weight, into a new tensor that then
    becomes the accumulator's buffer (the path through memory Keras's own
    `gradient_accumulation_steps` takes; see `gradaccum._strategies`).

    Args:
        accumulators: Replica-local variables.
        grads: Their dense gradients.
        weight: A scalar, or None.
        into_new: See above.
        first: Scalar boolean tensor: this is the cycle's first micro-step.
            Under XLA the choice is a select per accumulator, fused into its
            add (one pass). Otherwise one `tf.cond` for all of them (each
            `tf.cond` costs a function call, as much as a few percent of a
            micro-step with one per variable), whose overwrite hands each
            (weighted) gradient's buffer over without a pass over the old
            sums.
        hand_over: None, or a scalar boolean tensor: this micro-step ends
            the cycle. Then the sums after the add are returned, and on a
            step that ends a cycle (not its first), traced and not compiled
            by XLA, each accumulator takes its gradient's buffer in place of
            its sum's: the sum returned is then held by nothing else, so the
            update's first operation can write into it where it would
            otherwise allocate (SGD's `lr * grad`; Keras's option hands its
            update a temporary `g + acc` the same way). Between cycles those
            accumulators hold their last micro-gradients, which the next
            cycle's first micro-step writes over like any sums; the
            gradients' buffers are taken over, not copied, being used by
            nothing after this.

    Returns:
        With `hand_over`, each accumulator's sum after this micro-step (in
        the order given); else None.
    """
    w = None if weight is None else tf.cast(weight, tf.float32)
    pairs = [(a, tf.cast(g, a.dtype)) for a, g in zip(accumulators, grads)]
    if not pairs:
        return None if hand_over is None else []

    def sums() -> list[tf.Tensor]:
        # As the update reads them (see `gradaccum._strategies._read`).
        return [a.read_value() for a, _ in pairs]

    def weighted(a: tf.Variable, g: tf.Tensor) -> tf.Tensor:
        return g if w is None else g * tf.cast(w, a.dtype)

    if compiled_by_xla():
        # One fused pass each (see `compiled_by_xla`): no select after the
        # update's `tf.cond` reads the sums, which would make XLA keep them
        # in a temporary and copy them back on every step.
        for a, g in pairs:
            new = weighted(a, g)
            a.assign(select(first, new, a.value() + new), read_value=False)
        return None if hand_over is None else sums()

    def add() -> None:
        for a, g in pairs:
            if w is not None:
                # `acc -= (-w) * grad`, in place, in one fused pass: `fit`
                # weighs every micro-batch by its loss count, and `grad * w`
                # would be a pass over the gradient of its own (as costly as
                # the add). The result is bit for bit that of
                # `acc + grad * w` (negation is exact, and the kernel does
                # not contract into a fused multiply-add).
                tf.raw_ops.ResourceApplyGradientDescent(
                    var=local_copy(a).handle, alpha=-tf.cast(w, a.dtype), delta=g
                )
            elif into_new:
                a.assign(a.value() + g, read_value=False)
            else:
                a.assign_add(g, read_value=False)

    def overwrite() -> None:
        for a, g in pairs:
            a.assign(weighted(a, g), read_value=False)

    if hand_over is None:
        tf.cond(first, overwrite, add)
        return None
    if tf.executing_eagerly():
        # Eagerly the caller still holds the gradients: taking them over
        # would be a copy.
        tf.cond(first, overwrite, add)
        return sums()

    def then_sums(write: Any) -> Any:
        def branch() -> list[tf.Tensor]:
            write()
            return sums()

        return branch

    def add_and_hand_over() -> list[tf.Tensor]:
        add()
        held = sums()
        # After the reads (ordered on each variable), so they read the sums.
        for a, g in pairs:
            a.assign(g, read_value=False)
        return held

    branch = tf.where(first, 0, tf.where(hand_over, 2, 1))
    return tf.switch_case(branch, [then_sums(overwrite), then_sums(add), add_and_hand_over])


def slice_buffers(variable: Any, colocate_with: Any) -> tuple[tf.Variable, tf.Variable]:
    """Empty buffers for a cycle's `tf.IndexedSlices` of `variable`: values
    (rows of the variable's shape, accumulator dtype) and int64 indices.

    Their first dimension is left unknown: each micro-step appends its
    slices (`append_slices`). Create inside `distribution.creation_scope`.
    """
    row = list(variable.shape)[1:]
    values = replica_local(
        tf.zeros([0] + row, dtype=accumulator_dtype(variable)),
        name="kept_values",
        colocate_with=colocate_with,
        shape=tf.TensorShape([None] + row),
    )
    indices = replica_local(
        tf.zeros([0], dtype=tf.int64),
        name="kept_indices",
        colocate_with=colocate_with,
        shape=tf.TensorShape([None]),
    )
    return values, indices


def append_slices(values: tf.Variable, indices: tf.Variable, grad: tf.IndexedSlices, weight: Any) -> None:
    """Appends `weight * grad` (or `grad`) to the buffers `slice_buffers` made.

    Repeated rows stay separate, as the optimizer would see them in one
    large batch. Each append allocates the grown buffer once (the old one
    is freed when the assignment replaces it).

    Raises:
        ValueError: Under XLA, which cannot change a variable's shape.
    """
    if compiled_by_xla():
        raise ValueError(
            "sparse=\"slices\" keeps a cycle's slices in buffers that grow on "
            "every micro-step, which XLA cannot compile (`jit_compile=True`). "
            "Compile without XLA, or use sparse=\"rows\" (the default)."
        )
    new = tf.cast(grad.values, values.dtype)
    if weight is not None:
        new = new * tf.cast(weight, values.dtype)
    values.assign(tf.concat([values.value(), new], axis=0), read_value=False)
    indices.assign(
        tf.concat([indices.value(), tf.cast(grad.indices, tf.int64)], axis=0),
        read_value=False,
    )


def kept_slices(values: tf.Variable, indices: tf.Variable, dense_shape: Any, divisor: Any) -> tf.IndexedSlices:
    """The kept slices as one `tf.IndexedSlices`, their values divided by the
    scalar `divisor` (or as they are, for None)."""
    v = values.read_value()
    if divisor is not None:
        v = v / tf.cast(divisor, v.dtype)
    return tf.IndexedSlices(v, indices.read_value(), tf.constant([int(d) for d in dense_shape], dtype=tf.int64))


def clear_slices(buffers: Sequence[tuple[tf.Variable, tf.Variable]]) -> None:
    """Empties each pair of slice buffers."""
    for values, indices in buffers:
        values.assign(tf.zeros([0] + list(values.shape)[1:], values.dtype), read_value=False)
        indices.assign(tf.zeros([0], tf.int64), read_value=False)


def clear_slices_if(keep_new: tf.Tensor, buffers: Sequence[tuple[tf.Variable, tf.Variable]]) -> None:
    """`clear_slices` if `keep_new` (a `tf.cond` that synchronises nothing)."""
    if buffers:
        tf.cond(keep_new, lambda: clear_slices(buffers), nothing)


def max_into(accumulator: tf.Variable, value: Any, first: tf.Tensor) -> None:
    """Sets `accumulator` to the elementwise maximum of itself and `value`,
    or to `value` on a cycle's first micro-step (`first`, see `add_into`)."""
    value = tf.cast(tf.convert_to_tensor(value), accumulator.dtype)
    accumulator.assign(select(first, value, tf.maximum(accumulator.value(), value)), read_value=False)


def add_scalar(total: tf.Variable, value: Any, first: tf.Tensor) -> None:
    """Adds the scalar `value` to `total`, or sets it on a cycle's first
    micro-step (`first`, see `add_into`)."""
    value = tf.cast(value, total.dtype)
    total.assign(select(first, value, total.value() + value), read_value=False)


def any_nonzero(values: Sequence[Any]) -> tf.Tensor:
    """Scalar boolean tensor: some element of some of `values` is not 0."""
    return tf.reduce_any(tf.stack([tf.reduce_any(tf.not_equal(v, 0)) for v in values]))


def select(keep_new: tf.Tensor, new: Any, old: Any) -> tf.Tensor:
    """`new` if the scalar `keep_new` holds, else `old` (same shape and dtype).

    The whole tensor is passed on, not computed: TensorFlow's `Select` with a
    scalar condition forwards one input's buffer, where `tf.where` (which
    broadcasts) runs an elementwise pass as costly as the update itself.
    Nothing of the discarded value reaches the result, NaN and inf included.
    """
    return tf.raw_ops.Select(condition=keep_new, x=new, y=old)


def divide_in_place(variables: Sequence[tf.Variable], divisor: tf.Tensor) -> None:
    """Divides each of the replica-local `variables` by the scalar `divisor`
    (a float32 tensor), unless it is 1.

    One after the other: each quotient replaces its variable's buffer before
    the next one is allocated, so at most one variable's worth is allocated
    at a time. The variables then hold what the update reads. Reading a
    variable allocates nothing, where a quotient computed for the update
    would be a second copy of the sums, alive next to them while the update
    runs; and since a read shares its buffer with the variable, no operation
    of the update can reuse that buffer, so the update allocates the same
    whichever order it runs in.
    """

    def divide() -> None:
        done: list[Any] = []
        for v in variables:
            with tf.control_dependencies(done):
                quotient = v.value() / tf.cast(divisor, v.dtype)
                done = [v.assign(quotient, read_value=False)]

    # A divisor of 1 is the common case: sums held at the scale of their
    # mean (see `gradaccum._strategies`).
    tf.cond(tf.equal(divisor, 1.0), nothing, divide)


def divide_if(keep_new: tf.Tensor, variables: Sequence[tf.Variable], divisor: tf.Tensor) -> None:
    """`divide_in_place` by the scalar `divisor` if `keep_new`.

    The `tf.cond` takes every variable as an input, so it runs once all
    writes made so far to any of them have run: what reads them after it
    (the update) waits for every micro-gradient to have been added. Under
    XLA a select instead (see `compiled_by_xla`).
    """
    if compiled_by_xla():
        for v in variables:
            v.assign(select(keep_new, v.value() / tf.cast(divisor, v.dtype), v.value()), read_value=False)
        return
    tf.cond(keep_new, lambda: divide_in_place(variables, divisor), nothing)


def zero(variables: Sequence[tf.Variable], zero_value: tf.Tensor) -> None:
    """Sets replica-local `variables` to `zero_value` (a 0 known only at run time).

    One after the other: each old buffer is freed before the next zeros are
    allocated. The zeros are filled at run time from a value TensorFlow
    cannot know in advance: zeros of a static shape are folded into a graph
    constant, which then stays in memory.
    """
    done: list[Any] = []
    for v in variables:
        with tf.control_dependencies(done):
            zeros = tf.fill(tf.shape(v), tf.cast(zero_value, v.dtype))
            done = [v.assign(zeros, read_value=False)]


def zero_if(condition: tf.Tensor, variables: Sequence[tf.Variable]) -> None:
    """`zero` if the scalar `condition` holds; on other steps nothing is
    allocated. Under XLA a select instead (see `compiled_by_xla`)."""
    if compiled_by_xla():
        for v in variables:
            v.assign(select(condition, tf.zeros_like(v), v.value()), read_value=False)
        return
    # `condition` is True inside the branch: its negation is a run-time zero.
    tf.cond(condition, lambda: zero(variables, tf.logical_not(condition)), nothing)


def is_power_of_two(x: tf.Tensor) -> tf.Tensor | None:
    """Whether the float scalar `x` is a positive, normal power of two.

    None for dtypes other than float32 and float64.
    """
    layout = {tf.float32: (tf.int32, 23, 0xFF), tf.float64: (tf.int64, 52, 0x7FF)}
    if x.dtype not in layout:
        return None
    int_dtype, mantissa_bits, exponent_all_ones = layout[x.dtype]
    bits = tf.bitcast(x, int_dtype)
    mantissa = tf.bitwise.bitwise_and(bits, tf.constant((1 << mantissa_bits) - 1, int_dtype))
    # Arithmetic shift: a set sign bit gives a negative exponent field.
    exponent = tf.bitwise.right_shift(bits, tf.constant(mantissa_bits, int_dtype))
    return tf.logical_and(
        tf.equal(mantissa, 0),
        tf.logical_and(exponent > 0, exponent < exponent_all_ones),
    )


def quotients(values: Sequence[tf.Tensor], divisor: tf.Tensor) -> list[tf.Tensor]:
    """`[v / divisor for v in values]`, bit for bit, for a positive scalar `divisor`.

    A divisor of 1 (sums held at the scale of their mean, the common case;
    see `gradaccum._strategies`) passes the values on as they are.

    A CPU divides several times slower than it multiplies: in profiles of
    the apply step in `fit`, the division ops took 3.2-3.6 ms against 1.4 ms
    for Keras's option, which multiplies by `1 / n` instead. Where `divisor`
    is a power of two (as `n` often is) its reciprocal is exact, and
    `v * (1 / divisor)` rounds exactly as `v / divisor` does (each is the
    exact quotient, rounded once), so that is computed; otherwise the
    division. One `tf.cond` per dtype.
    """
    out: list[Any] = [None] * len(values)
    by_dtype: dict[tf.DType, list[int]] = {}
    for k, v in enumerate(values):
        by_dtype.setdefault(v.dtype, []).append(k)
    for dtype, ks in by_dtype.items():
        d = tf.cast(divisor, dtype)
        group = [values[k] for k in ks]
        exact = is_power_of_two(d)

        def divide(group: list[tf.Tensor] = group, d: tf.Tensor = d) -> list[tf.Tensor]:
            return [v / d for v in group]

        def multiply(group: list[tf.Tensor] = group, d: tf.Tensor = d) -> list[tf.Tensor]:
            r = tf.math.reciprocal(d)
            return [v * r for v in group]

        def quotient(group: list[tf.Tensor] = group, exact: Any = exact) -> list[tf.Tensor]:
            return divide() if exact is None else tf.cond(exact, multiply, divide)

        def same(group: list[tf.Tensor] = group) -> list[tf.Tensor]:
            return list(group)

        results = tf.cond(tf.equal(d, 1), same, quotient)
        for k, q in zip(ks, results):
            out[k] = q
    return out
