"""What the accumulation needs from an optimizer, per optimizer family.

The accumulation owns the accumulators and the cycle; a family answers the
few questions whose answers differ between optimizer families: is the
optimizer built, for which variables, which variables hold its state, how
does it apply gradients, and is it a loss-scale optimizer around another.
`OptimizerFamily` is the contract; `FamilyBase` holds the defaults that
families share. Families are looked up in `gradaccum._families`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from gradaccum import _backend


class OptimizerFamily(Protocol):
    """The contract between the accumulation and one optimizer family."""

    # For messages: "Keras 3", "tf_keras", ...
    name: ClassVar[str]
    # Whether the optimizer's update can be split into what synchronises
    # replicas and what writes (`apply` takes a `masking`), so that the
    # masked update runs the writes in one branch instead of snapshotting
    # all state (see `gradaccum._backend.Replicas.apply_masked`).
    masks_writes: ClassVar[bool]
    # With `masks_writes`: the name of the optimizer's method that updates
    # one variable and synchronises nothing, so that a variable without a
    # gradient in the cycle can be left out at run time; None if it has
    # none such.
    per_variable_update: ClassVar[str | None]
    # Whether the optimizer creates its per-variable state lazily, so that a
    # gradient for a variable it was not built for extends the accumulation
    # state (`grow`) instead of being refused.
    grows: ClassVar[bool]
    # Whether a loss-scale optimizer of this family adds a step it skips for
    # non-finite gradients to its inner optimizer's `iterations`.
    skips_count_in_inner: ClassVar[bool]
    optimizer: Any

    @classmethod
    def accepts(cls, optimizer: Any) -> bool:
        """Whether `optimizer` belongs to this family."""

    def check(self) -> None:
        """Raises if the optimizer cannot be wrapped."""

    def inner_attribute(self) -> str | None:
        """For a loss-scale optimizer, the attribute holding its inner one."""

    @property
    def built(self) -> bool:
        """Whether the optimizer is built (its state exists)."""

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the optimizer for `variables`."""

    def grow(self, variables: Sequence[Any]) -> None:
        """Builds the optimizer for more variables (only if `grows`)."""

    def trainable_variables(self) -> list[Any]:
        """The variables the optimizer is built for, in its order."""

    def var_key(self, variable: Any) -> Any:
        """A hashable identity of `variable`, as the optimizer keys it."""

    def state_variables(self) -> list[Any]:
        """Every variable holding optimizer state that an update may write
        (as the backend's hooks write it: `Replicas.native`)."""

    def model_variable(self, variable: Any) -> Any:
        """The variable an update of `variable` writes (likewise)."""

    def slots(self, variables: Sequence[Any]) -> list[list[Any]] | None:
        """For each of `variables`, the optimizer state that belongs to it
        alone (what an update that leaves it out leaves alone), or None
        where the family cannot tell."""

    def unattributed_state(self) -> list[Any]:
        """Optimizer state that may belong to one variable but that `slots`
        attributes to none."""

    def strategy(self) -> Any:
        """The distribution strategy the optimizer was created under
        (`Replicas.strategy_of`)."""

    def apply_options(self, **kwargs: Any) -> Mapping[str, Any]:
        """The extra `apply_gradients` keyword arguments, checked."""

    def apply(
        self, grads: Sequence[Any], variables: Sequence[Any], options: Mapping[str, Any], masking: Any = None
    ) -> None:
        """The optimizer's own update, with what `apply_options` returned;
        with a `masking` (only where `masks_writes`), its writes take effect
        only as that says (`gradaccum._backend.Replicas.apply_masked`)."""

    def replica_clip(self) -> Callable[[list[Any]], list[Any]] | None:
        """The optimizer's clipping of a summed gradient, if it clips each
        replica's share before the all-reduce (else None)."""

    def gradient_scale(self) -> Any:
        """A loss-scale factor the optimizer divides its gradients by first
        (Keras 3's `loss_scale_factor`), or None."""

    @property
    def iterations(self) -> Any:
        """The optimizer's step counter."""

    def apply_gradients_result(self) -> Any:
        """What the optimizer's `apply_gradients` returns."""

    def minimize(
        self, apply_gradients: Callable[..., Any], loss: Any, var_list: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """The optimizer's `minimize`, applying through `apply_gradients`."""


class FamilyBase:
    """Defaults that optimizer families share (see `OptimizerFamily`)."""

    name: ClassVar[str] = "?"
    masks_writes: ClassVar[bool] = False
    per_variable_update: ClassVar[str | None] = None
    grows: ClassVar[bool] = False
    skips_count_in_inner: ClassVar[bool] = False

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def check(self) -> None:
        return None

    def inner_attribute(self) -> str | None:
        return None

    def grow(self, variables: Sequence[Any]) -> None:
        raise NotImplementedError(f"A {self.name} optimizer does not grow.")

    def model_variable(self, variable: Any) -> Any:
        return variable

    def slots(self, variables: Sequence[Any]) -> list[list[Any]] | None:
        return None

    def unattributed_state(self) -> list[Any]:
        return []

    def strategy(self) -> Any:
        return _backend.for_active().replicas.strategy_of(self.optimizer)

    def apply_options(self, **kwargs: Any) -> Mapping[str, Any]:
        if kwargs:
            raise TypeError(
                f"apply_gradients() of a {self.name} optimizer takes only "
                f"`grads_and_vars`. Received extra arguments: {sorted(kwargs)}."
            )
        return {}

    def replica_clip(self) -> Callable[[list[Any]], list[Any]] | None:
        return None

    def gradient_scale(self) -> Any:
        return None

    @property
    def iterations(self) -> Any:
        return self.optimizer.iterations

    def apply_gradients_result(self) -> Any:
        return self.optimizer.iterations

    def minimize(
        self, apply_gradients: Callable[..., Any], loss: Any, var_list: Any, *args: Any, **kwargs: Any
    ) -> Any:
        raise AttributeError(
            f"{type(self.optimizer).__name__!r} object has no attribute 'minimize'"
        )
