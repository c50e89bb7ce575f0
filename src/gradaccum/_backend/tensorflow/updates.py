"""Running the wrapped optimizer's update on a micro-step: masked or skipped.

Masked (`masked_update`): the update runs on every micro-step and keeps its
effect only on the apply step. On an in-between step every trainable
variable and every optimizer variable (moments, counters, EMA copies,
whatever the optimizer created) ends exactly where it started, bit for bit.
No branch encloses the update, so the optimizer's own replica
synchronisation (all-reduce, `merge_call`) runs unconditionally and
identically on every replica. Two ways to mask, chosen by the optimizer
family (`masks_writes`):

- Masked writes (`masking_writes`), for optimizers whose every state change
  goes through a write method of a TensorFlow variable (`assign`,
  `assign_add`, `assign_sub`, `scatter_*`), as Keras 3 optimizers' do. While
  the update runs, each of those writes to a tracked variable happens only
  if `keep_new`: `tf.cond(keep_new, write, nothing)` around that one write,
  whose value is computed unconditionally. Nothing is copied ahead of the
  update, and an in-between step writes nothing. Where the optimizer has a
  method that updates one variable and synchronises nothing (Keras 3's
  `update_step`, which runs per variable after the all-reduce, inside
  `extended.update`), that method runs only if `keep_new`
  (`skipping_each`): an in-between step skips the update's arithmetic, the
  bulk of its cost, while everything around it that may synchronise
  (all-reduce, clipping, merge calls) still runs on every micro-step.
- Snapshot and select (`snapshot_update`), for optimizers that write through
  fused kernels on raw variable handles: the values of every tracked
  variable are read before the update and selected after it. This keeps one
  copy of all of them alive until the select.

Selecting or skipping a write, rather than multiplying by 0/1, means a
non-finite value in the discarded update cannot leak into the kept one
(0 x inf is NaN).

Skipped (`skipped_update`): the update runs only if `keep_new`. A `tf.cond`
in replica context must not enclose a `merge_call`, and the wrapped
optimizer's update makes several (all-reduce, per-variable updates, the step
counter), so under strategies that need merge calls (`MirroredStrategy`) the
decision is taken in cross-replica context and the update re-enters replica
context inside the branch, as Keras's `LossScaleOptimizer` does:

    merge_call -> tf.cond(keep_new, call_for_each_replica(update), no-op)

Each replica computes the same `keep_new` (from the mirrored micro-step
counter), so every replica takes the same branch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from gradaccum import _patches
from gradaccum._backend.tensorflow.distribution import assign_each, copies, in_cross_replica
from gradaccum._backend.tensorflow.tensors import nothing, select


def masked_update(
    strategy: tf.distribute.Strategy,
    keep_new: tf.Tensor,
    state: Sequence[tf.Variable],
    update: Callable[[], Any],
    masks_writes: bool = False,
    per_variable: tuple[Any, str] | None = None,
    conditions: dict[int, tf.Tensor] | None = None,
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
        per_variable: With `masks_writes`, `(optimizer, name)` of the
            optimizer's method that updates one variable and synchronises
            nothing; it runs only if `keep_new` (see `skipping_each`).
        conditions: With `per_variable`, further conditions by the id of a
            variable (each replica's copy): its update and its writes take
            effect only if its condition holds too.
    """
    if masks_writes:
        skipping = contextlib.nullcontext()
        if per_variable is not None:
            skipping = skipping_each(*per_variable, keep_new, conditions)
        overwriting = contextlib.nullcontext()
        if conditions and per_variable is not None:
            overwriting = overwriting_all(per_variable[0])
        with masking_writes(state, keep_new, conditions), skipping, overwriting:
            update()
    else:
        snapshot_update(strategy, keep_new, state, update)


def skipped_update(keep_new: tf.Tensor, update: Callable[..., Any], *args: Any) -> None:
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
        tf.cond(keep_new, run, nothing)
        return

    def decide(distribution: tf.distribute.Strategy, keep_new: Any, *args: Any) -> None:
        # Every replica computed the same value; take the first replica's.
        keep = distribution.experimental_local_results(keep_new)[0]

        def run_on_each_replica() -> None:
            distribution.extended.call_for_each_replica(update, args=args)

        tf.cond(keep, run_on_each_replica, nothing)

    tf.distribute.get_replica_context().merge_call(decide, args=(keep_new, *args))


def _unique(variables: Sequence[tf.Variable]) -> list[tf.Variable]:
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


# ----------------------------------------------------------------------
# Snapshot and select: one copy of all of `state` alive during the update.


def _pick(var: tf.Variable, keep_new: tf.Tensor, old: tf.Tensor) -> Any:
    return var.assign(select(keep_new, var.read_value(), old))


def snapshot_update(
    strategy: tf.distribute.Strategy,
    keep_new: tf.Tensor,
    state: Sequence[tf.Variable],
    update: Callable[[], Any],
) -> None:
    """`masked_update` by reading all of `state` first and selecting after."""
    state = _unique(state)
    old = [v.read_value() for v in state]
    update()

    def select_each(strategy: tf.distribute.Strategy, keep_new: Any, old: Any) -> None:
        assign_each(strategy, state, _pick, [keep_new] * len(state), old)

    in_cross_replica(strategy, select_each, keep_new, old)


# ----------------------------------------------------------------------
# Masked writes: each write happens only if `keep_new`.

# The write methods of `tf.Variable`.
WRITES = (
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


class _Mask:
    """Patches that make calls take effect only if `keep_new`, shared by
    every replica thread that masks the same object (see `_shared`)."""

    def __init__(self) -> None:
        self.users = 0
        self._patches: list[_patches.Patch] = []

    def remove(self) -> None:
        for patch in self._patches:
            patch.remove()


class _WriteMask(_Mask):
    """The write methods of one TensorFlow variable, masked by `keep_new`.

    A masked write is `tf.cond(keep_new, write, nothing)`. The branch holds
    that one write and nothing that synchronises replicas; the value it
    writes is computed outside, unconditionally. Selecting between the new
    and the current value instead would assign a variable its own buffer on
    every in-between step, which TensorFlow does by copying it.
    """

    def __init__(self, variable: tf.Variable, keep_new: tf.Tensor, base: tf.Tensor | None = None):
        super().__init__()

        def masked_write(write: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
            def run() -> None:
                write(*args, **kwargs)

            # Overwriting with the moving averages, Keras writes every
            # variable, gradient or not: only the update's own condition.
            keep = base if base is not None and _OVERWRITING[0] > 0 else keep_new
            tf.cond(keep, run, nothing)
            return variable

        self._patches = [
            _patches.Patch(variable, name, masked_write)
            for name in WRITES
            if hasattr(variable, name)
        ]


class _CallMask(_Mask):
    """One method of an object, run only if `keep_new` (its result dropped).

    The method must synchronise nothing: the branch is taken per replica
    (or per device, inside `extended.update`).
    """

    def __init__(self, owner: Any, name: str, keep_new: tf.Tensor, conditions: dict[int, tf.Tensor] | None = None):
        super().__init__()
        conditions = conditions or {}

        def only_if_kept(method: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> None:
            def run() -> None:
                method(*args, **kwargs)

            # `update_step(gradient, variable, learning_rate)`.
            variable = args[1] if len(args) > 1 else kwargs.get("variable")
            condition = conditions.get(id(variable))
            tf.cond(keep_new if condition is None else tf.logical_and(keep_new, condition), run, nothing)

        self._patches = [_patches.Patch(owner, name, only_if_kept)]


# What is masked now, by the id of the masked object. Under
# `MirroredStrategy` every replica thread masks the same variables (and the
# same optimizer) and the optimizer writes them from a `merge_call` in yet
# another thread, so the masks are shared and counted; every replica's
# `keep_new` has the same value, so the first one serves all.
MASKS: dict[int, _Mask] = {}
_MASKS_LOCK = threading.Lock()


@contextlib.contextmanager
def _shared(objects: Sequence[Any], make: Callable[[Any], _Mask]) -> Iterator[None]:
    """Within the block, each of `objects` is masked by `make(object)`, or by
    the mask another thread made for it and still holds."""
    with _MASKS_LOCK:
        for o in objects:
            mask = MASKS.get(id(o))
            if mask is None:
                mask = MASKS[id(o)] = make(o)
            mask.users += 1
    try:
        yield
    finally:
        with _MASKS_LOCK:
            for o in objects:
                mask = MASKS[id(o)]
                mask.users -= 1
                if mask.users == 0:
                    mask.remove()
                    del MASKS[id(o)]


def _leaf_variables(variables: Sequence[tf.Variable]) -> list[tf.Variable]:
    """The variables writes reach: each replica's copy of a distributed one."""
    return _unique([copy for v in variables for copy in copies(v)])


def masking_writes(
    variables: Sequence[tf.Variable], keep_new: tf.Tensor, conditions: dict[int, tf.Tensor] | None = None
) -> contextlib.AbstractContextManager:
    """Within the block, writes to `variables` take effect only if `keep_new`
    (and, for a variable in `conditions`, by the id of a leaf copy, its
    condition).

    Args:
        variables: TensorFlow variables (plain or distributed).
        keep_new: Scalar boolean tensor.
        conditions: Further conditions by the id of a leaf variable.
    """
    conditions = conditions or {}

    def mask(v: tf.Variable) -> _WriteMask:
        condition = conditions.get(id(v))
        if condition is None:
            return _WriteMask(v, keep_new)
        return _WriteMask(v, tf.logical_and(keep_new, condition), base=keep_new)

    return _shared(_leaf_variables(variables), mask)


# How many calls are overwriting the model's variables with their moving
# averages (`ema_overwrite_frequency`) now. A count, not a thread-local flag:
# under a strategy the writes run in a merge call's thread, while each
# replica's thread waits inside the call.
_OVERWRITING = [0]


@contextlib.contextmanager
def overwriting_all(optimizer: Any) -> Iterator[None]:
    """Within the block, the optimizer's overwrite of the model variables
    with their moving averages is held back by the update's condition only,
    not by a variable's own: as in the large batch, Keras overwrites every
    variable, whether it received a gradient or not."""
    name = "_overwrite_model_variables_with_average_value"
    if not hasattr(optimizer, name):
        yield
        return

    def flagged(method: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        with _MASKS_LOCK:
            _OVERWRITING[0] += 1
        try:
            return method(*args, **kwargs)
        finally:
            with _MASKS_LOCK:
                _OVERWRITING[0] -= 1

    patch = _patches.Patch(optimizer, name, flagged)
    try:
        yield
    finally:
        patch.remove()


def skipping_each(
    owner: Any, name: str, keep_new: tf.Tensor, conditions: dict[int, tf.Tensor] | None = None
) -> contextlib.AbstractContextManager:
    """Within the block, calls of `owner.name` run only if `keep_new`.

    On an in-between step nothing of the method runs: its arithmetic is
    skipped, not only its writes. That is sound only for a method that
    synchronises nothing, such as Keras 3's `update_step`.

    Args:
        owner: The object whose method is masked (an optimizer).
        name: The method's name.
        keep_new: Scalar boolean tensor.
        conditions: Further conditions by the id of the variable the method
            is called for (its second argument).
    """
    return _shared([owner], lambda o: _CallMask(o, name, keep_new, conditions))
