"""What the device tells of its memory, per backend: the bytes it has free,
the bytes XLA's compiled train step uses, its own out-of-memory errors, and
the tests' hook that raises them (`out_of_memory_above`).

`gradaccum._auto_size` chooses `micro_batch_size="auto"` from these, and
`gradaccum._micro_batches` runs a batch again smaller where the device
runs out of memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from keras import tree

from gradaccum._backend import active
from gradaccum._backend.micro_batches import replicas


def out_of_memory(message: str) -> BaseException:
    """The active backend's own out-of-memory error, saying `message`."""
    if active() == "jax":
        import jax

        return jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: {message}")
    if active() == "torch":
        import torch

        return torch.OutOfMemoryError(f"CUDA out of memory: {message}")
    import tensorflow as tf

    return tf.errors.ResourceExhaustedError(None, None, f"OOM: {message}")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the active backend's out-of-memory error."""
    if active() == "jax":
        import jax

        return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)
    if active() == "torch":
        import torch

        return isinstance(error, torch.OutOfMemoryError)
    import tensorflow as tf

    return isinstance(error, tf.errors.ResourceExhaustedError)


def free_bytes() -> int | None:
    """The bytes the device that trains has free (the host's available
    memory for the CPU), or None where the backend does not tell."""
    stats = None
    if active() == "jax":
        import jax

        stats = jax.local_devices()[0].memory_stats()
        if stats and "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    elif active() == "torch":
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
    elif _tensorflow_uses_a_gpu():
        return None
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _tensorflow_uses_a_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_logical_devices("GPU"))


def measures(model: Any) -> bool:
    """Whether the size of `model`'s train step can be predicted from XLA's
    compiled memory: on JAX, and on TensorFlow with `jit_compile=True` on
    one replica."""
    if active() == "jax":
        return True
    # A step of several replicas is not traced alone: they are probed.
    return active() == "tensorflow" and model.jit_compile is True and not model.run_eagerly and replicas(model) == 1


def step_bytes(step: Callable[..., Any], state: Any, data: Any) -> int:
    """The bytes XLA's compiled train step uses: its arguments, outputs not
    aliased to them, and its temporaries (one compilation, nothing runs).
    JAX's `step(state, data)` (`memory_analysis()`), else TensorFlow's
    `step(data)` (`tensorflow.micro_batches.step_bytes`; `state` is None)."""
    # A prediction allocates nothing: the test hook leaves it alone.
    _INJECTED["measuring"] = True
    try:
        if state is None:
            from gradaccum._backend.tensorflow import micro_batches

            return micro_batches.step_bytes(step, data)
        return _jax_step_bytes(step, state, data)
    finally:
        _INJECTED["measuring"] = False


# The buffers XLA assigns, all the analysis reads, are decided on the
# optimised HLO, before the backend generates code: code generated without
# optimising gives the same bytes in about 0.5-0.7x the compile time.
MEASURING_OPTIONS = {"xla_backend_optimization_level": 0}


def _jax_step_bytes(step: Callable[[Any, Any], Any], state: Any, data: Any) -> int:
    import jax

    def abstract(t: Any) -> Any:
        return None if t is None else jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=getattr(t, "sharding", None))

    lowered = jax.jit(step).lower(tree.map_structure(abstract, state), tree.map_structure(abstract, data))
    memory = lowered.compile(compiler_options=MEASURING_OPTIONS).memory_analysis()
    return int(memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
               + memory.temp_size_in_bytes)


# What `out_of_memory_above` injects: micro-batches above this size run out
# of memory (None: never).
_INJECTED: dict[str, Any] = {"above": None, "measuring": False}


@contextlib.contextmanager
def out_of_memory_above(size: int) -> Iterator[None]:
    """For tests: inside the block, a split train step whose micro-batches
    are larger than `size` samples raises the active backend's own
    out-of-memory error (see `run_injected`). Sizes count as
    `micro_batch_size` does: under a `tf.distribute` strategy, over all
    replicas (a replica's device runs out above `size / replicas`)."""
    _INJECTED["above"] = size
    try:
        yield
    finally:
        _INJECTED["above"] = None


def injecting() -> bool:
    """Whether `out_of_memory_above` is in effect."""
    return _INJECTED["above"] is not None


def run_injected(step: Callable[..., Any], args: tuple, kwargs: dict, size: int, last: bool, model: Any) -> Any:
    """`step(*args, **kwargs)`, one micro-batch of `model`'s split train
    step whose micro-batches hold up to `size` samples, raising the
    backend's out-of-memory error where `out_of_memory_above` asks for it:
    where the step runs eagerly, on its last micro-batch, after the others
    have written their gradients, metrics and statistics; in a TensorFlow
    graph, once each micro-batch has run (the first to run raises, after its
    writes), as a device runs out partway through a step; under XLA, before
    it runs (as XLA runs out allocating the step's buffers)."""
    above = _INJECTED["above"]
    if above is None or size <= above or _INJECTED["measuring"]:
        return step(*args, **kwargs)
    message = f"injected: micro-batches of {size} samples do not fit, of {above} do"
    if not _eager() and active() == "tensorflow" and not model.jit_compile:
        from gradaccum._backend.tensorflow.micro_batches import raising_after

        return raising_after(step(*args, **kwargs), message)
    if last or not _eager():
        raise out_of_memory(message)
    return step(*args, **kwargs)


def _eager() -> bool:
    if active() == "jax":
        return False
    if active() == "torch":
        return True
    import tensorflow as tf

    return tf.executing_eagerly()
