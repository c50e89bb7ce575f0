"""Running the wrapped optimizer's update on a micro-step: masked or skipped.

Masked, for Keras 3 optimizers (`split_apply`): everything of the update
that synchronises replicas runs on every micro-step, and everything that
writes runs in one branch, taken on the apply step only. The optimizer's
`apply` is run in two parts:

    replica context:  unscale, clip, all-reduce            (every micro-step)
    merge call:       tf.cond(keep_new, writes, no-op)      (every micro-step)
    writes:           weight decay, `update_step` of each variable (through
                      `extended.update`), moving averages and their
                      overwrite, constraints, `iterations`

The merge call is taken on every replica (where the strategy needs none,
the branch is taken in replica context, as Keras does); the branch holds no
collective, and one branch serves the whole update whatever the number of
variables, as Keras's own `gradient_accumulation_steps` has. A variable that
received no gradient in the cycle (`Masking.conditions`) has its weight
decay, update and constraint in a branch of its own. Nothing is patched and
nothing is kept between calls: two optimizers may update at the same time
in two threads.

Snapshot and select (`snapshot_update`), for optimizers whose update cannot
be split so (tf_keras's `OptimizerV2`, whose kernels are fused, and Keras 3
optimizers that override the parts above under a strategy that needs merge
calls): the values of every tracked variable are read before the update and
selected after it, each by its own predicate, so that a variable without a
gradient in the cycle and its slots keep their values while the rest of
the state (`iterations`, Nadam's product) moves. This keeps one copy of all
of them alive until the select.

Skipped (`skipped_update`): the update runs only if `keep_new`. A `tf.cond`
in replica context must not enclose a `merge_call`, and the wrapped
optimizer's update makes several (all-reduce, per-variable updates, the step
counter), so under strategies that need merge calls (`MirroredStrategy`) the
decision is taken in cross-replica context and the update re-enters replica
context inside the branch, as Keras's `LossScaleOptimizer` does:

    merge_call -> tf.cond(keep_new, call_for_each_replica(update), no-op)

Each replica computes the same `keep_new` (from the mirrored micro-step
counter), so every replica takes the same branch. Selecting or skipping,
rather than multiplying by 0/1, means a non-finite value in the discarded
update cannot leak into the kept one (0 x inf is NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from gradaccum._backend.tensorflow.distribution import assign_each, in_cross_replica, tf_variable
from gradaccum._backend.tensorflow.tensors import nothing, select


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


# ----------------------------------------------------------------------
# Snapshot and select: one copy of the selected state alive during the update.


def _pick(var: tf.Variable, keep_new: tf.Tensor, old: tf.Tensor) -> Any:
    return var.assign(select(keep_new, var.read_value(), old))


def snapshot_update(
    strategy: tf.distribute.Strategy,
    keep: Sequence[tuple[tf.Variable, tf.Tensor]],
    update: Callable[[], Any],
) -> None:
    """Runs `update()`, then puts back each variable whose predicate is false.

    Args:
        strategy: The strategy the variables were created under.
        keep: Pairs of a variable `update` may write and a scalar boolean
            tensor (per replica, or one): whether the variable keeps its new
            value. A variable named twice keeps its first predicate.
        update: Runs the wrapped optimizer's update.
    """
    seen: set[int] = set()
    state, predicates = [], []
    for v, predicate in keep:
        if id(v) not in seen:
            seen.add(id(v))
            state.append(v)
            predicates.append(predicate)
    old = [v.read_value() for v in state]
    update()

    def select_each(strategy: tf.distribute.Strategy, predicates: Any, old: Any) -> None:
        assign_each(strategy, state, _pick, predicates, old)

    in_cross_replica(strategy, select_each, predicates, old)


# ----------------------------------------------------------------------
# A Keras 3 optimizer's update, split: synchronisation, then one branch.


class Masking(NamedTuple):
    """When a split update's writes take effect.

    Attributes:
        keep_new: Scalar boolean tensor, identical on every replica: the
            writes happen only if it holds. None where the caller's own
            branch decided already (skip mode).
        conditions: By position in the update's variables, a scalar boolean
            tensor: that variable's weight decay, update and constraint
            happen only if it holds too (it received a gradient in the
            cycle).
    """

    keep_new: Any
    conditions: dict[int, Any]


# The methods of a Keras 3 optimizer whose work `split_apply` does itself:
# an optimizer class that overrides one of them is updated by snapshot.
_SPLIT = ("apply", "_backend_apply_gradients", "_all_reduce_sum_gradients", "_distributed_tf_update_step",
          "_update_model_variables_moving_average", "_overwrite_model_variables_with_average_value")


def splits(optimizer: Any, strategy: tf.distribute.Strategy, conditioned: bool) -> bool:
    """Whether `split_apply` runs `optimizer`'s update as its `apply` does.

    An optimizer may override `_backend_update_step` (Nadam writes a
    product before calling its parent's) and `_apply_weight_decay` (Muon);
    `split_apply` then calls them inside the branch. That is sound only in
    replica context (no merge call needed), and for `_backend_update_step`
    only on one replica (its all-reduce then adds nothing) and for an update
    whose every variable received a gradient (`conditioned` False: it
    updates all its variables in one call).

    Asked where the update runs (in replica context, under `strategy`).

    Args:
        optimizer: A Keras 3 optimizer on TensorFlow.
        strategy: The strategy it was created under.
        conditioned: Whether some variable's update has a condition.
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    cls = type(optimizer)
    for name in _SPLIT:
        if getattr(cls, name, None) not in (getattr(TFOptimizer, name, None), getattr(BaseOptimizer, name, None)):
            return False
    own_step = cls._backend_update_step is not TFOptimizer._backend_update_step
    own_decay = cls._apply_weight_decay is not TFOptimizer._apply_weight_decay
    if not tf.__internal__.distribute.strategy_supports_no_merge_call():
        return not (own_step or own_decay)
    return not own_step or (strategy.num_replicas_in_sync == 1 and not conditioned)


def split_apply(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], masking: Masking) -> None:
    """`optimizer.apply(grads, variables)` with its writes in one branch.

    Called in replica context (or with no strategy). The optimizer must be
    built for `variables` and `splits` must hold.

    Args:
        optimizer: A Keras 3 optimizer on TensorFlow.
        grads: One gradient per variable, or None (left out, as `apply`
            leaves it out).
        variables: Keras variables.
        masking: When the writes take effect.
    """
    present = [k for k, g in enumerate(grads) if g is not None]
    if not present:
        return
    direct = [optimizer._overwrite_variable_with_gradient(variables[k]) for k in present]
    # A variable overwritten with its gradient takes it as it comes: not
    # unscaled, clipped nor all-reduced (as in `apply`).
    scale = optimizer.loss_scale_factor
    parts = [grads[k] if d or scale is None else grads[k] / scale for k, d in zip(present, direct)]
    clipped = optimizer._clip_gradients([g for g, d in zip(parts, direct) if not d])
    strategy = optimizer._distribution_strategy
    if strategy.num_replicas_in_sync > 1:
        pairs = optimizer._all_reduce_sum_gradients(
            [(g, tf_variable(variables[k])) for g, k in zip(clipped, [k for k, d in zip(present, direct) if not d])]
        )
        clipped = [g for g, _ in pairs]
    # On one replica the sum is the gradient itself: its all-reduce, ops that
    # copy each gradient, is left out.
    reduced = iter(clipped)
    values = [parts[j] if d else next(reduced) for j, d in enumerate(direct)]
    conditions = [masking.conditions.get(k) for k in present]
    keep = [] if masking.keep_new is None else [masking.keep_new]
    condition_values = [c for c in conditions if c is not None]

    def writes(distribution: tf.distribute.Strategy, values: list, keep: list, condition_values: list) -> None:
        first = distribution.experimental_local_results
        held = iter([first(c)[0] for c in condition_values])
        entries = [(k, g, d, None if c is None else next(held))
                   for k, g, d, c in zip(present, values, direct, conditions)]

        def run() -> None:
            _writes(optimizer, distribution, variables, entries)

        if keep:
            tf.cond(first(keep[0])[0], run, nothing)
        else:
            run()

    in_cross_replica(strategy, writes, values, keep, condition_values)


def _writes(optimizer: Any, distribution: tf.distribute.Strategy, variables: Sequence[Any], entries: list) -> None:
    """The writes of `apply`, in its order (`entries`: position, gradient,
    whether overwritten with it, condition or None)."""
    for k, g, direct, condition in entries:
        if direct:
            target = tf_variable(variables[k])
            _only_if(condition, lambda v=target, g=g: distribution.extended.update(v, _assign, args=(g,), group=False))
    updated = [(k, g, c) for k, g, d, c in entries if not d]
    learning_rate = optimizer.learning_rate
    always = [variables[k] for k, _, c in updated if c is None]
    _weight_decay(optimizer, distribution, always)
    _update_step(optimizer, distribution, [(g, variables[k]) for k, g, c in updated if c is None], learning_rate)
    for k, g, c in updated:
        if c is not None:
            def one(v: Any = variables[k], g: Any = g) -> None:
                _weight_decay(optimizer, distribution, [v])
                _update_step(optimizer, distribution, [(g, v)], learning_rate)

            tf.cond(c, one, nothing)
    if optimizer.use_ema:
        optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
        if optimizer.ema_overwrite_frequency:
            # Every variable, gradient or not, as `apply` overwrites them.
            overwrite = tf.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0)
            tf.cond(overwrite, lambda: optimizer._overwrite_model_variables_with_average_value(
                optimizer._trainable_variables), nothing)
    for k, _, c in updated:
        v = variables[k]
        if v.constraint is not None:
            _only_if(c, lambda v=v: v.assign(v.constraint(v)))
    optimizer._iterations.assign_add(1)


def _assign(variable: tf.Variable, value: Any) -> None:
    variable.assign(tf.cast(value, variable.dtype))


def _only_if(condition: Any, fn: Callable[[], Any]) -> None:
    if condition is None:
        fn()
    else:
        tf.cond(condition, lambda: (fn(), None)[1], nothing)


def _weight_decay(optimizer: Any, distribution: tf.distribute.Strategy, variables: list) -> None:
    """The optimizer's weight decay of `variables`: Keras's own for
    TensorFlow, without its merge call (this runs where that call leads)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    if not variables:
        return
    if type(optimizer)._apply_weight_decay is not TFOptimizer._apply_weight_decay:
        optimizer._apply_weight_decay(variables)
        return
    if optimizer.weight_decay is None:
        return

    def decay(variable: tf.Variable) -> None:
        if optimizer._use_weight_decay(variable):
            lr = tf.cast(optimizer.learning_rate, variable.dtype)
            wd = tf.cast(optimizer.weight_decay, variable.dtype)
            variable.assign_sub(variable * wd * lr)

    for variable in variables:
        distribution.extended.update(tf_variable(variable), decay, group=False)


def _update_step(optimizer: Any, distribution: tf.distribute.Strategy, pairs: list, learning_rate: Any) -> None:
    """The optimizer's `update_step` of each pair, as its
    `_backend_update_step` runs it after the all-reduce."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    if not pairs:
        return
    if type(optimizer)._backend_update_step is not TFOptimizer._backend_update_step:
        # Runs in replica context (see `splits`); its all-reduce of the
        # reduced gradients is then the identity of one replica's.
        optimizer._backend_update_step([g for g, _ in pairs], [v for _, v in pairs], learning_rate)
        return
    optimizer._distributed_tf_update_step(distribution, [(g, tf_variable(v)) for g, v in pairs], learning_rate)
