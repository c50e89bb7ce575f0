"""State that survives: checkpoints, `.keras` files and configs.

TensorFlow checkpoints (`tf.train.Checkpoint`, `BackupAndRestore`,
SavedModel) reach the proxy as a trackable object. Its children are the
wrapped optimizer's, unchanged, plus one more, `gradient_accumulation`, that
holds the accumulators, the micro-step counter and the `n`/`reduction` the
state was written with. Because the wrapped optimizer's own dependencies keep
their names, a checkpoint of a plain optimizer restores into an accumulating
one (slots into the right variables, accumulators left empty) and the reverse
works too (the extra child is simply not read). Restoring state written with a
different `n` or `reduction` raises instead of loading silently wrong.

Keras files (`model.save("m.keras")`, `.weights.h5`) call
`save_own_variables`/`load_own_variables`: the proxy stores the wrapped
optimizer's variables under their usual keys and its own state under
`gradaccum_*` keys. Keras serializes an object by its `__class__`, which a
proxy reports as the wrapped optimizer's; so `gradaccum` makes Keras's
`serialize_keras_object` write an `AccumulatingOptimizer` as itself (a config
with the wrapped optimizer's config, `n`, `reduction` and `mode`, registered as
`gradaccum>AccumulatingOptimizer`), and `load_model` needs no
`custom_objects` once `gradaccum` is imported, under `safe_mode=True` too.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
import wrapt

_CHILD = "gradient_accumulation"
_KEY = "gradaccum_"
_REGISTERED_NAME = "gradaccum>AccumulatingOptimizer"


class _AccumulationState(tf.Module):
    """The variables a proxy owns, and the settings they were written with.

    Args:
        accumulators: One replica-local sum of weighted gradients per variable.
        micro_step: Micro-batches accumulated in the current cycle (mirrored).
        weight_total: Replica-local sum of the micro-batch weights.
        n: Returns the current `n` (an int), 0 for a schedule.
        reduction: `"mean"` or `"sum"`.
        seen: The proxy's set of indices of variables that have received a
            gradient (they take part in every update from then on); saved
            with the state and restored into the same set object.
    """

    def __init__(
        self,
        accumulators: list[tf.Variable],
        micro_step: tf.Variable,
        weight_total: tf.Variable,
        n: Any,
        reduction: str,
        seen: set[int],
    ):
        super().__init__(name="gradient_accumulation")
        self.accumulators = accumulators
        self.micro_step = micro_step
        self.weight_total = weight_total
        self._current_n = n
        self._reduction = reduction
        self._seen = seen
        # Set when accumulators were restored from a file that did not say
        # which variables had gradients: the proxy then re-reads which
        # accumulators hold sums before its next step.
        self._restored = False

    def _seen_mask(self) -> np.ndarray:
        return np.array([i in self._seen for i in range(len(self.accumulators))])

    def _set_seen(self, mask: Any) -> None:
        self._seen.clear()
        self._seen.update(int(i) for i in np.flatnonzero(np.asarray(mask)))

    @property
    def _n(self) -> int:
        return int(self._current_n())

    def _n_tensor(self) -> tf.Tensor:
        return tf.constant(self._current_n(), dtype=tf.int64)

    # Written beside the variables; checked when read back.
    # Which variables have had a gradient is Python state (it decides what a
    # traced step updates); a resumed cycle needs it, or a variable whose
    # gradient is None for the rest of the cycle would be left out of the
    # update with its accumulated sum.
    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        return {
            "n": self._n_tensor(),
            "reduction": tf.constant(self._reduction),
            "seen": tf.constant(self._seen_mask()),
        }

    def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]) -> Any:
        n, reduction = restored_tensors["n"], restored_tensors["reduction"]
        if tf.executing_eagerly():
            _check_settings(int(n), reduction.numpy().decode(), self._n, self._reduction)
            self._set_seen(restored_tensors["seen"].numpy())
            return tf.no_op()
        # Traced restore functions (SavedModel) check in the graph.
        return tf.group(
            tf.debugging.assert_equal(
                n, self._n_tensor(), message="gradient accumulation: n differs"
            ),
            tf.debugging.assert_equal(
                reduction,
                tf.constant(self._reduction),
                message="gradient accumulation: reduction differs",
            ),
        )

    def _save(self, store: Any) -> None:
        store[f"{_KEY}n"] = np.asarray(self._n, dtype=np.int64)
        store[f"{_KEY}reduction"] = np.asarray(_REDUCTION_CODES[self._reduction])
        store[f"{_KEY}micro_step"] = np.asarray(self.micro_step.numpy())
        store[f"{_KEY}weight_total"] = np.asarray(self.weight_total.numpy())
        store[f"{_KEY}seen"] = self._seen_mask()
        for i, acc in enumerate(self.accumulators):
            store[f"{_KEY}accumulator_{i}"] = np.asarray(acc.numpy())

    def _load(self, store: Any) -> None:
        reduction = {v: k for k, v in _REDUCTION_CODES.items()}.get(
            int(np.asarray(store[f"{_KEY}reduction"])), "?"
        )
        _check_settings(int(np.asarray(store[f"{_KEY}n"])), reduction, self._n, self._reduction)
        count = sum(1 for k in store.keys() if k.startswith(f"{_KEY}accumulator_"))
        if count != len(self.accumulators):
            raise ValueError(
                f"The saved gradient-accumulation state has {count} "
                f"accumulators, but this optimizer has {len(self.accumulators)} "
                "(one per trainable variable): it was saved for another model."
            )
        for i, acc in enumerate(self.accumulators):
            value = np.asarray(store[f"{_KEY}accumulator_{i}"])
            if tuple(value.shape) != tuple(acc.shape):
                raise ValueError(
                    f"Saved accumulator {i} has shape {tuple(value.shape)}, "
                    f"but this optimizer's variable {i} has shape "
                    f"{tuple(acc.shape)}."
                )
            acc.assign(_per_replica_share(value))
        self.micro_step.assign(int(np.asarray(store[f"{_KEY}micro_step"])))
        if f"{_KEY}seen" in store.keys():
            self._set_seen(store[f"{_KEY}seen"])
        else:  # written before the mask was saved: read it off the sums
            self._restored = True
        if f"{_KEY}weight_total" in store.keys():
            self.weight_total.assign(_per_replica_share(np.asarray(store[f"{_KEY}weight_total"])))
        else:  # written before weights existed: every micro-batch weighed 1
            self.weight_total.assign(
                _per_replica_share(np.asarray(self.micro_step.numpy(), np.float32))
            )


_REDUCTION_CODES = {"mean": 0, "sum": 1}


def _per_replica_share(total: np.ndarray) -> np.ndarray:
    """The value each replica holds so that replica-local reads sum to total."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return total / replicas if replicas > 1 else total


def _describe_n(n: int) -> str:
    return "a schedule" if n == 0 else f"n={n}"


def _check_settings(saved_n: int, saved_reduction: str, n: int, reduction: str) -> None:
    if saved_n != n:
        raise ValueError(
            "The checkpoint's gradient-accumulation state was written with "
            f"{_describe_n(saved_n)}, but this optimizer accumulates with "
            f"{_describe_n(n)}. Wrap the optimizer the same way to resume "
            "this cycle, or restore into the plain optimizer to drop the "
            "partial cycle."
        )
    if saved_reduction != reduction:
        raise ValueError(
            "The checkpoint's gradient-accumulation state was written with "
            f"reduction={saved_reduction!r}, but this optimizer has "
            f"reduction={reduction!r}."
        )


class _Saveable:
    """Checkpoint and Keras-file hooks of `AccumulatingOptimizer`."""

    # TensorFlow checkpoints ------------------------------------------------

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        children = dict(self.__wrapped__._trackable_children(save_type, **kwargs))
        if self._self_core is self and self._self_state is not None:
            children[_CHILD] = self._self_state
        return children

    def _lookup_dependency(self, name: str, cached_dependencies: Any = None) -> Any:
        if name == _CHILD and self._self_core is self:
            return self._self_state
        return self.__wrapped__._lookup_dependency(name, cached_dependencies)

    def _restore_deferred_state(self) -> None:
        """Restores state a checkpoint held for it before it existed."""
        self.__wrapped__._handle_deferred_dependencies(name=_CHILD, trackable=self._self_state)

    # Keras files -----------------------------------------------------------

    def save_own_variables(self, store: Any) -> None:
        """Saves the wrapped optimizer's variables and the accumulation state.

        Args:
            store: The Keras weights store to write to.
        """
        self.__wrapped__.save_own_variables(store)
        if self._self_core is self and self._self_state is not None:
            self._self_state._save(store)

    def load_own_variables(self, store: Any) -> None:
        """Loads what `save_own_variables` wrote.

        A store written by the plain optimizer loads into the wrapped one and
        leaves the accumulators empty.

        Args:
            store: The Keras weights store to read from.

        Raises:
            ValueError: If the store was written with another `n`,
                `reduction` or model.
        """
        keys = list(store.keys())
        own = {k: store[k] for k in keys if not k.startswith(_KEY)}
        self.__wrapped__.load_own_variables(own)
        if self._self_core is self and any(k.startswith(_KEY) for k in keys):
            self._self_state._load(store)

    # Keras configs ---------------------------------------------------------

    def _serialized(self) -> dict:
        from keras.src.saving import serialization_lib

        n = self.n
        config = {
            "optimizer": serialization_lib.serialize_keras_object(self.__wrapped__),
            # A schedule is serialized as Keras serializes any function.
            "n": n if isinstance(n, int) else serialization_lib.serialize_keras_object(n),
            "reduction": self.reduction,
            "mode": self.mode,
        }
        return {
            "module": "gradaccum",
            "class_name": "AccumulatingOptimizer",
            "config": config,
            "registered_name": _REGISTERED_NAME,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        """Re-creates an `AccumulatingOptimizer` from its serialized config.

        Args:
            config: The `"config"` part of what `keras.saving.serialize_keras_object`
                writes for an `AccumulatingOptimizer`: the wrapped optimizer's
                serialized config, `n`, `reduction` and `mode`.
            custom_objects: Passed on to Keras's deserialization.

        Returns:
            A new `AccumulatingOptimizer` around a new wrapped optimizer.

        Raises:
            ValueError: If `config` lacks `optimizer` or `n`.
        """
        missing = {"optimizer", "n"} - set(config)
        if missing:
            raise ValueError(
                f"An AccumulatingOptimizer config needs {sorted(missing)}. "
                f"Received keys: {sorted(config)}."
            )
        inner = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        n = config["n"]
        if not isinstance(n, int):
            n = keras.saving.deserialize_keras_object(n, custom_objects=custom_objects)
        return cls(
            inner,
            n,
            reduction=config.get("reduction", "mean"),
            mode=config.get("mode", "masked"),
            _adopt=True,
        )


def _install_keras_serialization(cls: type) -> None:
    """Makes Keras serialize `cls` proxies as themselves; registers `cls`."""
    from keras.src.saving import object_registration, serialization_lib

    object_registration.GLOBAL_CUSTOM_OBJECTS[_REGISTERED_NAME] = cls
    object_registration.GLOBAL_CUSTOM_NAMES[cls] = _REGISTERED_NAME

    original = serialization_lib.serialize_keras_object
    if getattr(original, "_gradaccum_patched", False):
        return

    @wrapt.decorator
    def serialize(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        obj = args[0] if args else kwargs.get("obj")
        if type(obj) is cls:
            return obj._serialized()
        return wrapped(*args, **kwargs)

    patched = serialize(original)
    patched._gradaccum_patched = True
    # The function is bound by name in a few public modules too.
    import sys

    for name, module in list(sys.modules.items()):
        if (name == "keras" or name.startswith("keras.")) and getattr(
            module, "serialize_keras_object", None
        ) is original:
            setattr(module, "serialize_keras_object", patched)
