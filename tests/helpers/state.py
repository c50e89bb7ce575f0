"""Training state as NumPy arrays, and how two states are compared.

A state maps a key to an array: `"model/<layer>/<name>"` for every model
weight, `"opt/<name>"` for every optimizer variable and `"iterations"`. The
keys leave out what differs between two equivalent runs (the optimizer's
and the model's instance names, the uniquifying suffixes of unnamed
variables), so that a reference and a subject trained from the same model
constructor have the same keys. Keras 3 variables are named by their
`path`; tf_keras variables, which have none, by their `name`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from tests.helpers.tolerances import ATOL, FLOOR_FACTOR, RTOL


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))


def tf_keras_key(name: str) -> str:
    """A tf_keras variable's name without what differs between equivalent runs.

    Slot names start with the name scopes they were created in, which depend
    on the code path that built the optimizer ("Adam/m/hidden0/kernel" from
    `apply_gradients`, "m/hidden0/kernel" from `build`, "cond_1/Adam/iter"
    inside a loss-scale optimizer's `tf.cond`): leading scopes that are an
    optimizer's default name (capitalised; the test models' layer names are
    not) or a `cond` are dropped. So is the process-wide uniquifying suffix
    of unnamed variables ("Variable_3").
    """
    parts = name.split(":")[0].split("/")
    while len(parts) > 1 and re.fullmatch(r"[A-Z]\w*|cond(_\d+)?", parts[0]):
        parts = parts[1:]
    return re.sub(r"_\d+$", "", "/".join(parts))


def _put(named: list[tuple[str, Any]], seen: set[str], key: str, variable: Any) -> None:
    """Appends `(key, variable)`, numbering a repeated key ("key#1")."""
    unique, k = key, 1
    while unique in seen:
        unique, k = f"{key}#{k}", k + 1
    seen.add(unique)
    named.append((unique, variable))


def _variable_types() -> tuple[type, ...]:
    if keras.backend.backend() != "tensorflow":
        return (keras.Variable,)
    import tensorflow as tf

    return (keras.Variable, tf.Variable)


def _optimizer_types() -> tuple[type, ...]:
    """Keras 3's optimizer class, and tf_keras's where this process runs it."""
    found: list[type] = [keras.optimizers.Optimizer]
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None:
        found += [tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer]
    return tuple(found)


def optimizer_variables(optimizer: Any) -> list[Any]:
    """`optimizer.variables`, and the variables its (inner) optimizers hold.

    A Keras 3 LossScaleOptimizer builds its inner optimizer with Keras's
    variable tracking off, so variables an optimizer's `build` creates
    directly (Nadam's `_u_product`, Adafactor's placeholders) are missing
    from `variables` there; they are optimizer state all the same.
    (`variables` is a method on tf_keras's OptimizerV2.) tf_keras's
    optimizers hold such variables as plain `tf.Variable`s (its Nadam's
    `_u_product`, which its checkpoints save).
    """
    kinds, optimizers = _variable_types(), _optimizer_types()
    variables = optimizer.variables
    found = list(variables() if callable(variables) else variables)
    known = {id(v) for v in found}
    pending, visited = [optimizer], set()
    while pending:
        opt = pending.pop(0)
        opt = getattr(opt, "__wrapped__", opt)  # an AccumulatingOptimizer's
        if id(opt) in visited:
            continue
        visited.add(id(opt))
        known |= {id(v) for v in getattr(opt, "_trainable_variables", [])}
        for value in vars(opt).values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, optimizers):
                    pending.append(item)
                elif isinstance(item, kinds) and id(item) not in known:
                    known.add(id(item))
                    found.append(item)
    return found


def named_optimizer_variables(optimizer: Any, model_name: str = "") -> list[tuple[str, Any]]:
    """`("opt/<name>", variable)` for every optimizer variable, in creation order.

    Keras 3 names a variable by the last part of its path: the leading parts
    name the optimizer (and a loss-scale wrapper), which differ between the
    runs compared; slot names start with the model's name in a model built
    in Python, not in one loaded from a file, so `model_name` is dropped.
    The accumulation state, which the accumulating optimizer lists after
    the wrapped optimizer's variables on JAX and PyTorch, is left out: no
    plain optimizer has it.
    """
    named: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for v in optimizer_variables(optimizer):
        if not hasattr(v, "path"):
            _put(named, seen, f"opt/{tf_keras_key(v.name)}", v)
            continue
        leaf = v.path.rsplit("/", 1)[-1]
        if leaf.startswith("gradaccum_"):
            continue
        leaf = re.sub(r"_\d+$", "", leaf)
        if model_name and leaf.startswith(model_name + "_"):
            leaf = leaf[len(model_name) + 1 :]
        _put(named, seen, f"opt/{leaf}", v)
    return named


def named_model_weights(model: Any) -> list[tuple[str, Any]]:
    """`("model/<layer>/<name>", weight)` for every weight of the model."""
    named: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for v in model.weights:
        key = "/".join(v.path.split("/")[-2:]) if hasattr(v, "path") else tf_keras_key(v.name)
        _put(named, seen, f"model/{key}", v)
    return named


def named_variables(model: Any, optimizer: Any) -> list[tuple[str, Any]]:
    """The model's weights and the optimizer's variables, keyed as in `full_state`."""
    return named_model_weights(model) + named_optimizer_variables(
        optimizer, getattr(model, "name", "")
    )


def model_state(model: Any) -> dict[str, np.ndarray]:
    return {key: _numpy(v) for key, v in named_model_weights(model)}


def optimizer_state(optimizer: Any, model_name: str = "") -> dict[str, np.ndarray]:
    return {key: _numpy(v) for key, v in named_optimizer_variables(optimizer, model_name)}


def full_state(model: Any, optimizer: Any) -> dict[str, np.ndarray]:
    """Model weights, every optimizer variable and `iterations`."""
    out = {key: _numpy(v) for key, v in named_variables(model, optimizer)}
    # A variable, or (Keras's own accumulation on JAX) a computed array.
    out["iterations"] = np.asarray(int(_numpy(optimizer.iterations)))
    return out


def assert_states_close(
    reference: dict[str, np.ndarray],
    subject: dict[str, np.ndarray],
    rtol: float = RTOL,
    atol: float = ATOL,
    floor: dict[str, float] | None = None,
) -> None:
    """Every entry within float32 rounding of the reference.

    Within `rtol`/`atol`, or, for an entry whose two equivalent plain runs
    differ by more (see `rounding_floor`), within `FLOOR_FACTOR` times that.
    """
    assert sorted(reference) == sorted(subject), sorted(set(reference) ^ set(subject))
    if "iterations" in reference:
        assert int(subject["iterations"]) == int(reference["iterations"])
    for key in reference:
        extra = FLOOR_FACTOR * floor[key] if floor else 0.0
        np.testing.assert_allclose(
            subject[key], reference[key], rtol=rtol, atol=atol + extra, err_msg=key
        )


def assert_states_equal(
    before: dict[str, np.ndarray], after: dict[str, np.ndarray], what: str = ""
) -> None:
    """Every array equal (`np.array_equal`) and of the same dtype and shape."""
    assert sorted(before) == sorted(after), sorted(set(before) ^ set(after))
    changed = [
        k
        for k in before
        if np.asarray(before[k]).dtype != np.asarray(after[k]).dtype
        or not np.array_equal(before[k], after[k])
    ]
    assert not changed, f"{what}: changed {changed}" if what else f"changed {changed}"


def rounding_floor(reference: dict, summed: dict) -> dict[str, float]:
    """Per state entry: how far two equivalent plain runs differ.

    `summed` is the plain optimizer applied, once per cycle, to the mean of
    the micro-batch gradients that the test itself computes and sums in
    float32: mathematically the large-batch run, with no gradaccum
    involved, rounded the way accumulation rounds. Mostly the two agree to
    ~1e-7. But a gradient component that is a sum of terms cancelling to
    almost nothing carries a rounding error far above float32's relative
    precision, and an optimizer that normalises its step (Adam's
    m/sqrt(v), RMSprop, sign-like updates) makes its step size independent
    of the component's size, so that relative error becomes an absolute one
    of order `learning_rate * error` in the weights (measured: 1.9e-4 on one
    weight of a drawn Conv2D/AdamW run under XLA).
    """
    return {
        k: float(np.max(np.abs(np.asarray(reference[k], np.float64) - summed[k]), initial=0.0))
        for k in reference
    }


def assert_finite(state: dict) -> None:
    """A drawn run must stay finite, or a comparison would prove nothing."""
    bad = [k for k, v in state.items() if not np.all(np.isfinite(v))]
    assert not bad, f"non-finite reference state (invalid draw?): {bad}"


def values(variables: Sequence[Any]) -> list[np.ndarray]:
    """The variables' (or tensors') values as NumPy arrays."""
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def assert_same(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> None:
    """Two lists of arrays, bit for bit."""
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert np.array_equal(u, v), (i, np.max(np.abs(u - v)))


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray], prefix: str = "") -> float:
    """The largest absolute difference over the entries whose key starts with `prefix`."""
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a if k.startswith(prefix))


def without_keras_accumulation(state: dict[str, Any]) -> dict[str, Any]:
    """`state` without what Keras's own `gradient_accumulation_steps` keeps
    differently: its accumulators, and its step variable, which counts
    micro-steps (its `iterations`, compared as `"iterations"`, counts
    updates)."""
    return {k: v for k, v in state.items() if "gradient_accumulator" not in k and k != "opt/iteration"}


def accumulation_arrays(optimizer: Any) -> dict[str, np.ndarray]:
    """The accumulation state as arrays: each accumulator (`"acc/<i>"`),
    `micro_step`, `weight_total` and the noise scale's estimates, as
    `accumulation_state` shows them (empty before the state is built). A
    loss-scale optimizer's: its inner accumulating optimizer's."""
    if not hasattr(optimizer, "accumulation_state"):
        optimizer = optimizer.inner_optimizer
    state = optimizer.accumulation_state
    if state is None:
        return {}
    out = {f"acc/{i}": _numpy(a) for i, a in enumerate(state.accumulators)}
    out["micro_step"] = _numpy(state.micro_step)
    out["weight_total"] = _numpy(state.weight_total)
    for name in ("noise_scale", "gradient_sq", "gradient_trace", "noise_batch", "noise_cycles"):
        if getattr(state, name) is not None:
            out[name] = np.asarray(getattr(state, name))
    return out


def whole_state(model: Any, optimizer: Any) -> dict[str, np.ndarray]:
    """`full_state` and the accumulation state (`accumulation_arrays`): all
    a step may write."""
    return {**full_state(model, optimizer), **accumulation_arrays(optimizer)}
