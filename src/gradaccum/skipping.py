"""Skip mode: the wrapped optimizer's update runs only on apply steps.

On an in-between micro-step nothing but the accumulators and the micro-step
counter changes, and none of the update's work is done. The decision is a
`tf.cond` on `keep_new`. A `tf.cond` in replica context must not enclose a
`merge_call`, and the wrapped optimizer's update makes several (all-reduce,
per-variable updates, the step counter), so under strategies that need
merge calls (`MirroredStrategy`) the decision is taken in cross-replica
context and the update re-enters replica context inside the branch, as
Keras's `LossScaleOptimizer` does:

    merge_call -> tf.cond(keep_new, call_for_each_replica(update), no-op)

Each replica computes the same `keep_new` (from the mirrored micro-step
counter), so every replica takes the same branch.

On an optimizer whose accumulators are all made at `build` (not a tf_keras
OptimizerV2, whose accumulators grow), the apply step costs what Keras's
own `gradient_accumulation_steps` step does, by taking the same path
through memory:

- every micro-step adds into a new tensor (`acc = acc + g`, which may take
  over the gradient's buffer) instead of adding in place;
- the update's branch takes reads of the accumulators (and of the weight
  total) as inputs instead of reading them itself: a branch that touches a
  variable waits for every earlier write to it, so the first variable's
  update would wait for every gradient to be added, and the clearing below
  for the whole update. It divides them into new tensors, which its own
  arithmetic can write into (`_quotients`: by multiplying where that is
  exact, as Keras's option multiplies by `1 / n`);
- after the update each accumulator is pointed at a shared vector of zeros
  (`_zero_buffers`) instead of being filled with zeros: nothing is written,
  and the next micro-step's addition reads the zeros and writes a new
  tensor. Keras assigns a zeros constant of each variable's shape; the
  shared vector is as long as the longest accumulator only.

Memory, then, is about what Keras's option takes: the accumulators, the zero
vector, and while a micro-step adds, each new sum next to the old one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from gradaccum.distribution import _replica_local


def _skipped_update(
    keep_new: tf.Tensor, update: Callable[..., Any], *args: Any
) -> None:
    """Runs `update(*args)` in replica context if `keep_new`, else nothing.

    Args:
        keep_new: Scalar boolean tensor (identical on every replica).
        update: Called in replica context; must capture no per-replica
            tensor (it may run in another replica's thread). Per-replica
            inputs go in `args`.
        *args: Per-replica inputs of `update` (tensors or lists of them).
    """
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "Gradients must be applied in replica context (inside "
            "`strategy.run` or `model.fit`), not in cross-replica context."
        )

    def run() -> None:
        update(*args)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        tf.cond(keep_new, run, _nothing)
        return

    def decide(distribution: tf.distribute.Strategy, keep_new: Any, *args: Any) -> None:
        # Every replica computed the same value; take the first replica's.
        keep = distribution.experimental_local_results(keep_new)[0]

        def run_on_each_replica() -> None:
            distribution.extended.call_for_each_replica(update, args=args)

        tf.cond(keep, run_on_each_replica, _nothing)

    tf.distribute.get_replica_context().merge_call(decide, args=(keep_new, *args))


def _is_power_of_two(x: tf.Tensor) -> tf.Tensor | None:
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


def _quotients(values: Sequence[tf.Tensor], divisor: tf.Tensor) -> list[tf.Tensor]:
    """`[v / divisor for v in values]`, bit for bit, for a positive scalar `divisor`.

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
        exact = _is_power_of_two(d)

        def divide(group: list[tf.Tensor] = group, d: tf.Tensor = d) -> list[tf.Tensor]:
            return [v / d for v in group]

        def multiply(group: list[tf.Tensor] = group, d: tf.Tensor = d) -> list[tf.Tensor]:
            r = tf.math.reciprocal(d)
            return [v * r for v in group]

        results = divide() if exact is None else tf.cond(exact, multiply, divide)
        for k, q in zip(ks, results):
            out[k] = q
    return out


def _zero_buffers(accumulators: Sequence[tf.Variable]) -> dict[tf.DType, tf.Variable]:
    """One replica-local vector of zeros per dtype, as long as the longest
    accumulator of that dtype (float32 at least one long, for the weight
    total). Create inside `gradaccum.distribution._creation_scope`; nothing
    writes them, and checkpoints do not hold them.
    """
    sizes: dict[tf.DType, int] = {tf.float32: 1}
    for a in accumulators:
        dtype = a.dtype.base_dtype
        sizes[dtype] = max(sizes.get(dtype, 1), a.shape.num_elements())
    return {
        dtype: _replica_local(tf.zeros([size], dtype=dtype), name="zeros")
        for dtype, size in sizes.items()
    }


def _shares_zeros(variable: tf.Variable) -> bool:
    """Whether `_cleared_if` can point `variable` at a zero buffer."""
    return variable.shape.is_fully_defined()


def _cleared_if(
    keep_new: tf.Tensor,
    variables: Sequence[tf.Variable],
    zeros: dict[tf.DType, tf.Variable],
) -> None:
    """If `keep_new`, makes each replica-local variable read as zeros.

    Each variable takes a reshaped leading slice of the zero vector of its
    dtype, which shares that vector's buffer: no allocation, no write.
    TensorFlow copies a shared buffer before anything writes into it, so
    the zeros stay zeros. The branch synchronises nothing.
    """

    def clear() -> None:
        for v in variables:
            size = v.shape.num_elements()
            flat = zeros[v.dtype.base_dtype].value()[:size]
            v.assign(tf.reshape(flat, v.shape), read_value=False)

    tf.cond(keep_new, clear, _nothing)


def _nothing() -> None:
    return None
