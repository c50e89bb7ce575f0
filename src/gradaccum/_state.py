"""The accumulation state of one optimizer, and how it persists.

`State` owns the variables being accumulated for and their index, one
accumulator per variable, the micro-step counter, the sum of micro-batch
weights, and which variables take part in updates. It is built once the
wrapped optimizer is built, and grows with an optimizer that creates its
state lazily (see `OptimizerFamily.grows`).

Persistence. TensorFlow checkpoints (`tf.train.Checkpoint`,
`BackupAndRestore`, SavedModel) reach the state through `State.module`, a
`tf.Module` that the proxy adds to the wrapped optimizer's children as
`gradient_accumulation`: the accumulators, the micro-step counter, the
weight total, the scale the sums are held at (see `State.scale`), the kept
slices (`sparse="slices"`, by variable position,
restored when they are created again), and as tensors the `n`/`reduction`
the state was written with and which variables take part; a checkpoint
matches accumulators by position.
Keras files (`.keras`, `.weights.h5`) reach it through `save`/`load`, under
`gradaccum_*` keys beside the wrapped optimizer's own, holding the plain
sums (scale 1, see `State.unscale`), with each
accumulator's variable named (`gradaccum_names`), so that a model that lists
its variables in another order once reloaded (a float8-quantized `Dense`
lists its scales first) gets each sum back on its variable. Restoring state
written with a different `n` or `reduction` raises instead of loading
silently wrong.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from gradaccum._backend.tensorflow import distribution, tensors
from gradaccum._family import OptimizerFamily
from gradaccum._store import (  # noqa: F401  (CHILD and read_store: for the proxy)
    _REDUCTION_CODES,
    CHILD,
    _check_settings,
    _name,
    _path,
    KEY,
    _decode_names,
    _encode_names,
    check_saved_settings,
    read_store,
    relative_names,
    saved_accumulators,
)
from gradaccum._view import AccumulationState

class _Checkpointed(tf.Module):
    """What TensorFlow checkpoints hold of a `State` (see the module docstring)."""

    def __init__(
        self,
        state: State,
        accumulators: list[tf.Variable],
        micro_step: tf.Variable,
        weight_total: tf.Variable,
        scale: tf.Variable,
    ):
        super().__init__(name=CHILD)
        self.accumulators = accumulators
        self.micro_step = micro_step
        self.weight_total = weight_total
        self.scale = scale
        # With `sparse="slices"`: the cycle's kept slices, by the position
        # of their variable (as a string), created when it first receives
        # `tf.IndexedSlices`. A checkpoint restores them when they are
        # created again (TensorFlow defers what it cannot restore yet).
        self.kept_values: dict[str, tf.Variable] = {}
        self.kept_indices: dict[str, tf.Variable] = {}
        self._state = state

    # Written beside the variables; checked when read back. Which variables
    # have had a gradient is Python state (it decides what a traced step
    # updates); a resumed cycle needs it, or a variable whose gradient is
    # None for the rest of the cycle would be left out of the update with
    # its accumulated sum.
    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        state = self._state
        return {
            "n": tf.constant(state.n_code, dtype=tf.int64),
            "reduction": tf.constant(state.reduction),
            "seen": tf.constant(state.participation_mask()),
        }

    def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]) -> Any:
        state = self._state
        n, reduction = restored_tensors["n"], restored_tensors["reduction"]
        if tf.executing_eagerly():
            _check_settings(int(n), reduction.numpy().decode(), state.n_code, state.reduction)
            state.set_participation(restored_tensors["seen"].numpy())
            return tf.no_op()
        # Traced restore functions (SavedModel) check in the graph.
        return tf.group(
            tf.debugging.assert_equal(
                n, tf.constant(state.n_code, dtype=tf.int64),
                message="gradient accumulation: n differs",
            ),
            tf.debugging.assert_equal(
                reduction,
                tf.constant(state.reduction),
                message="gradient accumulation: reduction differs",
            ),
        )


class State:
    """Accumulators, counters and participation for one optimizer's variables.

    Args:
        family: The wrapped optimizer's family.
        variables: The variables the optimizer is built for, in its order.
        n_code: What checkpoints record as `n` (0 for a schedule); the
            owner updates it when `n` changes.
        reduction: `"mean"` or `"sum"`, recorded the same way.
        sparse_slices: Whether `tf.IndexedSlices` gradients are kept as
            slices (`sparse="slices"`) rather than added into their rows.
    """

    def __init__(
        self,
        family: OptimizerFamily,
        variables: Sequence[Any],
        n_code: int,
        reduction: str,
        sparse_slices: bool = False,
    ):
        self._family = family
        self.sparse_slices = sparse_slices
        self.variables: list[Any] = list(variables)
        self._index = {family.var_key(v): i for i, v in enumerate(self.variables)}
        self.n_code = n_code
        self.reduction = reduction
        # Indices of variables that have received a gradient: they take part
        # in every update from then on (zeros on micro-steps without one).
        self._participants: set[int] = set()
        # Set when accumulators were restored from a file that did not say
        # which variables had gradients: the participants are then read off
        # the sums before the next step (`refresh_participants`).
        self._restored_without_participants = False
        with distribution.creation_scope(family.strategy()):
            accumulators = self._new_accumulators(self.variables)
            micro_step = distribution.mirrored_counter(0, name="micro_step")
            weight_total = distribution.replica_local(tf.constant(0.0), name="weight_total")
            # The same on every replica: it is set from the divisor, which is.
            scale = distribution.mirrored_counter(1, name="sum_scale", dtype=tf.float32)
        self.module = _Checkpointed(self, accumulators, micro_step, weight_total, scale)

    @property
    def accumulators(self) -> Sequence[tf.Variable]:
        return self.module.accumulators

    @property
    def micro_step(self) -> tf.Variable:
        return self.module.micro_step

    @property
    def weight_total(self) -> tf.Variable:
        return self.module.weight_total

    @property
    def scale(self) -> tf.Variable:
        """What the accumulators' sums are held multiplied by (float32).

        1, or the reciprocal of the last cycle's divisor where that is a
        power of two, so that a cycle like the last one ends holding its
        mean and divides nothing (see `gradaccum._strategies`).
        """
        return self.module.scale

    def _new_accumulators(self, variables: Sequence[Any]) -> list[tf.Variable]:
        """One zero accumulator per variable (inside a creation scope)."""
        return [
            distribution.replica_local(
                tf.zeros(v.shape, dtype=tensors.accumulator_dtype(v)),
                name="accumulator",
                colocate_with=self._family.model_variable(v),
            )
            for v in variables
        ]

    # ------------------------------------------------------------------
    # Between cycles.

    def begun(self) -> bool:
        """Whether the current cycle holds a micro-batch (read eagerly)."""
        with tf.init_scope():
            return int(self.micro_step.numpy()) > 0

    def settle(self) -> None:
        """Makes the raw state read as the view documents it, eagerly.

        Between cycles, zeroes the accumulators and the weight total: a
        cycle's end leaves them holding its values, and the next cycle's
        first micro-step writes over them (see `gradaccum._strategies`).
        Within a cycle, `unscale`s the sums. Inside a traced function
        nothing is done, and the raw values are seen.
        """
        if not tf.executing_eagerly():
            return
        if self.begun():
            self.unscale()
            return
        for v in [*self.accumulators, self.weight_total]:
            v.assign(tf.zeros(v.shape, v.dtype), read_value=False)

    def unscale(self) -> None:
        """Divides the held sums by `scale` and sets it to 1 (eagerly).

        Exact: the scale is a power of two. The rest of the cycle adds at
        scale 1, and its end divides by the weight total itself; the cycle
        after it is scaled again. Every replica divides its own sums.
        """
        if not tf.executing_eagerly():
            return
        scale = float(self.scale.numpy())
        if scale == 1.0:
            return
        held = [acc for i, acc in enumerate(self.accumulators) if not self.keeps_maximum(i)]
        held += [values for values, _ in self.all_kept().values()]
        for variable in held:
            for copy in distribution.copies(variable):
                copy.assign(copy.read_value() / tf.cast(scale, copy.dtype), read_value=False)
        self.scale.assign(1.0)

    # ------------------------------------------------------------------
    # Kept slices (`sparse="slices"`).

    def keeps_slices(self, index: int) -> bool:
        """Whether variable `index` has buffers of kept slices."""
        return str(index) in self.module.kept_values

    def slice_buffers(self, index: int) -> tuple[tf.Variable, tf.Variable]:
        """The (values, indices) buffers of variable `index`, created empty
        (eagerly, also while a step is traced) when first asked for."""
        key = str(index)
        module = self.module
        if key not in module.kept_values:
            variable = self.variables[index]
            self._check_no_row_sums(index)
            with distribution.creation_scope(self._family.strategy()):
                values, indices = tensors.slice_buffers(
                    variable, self._family.model_variable(variable)
                )
            module.kept_values[key] = values
            module.kept_indices[key] = indices
        return module.kept_values[key], module.kept_indices[key]

    def _check_no_row_sums(self, index: int) -> None:
        """Refuses to keep slices for a variable whose accumulator holds sums.

        Read once, eagerly, when its buffers are created: sums there come
        from dense gradients earlier in the cycle, or from a partial cycle
        restored from state written with `sparse="rows"`. The update would
        hand over the slices alone and leave those sums out. Between cycles
        an accumulator holds the last cycle's values, which count for
        nothing.
        """
        with tf.init_scope():
            held = self.begun() and bool(
                tf.reduce_any(tf.not_equal(tf.convert_to_tensor(self.accumulators[index]), 0)).numpy()
            )
        if held:
            raise ValueError(
                f"With sparse=\"slices\", variable {_name(self.variables[index])!r} "
                "received tf.IndexedSlices while its accumulator holds a partial "
                "cycle's row sums (dense gradients earlier in the cycle, or a "
                "partial cycle restored from state saved with sparse=\"rows\"), "
                "which the update would leave out. Finish or `flush()` that cycle "
                "with sparse=\"rows\" first."
            )

    def all_kept(self) -> dict[int, tuple[tf.Variable, tf.Variable]]:
        """Every variable's slice buffers, by its position."""
        return {int(key): self.slice_buffers(int(key)) for key in self.module.kept_values}

    def kept_buffers(self, indices: Sequence[int]) -> list[tuple[tf.Variable, tf.Variable]]:
        """The slice buffers of those of `indices` that have them."""
        return [self.slice_buffers(i) for i in indices if self.keeps_slices(i)]

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
                    f"Received a gradient for variable {_name(next(iter(new.values())))!r}, "
                    "which this optimizer was not built for. It was built for "
                    f"{len(self.variables)} variables: "
                    f"{[getattr(u, 'path', u.name) for u in self.variables]}."
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
        traced = not tf.executing_eagerly()
        try:
            with distribution.creation_scope(self._family.strategy()):
                accumulators = self._new_accumulators(variables)
            self._family.grow(variables)  # last: nothing is recorded if a creation fails
        except ValueError as error:
            if not traced:
                raise
            raise ValueError(
                f"Received gradients for variables {[getattr(v, 'name', repr(v)) for v in variables]}, "
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
        # Appended to the tracked list: checkpointed as the next positions,
        # and restored there from a checkpoint read before they existed.
        self.module.accumulators.extend(accumulators)

    # ------------------------------------------------------------------
    # Which variables take part.

    def take_part(self, index: int) -> None:
        """Variable `index` has received a gradient."""
        self._participants.add(index)

    def participants(self) -> list[int]:
        """Indices of the variables that take part, among those held."""
        return sorted(i for i in self._participants if i < len(self.accumulators))

    def has_participants(self) -> bool:
        return bool(self._participants)

    def keeps_maximum(self, index: int) -> bool:
        """Whether variable `index` takes its cycle's maximum, not a mean.

        True for Keras variables marked `overwrite_with_gradient`: the wrapped
        optimizer assigns their "gradient" (their new value) to them. Read
        when a step is traced, as Keras reads it when it applies gradients.
        """
        return bool(getattr(self.variables[index], "overwrite_with_gradient", False))

    def unmet(self) -> list[int]:
        """Taking part by a restore, but not met by this optimizer yet."""
        return sorted(i for i in self._participants if i >= len(self.variables))

    def left_out(self) -> list[int]:
        """Held, but not taking part (no gradient so far)."""
        return [i for i in range(len(self.variables)) if i not in self._participants]

    def refresh_participants(self) -> None:
        """After a restore that did not say which variables take part: those
        whose accumulators hold sums do. Reads them once (eagerly, also while
        tracing)."""
        if not self._restored_without_participants:
            return
        self._restored_without_participants = False
        if not self.begun():  # the sums are the last cycle's
            return
        with tf.init_scope():
            for i, acc in enumerate(self.accumulators):
                if i not in self._participants and bool(
                    tf.reduce_any(tf.not_equal(tf.convert_to_tensor(acc), 0)).numpy()
                ):
                    self._participants.add(i)

    def participation_mask(self) -> np.ndarray:
        return np.array([i in self._participants for i in range(len(self.accumulators))])

    def set_participation(self, mask: Any) -> None:
        self._participants.clear()
        self._participants.update(int(i) for i in np.flatnonzero(np.asarray(mask)))

    # ------------------------------------------------------------------
    # Keras files.

    @staticmethod
    def owns_key(key: str) -> bool:
        """Whether a Keras weights-store key is one `save` writes."""
        return key.startswith(KEY)

    def save(self, store: Any) -> None:
        """Writes the state into a Keras weights store.

        Accumulator `i` goes under `accumulator_{i}`, and `names` lists each
        one's variable by its `relative_names`. Between cycles the
        accumulators and the weight total are written as zeros (they hold
        the last cycle's values; see `settle`); within a cycle, as plain
        sums (`unscale`).
        """
        begun = self.begun()
        if begun:
            self.unscale()
        store[f"{KEY}n"] = np.asarray(self.n_code, dtype=np.int64)
        store[f"{KEY}reduction"] = np.asarray(_REDUCTION_CODES[self.reduction])
        store[f"{KEY}micro_step"] = np.asarray(self.micro_step.numpy())
        total = np.asarray(self.weight_total.numpy())
        store[f"{KEY}weight_total"] = total if begun else np.zeros_like(total)
        store[f"{KEY}seen"] = self.participation_mask()
        store[f"{KEY}names"] = _encode_names(relative_names(self.variables))
        for i, acc in enumerate(self.accumulators):
            if self.keeps_maximum(i) and isinstance(acc, tf.distribute.DistributedValues):
                # A replica-local variable reads as the sum of the replicas'
                # copies; a maximum is the maximum of them.
                value = np.max([np.asarray(v.numpy()) for v in acc.values], axis=0)
            else:
                value = np.asarray(acc.numpy())
            store[f"{KEY}accumulator_{i}"] = value if begun else np.zeros_like(value)
            if self.keeps_slices(i):
                values, indices = self.slice_buffers(i)
                store[f"{KEY}kept_values_{i}"] = np.asarray(values.numpy())
                store[f"{KEY}kept_indices_{i}"] = np.asarray(indices.numpy())

    def load(self, store: Any) -> None:
        """Reads what `save` wrote (or an older store without `names`).

        Accumulators are matched to variables by name when the saved names
        and this optimizer's are the same set of distinct names; otherwise
        (names written by a model with other layer names, or none written)
        by position, as the wrapped Keras optimizer loads its own variables.

        Raises:
            ValueError: If the store was written with another `n`,
                `reduction` or model (naming the variables that differ).
        """
        check_saved_settings(store, self.n_code, self.reduction)
        source, values = saved_accumulators(store, self.variables, [acc.shape for acc in self.accumulators])
        count = len(source)
        kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for i, j in enumerate(source):
            if f"{KEY}kept_values_{j}" in store.keys():
                kept[i] = (
                    np.asarray(store[f"{KEY}kept_values_{j}"]),
                    np.asarray(store[f"{KEY}kept_indices_{j}"], dtype=np.int64),
                )
        for i, (acc, value) in enumerate(zip(self.accumulators, values)):
            if i in kept and not self.sparse_slices:
                # Kept slices loaded where rows are accumulated: their rows' sums.
                value = value.copy()
                np.add.at(value, kept[i][1], kept[i][0].astype(value.dtype))
            # A maximum is every replica's; a sum is split among them.
            acc.assign(value if self.keeps_maximum(i) else distribution.per_replica_share(value))
        if self.sparse_slices:
            for i in range(len(self.accumulators)):
                if i in kept:
                    buffers = self.slice_buffers(i)
                    for buffer, value in zip(buffers, kept[i]):
                        buffer.assign(value.astype(buffer.dtype.as_numpy_dtype), read_value=False)
                elif self.keeps_slices(i):
                    tensors.clear_slices([self.slice_buffers(i)])
        self.micro_step.assign(int(np.asarray(store[f"{KEY}micro_step"])))
        if f"{KEY}seen" in store.keys():
            saved_seen = np.asarray(store[f"{KEY}seen"])
            self.set_participation(saved_seen[source] if len(saved_seen) == count else saved_seen)
        else:  # written before the mask was saved: read it off the sums
            self._restored_without_participants = True
        if f"{KEY}weight_total" in store.keys():
            total = np.asarray(store[f"{KEY}weight_total"])
        else:  # written before weights existed: every micro-batch weighed 1
            total = np.asarray(self.micro_step.numpy(), np.float32)
        self.weight_total.assign(distribution.per_replica_share(total))
        self.scale.assign(1.0)  # a file holds the plain sums
