"""`Settings`: how one optimizer accumulates, checked once.

The arguments of `accumulate()` are one frozen value. It is checked when it
is made, and everything that needs the settings reads this value: the
optimizer proxy, the accumulating core, configs, pickles and copies, the
loss-scale wrapping and `accumulating()`. A setting added here is saved,
copied and restored without another list to extend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gradaccum import _validation
from gradaccum._adaptive import NoiseScaleSchedule


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings of an accumulating optimizer (see `gradaccum.accumulate`).

    Attributes:
        n: Micro-batches per applied update: an int >= 1, or a schedule (a
            callable of the applied-update count returning the next cycle's
            `n`).
        reduction: `"mean"` or `"sum"`.
        mode: `"masked"` or `"skip"`.
        weigh_by: `"count"` or `"batch"`.
        sparse: `"auto"`, `"rows"` or `"slices"` (how `tf.IndexedSlices`
            gradients are accumulated; see `gradaccum.accumulate`).
        agc: Adaptive gradient clipping's factor, or None (off).
        agc_eps: The smallest weight norm an AGC cap is computed from.
        agc_exclude: The variables AGC leaves alone: None, a predicate, or a
            tuple of variables and variable paths.
        noise_scale: Whether the gradient noise scale is measured.
        noise_decay: The decay of the moving averages of its estimates.
        accumulator_dtype: `"float32"` or `"bfloat16"` (compensated).
        micro_batch_size: None, or the samples of one micro-batch inside
            `model.fit`'s train step (`gradaccum._micro_batches`), or
            `"auto"` (`gradaccum._auto_size`); then `n` is 1: each train
            step is one cycle of its own micro-batches.
        memory_limit: With `micro_batch_size="auto"`: the bytes the train
            step may use on the device, or None (what the device has free).

    Raises:
        TypeError: If a setting has the wrong type.
        ValueError: If a setting has a wrong value, or `agc_exclude` is
            given without `agc`.
    """

    n: int | Callable[[Any], Any]
    reduction: str = "mean"
    mode: str = "masked"
    weigh_by: str = "count"
    sparse: str = "auto"
    agc: float | None = None
    agc_eps: float = 1e-3
    agc_exclude: Any = None
    noise_scale: bool = False
    noise_decay: float = 0.9
    accumulator_dtype: str = "float32"
    micro_batch_size: int | str | None = None
    memory_limit: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check = _CHECKS[field.name]
            object.__setattr__(self, field.name, check(getattr(self, field.name)))
        if self.agc is None and self.agc_exclude is not None:
            raise ValueError(
                "`agc_exclude` names variables adaptive gradient clipping leaves "
                "out, but `agc` is None (clipping is off). Pass `agc=` (for "
                "example 0.01) or drop `agc_exclude`."
            )
        if isinstance(self.n, NoiseScaleSchedule):
            # The schedule chooses `n` from the measured noise scale.
            object.__setattr__(self, "noise_scale", True)
        if self.noise_scale and self.reduction != "mean":
            # The estimators take each micro-gradient as the mean over its
            # micro-batch; a sum-reduced loss's gradient is not.
            raise ValueError(
                "noise_scale=True (which n=gradaccum.schedules.from_noise_scale(...) implies) measures "
                "the noise scale from mean micro-gradients; it needs reduction=\"mean\". "
                f"Received: reduction={self.reduction!r}."
            )
        if self.micro_batch_size is not None and self.n != 1:
            _validation.check_n_or_micro_batch_size(self.n, self.micro_batch_size)
        if self.memory_limit is not None and self.micro_batch_size != "auto":
            raise ValueError(
                "`memory_limit` bounds the memory micro_batch_size=\"auto\" chooses a micro-batch for; "
                f"Received: memory_limit={self.memory_limit!r} with micro_batch_size={self.micro_batch_size!r}."
            )
        if self.accumulator_dtype != "float32" and self.sparse == "slices":
            raise ValueError(
                f"accumulator_dtype={self.accumulator_dtype!r} sums dense gradients with compensation; "
                f"sparse={self.sparse!r} keeps slices instead. Use sparse=\"rows\" or accumulator_dtype=\"float32\"."
            )

    def replace(self, **changes: Any) -> Settings:
        """These settings with `changes` (checked)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name: the keyword arguments of `accumulate()`."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def portable(self) -> Settings:
        """These settings with the variables AGC leaves out named by their
        paths: what a copy, a pickle or a config carries, since it meets the
        variables of another model (or of the same one loaded anew)."""
        exclude = self.agc_exclude
        if exclude is None or callable(exclude):
            return self
        from gradaccum._agc import variable_path

        return self.replace(agc_exclude=tuple(e if isinstance(e, str) else variable_path(e) for e in exclude))

    def to_config(self) -> dict[str, Any]:
        """The settings as a Keras config: callables (a schedule of `n`, an
        AGC predicate) serialized as Keras serializes any function."""
        from keras.src.saving import serialization_lib

        config = self.portable().as_dict()
        for name, value in config.items():
            if callable(value):
                config[name] = serialization_lib.serialize_keras_object(value)
            elif isinstance(value, tuple):
                config[name] = list(value)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Settings:
        """The inverse of `to_config` (a setting the config lacks gets its
        default).

        Raises:
            TypeError: If `config` lacks `n`.
            ValueError: If `config` names an unknown setting.
        """
        import keras

        unknown = set(config) - {field.name for field in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"Unknown settings in an accumulating optimizer's config: {sorted(unknown)}.")
        values = dict(config)
        for name, value in values.items():
            if isinstance(value, dict):
                values[name] = keras.saving.deserialize_keras_object(value, custom_objects=custom_objects)
        return cls(**values)


# One check per setting, each returning the value as kept.
_CHECKS: dict[str, Callable[[Any], Any]] = {
    "n": _validation.check_n_or_schedule,
    "reduction": _validation.check_reduction,
    "mode": _validation.check_mode,
    "weigh_by": _validation.check_weigh_by,
    "sparse": _validation.check_sparse,
    "agc": _validation.check_agc,
    "agc_eps": _validation.check_agc_eps,
    "agc_exclude": _validation.check_agc_exclude,
    "noise_scale": _validation.check_noise_scale,
    "noise_decay": _validation.check_noise_decay,
    "accumulator_dtype": _validation.check_accumulator_dtype,
    "micro_batch_size": _validation.check_micro_batch_size,
    "memory_limit": _validation.check_memory_limit,
}


class SettingsView:
    """The settings an accumulating optimizer shows, read-only (its
    `_self_core` holds them); `n`, which can be set, is the optimizer's own.
    """

    _self_core: Any

    @property
    def reduction(self) -> str:
        """`"mean"` or `"sum"`: how the micro-gradients are combined."""
        return self._self_core.settings.reduction

    @property
    def mode(self) -> str:
        """`"masked"` or `"skip"`: when the wrapped optimizer's update runs."""
        return self._self_core.settings.mode

    @property
    def weigh_by(self) -> str:
        """`"count"` or `"batch"`: what a `model.fit` micro-batch weighs."""
        return self._self_core.settings.weigh_by

    @property
    def sparse(self) -> str:
        """`"auto"`, `"rows"` or `"slices"`: how `tf.IndexedSlices` gradients are kept."""
        return self._self_core.settings.sparse

    @property
    def agc(self) -> float | None:
        """Adaptive gradient clipping's factor, or None (off)."""
        return self._self_core.settings.agc

    @property
    def agc_eps(self) -> float:
        """The smallest weight norm an AGC cap is computed from."""
        return self._self_core.settings.agc_eps

    @property
    def micro_batch_size(self) -> int | str | None:
        """The samples of one micro-batch inside `model.fit`'s train step, or
        None; with `"auto"`, the size chosen (an int) once a step has chosen it."""
        from gradaccum import _auto_size

        return _auto_size.size_of(self._self_core)

    @property
    def memory_limit(self) -> int | None:
        """The bytes `micro_batch_size="auto"` fits the train step into, or None."""
        return self._self_core.settings.memory_limit

    @property
    def agc_exclude(self) -> Any:
        """What AGC leaves out: None, a predicate, or variables and paths."""
        return self._self_core.settings.agc_exclude
