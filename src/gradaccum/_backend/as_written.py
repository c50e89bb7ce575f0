"""Running the accumulation as it is written, on every backend (`unconverted`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import keras

_F = TypeVar("_F", bound=Callable[..., Any])


def unconverted(method: _F) -> _F:
    """Runs `method` as it is written: never converted by TensorFlow's
    AutoGraph, never traced by `torch.compile`.

    A `tf.function` converts the Python functions it calls, unless they are
    Keras's or TensorFlow's, so a custom loop would convert the accumulation,
    which writes every branch itself, where `fit` (Keras's code calling it)
    does not. So it runs unconverted everywhere, and so do the branches and
    merge calls it makes.

    `torch.compile` (`jit_compile=True` on PyTorch) traces Python into a graph
    that keeps the tensor work and drops or freezes the rest: the cycle's
    position kept on the host, a loss count handed to the optimizer, and any
    attribute of the proxy it cannot look up (wrapt's proxy is a C type), read
    as absent. So on PyTorch it runs between the compiled graphs.
    """
    eager: list[Callable[..., Any]] = []

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        backend = keras.config.backend()
        if backend == "tensorflow":
            import tensorflow as tf

            return tf.autograph.experimental.do_not_convert(method)(*args, **kwargs)
        if backend == "torch":
            import torch

            if torch.compiler.is_compiling():
                if not eager:
                    eager.append(torch.compiler.disable(method))
                return eager[0](*args, **kwargs)
        return method(*args, **kwargs)

    return call  # type: ignore[return-value]
