"""The accumulation state in TensorFlow checkpoints.

`tf.train.Checkpoint`, `BackupAndRestore` and SavedModel reach the state
through a child of the optimizer named `gradient_accumulation`, a
`tf.Module` made once the state exists (`checkpoint_class`).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from gradaccum._persistence.keras_files import KEPT, check_settings
from gradaccum._state import State

CHILD = "gradient_accumulation"


_CHECKPOINT: list[type] = []


def checkpoint_class() -> type:
    """The checkpoint child's class, made once TensorFlow is in use."""
    if _CHECKPOINT:
        return _CHECKPOINT[0]
    import tensorflow as tf


    class Checkpointed(tf.Module):
        """What TensorFlow checkpoints hold of a `State`.

        The containers are the state's own: a variable the state adds later
        (an optimizer that grows) is tracked, and restored from a checkpoint
        read before it existed. Kept slices go in a child of their own
        (`KeptSlices`). Which variables take part is
        Python state that decides what a traced step updates, so it is
        written beside the variables, with the settings, which are checked.
        """

        def __init__(self, state: State, core: Any):
            super().__init__(name=CHILD)
            self.accumulators = state.accumulators
            state.accumulators = self.accumulators  # the tracked list
            self.micro_step = state.micro_step
            self.weight_total = state.weight_total
            if state.touched is not None:
                self.touched = state.touched
            self.slices = KeptSlices(core)
            if state.noise is not None:
                self.noise = state.noise.variables()
            if state.compensations is not None:
                self.compensations = state.compensations
                state.compensations = self.compensations  # the tracked list
            self._core = core
            self.restored = False

        def load_slices(self, state: State) -> None:
            """Once all of a restore has been read: loads the kept slices (into
            rows, those of a `sparse="rows"` optimizer, which adds into the
            restored accumulators: a restore reads its objects in no order
            that puts the accumulators first)."""
            self.restored = False
            loaded, state.loaded_slices = state.loaded_slices, {}
            for i in range(len(state.accumulators)):
                if i in loaded or i in state.kept:
                    state.load_kept(i, loaded.get(i, {}), self._core.settings.sparse)

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

    class KeptSlices(tf.Module):
        """The kept slices of the current cycle (`State.kept`), as one string
        tensor: NumPy's `.npz` of what Keras files hold of them, for every
        variable. Which variables keep slices, and in which layout, is
        known only once steps ran, where a checkpoint's keys must be known
        when it is read; and a replica-local variable would be saved as the
        sum over replicas, where each replica keeps slices of its own.
        Traced (a SavedModel's save function), it writes none."""

        def __init__(self, core: Any):
            super().__init__(name="kept_slices")
            self._core = core

        def _serialize_to_tensors(self) -> dict[str, Any]:
            arrays: dict[str, np.ndarray] = {}
            if tf.executing_eagerly():
                for i, kept in self._core.state.kept.items():
                    arrays.update({f"{key}_{i}": value for key, value in kept.saved().items()})
            buffer = io.BytesIO()
            np.savez(buffer, **arrays)
            return {"npz": tf.constant(buffer.getvalue())}

        def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
            if not tf.executing_eagerly():
                return tf.no_op()
            state = self._core.state
            with np.load(io.BytesIO(restored_tensors["npz"].numpy())) as held:
                arrays = {key: held[key] for key in held.files}
            loaded = {}
            for i in range(len(state.accumulators)):
                kept = {key: arrays[f"{key}_{i}"] for key in KEPT if f"{key}_{i}" in arrays}
                if kept:
                    loaded[i] = kept
            # Loaded once the whole restore has been read (`Checkpointed.load_slices`).
            state.loaded_slices = loaded
            state.checkpoint.restored = True
            return tf.no_op()

    _CHECKPOINT.append(Checkpointed)
    return Checkpointed
