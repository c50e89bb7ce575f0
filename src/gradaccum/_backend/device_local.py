"""Device-local accumulators on JAX under `keras.distribution`.

With the batch split over a mesh axis (`DataParallel`, or a `ModelParallel`
whose batch axis shards no variable), each device can add the gradients of
its own share of the micro-batch into an accumulator of its own, and the
devices need to exchange gradients only once per cycle, when the update
sums the accumulators. An accumulator then has a leading axis of one entry
per device of that mesh axis, sharded over it: each device holds one entry,
the variable's size, as a replicated accumulator would (its other axes
sharded as its variable is). `gradaccum._data_parallel` computes the
per-device gradients in `fit`'s train step.

Where that is not possible the accumulators are the variables' shape, and
`why_not` says why, for the warning the train step gives.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras


class DataAxis(NamedTuple):
    """The mesh axis the batch is split over.

    Attributes:
        mesh: The distribution's `keras.distribution.DeviceMesh`.
        name: The axis's name.
        size: The number of devices along it.
    """

    mesh: Any
    name: str
    size: int


def data_axis() -> tuple[DataAxis | None, str | None]:
    """The active distribution's batch axis, or `(None, why not)`.

    `(None, None)` without a distribution, or where the batch axis has one
    device: there is nothing to exchange.
    """
    if keras.config.backend() != "jax":
        return None, None
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None, None
    if not isinstance(distribution, (keras.distribution.DataParallel, keras.distribution.ModelParallel)):
        return None, f"the distribution is a {type(distribution).__name__}, not DataParallel or ModelParallel"
    name = distribution.batch_dim_name
    mesh = distribution.device_mesh
    if name not in mesh.axis_names:
        return None, f"the batch axis {name!r} is not an axis of the device mesh {mesh.axis_names}"
    size = int(mesh.shape[list(mesh.axis_names).index(name)])
    if size == 1:
        return None, None
    return DataAxis(mesh, name, size), None


def stacked_layout(variable: Any, axis: DataAxis) -> tuple[Any, str | None]:
    """The layout of `variable`'s device-local accumulator, or `(None, why not)`.

    The accumulator's first axis is split over the batch axis; its others
    are sharded as the variable is, so that adding a device's gradient
    moves nothing between devices.
    """
    layout = getattr(variable, "_layout", None)
    axes: tuple[Any, ...] = (None,) * len(variable.shape)
    if layout is not None:
        axes = tuple(getattr(layout, "axes", None) or _spec_axes(layout, len(variable.shape)))
    if any(a == axis.name or (isinstance(a, tuple) and axis.name in a) for a in axes):
        path = getattr(variable, "path", variable.name)
        return None, f"variable {path!r} is sharded over the batch axis {axis.name!r}"
    return keras.distribution.TensorLayout((axis.name, *axes), axis.mesh), None


def _spec_axes(layout: Any, ndim: int) -> tuple[Any, ...]:
    """The axes of a JAX `NamedSharding` used as a layout."""
    spec = tuple(getattr(layout, "spec", ()) or ())
    return spec + (None,) * (ndim - len(spec))


def stacked(value: Any, size: int) -> Any:
    """A value of a variable's shape as a device-local accumulator holds it:
    all of it in the first device's entry (the sum over entries is what
    counts), zeros in the others."""
    import numpy as np

    value = np.asarray(value)
    zeros = np.zeros((size - 1, *value.shape), value.dtype)
    return np.concatenate([value[None], zeros])
