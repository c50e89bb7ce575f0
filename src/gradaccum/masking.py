"""Branch-free masked updates.

Every micro-step runs the wrapped optimizer's real update. Before it, the
values of every variable the update can touch are read; after it, each of
those variables is set to `where(keep_new, new, old)`. On an in-between step
`keep_new` is False, so every trainable variable and every optimizer variable
(moments, counters, EMA copies, whatever the optimizer created) ends exactly
where it started, bit for bit. No branch encloses the update, so the
optimizer's own replica synchronisation (all-reduce, `merge_call`) runs
unconditionally and identically on every replica.

`tf.where` is used rather than multiplying by 0/1, so a non-finite value in
the discarded update cannot leak into the kept one (0 x inf is NaN).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from gradaccum.distribution import _assign_each, _in_cross_replica


def _unique(variables: Sequence[tf.Variable]) -> list[tf.Variable]:
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _pick(var: tf.Variable, keep_new: tf.Tensor, old: tf.Tensor) -> Any:
    return var.assign(tf.where(keep_new, var.read_value(), old))


def _masked_update(
    strategy: tf.distribute.Strategy,
    keep_new: tf.Tensor,
    state: Sequence[tf.Variable],
    update: Callable[[], Any],
) -> None:
    """Runs `update()`, then keeps its effect on `state` only if `keep_new`.

    Args:
        strategy: The distribution strategy that owns `state`.
        keep_new: Scalar boolean tensor (identical on every replica).
        state: TensorFlow variables `update` may write. Anything it writes
            outside this list is not rolled back.
        update: Runs the real update in the current (replica) context.
    """
    state = _unique(state)
    old = [v.read_value() for v in state]
    update()

    def select(strategy, keep_new, old):
        _assign_each(strategy, state, _pick, [keep_new] * len(state), old)

    _in_cross_replica(strategy, select, keep_new, old)
