"""The accumulation state in Keras files: its keys, names and settings.

Every backend writes the same `gradaccum_*` keys beside the wrapped
optimizer's own (see `gradaccum._state`), so a file written on one Keras
backend resumes its partial cycle on another.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# The proxy's checkpoint child, and the prefix of its keys in Keras files.
CHILD = "gradient_accumulation"
KEY = "gradaccum_"
# Optimizer state a Keras file would lose (`Keras3Family.untracked_variables`).
UNTRACKED = f"{KEY}untracked_"
_REDUCTION_CODES = {"mean": 0, "sum": 1}


def _name(variable: Any) -> str:
    return getattr(variable, "path", None) or getattr(variable, "name", repr(variable))


def _path(variable: Any) -> str:
    """A variable's path (Keras 3) or name without its `:0` (TensorFlow)."""
    path = getattr(variable, "path", None) or variable.name
    return path[:-2] if path.endswith(":0") else path


def relative_names(variables: Sequence[Any]) -> list[str]:
    """The variables' paths without the leading components they all share.

    A variable's path depends on the name scope it was created in: a model
    built in Python and the same model loaded from a file may give the same
    variables paths that differ by a leading model name (`mlp/dense/kernel`
    and `dense/kernel`). What follows the common prefix names each variable
    the same way in both. The last component is never dropped.
    """
    parts = [_path(v).split("/") for v in variables]
    common = 0
    if parts:
        shortest = min(len(p) for p in parts) - 1
        while common < shortest and all(p[common] == parts[0][common] for p in parts):
            common += 1
    return ["/".join(p[common:]) for p in parts]


def _encode_names(names: list[str]) -> np.ndarray:
    # Keras stores hold numeric arrays only: UTF-8 bytes, separated by NUL
    # (which no variable name contains).
    return np.frombuffer("\0".join(names).encode("utf-8"), dtype=np.uint8)


def _decode_names(encoded: Any, count: int) -> list[str]:
    if not count:
        return []
    return np.asarray(encoded, dtype=np.uint8).tobytes().decode("utf-8").split("\0")


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


def read_store(store: Any) -> dict[str, np.ndarray]:
    """A Keras weights store's values, read into memory.

    Keras closes the file once loading returns; what an unbuilt optimizer
    keeps for later must not refer to it.
    """
    return {key: np.array(store[key]) for key in store.keys()}


def check_saved_settings(store: Any, n_code: int, reduction: str) -> None:
    """Refuses a Keras weights store written with another `n` or `reduction`.

    A store without accumulation state (written by the plain optimizer)
    passes.

    Raises:
        ValueError: If the store's `n` or `reduction` differ.
    """
    if f"{KEY}n" not in store.keys():
        return
    saved_reduction = {v: k for k, v in _REDUCTION_CODES.items()}.get(
        int(np.asarray(store[f"{KEY}reduction"])), "?"
    )
    _check_settings(int(np.asarray(store[f"{KEY}n"])), saved_reduction, n_code, reduction)


def saved_accumulators(
    store: Any, variables: Sequence[Any], shapes: Sequence[Any]
) -> tuple[list[int], list[np.ndarray]]:
    """The saved accumulators for `variables`, and where each was saved.

    Accumulators are matched to variables by name when the saved names and
    these are the same set of distinct names; otherwise (names written by a
    model with other layer names, or none written) by position, as the
    wrapped Keras optimizer loads its own variables.

    Args:
        store: A Keras weights store holding what `State.save` wrote.
        variables: The variables accumulated for, in the optimizer's order.
        shapes: Their accumulators' shapes.

    Returns:
        `(source, values)`: `source[i]` is the saved position of accumulator
        `i`, `values[i]` its saved value.

    Raises:
        ValueError: If the store was written for another model (naming the
            variables that differ).
    """
    count = sum(1 for k in store.keys() if k.startswith(f"{KEY}accumulator_"))
    names = relative_names(variables)
    saved_names = None
    if f"{KEY}names" in store.keys():
        saved_names = _decode_names(store[f"{KEY}names"], count)
    if count != len(shapes):
        differ = ""
        if saved_names is not None:
            only_saved = [m for m in saved_names if m not in names][:5]
            only_here = [m for m in names if m not in saved_names][:5]
            differ = f" Saved only: {only_saved}; here only: {only_here}."
        raise ValueError(
            f"The saved gradient-accumulation state has {count} "
            f"accumulators, but this optimizer has {len(shapes)} "
            f"(one per trainable variable): it was saved for another model.{differ}"
        )
    # `source[i]`: the saved position of this optimizer's accumulator `i`.
    source = list(range(count))
    if (
        saved_names is not None
        and len(set(saved_names)) == len(saved_names) == len(set(names)) == count
        and set(saved_names) == set(names)
    ):
        position = {name: j for j, name in enumerate(saved_names)}
        source = [position[name] for name in names]
    values = []
    for i, (shape, j) in enumerate(zip(shapes, source)):
        value = np.asarray(store[f"{KEY}accumulator_{j}"])
        if tuple(value.shape) != tuple(shape):
            saved = repr(saved_names[j]) if saved_names is not None else f"at position {j}"
            raise ValueError(
                f"The saved accumulator for variable {saved} has shape "
                f"{tuple(value.shape)}, but this optimizer's variable "
                f"{_path(variables[i])!r} (position {i}) has shape "
                f"{tuple(shape)}: the state was saved for another model."
            )
        values.append(value)
    return source, values


def owns_key(key: str) -> bool:
    """Whether a Keras-file key is the accumulation state's."""
    return key.startswith(KEY)
