"""The accumulation state in TensorFlow checkpoints.

`tf.train.Checkpoint`, `BackupAndRestore` and SavedModel reach the state
through a child of the optimizer named `gradient_accumulation`, a
`tf.Module` made once the state exists (`checkpoint_class`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradaccum._persistence.keras_files import check_settings
from gradaccum._state import State

CHILD = "gradient_accumulation"


_CHECKPOINT: list[type] = []


def checkpoint_class() -> type:
    """The checkpoint child's class, made once TensorFlow is in use."""
    if _CHECKPOINT:
        return _CHECKPOINT[0]
    import tensorflow as tf

    from gradaccum._backend.tensorflow import distribution

    class Checkpointed(tf.Module):
        """What TensorFlow checkpoints hold of a `State`.

        The containers are the state's own: a variable the state adds later
        (an optimizer that grows, kept slices) is tracked, and restored from
        a checkpoint read before it existed. Which variables take part is
        Python state that decides what a traced step updates, so it is
        written beside the variables, with the settings, which are checked.
        `scale` is 1: a checkpoint written before held the sums of a partial
        cycle multiplied by it, which `upgrade` divides out; such a
        checkpoint has no `touched` either, which `upgrade` fills in.
        """

        def __init__(self, state: State, core: Any):
            super().__init__(name=CHILD)
            self.accumulators = state.accumulators
            state.accumulators = self.accumulators  # the tracked list
            self.micro_step = state.micro_step
            self.weight_total = state.weight_total
            if state.touched is not None:
                self.touched = state.touched
            if state.noise is not None:
                self.noise = state.noise.variables()
            if state.compensations is not None:
                self.compensations = state.compensations
                state.compensations = self.compensations  # the tracked list
            self.kept_values: dict[str, Any] = {}
            self.kept_indices: dict[str, Any] = {}
            for index, buffers in state.kept.items():
                self.track_slices(index, buffers)
            with distribution.creation_scope(core.family.strategy()):
                self.scale = distribution.mirrored_counter(1, name="sum_scale", dtype=tf.float32)
            self._core = core
            self.restored = False

        def track_slices(self, index: int, buffers: tuple[Any, Any]) -> None:
            self.kept_values[str(index)], self.kept_indices[str(index)] = buffers

        def upgrade(self, state: State) -> None:
            """Brings a restored checkpoint of an earlier format to this one."""
            self.restored = False
            self._touch_all_if_unrecorded(state)
            scale = float(self.scale.numpy())
            if scale == 1.0:
                return
            held = [a for i, a in enumerate(state.accumulators) if not state.keeps_maximum(i)]
            held += [values for values, _ in state.kept.values()]
            for variable in held:
                for copy in distribution.copies(variable):
                    copy.assign(copy.read_value() / tf.cast(scale, copy.dtype), read_value=False)
            self.scale.assign(1.0)

        def _touch_all_if_unrecorded(self, state: State) -> None:
            # A cycle under way records at least one variable as touched; a
            # checkpoint written before this was recorded restores none, and
            # then every variable taking part counts as touched, as it did.
            if state.touched is None or int(distribution.copies(state.micro_step)[0].numpy()) == 0:
                return
            if np.any(distribution.copies(state.touched)[0].numpy()):
                return
            mask = np.array([int(i in state.participants) for i in range(len(state.accumulators))], np.int32)
            for copy in distribution.copies(state.touched):
                copy.assign(mask, read_value=False)

        def _serialize_to_tensors(self) -> dict[str, Any]:
            state = self._core.state
            return {
                "n": tf.constant(self._core.cycle.code, dtype=tf.int64),
                "reduction": tf.constant(self._core.settings.reduction),
                "seen": tf.constant(np.array([i in state.participants for i in range(len(state.accumulators))])),
            }

        def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
            core = self._core
            n, reduction = restored_tensors["n"], restored_tensors["reduction"]
            if tf.executing_eagerly():
                check_settings(int(n), reduction.numpy().decode(), core.cycle.code, core.settings.reduction)
                seen = restored_tensors["seen"].numpy()
                core.state.participants = {int(i) for i in np.flatnonzero(seen)}
                self.restored = True
                return tf.no_op()
            # Traced restore functions (SavedModel) check in the graph.
            return tf.group(
                tf.debugging.assert_equal(n, tf.constant(core.cycle.code, dtype=tf.int64),
                                          message="gradient accumulation: n differs"),
                tf.debugging.assert_equal(reduction, tf.constant(core.settings.reduction),
                                          message="gradient accumulation: reduction differs"),
            )

    _CHECKPOINT.append(Checkpointed)
    return Checkpointed
