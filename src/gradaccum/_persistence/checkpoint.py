"""The accumulation state in TensorFlow checkpoints.

`tf.train.Checkpoint`, `BackupAndRestore` and SavedModel reach the state
through a child of the optimizer named `gradient_accumulation`, a
`tf.Module` made once the state exists (`checkpoint_class`). A checkpoint
written with another `n` or `reduction` is refused before anything of it is
restored (`read_checked`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
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
            if state.took_part is not None:
                self.touched = state.took_part
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
                "seen": tf.constant(np.array([i in state.took_part_ever for i in range(len(state.accumulators))])),
            }

        def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
            core = self._core
            n, reduction = restored_tensors["n"], restored_tensors["reduction"]
            if tf.executing_eagerly():
                check_settings(int(n), reduction.numpy().decode(), core.cycle.code, core.settings.reduction)
                seen = restored_tensors["seen"].numpy()
                core.state.took_part_ever = {int(i) for i in np.flatnonzero(seen)}
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


def read_checked(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """`tf.train.Checkpoint.read` (which `restore` calls), which first refuses
    a checkpoint whose accumulation state an accumulating optimizer it
    restores cannot take.

    The state's settings are checked where it is restored, but TensorFlow
    restores the model's and the optimizer's variables in the same pass, so
    that refusal would leave them restored. Read from the file first,
    nothing is restored.

    Raises:
        ValueError: If the checkpoint was written with another `n` or
            `reduction`.
    """
    found = _accumulating(instance)
    save_path = args[0] if args else kwargs.get("save_path")
    if found and save_path is not None:
        import tensorflow as tf

        try:
            reader = tf.train.load_checkpoint(os.fspath(save_path))
        except (tf.errors.OpError, ValueError, TypeError):
            reader = None  # TensorFlow's own read reports it
        for path, core in found if reader is not None else ():
            key = f"{path}/{CHILD}/.ATTRIBUTES/"
            if reader.has_tensor(f"{key}n"):
                saved_reduction = reader.get_tensor(f"{key}reduction")
                saved_reduction = saved_reduction.decode() if isinstance(saved_reduction, bytes) else "?"
                check_settings(int(reader.get_tensor(f"{key}n")), saved_reduction, core.cycle.code,
                               core.settings.reduction)
    return wrapped(*args, **kwargs)


def _accumulating(root: Any) -> list[tuple[str, Any]]:
    """`(path, core)` of each accumulating optimizer a checkpoint of `root`
    holds, by its path in the checkpoint's keys."""
    from tensorflow.python.trackable.trackable_utils import escape_local_name

    found, seen, pending = [], {id(root)}, [("", root)]
    while pending:
        path, obj = pending.pop(0)
        core = getattr(obj, "_self_core", None)
        if core is not None:
            found.append((path, core))
        try:
            children = obj._trackable_children()
        except (AttributeError, TypeError, ValueError):
            continue
        for name, child in children.items():
            if id(child) not in seen:
                seen.add(id(child))
                pending.append((f"{path}/{escape_local_name(name)}" if path else escape_local_name(name), child))
    return found
