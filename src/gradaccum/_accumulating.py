"""Accumulation for training code you do not own: `with accumulating(n=4):`.

Inside the block, every optimizer that `Model.compile` receives is wrapped
with `accumulate(..., n)` before `compile` sees it, and `Model.fit` of a
model compiled earlier wraps that model's optimizer before it trains. Both
for Keras 3's `keras.Model` and, once `tf_keras` is imported (by its users:
`import gradaccum` never imports it), `tf_keras.Model`. What happens:

- An optimizer instance is wrapped; an identifier (`"adam"`, a config dict)
  is first resolved with the library's own `optimizers.get`. `compile`'s
  own default (`"rmsprop"`) is received like any other and wrapped too.
- `fit` of a model whose optimizer does not accumulate (a keras-hub task
  compiles in its constructor; a model compiled before the block) wraps
  it, as `accumulate` wraps any optimizer: a built or trained one keeps
  its state, and its next update is the first accumulated one. The model's
  train function is traced anew (it holds the old optimizer's update), and
  the model's compile config names the accumulating optimizer, so a saved
  model reloads with it. The model keeps the wrapped optimizer after the
  block, as one compiled inside the block does.
- An optimizer that already accumulates (an `AccumulatingOptimizer`, or a
  loss-scale optimizer around one) is passed on unchanged: nothing
  accumulates twice, and its own `n` stands.
- `reduction`: by default it follows the compiled loss. A loss object whose
  `reduction` is `"sum"` (summed over the batch, not averaged) gets
  `reduction="sum"`, anything else `"mean"`; losses of both kinds on
  several outputs can be matched by neither and warn. A `reduction` given
  to the block is used as given, with a warning where the compiled loss
  says otherwise (and so is an accumulating optimizer's own). A loss that a
  custom `train_step` computes is not visible here: pass `reduction="sum"`
  if it sums.
- `batch_normalization=True`: every `keras.layers.BatchNormalization` the
  block's thread creates (models built or loaded in the block) is
  `gradaccum.layers.BatchNormalization` (see `gradaccum._batch_norm`).
- Nested blocks: the innermost block's settings apply; leaving it
  restores the outer block's.
- Threads: a block applies to the thread that entered it. `compile` and
  `fit` called on other threads at the same time are not affected. The
  patches stay installed while any thread is inside a block and are removed
  when the last one leaves, restoring the original methods.
- Subclasses that override `compile` or `fit` are covered when they call
  `super().compile(...)` / `super().fit(...)`.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import keras

from gradaccum import _batch_norm, _patches
from gradaccum._proxy import AccumulatingOptimizer, accumulating_in
from gradaccum._settings import Settings
from gradaccum._validation import check_n_or_micro_batch_size

_local = threading.local()


class _Block(NamedTuple):
    settings: Settings
    follows_loss: bool  # whether `reduction` follows the compiled loss


def _stack() -> list[_Block]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


# ----------------------------------------------------------------------
# The loss's reduction.


def _loss_reductions(loss: Any) -> set[str]:
    """The reductions of the loss objects in a compiled `loss` argument.

    A loss given by name or as a function is reduced by Keras with its
    default, a mean over the batch; a loss object says how it reduces.
    """
    if loss is None:
        return set()
    if isinstance(loss, dict):
        return set().union(*(_loss_reductions(v) for v in loss.values()))
    if isinstance(loss, (list, tuple)):
        return set().union(*(_loss_reductions(v) for v in loss))
    reduction = getattr(loss, "reduction", None)
    return {"sum" if reduction == "sum" else "mean"}


def _reduction(block: _Block, loss: Any) -> str:
    """The reduction to accumulate with, for a model compiled with `loss`."""
    seen = _loss_reductions(loss)
    if not block.follows_loss:
        _check_matches(block.settings.reduction, seen, "the `accumulating()` block has")
        return block.settings.reduction
    if seen == {"sum"}:
        return "sum"
    if len(seen) > 1:
        warnings.warn(
            "gradaccum.accumulating(): the model is compiled with losses that sum "
            "over the batch and losses that average over it; no single "
            "`reduction` gives the large batch's gradient of their total. "
            "Accumulating with reduction='mean'.",
            stacklevel=4,
        )
    return "mean"


def _check_matches(reduction: str, seen: set[str], whose: str) -> None:
    if len(seen) == 1 and reduction not in seen:
        (loss_reduction,) = seen
        effect = "1/n of" if reduction == "mean" else "n times"
        warnings.warn(
            f"gradaccum: {whose} reduction={reduction!r}, but the model's loss "
            f"is reduced by {loss_reduction!r} over the batch: each update is "
            f"{effect} the large batch's. Pass reduction={loss_reduction!r} "
            "unless that is what you want.",
            stacklevel=4,
        )


# ----------------------------------------------------------------------
# The patches.


def _accumulate(optimizer: Any, block: _Block, loss: Any) -> AccumulatingOptimizer:
    settings = block.settings.replace(reduction=_reduction(block, loss))
    return AccumulatingOptimizer._create(optimizer, settings)


def _compile(get_optimizer: Callable[[Any], Any], wrapped: Callable[..., Any], instance: Any, args: tuple,
             kwargs: dict) -> Any:
    """`Model.compile` of a library whose `optimizers.get` is `get_optimizer`."""
    stack = _stack()
    if not stack or instance is None:
        return wrapped(*args, **kwargs)
    block = stack[-1]
    # `wrapped` is bound to the model: its signature has no `self`.
    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    optimizer = bound.arguments.get("optimizer", "rmsprop")
    loss = bound.arguments.get("loss")
    if optimizer is not None:
        accumulating = accumulating_in(optimizer)
        if accumulating is None:
            bound.arguments["optimizer"] = _accumulate(get_optimizer(optimizer), block, loss)
        else:
            _check_matches(accumulating.reduction, _loss_reductions(loss), "the optimizer has")
    return wrapped(*bound.args, **bound.kwargs)


def compile_keras(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras 3's `Model.compile` inside a block."""
    return _compile(keras.optimizers.get, wrapped, instance, args, kwargs)


def compile_tf_keras(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """tf_keras's `Model.compile` inside a block."""
    return _compile(sys.modules["tf_keras"].optimizers.get, wrapped, instance, args, kwargs)


def fit(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """`Model.fit` inside a block: a model compiled outside it accumulates."""
    stack = _stack()
    if stack and instance is not None:
        _accumulate_compiled(instance, stack[-1])
    return wrapped(*args, **kwargs)


def _accumulate_compiled(model: Any, block: _Block) -> None:
    """Wraps the optimizer of a model compiled outside the block."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or accumulating_in(optimizer) is not None:
        return  # not compiled (fit itself says so), or accumulating already
    model.optimizer = _accumulate(optimizer, block, getattr(model, "loss", None))
    # The compiled train function applies the old optimizer's update.
    model.make_train_function(force=True)
    # Both Keras 3 and tf_keras keep `compile`'s arguments here for
    # `get_compile_config()`, which `model.save` writes: name the optimizer
    # that trains now, so that a saved model reloads with it.
    compile_config = getattr(getattr(model, "_compile_config", None), "config", None)
    if isinstance(compile_config, dict) and "optimizer" in compile_config:
        compile_config["optimizer"] = model.optimizer


_PATCHES = ("keras.compile", "keras.fit", "tf_keras.compile", "tf_keras.fit")


@contextlib.contextmanager
def accumulating(
    n: int | Callable[..., Any] | None = None,
    *,
    micro_batch_size: int | str | None = None,
    reduction: str | None = None,
    batch_normalization: bool = False,
    **settings: Any,
) -> Iterator[None]:
    """Accumulates gradients in the training code run inside the block.

    Wraps every optimizer given to `Model.compile` in the block, and the
    optimizer of every model compiled earlier that `Model.fit` trains in
    it (Keras 3, and tf_keras once imported).

    ```python
    with gradaccum.accumulating(n=4):
        third_party.train(model_config, batch_size=8)   # compiles and fits
    ```

    ```python
    with gradaccum.accumulating(micro_batch_size=8):
        third_party.train(model_config, batch_size=64)  # one update per 64
    ```

    Args:
        n: Micro-batches per update, across train steps (an int >= 1 or a
            schedule), as for `accumulate()`; not with `micro_batch_size`.
        micro_batch_size: Instead of `n`: the samples of one micro-batch
            inside `model.fit`'s train step, or `"auto"` (with an optional
            `memory_limit=` among `settings`), as for `accumulate()`. Each
            batch of the code's `fit` is then one update, computed in
            micro-batches. A model that overrides `train_step` with a step
            of its own cannot be split: its `apply_gradients` raises and
            says to use `n`.
        reduction: `"mean"` or `"sum"`, as for `accumulate()`. By default
            (`None`) it follows the compiled loss: `"sum"` for a loss object
            whose `reduction` is `"sum"`, else `"mean"`. Pass `"sum"` for a
            loss summed over the batch that `compile` does not see (one a
            custom `train_step` computes).
        batch_normalization: If True, every `keras.layers.BatchNormalization`
            created in the block (by this thread; also one `load_model`
            deserializes) is a `gradaccum.layers.BatchNormalization`, whose
            moving statistics follow the cycle. Layers created before the
            block stay as they are (see
            `gradaccum.layers.replace_batch_normalization`).
        **settings: Any other setting of `accumulate()` (`mode`, `weigh_by`,
            `sparse`, `agc`, ...).

    Yields:
        Nothing; on exit `compile` and `fit` are restored (see the module
        docstring for nested blocks, threads and optimizers that already
        accumulate).

    Raises:
        TypeError: If a setting has the wrong type, both `n` and
            `micro_batch_size` are missing, or `batch_normalization` is not
            a bool.
        ValueError: If a setting has a wrong value, or both `n` and
            `micro_batch_size` are given.
    """
    if not isinstance(batch_normalization, bool):
        raise TypeError(
            "`batch_normalization` must be True or False. Received: "
            f"batch_normalization={batch_normalization!r}."
        )
    check_n_or_micro_batch_size(n, micro_batch_size)
    if micro_batch_size is not None:
        n = 1  # each train step is one cycle, of its own micro-batches
    settings = Settings(n, reduction=reduction or "mean", micro_batch_size=micro_batch_size, **settings)
    block = _Block(settings, follows_loss=reduction is None)
    _patches.install()
    acquired = []
    try:
        for name in _PATCHES:
            patch = _patches.shared(name)
            patch.acquire()
            acquired.append(patch)
        stack = _stack()
        stack.append(block)
        try:
            with _batch_norm.replacing() if batch_normalization else contextlib.nullcontext():
                yield
        finally:
            stack.pop()
    finally:
        for patch in reversed(acquired):
            patch.release()
