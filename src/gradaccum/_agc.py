"""Adaptive gradient clipping (AGC) of the accumulated gradient.

AGC (Brock et al. 2021, "High-Performance Large-Scale Image Recognition
Without Normalization") caps, for each output unit of each variable, the
gradient's norm at `clip_factor * max(||W_unit||, eps)`. It is not linear:
clipping each micro-batch's gradient and summing (what the seed package
does) is not clipping their sum. Large-batch training clips the large
batch's gradient once per update, so gradaccum clips the accumulated
gradient where it is handed to the wrapped optimizer: after the replica sum
(`gradaccum._core.Core.deliver`) and on unscaled gradients, before the
wrapped optimizer's own `clipnorm`/`global_clipnorm`/`clipvalue`.

Unit norms follow the paper's reference code (`unitwise_norm` there):
whole-tensor norms for tensors with at most one dimension larger than 1
(biases, scalars, a `(5, 1)` kernel), the norm over axis 0 for kernels of
rank 2 and 3 (`(in, out)`, multi-head `(in, heads, out)`), over axes 0-2 for
4-D convolution kernels (`HWIO`). The reference code refuses higher ranks;
here they take every axis but the last (a `Conv3D` kernel's `DHWIO`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from gradaccum import _backend

# What keeps a zero gradient norm from being a divisor; as in the
# reference code, it can only matter for a unit whose gradient is 0, which
# is left as it is anyway.
_TINY = 1e-6


def unit_axes(shape: Sequence[int | None]) -> tuple[int, ...] | None:
    """The axes a unit's norm runs over, None for the whole tensor."""
    shape = list(shape)
    if len([d for d in shape if d != 1]) <= 1:
        return None
    rank = len(shape)
    if rank in (2, 3):
        return (0,)
    if rank == 4:
        return (0, 1, 2)
    return tuple(range(rank - 1))


def unitwise_norm(x: Any, axes: tuple[int, ...] | None) -> Any:
    """The Euclidean norm over `axes` (all for None), dimensions kept."""
    return ops.sqrt(ops.sum(ops.square(x), axis=axes, keepdims=True))


def _compute_dtype(dtype: Any) -> str:
    return "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"


def variable_path(variable: Any) -> str:
    """How the exclusion names a variable: its `path`, else its `name`."""
    path = getattr(variable, "path", None)
    if isinstance(path, str):
        return path
    return _without_index(str(getattr(variable, "name", "")))


def _same_path(a: str, b: str) -> bool:
    """Whether two variable paths name the same variable: equal, or one ends
    with `"/"` and the other. A model built in Python prefixes its variables'
    paths with its name (`"mlp/out/kernel"`); the same model loaded from a
    file does not (`"out/kernel"`)."""
    a, b = _without_index(a), _without_index(b)
    return a == b or a.endswith("/" + b) or b.endswith("/" + a)


def _without_index(name: str) -> str:
    # A TensorFlow variable's name ends with its output index (":0").
    return name[:-2] if name.endswith(":0") else name


class AdaptiveClipping:
    """Unit-wise adaptive gradient clipping (see the module docstring).

    Args:
        clip_factor: λ, checked (a finite number > 0).
        eps: The smallest weight norm a unit's cap is computed from,
            checked (a finite number > 0).
        exclude: Variables left unclipped, checked: None, a predicate
            `exclude(variable) -> bool`, or a tuple of variables and of
            strings, each naming a variable by its `path` (Keras 3) or
            `name` (tf_keras, with or without `":0"`): a string names the
            variables whose path equals it, ends with `"/"` and it, or is
            its end after a `"/"` (`"out/kernel"` names `"mlp/out/kernel"`
            and the other way round).
    """

    def __init__(self, clip_factor: float, eps: float, exclude: Any):
        self.clip_factor = clip_factor
        self.eps = eps
        self.exclude = exclude

    def excludes(self, variable: Any) -> bool:
        """Whether `variable`'s gradient is left as it is."""
        # A float8 layer's scales and amax histories are overwritten with
        # their "gradient", which is a value, not a gradient.
        if getattr(variable, "overwrite_with_gradient", False):
            return True
        exclude = self.exclude
        if exclude is None:
            return False
        if callable(exclude):
            return bool(exclude(variable))
        path = variable_path(variable)
        for entry in exclude:
            if isinstance(entry, str):
                if _same_path(entry, path):
                    return True
            elif entry is variable:
                return True
        return False

    def excluded_names(self) -> list[str] | None:
        """The exclusion as names, for configs (None if it is a predicate)."""
        if self.exclude is None or callable(self.exclude):
            return None
        return [e if isinstance(e, str) else variable_path(e) for e in self.exclude]

    def portable(self) -> AdaptiveClipping:
        """The same clipping with variables in the exclusion named by their
        paths: what a copy, a pickle or a config of the optimizer carries
        (it will meet the variables of another model, or of the same one
        loaded anew)."""
        names = self.excluded_names()
        if names is None:
            return self
        return AdaptiveClipping(self.clip_factor, self.eps, tuple(names))

    def factor(self, grad: Any, variable: Any, scale: Any = None) -> Any:
        """What `grad` is multiplied by: per unit, 1 or the cap over its norm.

        Args:
            grad: A dense tensor or `tf.IndexedSlices` (its rows summed).
            variable: The variable `grad` is the gradient of.
            scale: A loss-scale factor `grad` carries (clipping looks at
                `grad / scale`), or None.
        """
        grad = _backend.for_active().gradients.densify(grad)
        dtype = _compute_dtype(grad.dtype)
        dense = ops.cast(grad, dtype)
        if scale is not None:
            dense = dense / ops.cast(scale, dtype)
        weights = ops.cast(ops.convert_to_tensor(variable), dtype)
        axes = unit_axes(dense.shape)
        cap = ops.maximum(unitwise_norm(weights, axes), ops.cast(self.eps, dtype)) * ops.cast(
            self.clip_factor, dtype
        )
        norm = unitwise_norm(dense, axes)
        # `where`, not `minimum`: a unit under its cap keeps its gradient
        # exactly (a factor of 1), as in the reference code.
        return ops.where(norm < cap, ops.ones_like(norm), cap / ops.maximum(norm, _TINY))

    def clip(self, grads: Sequence[Any], variables: Sequence[Any], scale: Any = None) -> list[Any]:
        """Clips each gradient of a variable not excluded.

        Args:
            grads: Gradients (dense, `tf.IndexedSlices` or None).
            variables: Their variables.
            scale: A loss-scale factor the gradients carry, or None.

        Returns:
            The gradients, clipped, in their dtypes; `IndexedSlices` stay
            sparse (every row of a unit scales alike).
        """
        backend = _backend.for_active()
        out = []
        for g, v in zip(grads, variables):
            if g is None or self.excludes(v):
                out.append(g)
                continue
            out.append(backend.gradients.scale_gradient(g, self.factor(g, v, scale)))
        return out


def clipping(clip_factor: Any, eps: Any, exclude: Any) -> AdaptiveClipping | None:
    """An `AdaptiveClipping`, or None for `clip_factor=None` (all checked)."""
    if clip_factor is None:
        return None
    return AdaptiveClipping(clip_factor, eps, exclude)

