"""The Keras 3 optimizer family (`keras.optimizers.Optimizer`), on every Keras backend."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras

from gradaccum import _backend
from gradaccum._family import FamilyBase

# The base optimizer's lists of variables that hold no variable's slots: all
# its variables, those it is built for, and EMA's averages.
_BASE_LISTS = ("_variables", "_trainable_variables", "_model_variables_moving_average")


class Keras3Family(FamilyBase):
    """`keras.optimizers.Optimizer`, and Keras's `LossScaleOptimizer` around one."""

    name = "Keras 3"
    # Its `apply` splits into all-reduce and writes on TensorFlow (see
    # `OptimizerFamily.masks_writes`).
    masks_writes = True
    # Runs per variable inside `extended.update`, after the all-reduce.
    per_variable_update = "update_step"

    @classmethod
    def accepts(cls, optimizer: Any) -> bool:
        return isinstance(optimizer, keras.optimizers.Optimizer)

    def check(self) -> None:
        steps = getattr(self.optimizer, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "`optimizer` has its own gradient accumulation "
                f"(gradient_accumulation_steps={steps}); wrapping it would "
                "accumulate twice. Create it without "
                "`gradient_accumulation_steps`."
            )

    def inner_attribute(self) -> str | None:
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return "inner_optimizer"
        return None

    @property
    def built(self) -> bool:
        return bool(self.optimizer.built)

    def build(self, variables: Sequence[Any]) -> None:
        _backend.for_active().replicas.check_buildable(self)
        self.optimizer.build(list(variables))

    def trainable_variables(self) -> list[Any]:
        return list(self.optimizer._trainable_variables)

    def var_key(self, variable: Any) -> Any:
        return self.optimizer._var_key(variable)

    def state_variables(self) -> list[Any]:
        """Every variable holding optimizer state (slots, counters, EMA), as
        the backend's hooks write it (`Replicas.native`).

        `optimizer.variables` lists what Keras tracked while the optimizer
        was built. A `LossScaleOptimizer` builds its inner optimizer with
        tracking switched off, so variables an optimizer's `build` creates
        directly (Nadam's `_u_product`, Adafactor's placeholders) are then
        missing from that list; they are found among its attributes.
        """
        variables = list(self.optimizer.variables) + self.untracked_variables()
        native = _backend.for_active().replicas.native
        return [native(v) for v in variables]

    def untracked_variables(self) -> list[Any]:
        """The optimizer state missing from `optimizer.variables` (see
        `state_variables`), in the order of the optimizer's attributes.

        Keras's own files do not hold these; the proxy saves them itself.
        """
        known = {id(v) for v in self.optimizer.variables}
        known |= {id(v) for v in self.optimizer._trainable_variables}
        found = []
        for value in vars(self.optimizer).values():
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, keras.Variable) and id(v) not in known:
                    known.add(id(v))
                    found.append(v)
        return found

    def slots(self, variables: Sequence[Any]) -> list[list[Any]] | None:
        """The optimizer state that belongs to each of `variables` alone.

        Keras's optimizers keep a variable's slots in lists of one entry per
        variable they were built for, at the variable's index
        (`self._momentums[self._get_variable_index(variable)]`): the entry
        of every such list among the optimizer's attributes, but the base
        optimizer's own (all its variables, and EMA's averages, which move
        in every update, gradient or not).

        Args:
            variables: Variables the optimizer was built for.

        Returns:
            For each variable, its slots (as `state_variables` lists them).
        """
        native = _backend.for_active().replicas.native
        lists = self._slot_lists()
        indices = [self.optimizer._get_variable_index(v) for v in variables]
        return [[native(s[k]) for s in lists if s[k] is not None] for k in indices]

    def unattributed_state(self) -> list[Any]:
        """Optimizer state that may belong to one variable but that `slots`
        attributes to none: every state variable that is not a scalar (the
        optimizer's own counters and products, as Nadam's, are) nor a slot.
        EMA's averages among them: each moves in every update, computed
        from its variable's new value, which an update that runs for a
        variable without a gradient has moved."""
        native = _backend.for_active().replicas.native
        known = {id(native(s)) for slots in self._slot_lists() for s in slots if s is not None}
        return [v for v in self.state_variables() if id(v) not in known and len(v.shape) != 0]

    def _slot_lists(self) -> list[list[Any]]:
        count = len(self.optimizer._trainable_variables)
        found = []
        for name, value in vars(self.optimizer).items():
            if name in _BASE_LISTS or not isinstance(value, (list, tuple)) or len(value) != count:
                continue
            if all(v is None or isinstance(v, keras.Variable) for v in value) and any(v is not None for v in value):
                found.append(value)
        return found

    def model_variable(self, variable: Any) -> Any:
        return _backend.for_active().replicas.native(variable)

    def apply(
        self, grads: Sequence[Any], variables: Sequence[Any], options: Mapping[str, Any], masking: Any = None
    ) -> None:
        # `options` is always empty (`apply_options` accepts none).
        if masking is None:
            self.optimizer.apply(list(grads), list(variables))
            return
        _backend.for_active().replicas.apply_masked(self.optimizer, grads, variables, masking)

    def gradient_scale(self) -> Any:
        return getattr(self.optimizer, "loss_scale_factor", None)

    def replica_clip(self) -> Callable[[list[Any]], list[Any]] | None:
        """Keras 3 clips each replica's share before its all-reduce."""
        names = ("clipnorm", "global_clipnorm", "clipvalue")
        if not any(getattr(self.optimizer, name, None) for name in names):
            return None
        optimizer = self.optimizer

        def clip(summed: list[Any]) -> list[Any]:
            # On unscaled gradients, as a loss-scale optimizer hands them.
            scale = getattr(optimizer, "loss_scale_factor", None)
            if scale is not None:
                summed = [g / scale for g in summed]
            clipped = optimizer._clip_gradients(summed)
            return clipped if scale is None else [g * scale for g in clipped]

        return clip
