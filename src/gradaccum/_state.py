"""The accumulation state of one optimizer.

`State` owns the variables gradients are accumulated for and their index,
one accumulator per variable, the micro-step counter, the sum of the cycle's
micro-batch weights, `n` (an int's variable), which variables took part
(see docs/ARCHITECTURE.md), and, on TensorFlow, each variable's kept slices (its cycle's
`tf.IndexedSlices`, unless `sparse="rows"`). The backend creates the variables (`Backend.create_state`); it is
built once the wrapped optimizer is, and grows with an optimizer that
creates its state lazily (`OptimizerFamily.grows`). How it persists is
`gradaccum._persistence`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from keras import ops

from gradaccum import _noise
from gradaccum._backend import Backend, KeptSlices
from gradaccum._view import AccumulationState


def variable_name(variable: Any) -> str:
    """A variable's path (Keras 3) or name, for messages."""
    return getattr(variable, "path", None) or getattr(variable, "name", repr(variable))


# A variable's kind (`_kind`) and the groups a micro-step adds gradients in
# (`State.group`): a sparse gradient is kept as slices, or scattered into a
# sum's rows.
SUM, MAXIMUM, COMPENSATED = "sum", "maximum", "compensated"
SLICES, SCATTERED = "slices", "scattered"
GROUPS = (SUM, MAXIMUM, COMPENSATED, SCATTERED, SLICES)


def _kind(variable: Any, dtype: str) -> str:
    """How `variable`'s gradients are accumulated, decided once, when the
    state is built (or grows): `MAXIMUM`, the cycle's maximum, not a mean,
    for Keras variables marked `overwrite_with_gradient` (a float8 layer's
    scales and amax histories: the wrapped optimizer assigns their
    "gradient", which is their new value; Keras marks them when it creates
    them); `COMPENSATED`, summed with compensation, with bfloat16
    accumulators (`dtype`); else `SUM`."""
    if getattr(variable, "overwrite_with_gradient", False):
        return MAXIMUM
    return COMPENSATED if dtype == "bfloat16" else SUM


class State:
    """Accumulators, counters and which variables took part, for one optimizer's variables.

    Args:
        backend: The backend's hooks.
        family: The wrapped optimizer's family.
        variables: The variables the optimizer is built for, in its order.
        n: The int `n`, or None for a schedule.
        dtype: The accumulators' dtype, `"float32"` or `"bfloat16"` (then
            with compensations, see `gradaccum._compensated`).
    """

    def __init__(self, backend: Backend, family: Any, variables: Sequence[Any], n: int | None,
                 dtype: str = "float32"):
        self._backend = backend
        self._family = family
        self.variables: list[Any] = list(variables)
        self._index = {family.var_key(v): i for i, v in enumerate(self.variables)}
        # Each variable's kind (`_kind`), decided here, once.
        self._kinds = [_kind(v, dtype) for v in self.variables]
        created = backend.create_state(family, self.variables, n, dtype)
        self._dtype = dtype
        self.accumulators: list[Any] = created.accumulators
        # With bfloat16 accumulators, each one's compensation (by position).
        self.compensations = backend.new_accumulators(family, self.variables, dtype) if dtype == "bfloat16" else None
        self.micro_step = created.micro_step
        self.weight_total = created.weight_total
        self.n = created.n
        # Which variables took part in the current cycle, where the backend
        # keeps flags of it in a variable (`Backend.create_state`).
        self.took_part = created.took_part
        # The cycle's position and which variables took part in it, on the
        # device or on the host (`Backend.position`).
        self.position = backend.position(self.micro_step, self.took_part)
        # Each variable's kept slices (`KeptSlices.new_kept`), by position,
        # made when it first receives `tf.IndexedSlices` to keep (or a file
        # gives it some).
        self.kept: dict[int, Any] = {}
        # What a checkpoint's restore gave the kept slices, loaded once the
        # whole restore has been read (`gradaccum._persistence.checkpoint`).
        self.loaded_slices: dict[int, dict[str, Any]] = {}
        # Positions of the variables that took part in some cycle so far: an
        # update may involve only these.
        self.took_part_ever: set[int] = set()
        # The gradient noise scale's state (`gradaccum._noise`), if measured.
        self.noise: Any = None
        # What TensorFlow checkpoints track (`gradaccum._persistence`): it
        # holds the containers above, so that growing them is tracked.
        self.checkpoint: Any = None

    # ------------------------------------------------------------------
    # Variables and their index.

    def indices_of(self, variables: Sequence[Any]) -> list[int]:
        """Each variable's index; adds those not met yet if the family grows.

        Raises:
            ValueError: For a variable the optimizer was not built for, if
                the family does not grow (or cannot grow here).
        """
        var_key = self._family.var_key
        new: dict[Any, Any] = {}
        for v in variables:
            key = var_key(v)
            if key not in self._index:
                new.setdefault(key, v)
        if new:
            if not self._family.grows:
                raise ValueError(
                    f"Received a gradient for variable {variable_name(next(iter(new.values())))!r}, "
                    "which this optimizer was not built for. It was built for "
                    f"{len(self.variables)} variables: "
                    f"{[variable_name(u) for u in self.variables]}."
                    " Build a new optimizer for a new set of variables."
                )
            self._grow(list(new.values()))
        return [self._index[var_key(v)] for v in variables]

    def _grow(self, variables: list[Any]) -> None:
        """Extends the state to variables met after `build`.

        For optimizers that create their per-variable state lazily (a tf_keras
        OptimizerV2, which a loss-scale optimizer may first call with only the
        variables that have gradients): their slots and accumulators are
        created as `build` creates them, and the variables are appended to the
        built ones, so existing indices (and checkpoint positions) stay.
        """
        traced = not self._backend.writable_now(self.micro_step)
        try:
            accumulators = self._backend.new_accumulators(self._family, variables, self._dtype)
            compensations = self.compensations and self._backend.new_accumulators(self._family, variables, "bfloat16")
            self._family.grow(variables)  # last: nothing is recorded if a creation fails
        except ValueError as error:
            if not traced:
                raise
            raise ValueError(
                f"Received gradients for variables {[variable_name(v) for v in variables]}, "
                "which this optimizer was not built for, inside a `tf.function` that "
                "cannot create their accumulation state (a `tf.function` "
                "creates variables on its first trace only). Build the "
                "optimizer with all variables before the first step: "
                "`opt.build(model.trainable_variables)`."
            ) from error
        start = len(self.variables)
        for i, v in enumerate(variables):
            self._index[self._family.var_key(v)] = start + i
        self.variables.extend(variables)
        self._kinds.extend(_kind(v, self._dtype) for v in variables)
        # Appended to the tracked list: checkpointed as the next positions,
        # and restored there from a checkpoint read before they existed.
        self.accumulators.extend(accumulators)
        if compensations:
            self.compensations.extend(compensations)

    # ------------------------------------------------------------------
    # Which variables take part (see docs/ARCHITECTURE.md).

    def may_take_part(self) -> list[int]:
        """Positions of the held variables that took part in some cycle."""
        return sorted(i for i in self.took_part_ever if i < len(self.accumulators))

    def unmet(self) -> list[int]:
        """Took part before a restore, but not met by this optimizer yet."""
        return sorted(i for i in self.took_part_ever if i >= len(self.variables))

    def never_took_part(self) -> list[int]:
        """Held, but never took part (no gradient so far)."""
        return [i for i in range(len(self.variables)) if i not in self.took_part_ever]

    def check_unmet(self, ends: Any) -> None:
        """Refuses to end a cycle without restored sums it cannot hold yet.

        A checkpoint of an optimizer that grew (see `indices_of`) may hold
        accumulators for variables that an optimizer restored from it has
        not met yet: their restore waits until they are added, and an update
        before then would leave their accumulated gradients out. Raises
        where `ends` is known to hold; while tracing, always (a traced step
        that has not met them never will).
        """
        unmet = self.unmet()
        if not unmet or (self._backend.known(ends) and not bool(ops.convert_to_numpy(ends))):
            return
        raise ValueError(
            "The restored accumulation state holds gradients for "
            f"variables at positions {unmet}, which this optimizer has not "
            f"met yet (it holds {len(self.variables)}); an update now "
            "would leave them out. Build the optimizer with all variables, in "
            "the order the saved one met them, before its first step after "
            "the restore: `opt.build(model.trainable_variables)`."
        )

    def check_never_took_part(self, ends: Any) -> None:
        """Refuses to drop gradients a traced step cannot see.

        Which variables an update may involve is decided while a step is
        traced, from the variables that took part so far. A
        step traced before some variable first received a gradient (one
        trace per task in multi-task training) leaves it out; if it then
        runs an apply step while that variable holds accumulated gradients,
        they would be neither applied nor cleared. That fails instead, where
        the backend has run-time assertions. Eager steps see every variable.
        """
        never = self.never_took_part()
        if not never or self._backend.known(ends):
            return
        held = [self.accumulators[i] for i in never]
        names = [variable_name(self.variables[i]) for i in never]
        self._backend.tensors.assert_that(
            lambda: ops.logical_not(ops.logical_and(ends, self._backend.tensors.any_nonzero(held))),
            f"gradaccum: this traced step was traced before variables {names} first "
            "received gradients, and leaves them out of the update, but they hold "
            "accumulated gradients now. Trace every step after each variable has "
            "received a gradient once (for example run one step per task eagerly "
            "first), or trace this step anew (a new tf.function).",
        )

    def group(self, index: int, slices: bool, sparse: str) -> str:
        """The group (of `GROUPS`) variable `index`'s gradient is added
        with: its kind, except that a sparse gradient (`slices`) is kept as
        slices unless `sparse="rows"`, or else scattered into a sum's rows.

        Raises:
            ValueError: For a dense gradient of a variable that keeps slices.
        """
        kind = self._kinds[index]
        if kind == MAXIMUM:
            return MAXIMUM
        if slices and sparse != "rows":
            return SLICES
        if kind == COMPENSATED:
            return COMPENSATED
        if slices:
            return SCATTERED
        if self.keeps_slices(index):
            raise ValueError(
                f"Variable {variable_name(self.variables[index])!r} received a dense gradient "
                "after tf.IndexedSlices that are kept as slices: a variable's gradients must "
                "be of one kind (each traced step decides it). Use sparse=\"rows\", which "
                "adds both kinds into one accumulator."
            )
        return SUM

    def compensated(self, index: int) -> bool:
        """Whether variable `index` is summed with compensation."""
        return self._kinds[index] == COMPENSATED

    def keeps_maximum(self, index: int) -> bool:
        """Whether variable `index` takes its cycle's maximum (`_kind`)."""
        return self._kinds[index] == MAXIMUM

    # ------------------------------------------------------------------
    # Kept slices (TensorFlow).

    def keeps_slices(self, index: int) -> bool:
        """Whether variable `index` keeps its slices."""
        return index in self.kept

    def kept_for(self, index: int, keep_all: bool) -> Any:
        """The kept slices of variable `index`, made (empty) when first
        asked for. `keep_all`: every slice grows (`sparse="slices"`)."""
        if index not in self.kept:
            backend = self._backend
            self.kept[index] = backend.new_kept(
                self._family, self.variables[index], self.accumulators[index], self.n, keep_all,
                lambda: int(backend.saved(self.micro_step, False)) if self.begun() else 0,
            )
        return self.kept[index]

    def reserve_kept(self) -> None:
        """Makes every variable's kept slices hold a cycle of the current
        `n` (eagerly, after `n` was set)."""
        with self._backend.eagerly():
            for kept in self.kept.values():
                kept.reserve()

    def load_kept(self, index: int, saved: dict[str, Any], sparse: str) -> None:
        """Loads kept slices a file or checkpoint held for variable `index`
        (eagerly): kept again, or added into its rows where slices are not
        kept (`sparse="rows"`, or a backend without `tf.IndexedSlices`)."""
        if sparse != "rows" and isinstance(self._backend, KeptSlices):
            self.kept_for(index, sparse == "slices").load(saved)
            return
        backend, accumulator = self._backend, self.accumulators[index]
        rows = np.asarray(backend.saved(accumulator, False)).copy()
        for values, indices in (("kept_values", "kept_indices"), ("fixed_values", "fixed_indices")):
            if values in saved:
                np.add.at(rows, np.asarray(saved[indices], np.int64), np.asarray(saved[values], rows.dtype))
        backend.load(accumulator, rows, False)

    # ------------------------------------------------------------------
    # Between cycles.

    def begun(self) -> bool:
        """Whether the current cycle holds a micro-batch (read eagerly)."""
        with self._backend.eagerly():
            return int(self._backend.saved(self.micro_step, False)) > 0

    def load_restored_slices(self) -> None:
        """Loads the kept slices a TensorFlow checkpoint restored, once the
        whole restore has been read (see `Checkpointed.load_slices`)."""
        if self.checkpoint is not None and self.checkpoint.restored:
            with self._backend.eagerly():
                self.checkpoint.load_slices(self)

    def view(self) -> AccumulationState:
        """The state as `AccumulatingOptimizer.accumulation_state` shows it
        (settled first, see `settle`)."""
        self.settle()
        return AccumulationState(
            variables=tuple(self.variables),
            accumulators=tuple(self.accumulators),
            micro_step=self._backend.snapshot(self.micro_step),
            weight_total=self._backend.snapshot(self.weight_total),
            kept_slices=self._kept_view(),
            **_noise.view_fields(self.noise, self._backend.writable_now(self.micro_step)),
        )

    def _kept_view(self) -> dict[int, tuple[Any, Any]]:
        """Each variable's kept slices of the current cycle, eagerly."""
        if not self._backend.writable_now(self.micro_step):
            return {}
        return {i: kept.view() for i, kept in self.kept.items() if not getattr(kept, "rows_only", False)}

    def settle(self) -> None:
        """Makes the state read as `AccumulationState` documents it.

        The end of a cycle leaves the accumulators and the weight total
        holding its values, and the next cycle's first micro-step writes
        over them (see `gradaccum._core`). Between cycles this zeroes them,
        where a write lasts (eagerly); inside a trace nothing is done.
        """
        self.load_restored_slices()
        if not self._backend.writable_now(self.micro_step) or self.begun():
            return
        backend = self._backend
        for v in [*self.accumulators, *(self.compensations or []), self.weight_total]:
            backend.load(v, np.zeros_like(backend.saved(v, False)), False)
