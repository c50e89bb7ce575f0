"""The accumulation state in Keras files (`.keras`, `.weights.h5`).

The state goes under `gradaccum_*` keys beside the wrapped optimizer's own,
the same on every backend, so a file written on one resumes its partial
cycle on another. Each accumulator's variable is named (`gradaccum_names`,
paths relative to what they share), so a model that lists its variables in
another order once reloaded gets each sum back on its variable. State
written with another `n` or `reduction`, or for another model, is refused
before `load_weights` writes any weight (`check_before_loading`). A plain
Keras optimizer given such a file loads its own variables from it and drops
the partial cycle (`load_into_plain`).
"""

from __future__ import annotations

import os
import warnings
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gradaccum._noise import NAMES as NOISE_NAMES
from gradaccum._state import State

KEY = "gradaccum_"
# Optimizer state a Keras file would lose (`Keras3Family.untracked_variables`).
UNTRACKED = f"{KEY}untracked_"
_REDUCTIONS = ("mean", "sum")
# A variable's kept slices (`State.kept`), each key followed by `_{index}`:
# grown slices of every replica side by side (the only ones files written
# before held, with `sparse="slices"`), each replica's count, fixed slices
# summed over replicas, and the cycle's micro-steps they hold.
KEPT = ("kept_values", "kept_indices", "kept_counts", "fixed_values", "fixed_indices", "kept_steps")


def owns_key(key: str) -> bool:
    """Whether a Keras-file key is the accumulation state's."""
    return key.startswith(KEY)


def read_store(store: Any) -> dict[str, np.ndarray]:
    """A Keras weights store's values, read into memory (Keras closes the
    file once loading returns)."""
    # A Keras store is not a dict: it lists its keys with `keys()`.
    return {key: np.array(store[key]) for key in store.keys()}  # noqa: SIM118


def _path(variable: Any) -> str:
    path = getattr(variable, "path", None) or variable.name
    return path[:-2] if path.endswith(":0") else path


def relative_names(variables: Sequence[Any]) -> list[str]:
    """The variables' paths without the leading components they all share:
    a model built in Python and the same model loaded from a file may give
    the same variables paths that differ by a leading model name. The last
    component is never dropped."""
    parts = [_path(v).split("/") for v in variables]
    common = 0
    if parts:
        shortest = min(len(p) for p in parts) - 1
        while common < shortest and all(p[common] == parts[0][common] for p in parts):
            common += 1
    return ["/".join(p[common:]) for p in parts]


def check_settings(saved_n: int, saved_reduction: str, n: int, reduction: str) -> None:
    """Refuses state written with another `n` (0: a schedule) or `reduction`."""

    def describe(n: int) -> str:
        return "a schedule" if n == 0 else f"n={n}"

    if saved_n != n:
        raise ValueError(
            "The checkpoint's gradient-accumulation state was written with "
            f"{describe(saved_n)}, but this optimizer accumulates with "
            f"{describe(n)}. Wrap the optimizer the same way to resume "
            "this cycle, or restore into the plain optimizer to drop the "
            "partial cycle."
        )
    if saved_reduction != reduction:
        raise ValueError(
            "The checkpoint's gradient-accumulation state was written with "
            f"reduction={saved_reduction!r}, but this optimizer has reduction={reduction!r}."
        )


def check_store(values: dict[str, np.ndarray], n: int, reduction: str) -> None:
    """`check_settings` for a Keras store (one without the state passes)."""
    if f"{KEY}n" in values:
        saved = int(np.asarray(values[f"{KEY}reduction"]))
        check_settings(int(np.asarray(values[f"{KEY}n"])), _REDUCTIONS[saved] if saved < 2 else "?", n, reduction)


def snapshot(state: State, backend: Any, n: int, reduction: str) -> dict[str, np.ndarray]:
    """The state as Keras files hold it. Between cycles the accumulators and
    the weight total hold the last cycle's values, which count for nothing:
    they are written as zeros."""
    state.load_restored_slices()
    begun = state.begun()
    total = backend.saved(state.weight_total, False)
    names = "\0".join(relative_names(state.variables)).encode("utf-8")
    values = {
        f"{KEY}n": np.asarray(n, dtype=np.int64),
        f"{KEY}reduction": np.asarray(_REDUCTIONS.index(reduction)),
        f"{KEY}micro_step": np.asarray(backend.saved(state.micro_step, False), np.int64),
        f"{KEY}weight_total": total if begun else np.zeros_like(total),
        f"{KEY}seen": np.array([i in state.took_part_ever for i in range(len(state.accumulators))]),
        f"{KEY}touched": _took_part(state, backend),
        # Keras stores hold numbers only: UTF-8 bytes, separated by NUL.
        f"{KEY}names": np.frombuffer(names, dtype=np.uint8),
    }
    if state.noise is not None:
        # The noise scale's estimates, and its sum of the cycle so far.
        for name, variable in zip(NOISE_NAMES, state.noise.variables()):
            values[f"{KEY}noise_{name}"] = np.asarray(backend.saved(variable, False), np.float32)
    for i, accumulator in enumerate(state.accumulators):
        value = _portable(backend.saved(accumulator, state.keeps_maximum(i)))
        values[f"{KEY}accumulator_{i}"] = value if begun else np.zeros_like(value)
        if state.compensations is not None:
            value = _portable(backend.saved(state.compensations[i], False))
            values[f"{KEY}compensation_{i}"] = value if begun else np.zeros_like(value)
        if i in state.kept:
            for key, held in state.kept[i].saved().items():
                values[f"{KEY}{key}_{i}"] = held
    return values


def _portable(value: np.ndarray) -> np.ndarray:
    # Keras stores hold NumPy's own dtypes: bfloat16 is written as float32
    # (exactly) and cast back when loaded.
    return value.astype(np.float32) if value.dtype.name == "bfloat16" else value


def _took_part(state: State, backend: Any) -> np.ndarray:
    """Which variables received a gradient in the current cycle."""
    if state.took_part is not None:
        return backend.saved(state.took_part, False) > 0
    took_part = state.position.took_part()
    if took_part is not None:
        return np.array([i in took_part for i in range(len(state.accumulators))])
    return np.array([i in state.took_part_ever for i in range(len(state.accumulators))])


def check_model(values: dict[str, np.ndarray], state: State) -> None:
    """Refuses a store whose accumulation state was written for another
    model (another count of accumulators, or other shapes); one without
    the state passes.

    Raises:
        ValueError: Naming what differs.
    """
    if f"{KEY}n" in values:
        _sources(values, state)


def _sources(values: dict[str, np.ndarray], state: State) -> list[int]:
    """`source[i]`: the saved position of accumulator `i`. By name when the
    saved names and these are the same set of distinct names; otherwise (a
    model with other layer names, or no names written) by position, as the
    wrapped Keras optimizer loads its own variables.

    Raises:
        ValueError: If the store was written for another model.
    """
    count = sum(1 for k in values if k.startswith(f"{KEY}accumulator_"))
    names = relative_names(state.variables)
    saved_names = None
    if f"{KEY}names" in values and count:
        saved_names = np.asarray(values[f"{KEY}names"], dtype=np.uint8).tobytes().decode("utf-8").split("\0")
    if count != len(state.accumulators):
        differ = ""
        if saved_names is not None:
            only_saved = [m for m in saved_names if m not in names][:5]
            only_here = [m for m in names if m not in saved_names][:5]
            differ = f" Saved only: {only_saved}; here only: {only_here}."
        raise ValueError(
            f"The saved gradient-accumulation state has {count} accumulators, but this "
            f"optimizer has {len(state.accumulators)} (one per trainable variable): it "
            f"was saved for another model.{differ}"
        )
    source = list(range(count))
    if saved_names is not None and len(set(saved_names)) == count == len(set(names)) and set(saved_names) == set(names):
        position = {name: j for j, name in enumerate(saved_names)}
        source = [position[name] for name in names]
    for i, j in enumerate(source):
        shape, saved = tuple(state.variables[i].shape), tuple(values[f"{KEY}accumulator_{j}"].shape)
        if saved != shape:
            where = repr(saved_names[j]) if saved_names is not None else f"at position {j}"
            raise ValueError(
                f"The saved accumulator for variable {where} has shape {saved}, but this "
                f"optimizer's variable {_path(state.variables[i])!r} (position {i}) has shape "
                f"{shape}: the state was saved for another model."
            )
    return source


def restore(state: State, backend: Any, values: dict[str, np.ndarray], sparse: str) -> None:
    """Loads what `snapshot` wrote.

    Raises:
        ValueError: If the store was written for another model.
    """
    source = _sources(values, state)
    for i, j in enumerate(source):
        value = np.asarray(values[f"{KEY}accumulator_{j}"]).copy()
        backend.load(state.accumulators[i], value.astype(backend.saved(state.accumulators[i], False).dtype),
                     state.keeps_maximum(i))
        if state.compensations is not None:
            # A file written without compensation: the sums are exact as held.
            held = np.asarray(values.get(f"{KEY}compensation_{j}", np.zeros_like(value)))
            target = state.compensations[i]
            backend.load(target, held.astype(backend.saved(target, False).dtype), False)
    micro_step = int(np.asarray(values[f"{KEY}micro_step"]))
    backend.assign(state.micro_step, micro_step)
    seen = np.asarray(values[f"{KEY}seen"], dtype=bool)
    state.took_part_ever = {i for i, j in enumerate(source) if bool(seen[j])}
    flags = np.asarray(values[f"{KEY}touched"], dtype=bool)
    took_part = {i for i, j in enumerate(source) if flags[j]} & state.took_part_ever
    state.position.load_took_part(took_part, len(state.accumulators))
    if state.noise is not None:
        # A file written without the noise scale leaves it unmeasured.
        for name, variable in zip(NOISE_NAMES, state.noise.variables()):
            backend.load(variable, np.asarray(values.get(f"{KEY}noise_{name}", 0.0), np.float32), False)
    backend.load(state.weight_total, np.asarray(values[f"{KEY}weight_total"], np.float32), False)
    # Last: where the slices are added into rows, into the rows just loaded.
    for i, j in enumerate(source):
        kept = {key: values[f"{KEY}{key}_{j}"] for key in KEPT if f"{KEY}{key}_{j}" in values}
        if kept or i in state.kept:
            state.load_kept(i, kept, sparse)


def _file_state(filepath: Any) -> dict[str, np.ndarray] | None:
    """The accumulation state a local `.weights.h5` or `.keras` file holds
    for a model's optimizer (or the inner optimizer of a loss-scale one
    there); None where it holds none or is of another kind."""
    from keras.src.saving import saving_lib

    path = str(filepath)
    if not os.path.isfile(path) or not path.endswith((".weights.h5", ".keras")):
        return None
    archive = zipfile.ZipFile(path, "r") if path.endswith(".keras") else None
    store = saving_lib.H5IOStore(saving_lib._VARS_FNAME_H5 if archive else path, archive=archive, mode="r")
    try:
        for inner in ("optimizer", "optimizer/inner_optimizer"):
            values = read_store(store.get(inner))
            if f"{KEY}n" in values:
                return values
        return None
    finally:
        store.close()
        if archive is not None:
            archive.close()


def check_before_loading(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `load_weights_only`, which first refuses a file whose
    accumulation state the model's accumulating optimizer cannot take.

    Keras loads the layers' weights before the optimizer's variables and
    reports a failure once all were tried, so a refusal of the optimizer's
    state alone would leave the model with the file's weights. Checked
    first, nothing is written. (With `skip_mismatch=True` Keras loads what
    fits and warns, and so it does here.)

    Raises:
        ValueError: If the file was written with another `n` or `reduction`,
            or for another model.
    """
    model = args[0] if args else kwargs.get("model")
    filepath = args[1] if len(args) > 1 else kwargs.get("filepath")
    skip_mismatch = args[2] if len(args) > 2 else kwargs.get("skip_mismatch", False)
    optimizer = getattr(model, "optimizer", None)
    cores = [getattr(o, "_self_core", None) for o in (optimizer, getattr(optimizer, "inner_optimizer", None))]
    core = next((c for c in cores if c is not None), None)
    if core is not None and not skip_mismatch:
        values = _file_state(filepath)
        if values is not None:
            check_store(values, core.cycle.code, core.settings.reduction)
            if core.state is not None:
                check_model(values, core.state)
    return wrapped(*args, **kwargs)


def load_into_plain(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `Optimizer.load_own_variables`, which loads a plain
    optimizer's variables (slots, `iterations`) from an accumulating
    optimizer's store, as a TensorFlow checkpoint restores them, where
    Keras would skip them all for the store's extra keys. The partial cycle
    the file holds is dropped, warned: a plain optimizer cannot hold it."""
    store = args[0] if args else kwargs["store"]
    keys = list(store.keys())
    if not any(owns_key(k) for k in keys):
        return wrapped(*args, **kwargs)
    micro_steps = int(np.asarray(store[f"{KEY}micro_step"])) if f"{KEY}micro_step" in keys else 0
    if micro_steps:
        warnings.warn(
            f"gradaccum: optimizer {getattr(instance, 'name', '')!r} does not accumulate, so the partial "
            f"cycle of {micro_steps} micro-batch{'es' if micro_steps > 1 else ''} this file holds is "
            "dropped; its own variables and `iterations` are loaded. Wrap it with `accumulate` as the "
            "saved one was to resume the cycle.",
            stacklevel=3,
        )
    return wrapped({k: store[k] for k in keys if not owns_key(k)})
