"""`accumulate()`: the one-line entry point."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras

from gradaccum import _patches
from gradaccum._proxy import AccumulatingOptimizer
from gradaccum._settings import Settings
from gradaccum._validation import check_n_or_micro_batch_size


def accumulate(
    optimizer: keras.optimizers.Optimizer | None = None,
    n: int | Callable[[Any], Any] | None = None,
    *,
    reduction: str = "mean",
    mode: str = "masked",
    weigh_by: str = "count",
    sparse: str = "auto",
    agc: float | None = None,
    agc_eps: float = 1e-3,
    agc_exclude: Callable[[Any], bool] | Sequence[Any] | None = None,
    noise_scale: bool = False,
    noise_decay: float = 0.9,
    accumulator_dtype: str = "float32",
    micro_batch_size: int | str | None = None,
    memory_limit: int | None = None,
) -> AccumulatingOptimizer | Decorator:
    """Gives an optimizer gradient accumulation over `n` micro-batches.

    Training on micro-batches of size `B` with the result gives the weights,
    optimizer state and `iterations` of training `optimizer` on batches of
    `B * n`, to float32 rounding, on every Keras 3 backend (TensorFlow,
    JAX, PyTorch) and with tf_keras.

    ```python
    opt = accumulate(keras.optimizers.Adam(1e-3), n=4)
    AccAdam = accumulate(n=4)(keras.optimizers.Adam)   # decorator form
    # model.fit(batch_size=64) applies once per batch of 64, computed in
    # micro-batches of 16 inside each train step:
    opt = accumulate(keras.optimizers.Adam(1e-3), micro_batch_size=16)
    ```

    Args:
        optimizer: A Keras optimizer instance. Omit it to get a decorator for
            an optimizer class or factory function.
        n: Micro-batches per applied update, across train steps (custom
            train steps and loops; not with `micro_batch_size`): an int >= 1, or a schedule: a
            callable that takes the number of applied updates (an integer
            tensor; on PyTorch a Python int, so that nothing is read back
            from the device) and returns `n` for the next cycle, for example
            `lambda step: keras.ops.where(step < 100, 2, 8)`. At most what
            the cycle's counters hold: 2**63 - 1 on TensorFlow (int64),
            2**31 - 1 on JAX and PyTorch (int32), checked for the active
            backend. A schedule's value below 1 raises; traced, it raises
            at run time where the backend can (a `tf.function` without
            XLA), and is taken as 1 where it cannot (XLA, `jax.jit`), which
            a warning says when the schedule is traced.
        reduction: `"mean"` (default) applies the mean of the micro-batch
            gradients, as training on the large batch with a mean-reduced loss
            does; `"sum"` applies their sum (for sum-reduced losses). Weighted
            micro-batches (`apply_gradients(..., weight=w)`) give the weighted
            mean or sum.
        mode: `"masked"` (default) runs the wrapped optimizer's update on
            every micro-step and keeps its result only on the apply step,
            with no branch around anything that synchronises replicas:
            every micro-step runs the optimizer's all-reduce, clipping and
            merge calls (a Keras 3 optimizer's per-variable arithmetic, which
            synchronises nothing, runs only on the apply step).
            `"skip"` runs the update only on the apply step (a `tf.cond`
            decided in cross-replica context, so it works under
            `MirroredStrategy`): in-between micro-steps cost only the
            accumulation, and replicas all-reduce once per cycle. Both give
            the same result. On JAX and PyTorch both run the update on the
            apply step only. See the modes guide (`docs/guides/modes.md`).
        weigh_by: What a micro-batch of `model.fit` weighs in the mean.
            `"count"` (default): the count Keras's loss divided it by (its
            valid entries under a mask, its sum of sample weights for
            `reduction="mean_with_sample_weight"`, its size), so the update
            is the mean over every entry of the cycle, as on the large batch
            (several losses: `docs/guides/loss-counts.md`); in a train step
            split by `micro_batch_size`, a loss that tells no count (a
            `compute_loss` of the model's own, a loss function returning a
            scalar) weighs its samples. `"batch"`: 1, every
            micro-batch alike (Keras's per-batch means, averaged). A
            `weight` passed to `apply_gradients` wins over either.
        sparse: How `tf.IndexedSlices` gradients (an `Embedding`'s, on
            TensorFlow) are accumulated. Keras's TensorFlow optimizers take
            such a gradient slice by slice (Adam's second moment and
            `global_clipnorm` see each slice's square), so the large batch's
            update depends on how its lookups form slices. `"auto"`
            (default) keeps them as the large batch has them: the slices of
            a lookup of the batch's ids (tokens) side by side, those of a
            lookup that does not grow with the batch (positions,
            `Embedding(T)(ops.arange(T))`) summed, one per index; in a
            traced step it reads which is which off the graph, eagerly off
            the cycle's index sets (with a warning). It holds no more than
            the large batch's own gradient does, works under XLA and
            distribution strategies, and warns, naming the variable, where
            it cannot be exact (see `docs/guides/sparse.md`). `"rows"` adds them into a
            dense accumulator, summing a row's repeated slices: exact only
            for updates linear in the gradient. `"slices"` keeps every
            micro-step's slices, side by side. On JAX and PyTorch embedding
            gradients are dense; `"auto"` and `"rows"` add them up.
        agc: Adaptive gradient clipping's factor λ (Brock et al. 2021), or
            None (default: off). Each update's gradient (the accumulated
            mean, once per cycle, summed over replicas and unscaled) is
            clipped unit-wise: each output unit's gradient norm is capped at
            `agc * max(||W_unit||, agc_eps)`, before the wrapped optimizer's
            own `clipnorm`/`global_clipnorm`/`clipvalue`. Works with `n=1`
            too (plain AGC).
        agc_eps: The smallest weight norm a cap is computed from (so that
            units initialised at zero can move), a number > 0.
        agc_exclude: Variables AGC leaves alone (the paper does not clip the
            final classifier layer): a predicate `f(variable) -> bool`, or a
            list of variables and variable paths (`"dense_1/kernel"`; for
            tf_keras the variable's name). Configs save a list as paths; a
            predicate is saved as Keras saves a function.
        noise_scale: Whether to measure the gradient noise scale
            B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, appendix A.1)
            from each cycle's micro-gradients (default False). Read it as
            `opt.noise_scale`, in the units of the micro-batch weight
            (samples for `fit`'s mean losses, tokens for a masked loss
            weighed by its count, micro-batches where unweighted); see
            docs/guides/noise-scale.md. Needs `reduction="mean"`; not with
            `sparse="slices"`. On TensorFlow a variable whose slices are
            kept (`sparse="auto"`) is left out of it, with a warning.
        noise_decay: The decay of the exponential moving averages of the
            estimates of |G|² and tr(Σ), a number in [0, 1) (default 0.9:
            about the last ten cycles; 0: the latest cycle only).
        accumulator_dtype: `"float32"` (default; float64 for float64
            variables) or `"bfloat16"`: bfloat16 accumulators with
            compensated (Kahan) summation, for bfloat16 models (see
            docs/guides/accumulator-dtype.md for its memory and error).
        micro_batch_size: Instead of `n`: the samples of one micro-batch
            inside `model.fit`'s train step, an int >= 1. `fit(batch_size=B)`
            then computes each batch in `ceil(B / micro_batch_size)`
            micro-batches and applies once per batch, as plain `fit` on
            batches of `B` does (the last micro-batch may be smaller). Only
            Keras's own train step is split: `apply_gradients` called from
            an overridden `train_step` or a custom loop raises (use `n`
            there). `"auto"`: the largest micro-batch whose step fits the
            device's memory, predicted on JAX, probed elsewhere, and made
            smaller (the same batch run again) where the device runs out of
            memory; `opt.micro_batch_size` then reads the size chosen. See
            docs/guides/micro-batching.md.
        memory_limit: With `micro_batch_size="auto"`: the bytes the train
            step may use on the device (variables, optimizer state,
            accumulators and activations), an int >= 1; default (None):
            what the device has free (on the CPU, the host's available
            memory).

    Returns:
        An `AccumulatingOptimizer` around the very `optimizer` passed in, or,
        without `optimizer`, a decorator whose result builds one per call.

    Raises:
        TypeError: If both `n` and `micro_batch_size` are missing, `n` is
            neither an int nor a callable, `micro_batch_size` neither an int
            nor `"auto"`, `memory_limit` not an int,
            `optimizer` is not a Keras optimizer, `sparse`, `agc`, `agc_eps`
            or `agc_exclude` has the wrong type, `noise_scale` is not a
            bool, `noise_decay` not a number or `accumulator_dtype` not a
            string.
        ValueError: If `n < 1` or above what the counters hold, `micro_batch_size < 1` or a
            string other than `"auto"`, `memory_limit < 1` or given without
            `micro_batch_size="auto"`, both `n` and `micro_batch_size` are given, `reduction`,
            `mode`, `weigh_by`, `sparse` or
            `accumulator_dtype` is unknown, `agc` or `agc_eps` is not a
            finite number > 0, `agc_exclude` is given without `agc`,
            `noise_decay` is outside [0, 1), `noise_scale=True` or
            `accumulator_dtype="bfloat16"` is given with `sparse="slices"`,
            `noise_scale=True` with `reduction="sum"`, `optimizer` already
            accumulates gradients (an `AccumulatingOptimizer`, or an
            optimizer with its own `gradient_accumulation_steps`), a
            TensorFlow-only setting (`sparse="slices"`) is asked for on
            another backend, or the active Keras backend cannot train
            (numpy, openvino).
    """
    # Every argument but the optimizer is a setting, checked once, here.
    given = {name: value for name, value in locals().items() if name != "optimizer"}
    check_n_or_micro_batch_size(n, micro_batch_size)
    if micro_batch_size is not None:
        # Each train step is one cycle, of its own micro-batches.
        given["n"] = 1
    settings = Settings(**given)
    _patches.install()
    if optimizer is not None:
        return AccumulatingOptimizer._create(optimizer, settings)
    return Decorator(settings)


class Decorator:
    """What `accumulate(n=...)` returns without an optimizer: it decorates an
    optimizer class or factory, whose every result accumulates.

    Args:
        settings: The accumulation's settings.
    """

    def __init__(self, settings: Settings):
        self.settings = settings

    def __call__(self, factory: Callable[..., Any]) -> Callable[..., Any]:
        """Wraps `factory` (an optimizer class or function).

        Raises:
            TypeError: If `factory` is not callable.
        """
        if not callable(factory):
            raise TypeError(
                "accumulate(n=...) decorates an optimizer class or factory "
                f"function. Received: {factory!r} of type {type(factory).__name__}."
            )
        settings = self.settings

        @functools.wraps(factory, updated=())
        def make(*args: Any, **kwargs: Any) -> AccumulatingOptimizer:
            return AccumulatingOptimizer._create(factory(*args, **kwargs), settings)

        return make

    @property
    def given(self) -> str:
        """The decorator's defining argument as written: `n=4` or `micro_batch_size=8`."""
        size = self.settings.micro_batch_size
        return f"n={self.settings.n!r}" if size is None else f"micro_batch_size={size!r}"

    def __repr__(self) -> str:
        return f"<gradaccum.accumulate({self.given}) decorator>"


def optimizer_get(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `keras.optimizers.get` (what `compile` resolves its
    `optimizer` with), refusing the decorator `accumulate(n=...)` returns
    with an error that says what to pass instead.

    Raises:
        TypeError: For such a decorator.
    """
    identifier = args[0] if args else kwargs.get("identifier")
    if isinstance(identifier, Decorator):
        given = identifier.given
        raise TypeError(
            f"`optimizer` is accumulate({given}) without an optimizer: that is a decorator for an "
            "optimizer class. Pass the optimizer to wrap, "
            f"accumulate(keras.optimizers.Adam(1e-3), {given}), or decorate a class and create "
            f"one: accumulate({given})(keras.optimizers.Adam)(1e-3)."
        )
    return wrapped(*args, **kwargs)
