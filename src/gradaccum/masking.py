"""Branch-free masked updates.

Every micro-step runs the wrapped optimizer's real update, and keeps its
effect only on the apply step: on an in-between step every trainable
variable and every optimizer variable (moments, counters, EMA copies,
whatever the optimizer created) ends exactly where it started, bit for bit.
No branch encloses the update, so the optimizer's own replica
synchronisation (all-reduce, `merge_call`) runs unconditionally and
identically on every replica.

Two ways to mask, chosen by the optimizer family's adapter:

- Masked writes (`_masking_writes`), for optimizers whose every state change
  goes through a write method of a TensorFlow variable (`assign`,
  `assign_add`, `assign_sub`, `scatter_*`), as Keras 3 optimizers' do. While
  the update runs, each of those writes to a tracked variable happens only
  if `keep_new`: `tf.cond(keep_new, write, nothing)` around that one write,
  whose value is computed unconditionally. Nothing is copied ahead of the
  update, and an in-between step writes nothing.
- Snapshot and select (`_snapshot_update`), for optimizers that write through
  fused kernels on raw variable handles: the values of every tracked
  variable are read before the update and selected after it. This keeps one
  copy of all of them alive until the select.

Selecting or skipping a write, rather than multiplying by 0/1, means a
non-finite value in the discarded update cannot leak into the kept one
(0 x inf is NaN).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

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


def _select(keep_new: tf.Tensor, new: Any, old: Any) -> tf.Tensor:
    """`new` if the scalar `keep_new` holds, else `old` (same shape and dtype).

    The whole tensor is passed on, not computed: TensorFlow's `Select` with a
    scalar condition forwards one input's buffer, where `tf.where` (which
    broadcasts) runs an elementwise pass as costly as the update itself.
    Nothing of the discarded value reaches the result, NaN and inf included.
    """
    return tf.raw_ops.Select(condition=keep_new, x=new, y=old)


def _masked_update(
    strategy: tf.distribute.Strategy,
    keep_new: tf.Tensor,
    state: Sequence[tf.Variable],
    update: Callable[[], Any],
    masks_writes: bool = False,
) -> None:
    """Runs `update()`, then keeps its effect on `state` only if `keep_new`.

    Args:
        strategy: The distribution strategy that owns `state`.
        keep_new: Scalar boolean tensor (identical on every replica).
        state: TensorFlow variables `update` may write. Anything it writes
            outside this list is not rolled back.
        update: Runs the real update in the current (replica) context.
        masks_writes: Whether every write `update` makes goes through a
            variable's write methods, so each write can be masked where it
            happens (no copy of `state`). Otherwise `state` is snapshotted.
    """
    if masks_writes:
        with _masking_writes(state, keep_new):
            update()
    else:
        _snapshot_update(strategy, keep_new, state, update)


def _divide_in_place(variables: Sequence[tf.Variable], divisor: tf.Tensor) -> None:
    """Divides each of the replica-local `variables` by the scalar `divisor`.

    One after the other: each quotient replaces its variable's buffer before
    the next one is allocated, so at most one variable's worth is allocated
    at a time. The variables then hold what the update reads. Reading a
    variable allocates nothing, where a quotient computed for the update
    would be a second copy of the sums, alive next to them while the update
    runs; and since a read shares its buffer with the variable, no operation
    of the update can reuse that buffer, so the update allocates the same
    whichever order it runs in.
    """
    done: list[Any] = []
    for v in variables:
        with tf.control_dependencies(done):
            quotient = v.value() / tf.cast(divisor, v.dtype)
            done = [v.assign(quotient, read_value=False)]


def _divide_if(
    keep_new: tf.Tensor,
    variables: Sequence[tf.Variable],
    divisor: Callable[[], tf.Tensor],
) -> None:
    """`_divide_in_place` by `divisor()` if `keep_new`, in a `tf.cond` that
    synchronises nothing (`divisor` is called inside the branch).

    The `tf.cond` takes every variable as an input, so it runs once all
    writes made so far to any of them have run: what reads them after it
    (the update) waits for every micro-gradient to have been added.
    """
    tf.cond(keep_new, lambda: _divide_in_place(variables, divisor()), _nothing)


def _zero(
    variables: Sequence[tf.Variable],
    zero: tf.Tensor,
    after: Sequence[tf.Variable] = (),
) -> None:
    """Sets replica-local `variables` to `zero` (a scalar 0 known only at run time).

    It waits for the writes made so far to the variables in `after` (the
    update's), so the zeros are not allocated while the update's temporaries
    are alive, and zeroes the variables one after the other: each old buffer
    is freed before the next zeros are allocated. The zeros are filled at run
    time from a value TensorFlow cannot know in advance: zeros of a static
    shape are folded into a graph constant, which then stays in memory.
    """
    done: list[Any] = [v.value() for v in after]
    for v in variables:
        with tf.control_dependencies(done):
            zeros = tf.fill(tf.shape(v), tf.cast(zero, v.dtype))
            done = [v.assign(zeros, read_value=False)]


def _zero_if(
    keep_new: tf.Tensor,
    variables: Sequence[tf.Variable],
    after: Sequence[tf.Variable] = (),
) -> None:
    """`_zero` if `keep_new`, in a `tf.cond` that synchronises nothing.

    On an in-between step nothing is allocated, and nothing of `after` is
    read: the reads are inside the branch, and the `tf.cond` waits for the
    writes to `after` since it takes those variables as inputs.
    """
    tf.cond(
        keep_new,
        lambda: _zero(variables, tf.logical_not(keep_new), after=after),
        _nothing,
    )


# ----------------------------------------------------------------------
# Snapshot and select: one copy of all of `state` alive during the update.


def _pick(var: tf.Variable, keep_new: tf.Tensor, old: tf.Tensor) -> Any:
    return var.assign(_select(keep_new, var.read_value(), old))


def _snapshot_update(
    strategy: tf.distribute.Strategy,
    keep_new: tf.Tensor,
    state: Sequence[tf.Variable],
    update: Callable[[], Any],
) -> None:
    state = _unique(state)
    old = [v.read_value() for v in state]
    update()

    def select(strategy, keep_new, old):
        _assign_each(strategy, state, _pick, [keep_new] * len(state), old)

    _in_cross_replica(strategy, select, keep_new, old)


# ----------------------------------------------------------------------
# Masked writes: each write happens only if `keep_new`.

# The write methods of `tf.Variable`.
_WRITES = (
    "assign",
    "assign_add",
    "assign_sub",
    "scatter_add",
    "scatter_sub",
    "scatter_max",
    "scatter_min",
    "scatter_mul",
    "scatter_div",
    "scatter_update",
    "batch_scatter_update",
    "scatter_nd_add",
    "scatter_nd_sub",
    "scatter_nd_update",
    "scatter_nd_max",
    "scatter_nd_min",
)
_MISSING = object()


def _nothing() -> None:
    return None


class _WriteMask:
    """The write methods of one TensorFlow variable, masked by `keep_new`.

    A masked write is `tf.cond(keep_new, write, nothing)`. The branch holds
    that one write and nothing that synchronises replicas; the value it
    writes is computed outside, unconditionally. Selecting between the new
    and the current value instead would assign a variable its own buffer on
    every in-between step, which TensorFlow does by copying it.
    """

    def __init__(self, variable: tf.Variable, keep_new: tf.Tensor):
        self.variable = variable
        self.keep_new = keep_new
        self.users = 0
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        var = self.variable
        for name in _WRITES:
            if hasattr(var, name):
                self._saved[name] = var.__dict__.get(name, _MISSING)
                setattr(var, name, self._masked(getattr(var, name)))

    def uninstall(self) -> None:
        var = self.variable
        for name, saved in self._saved.items():
            delattr(var, name)
            if saved is not _MISSING:
                setattr(var, name, saved)
        self._saved.clear()

    def _masked(self, write: Callable[..., Any]) -> Callable[..., Any]:
        var = self.variable

        def masked_write(*args: Any, **kwargs: Any) -> tf.Variable:
            def run() -> None:
                write(*args, **kwargs)

            tf.cond(self.keep_new, run, _nothing)
            return var

        return masked_write


# Variables whose write methods are masked now, by id. Under
# `MirroredStrategy` every replica thread masks the same variables and the
# optimizer writes them from a `merge_call` in yet another thread, so the
# masks are shared and counted; every replica's `keep_new` has the same
# value, so the first one serves all.
_MASKS: dict[int, _WriteMask] = {}
_MASKS_LOCK = threading.Lock()


def _leaf_variables(variables: Sequence[tf.Variable]) -> list[tf.Variable]:
    """The variables writes reach: each replica's copy of a distributed one."""
    leaves: list[tf.Variable] = []
    for v in variables:
        if isinstance(v, tf.distribute.DistributedValues):
            leaves.extend(v.values)
        else:
            leaves.append(v)
    return _unique(leaves)


@contextlib.contextmanager
def _masking_writes(
    variables: Sequence[tf.Variable], keep_new: tf.Tensor
) -> Iterator[None]:
    """Within the block, writes to `variables` take effect only if `keep_new`.

    Args:
        variables: TensorFlow variables (plain or distributed).
        keep_new: Scalar boolean tensor.
    """
    leaves = _leaf_variables(variables)
    with _MASKS_LOCK:
        for v in leaves:
            mask = _MASKS.get(id(v))
            if mask is None:
                mask = _MASKS[id(v)] = _WriteMask(v, keep_new)
                mask.install()
            mask.users += 1
    try:
        yield
    finally:
        with _MASKS_LOCK:
            for v in leaves:
                mask = _MASKS[id(v)]
                mask.users -= 1
                if mask.users == 0:
                    mask.uninstall()
                    del _MASKS[id(v)]
