"""What the proxy needs from an optimizer, per optimizer family.

The proxy owns the accumulation; an adapter answers the few questions that
differ between optimizer families (Keras 3 here; other families register
their own adapter with `_register`): is it built, which variables does it
update, which variables hold its state, and how does it apply gradients.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import keras
import tensorflow as tf

from gradaccum.distribution import (
    _check_buildable,
    _check_strategy,
    _replicas_in_sync,
    _sum_over_replicas,
    _tf_variable,
)


class _Keras3Optimizer:
    """Adapter for `keras.optimizers.Optimizer` (Keras 3, TF backend)."""

    family = "Keras 3"
    # Every state change of a Keras 3 optimizer (update steps, weight decay,
    # EMA, constraints, the step counter) is a call of a TensorFlow
    # variable's write method, so the masked update can mask each write
    # instead of snapshotting all state (see `gradaccum.masking`). Adapters
    # for optimizers that write through fused kernels on raw variable
    # handles leave this False.
    masks_writes = True
    # Whether the optimizer creates its per-variable state lazily, so that a
    # gradient for a variable it was not built for extends the accumulation
    # state (`grow`) instead of being refused. A Keras 3 optimizer is built
    # for a fixed set of variables.
    grows = False

    def __init__(self, optimizer: keras.optimizers.Optimizer):
        self.optimizer = optimizer

    @staticmethod
    def accepts(optimizer: Any) -> bool:
        return isinstance(optimizer, keras.optimizers.Optimizer)

    def check(self) -> None:
        """Raises if the optimizer cannot be wrapped."""
        steps = getattr(self.optimizer, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "`optimizer` has its own gradient accumulation "
                f"(gradient_accumulation_steps={steps}); wrapping it would "
                "accumulate twice. Create it without "
                "`gradient_accumulation_steps`."
            )

    @property
    def built(self) -> bool:
        return bool(self.optimizer.built)

    def build(self, variables: Sequence[Any]) -> None:
        _check_strategy(self.strategy(), "optimizer")
        _check_buildable("optimizer")
        self.optimizer.build(list(variables))

    def trainable_variables(self) -> list[Any]:
        return list(self.optimizer._trainable_variables)

    def var_key(self, variable: Any) -> Any:
        return self.optimizer._var_key(variable)

    def state_variables(self) -> list[tf.Variable]:
        """Every TF variable holding optimizer state (slots, counters, EMA).

        `optimizer.variables` lists what Keras tracked while the optimizer
        was built. A `LossScaleOptimizer` builds its inner optimizer with
        tracking switched off, so variables an optimizer's `build` creates
        directly (Nadam's `_u_product`, Adafactor's placeholders) are then
        missing from that list; they are found among its attributes.
        """
        variables = list(self.optimizer.variables)
        known = {id(v) for v in variables}
        known |= {id(v) for v in self.optimizer._trainable_variables}
        for value in vars(self.optimizer).values():
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, keras.Variable) and id(v) not in known:
                    known.add(id(v))
                    variables.append(v)
        return [_tf_variable(v) for v in variables]

    def model_variable(self, variable: Any) -> tf.Variable:
        return _tf_variable(variable)

    def strategy(self) -> tf.distribute.Strategy:
        strategy = getattr(self.optimizer, "_distribution_strategy", None)
        return strategy if strategy is not None else tf.distribute.get_strategy()

    def apply_options(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Extra `apply_gradients` arguments: a Keras 3 optimizer takes none."""
        if args or kwargs:
            raise TypeError(
                "apply_gradients() of a Keras 3 optimizer takes only "
                "`grads_and_vars`. Received extra arguments: "
                f"{list(args) + sorted(kwargs)}."
            )
        return {}

    def apply(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        self.optimizer.apply(list(grads), list(variables))

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's own `apply_gradients` (a loss-scale one's)."""
        return self.optimizer.apply_gradients(grads_and_vars, *args, **kwargs)

    def apply_accumulated(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """`apply` for accumulated (dense, per-replica) gradients.

        Under several replicas with clipping set, clips what one device
        training on the large batch would clip (see `_clip_across_replicas`).
        """
        grads = list(grads)
        replicas = _replicas_in_sync()
        if replicas > 1 and self._clips():
            grads = self._clip_across_replicas(grads, replicas)
        self.optimizer.apply(grads, list(variables))

    def _clips(self) -> bool:
        names = ("clipnorm", "global_clipnorm", "clipvalue")
        return any(getattr(self.optimizer, name, None) for name in names)

    def _clip_across_replicas(self, grads: list[Any], replicas: int) -> list[Any]:
        """Clips the gradient summed over replicas, as one device would.

        Keras clips each replica's share of the gradient before its
        all-reduce, so with several replicas it clips a different vector
        than training on one device does. Summing first, clipping with the
        optimizer's own rule, and handing each replica `1 / replicas` of the
        result makes the optimizer's all-reduce rebuild the clipped sum; its
        own clipping then leaves the (already small enough) shares alone.
        Costs one more all-reduce per step, only when clipping is set.
        """
        summed = _sum_over_replicas(grads)
        scale = getattr(self.optimizer, "loss_scale_factor", None)
        if scale is not None:
            summed = [g / scale for g in summed]
        clipped = self.optimizer._clip_gradients(summed)
        if scale is not None:
            clipped = [g * scale for g in clipped]
        return [g / replicas for g in clipped]

    @property
    def iterations(self) -> Any:
        return self.optimizer.iterations

    def apply_gradients_result(self) -> Any:
        """What `apply_gradients` returns: the optimizer's `iterations`."""
        return self.optimizer.iterations


_ADAPTERS: list[type] = [_Keras3Optimizer]


def _register(adapter: type) -> None:
    """Adds an adapter class (with `accepts`) for another optimizer family."""
    if adapter not in _ADAPTERS:
        _ADAPTERS.append(adapter)


def _load_optional_families() -> None:
    """Registers the adapters of optimizer families already imported.

    `tf_keras` is imported only by its users; its adapters are loaded once it
    is, so `import gradaccum` never imports it.
    """
    if "tf_keras" in sys.modules:
        import gradaccum.legacy  # noqa: F401  (registers its adapters)


def _adapter_for(optimizer: Any) -> Any | None:
    _load_optional_families()
    for adapter in _ADAPTERS:
        if adapter.accepts(optimizer):
            return adapter(optimizer)
    return None


def _families() -> str:
    _load_optional_families()
    return ", ".join(a.family for a in _ADAPTERS)

