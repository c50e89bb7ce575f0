"""The legacy Keras 2 (`tf_keras`) optimizer families.

Two optimizer families ship with `tf_keras`:

- `tf_keras.optimizers.Optimizer`, the optimizer introduced in Keras 2.11
  (`tf_keras.optimizers.Adam`, ...), and
- `tf_keras.optimizers.legacy.Optimizer` (`OptimizerV2`), whose updates run
  in fused kernels (`ResourceApplyAdam`, ...) on the raw variable handles.

Neither's update is split into its all-reduce and its writes, so the masked
update snapshots their state (`masks_writes = False`): it reads every variable an
update can touch before the update and selects between old and new values
after it, so fused kernels, weight decay, EMA and constraints are all rolled
back alike on the in-between micro-steps.

This module imports `tf_keras`; `gradaccum._families` loads it only once
someone else has imported `tf_keras`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import tensorflow as tf
import tf_keras
from tf_keras.src.mixed_precision.autocast_variable import AutoCastVariable
from tf_keras.src.optimizers.legacy import optimizer_v2

from gradaccum._backend.tensorflow import distribution
from gradaccum._family import FamilyBase

# Both loss-scale optimizers (around either family) subclass this one.
_LossScaleOptimizers = tf_keras.mixed_precision.LossScaleOptimizer


def _variable_name(variable: Any) -> str:
    return getattr(variable, "name", repr(variable))


class _TfKerasFamily(FamilyBase):
    """What both `tf_keras` optimizer families share."""

    _base: ClassVar[type]
    # The `apply_gradients` keyword arguments the family takes.
    _apply_options: ClassVar[tuple[str, ...]]
    # A tf_keras loss-scale optimizer counts a step it skips in its inner
    # optimizer's `iterations`.
    skips_count_in_inner = True

    def __init__(self, optimizer: Any):
        super().__init__(optimizer)
        # The variables this family has built the optimizer for, in order.
        # A `tf_keras` optimizer does not keep that list itself.
        self._variables: list[Any] | None = None

    @classmethod
    def accepts(cls, optimizer: Any) -> bool:
        # A loss-scale optimizer belongs to the family it subclasses.
        return isinstance(optimizer, cls._base)

    def inner_attribute(self) -> str | None:
        # Both hold their inner optimizer in `_optimizer` (`inner_optimizer`
        # is a read-only property).
        return "_optimizer" if isinstance(self.optimizer, _LossScaleOptimizers) else None

    @property
    def built(self) -> bool:
        return self._variables is not None

    def trainable_variables(self) -> list[Any]:
        return list(self._variables or [])

    def model_variable(self, variable: Any) -> tf.Variable:
        """The variable an update writes: the one inside an `AutoCastVariable`."""
        if isinstance(variable, AutoCastVariable):
            return variable._variable
        return variable

    def apply_options(self, **kwargs: Any) -> Mapping[str, Any]:
        names = self._apply_options
        for key in kwargs:
            if key not in names:
                raise TypeError(
                    f"apply_gradients() got an unexpected keyword argument "
                    f"{key!r}; a {self.name} optimizer takes "
                    f"{', '.join(f'`{n}`' for n in names)}."
                )
        return dict(kwargs)


class TfKerasFamily(_TfKerasFamily):
    """`tf_keras.optimizers.Optimizer` (Keras 2.11+)."""

    name = "tf_keras"
    _base = tf_keras.optimizers.Optimizer
    _apply_options = ("name", "skip_gradients_aggregation", "experimental_aggregate_gradients")

    def __init__(self, optimizer: Any):
        super().__init__(optimizer)
        self._build_scope: str | None = None

    def build(self, variables: Sequence[Any]) -> None:
        opt = self.optimizer
        variables = list(variables)
        if getattr(opt, "_built", False):
            known = opt._index_dict
            missing = [v for v in variables if opt._var_key(v) not in known]
            if missing:
                raise ValueError(
                    "`optimizer` was built for other variables than the ones "
                    "it now receives gradients for: "
                    f"{[_variable_name(v) for v in missing]}. Build a new "
                    "optimizer for a new set of variables."
                )
        elif self._build_scope is None:
            opt.build(variables)
        else:
            # Built by the first `apply_gradients`: as it does, in a name
            # scope, which names the slots ("Adam/m/dense/kernel").
            with tf.name_scope(self._build_scope), tf.init_scope():
                opt.build(variables)
        self._variables = variables

    def apply_options(self, **kwargs: Any) -> Mapping[str, Any]:
        options = super().apply_options(**kwargs)
        if not self.built:
            opt = self.optimizer
            self._build_scope = options.get("name") or opt.name or "optimizer"
        return options

    def var_key(self, variable: Any) -> Any:
        return self.optimizer._var_key(variable)

    def state_variables(self) -> list[tf.Variable]:
        opt = self.optimizer
        # `variables` misses some state an update writes: the learning rate
        # `apply_gradients` assigns from its schedule, Nadam's `_u_product`.
        # Every variable the optimizer holds as an attribute is tracked too.
        hidden = [v for v in vars(opt).values() if isinstance(v, tf.Variable)]
        return list(opt.variables) + hidden

    def apply(
        self, grads: Sequence[Any], variables: Sequence[Any], options: Mapping[str, Any], masking: Any = None
    ) -> None:
        # No `masking`: tf_keras optimizers are not split (`masks_writes`).
        opt = self.optimizer
        if tf.executing_eagerly() and hasattr(opt, "_u_product_counter"):
            # Nadam also keeps a Python counter: run eagerly, it says for
            # which step `_u_product` is already up to date, and it is
            # `iterations + 1` before every step of plain training. The
            # masked update rolls the variable back but not the counter.
            opt._u_product_counter = int(opt.iterations.numpy()) + 1
        opt.apply_gradients(list(zip(grads, variables)), **options)

    def minimize(
        self, apply_gradients: Callable[..., Any], loss: Any, var_list: Any, tape: Any = None
    ) -> None:
        apply_gradients(self.optimizer.compute_gradients(loss, var_list, tape))


class TfKerasV2Family(_TfKerasFamily):
    """`tf_keras.optimizers.legacy.Optimizer` (OptimizerV2)."""

    name = "tf_keras legacy"
    _base = tf_keras.optimizers.legacy.Optimizer
    _apply_options = ("name", "experimental_aggregate_gradients")
    # An OptimizerV2 creates slots for each variable on its first gradient,
    # and a tf_keras loss-scale optimizer around the proxy (what `compile`
    # builds under `mixed_float16`) drops `None` gradients before calling it:
    # the first call may name only some of the variables.
    grows = True

    def build(self, variables: Sequence[Any]) -> None:
        variables = list(variables)
        self._create_weights(variables)
        self._variables = variables

    def grow(self, variables: Sequence[Any]) -> None:
        """Builds the optimizer for more variables, after those it has."""
        variables = list(variables)
        self._create_weights(variables)
        self._variables = list(self._variables or []) + variables

    def _create_weights(self, variables: list[Any]) -> None:
        opt = self.optimizer
        # As `apply_gradients` does: creates `iterations`, the
        # hyperparameter variables and any missing slots. Created here, not
        # on the update, the slots are among the state the masked update
        # restores on in-between micro-steps.
        with tf.name_scope(opt._name), tf.init_scope():
            opt._create_all_weights(variables)

    def var_key(self, variable: Any) -> Any:
        return optimizer_v2._var_key(variable)

    def apply_gradients_result(self) -> Any:
        # As `OptimizerV2.apply_gradients`: an op when traced (a loss-scale
        # optimizer's `tf.cond` needs one from both branches), made in
        # cross-replica context so that every replica returns the same one.
        if tf.executing_eagerly():
            return self.optimizer.iterations
        return distribution.in_cross_replica(self.strategy(), lambda strategy: tf.no_op())

    def state_variables(self) -> list[tf.Variable]:
        # `iterations`, hyperparameters and slots; `variables` is a method.
        return list(self.optimizer.variables())

    def apply(
        self, grads: Sequence[Any], variables: Sequence[Any], options: Mapping[str, Any], masking: Any = None
    ) -> None:
        # No `masking`: tf_keras optimizers are not split (`masks_writes`).
        self.optimizer.apply_gradients(list(zip(grads, variables)), **options)

    def minimize(
        self,
        apply_gradients: Callable[..., Any],
        loss: Any,
        var_list: Any,
        grad_loss: Any = None,
        name: str | None = None,
        tape: Any = None,
    ) -> Any:
        grads_and_vars = self.optimizer._compute_gradients(
            loss, var_list=var_list, grad_loss=grad_loss, tape=tape
        )
        return apply_gradients(grads_and_vars, name=name)


FAMILIES = (TfKerasFamily, TfKerasV2Family)
