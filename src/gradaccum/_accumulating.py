"""Accumulation for training code you do not own: `with accumulating(n=4):`.

Inside the block, every optimizer that `keras.Model.compile` receives is
wrapped with `accumulate(..., n)` before `compile` sees it. What happens:

- An optimizer instance is wrapped; an identifier (`"adam"`, a config dict)
  is first resolved with `keras.optimizers.get`. `compile`'s own default
  (`"rmsprop"`) is received like any other and wrapped too.
- An optimizer that already accumulates (an `AccumulatingOptimizer`, or a
  loss-scale optimizer around one) is passed on unchanged: nothing
  accumulates twice, and its own `n` stands.
- Nested blocks: the innermost block's `n`, `reduction` and `mode` apply; leaving it
  restores the outer block's.
- Threads: a block applies to the thread that entered it. `compile` called
  on other threads at the same time is not affected. The patch on
  `keras.Model.compile` stays installed while any thread is inside a block
  and is removed when the last one leaves, restoring the original method.
- Subclasses that override `compile` are covered when they call
  `super().compile(...)`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator

import keras

from gradaccum import _patches
from gradaccum._api import accumulate
from gradaccum._proxy import accumulating_in
from gradaccum._validation import check_mode, check_n_or_schedule, check_reduction

_local = threading.local()


def _stack() -> list[tuple[Any, str, str]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _wrapped_compile(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    stack = _stack()
    if not stack or instance is None:
        return wrapped(*args, **kwargs)
    n, reduction, mode = stack[-1]
    # `wrapped` is bound to the model: its signature has no `self`.
    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    optimizer = bound.arguments.get("optimizer", "rmsprop")
    if optimizer is not None and accumulating_in(optimizer) is None:
        bound.arguments["optimizer"] = accumulate(
            keras.optimizers.get(optimizer), n, reduction=reduction, mode=mode
        )
    return wrapped(*bound.args, **bound.kwargs)


_COMPILE = _patches.SharedPatch(lambda: keras.Model, "compile", _wrapped_compile)


@contextlib.contextmanager
def accumulating(
    n: int | Callable[..., Any], *, reduction: str = "mean", mode: str = "masked"
) -> Iterator[None]:
    """Wraps every optimizer given to `keras.Model.compile` in this block.

    ```python
    with gradaccum.accumulating(n=4):
        third_party.train(model_config, batch_size=8)   # compiles and fits
    ```

    Args:
        n: Micro-batches per update (an int >= 1 or a schedule), as for
            `accumulate()`.
        reduction: `"mean"` or `"sum"`, as for `accumulate()`.
        mode: `"masked"` or `"skip"`, as for `accumulate()`.

    Yields:
        Nothing; on exit `compile` is restored (see the module docstring for
        nested blocks, threads and optimizers that already accumulate).

    Raises:
        TypeError: If `n` is not an int or callable.
        ValueError: If `n < 1`, or `reduction` or `mode` is unknown.
    """
    n = check_n_or_schedule(n)
    reduction = check_reduction(reduction)
    mode = check_mode(mode)
    _COMPILE.acquire()
    stack = _stack()
    stack.append((n, reduction, mode))
    try:
        yield
    finally:
        stack.pop()
        _COMPILE.release()
