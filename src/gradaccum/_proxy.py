"""`AccumulatingOptimizer`: the optimizer proxy `accumulate()` returns.

It is a `wrapt.ObjectProxy`: to everyone else it is the optimizer it wraps.
Its own state is the accumulating core (`gradaccum._core.Core`) and its
settings; how it runs depends on what it wraps:

- a plain optimizer: `gradaccum._direct.Direct` hands each micro-step to
  the core;
- a loss-scale optimizer: `gradaccum._loss_scale.LossScaled` accumulates
  inside it, through an accumulating optimizer installed as its inner one,
  whose core this proxy shares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import keras
import wrapt

from gradaccum import _backend, _noise, _patches, _persistence
from gradaccum._direct import Direct
from gradaccum._loss_scale import LossScaled
from gradaccum._settings import Settings, SettingsView
from gradaccum._view import AccumulationState


class AccumulatingOptimizer(SettingsView, _persistence.Persistent, wrapt.ObjectProxy):
    """A Keras optimizer that applies one update every `n` micro-batches.

    The proxy is the wrapped optimizer to everyone else: `isinstance`,
    `learning_rate`, `iterations`, `variables`, `get_config()` reach the
    wrapped instance. Each call of `apply_gradients()` (or `apply()`) adds
    the gradients to float32 accumulators; on every `n`-th call the wrapped
    optimizer applies their mean (or sum) once, so clipping, weight decay,
    EMA, constraints, learning-rate schedules and `iterations` see exactly
    what training on the `n`-times larger batch sees.

    Wrapping a loss-scale optimizer accumulates inside it, on its inner
    optimizer: the result is still the loss-scale optimizer to other code,
    and a non-finite micro-batch is dropped, not counted.

    Create it with `gradaccum.accumulate()`, which documents the settings.

    Args:
        optimizer: The Keras optimizer instance to wrap.
        n: Micro-batches per update: an int >= 1, or a schedule.
        **settings: The other settings of `gradaccum.accumulate()`.

    Raises:
        TypeError: If `optimizer` is not an optimizer or a setting has the
            wrong type.
        ValueError: If a setting has a wrong value or `optimizer` already
            accumulates gradients.
    """

    def __init__(self, optimizer: Any, n: int | Callable[[Any], Any], **settings: Any):
        self._setup(optimizer, Settings(n, **settings))

    @classmethod
    def _create(cls, optimizer: Any, settings: Settings, adopt: bool = False) -> AccumulatingOptimizer:
        """An accumulating optimizer with settings checked already; `adopt`:
        see `LossScaled`."""
        proxy = cls.__new__(cls, optimizer)
        proxy._setup(optimizer, settings, adopt)
        return proxy

    def _setup(self, optimizer: Any, settings: Settings, adopt: bool = False) -> None:
        _patches.install()
        _backend.check_supported()
        if LossScaled.handles(optimizer):
            runner: Any = LossScaled(optimizer, settings, adopt, AccumulatingOptimizer._create)
        else:
            runner = Direct(optimizer, settings)
        super().__init__(optimizer)
        self._self_runner = runner
        self._self_core = runner.core

    # ------------------------------------------------------------------
    # Settings and state.

    @property
    def n(self) -> int | Callable[[Any], Any]:
        """Micro-batches per applied update: an int, or the schedule given.

        Set it to an int between cycles (`opt.n = 8`); the change needs no
        new trace, except to or from `n=1`: with `n=1` gradients go straight
        to the wrapped optimizer, and a function traced then keeps doing so,
        so trace it anew after such a change (setting another `n` after such
        a trace warns; on TensorFlow, running that function then raises).
        Set mid-cycle, the current cycle ends on the first micro-step at
        which it holds at least the new `n` micro-batches, and applies the
        mean over all of them. On TensorFlow under XLA, buffers of kept
        `tf.IndexedSlices` grow at once to hold a cycle of the new `n`.

        Raises:
            TypeError: When set to anything but an int (bools included).
            ValueError: When set to an int < 1 or above the counters' bound, when
                `n` was a schedule, or with `micro_batch_size` (`n` is then 1).
        """
        return self._self_core.cycle.value

    @n.setter
    def n(self, value: int) -> None:
        _check_settable(self._self_core.settings, value)
        self._self_core.cycle.set(value)
        state = self._self_core.state
        if state is not None:
            # Kept slices XLA cannot grow while a step runs hold a cycle of the new length.
            state.reserve_kept()

    @property
    def noise_scale(self) -> float | None:
        """The latest gradient noise scale tr(Σ) / |G|², a Python float (see
        `accumulate(noise_scale=True)`), or None before a cycle has ended.

        Raises:
            ValueError: If the optimizer was made with `noise_scale=False`.
        """
        return _noise.latest(self._self_core)

    @property
    def micro_step(self) -> Any:
        """Micro-batches accumulated in the current cycle (an integer tensor)."""
        return self._self_core.micro_step()

    @property
    def will_apply(self) -> Any:
        """Boolean tensor: the next micro-step applies an update."""
        return self._self_core.will_apply()

    @property
    def built(self) -> bool:
        """Whether the wrapped optimizer and the accumulation state are built."""
        return self._self_core.built

    @built.setter
    def built(self, value: bool) -> None:
        self.__wrapped__.built = value

    @property
    def accumulation_state(self) -> AccumulationState | None:
        """A read-only view of the accumulation state; None until built.

        See `gradaccum.AccumulationState`. For inspection and tests: the
        variables in it are the live ones, not copies.
        """
        return self._self_core.view()

    @_backend.unconverted
    def flush(self) -> None:
        """Applies what the current cycle holds now, if it holds anything.

        The update is the (weighted) mean over the micro-batches accumulated
        (or their sum, for `reduction="sum"`); the cycle then starts afresh.
        An empty cycle changes nothing. Usable eagerly and traced.
        """
        self._self_core.flush()

    # ------------------------------------------------------------------
    # The optimizer's methods.

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the wrapped optimizer (if needed) and the accumulators.

        Without a call of `build`, the first `apply_gradients` builds the
        optimizer for the variables it names. A tf_keras OptimizerV2
        (`tf_keras.optimizers.legacy`) creates its state per variable lazily,
        and so does the proxy around it: a variable met later gets its slots
        and accumulator then (eagerly, or on the first trace of a
        `tf.function`). Checkpoints hold the accumulators by position, in the
        order the optimizer met the variables.

        Args:
            variables: The trainable variables the optimizer will update.
        """
        self._self_runner.build(variables)

    @_backend.unconverted
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], weight: Any = None, **kwargs: Any) -> Any:
        """Accumulates one micro-batch of gradients; applies every `n`-th.

        A variable that receives no gradient on any micro-step of a cycle
        (a frozen layer, a branch not taken) gets no update in that cycle
        and its optimizer state does not change, as in the large batch;
        where a step cannot leave it out (a step traced by `jax.jit`, a
        tf_keras optimizer in a traced step) it gets a zero gradient, and
        a `UserWarning` says so once per optimizer.

        Args:
            grads_and_vars: `(gradient, variable)` pairs. A gradient may be
                `None` (counted as zeros in the cycle's sum) or a
                `tf.IndexedSlices` (kept as the `sparse` setting says).
            weight: Optional weight of this micro-batch (a number >= 0 or a
                scalar tensor), for example its sample or token count. The
                update applies `sum(w_i * g_i) / sum(w_i)` (`"mean"`) or
                `sum(w_i * g_i)` (`"sum"`). Omitted, it is the count the loss
                was divided by in `model.compute_loss` (as in `model.fit`,
                with `weigh_by="count"`), else 1. A traced tensor below 0 or
                not finite raises at run time; where nothing can (XLA,
                `jax.jit`) its micro-step is refused and changes nothing.
            **kwargs: Keyword arguments of a tf_keras optimizer's
                `apply_gradients` (`name`, `skip_gradients_aggregation`,
                `experimental_aggregate_gradients`), passed on to it on the
                applied update. A Keras 3 optimizer takes none.

        Returns:
            What the wrapped optimizer's `apply_gradients` returns.

        Raises:
            TypeError: If a keyword argument is not one the wrapped
                optimizer's `apply_gradients` takes; see also `apply()`.
            ValueError: See `apply()`.
        """
        return self._self_runner.apply_gradients(grads_and_vars, weight, **kwargs)

    @_backend.unconverted
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None, weight: Any = None) -> Any:
        """Accumulates one micro-batch of gradients; applies every `n`-th.

        Variables without a gradient: see `apply_gradients`.

        Args:
            grads: One gradient per variable (`None` counts as zeros in the
                cycle's sum).
            trainable_variables: The variables, in the order of `grads`; if
                omitted, those the optimizer was built with.
            weight: Optional weight of this micro-batch; see `apply_gradients`.

        Returns:
            What a loss-scale optimizer's `apply` returns around one, else None.

        Raises:
            TypeError: If `weight` is not a number or scalar tensor.
            ValueError: If a variable is not one the optimizer was built for
                (and cannot be added to it, see `build`), if `grads` does not
                match the built variables, if a gradient's shape is not its
                variable's (the message names the variable), if every
                gradient is `None`, if `weight` is negative or not finite, or
                if a variable's kept `tf.IndexedSlices` cannot be continued
                exactly (a dense gradient after kept slices in one cycle, a
                partial cycle loaded in another layout; see the sparse
                guide).
        """
        return self._self_runner.apply(grads, trainable_variables, weight)

    @property
    def variables(self) -> Any:
        """The wrapped optimizer's variables; on JAX and PyTorch followed by
        the accumulation state's (the accumulators, the micro-step counter,
        the weight total, an int `n`, and which variables received a
        gradient in the current cycle), so that `model.fit` on JAX carries
        them from step to step as it carries the optimizer's."""
        return self._self_runner.variables

    def stateless_apply(
        self, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Sequence[Any],
        weight: Any = None,
    ) -> tuple[list[Any], list[Any]]:
        """Accumulates one micro-batch without side effects (JAX, PyTorch).

        What JAX's `model.fit` calls, inside `jax.jit` or not; usable in a
        custom training loop the same way.

        Args:
            optimizer_variables: The values of `optimizer.variables`.
            grads: One gradient per trainable variable.
            trainable_variables: Those variables' values.
            weight: Optional weight of this micro-batch; see `apply_gradients`.

        Returns:
            `(trainable_variables, optimizer_variables)`: their new values.

        Raises:
            TypeError: If `weight` is not a number or scalar tensor.
            ValueError: If the optimizer is not built, the lists do not
                match its variables, or an eager `weight` is not finite >= 0.
            NotImplementedError: On the TensorFlow backend: call `apply`.
        """
        if isinstance(self._self_runner, LossScaled):
            return self._self_runner.stateless_apply(optimizer_variables, grads, trainable_variables, weight)
        return self._self_runner.stateless_apply(self.apply, optimizer_variables, grads, trainable_variables, weight)

    @_backend.unconverted
    def minimize(self, loss: Any, var_list: Any, *args: Any, **kwargs: Any) -> Any:
        """Computes the gradients of `loss` and accumulates them.

        The `minimize` of a tf_keras optimizer (which its `Model.fit` calls),
        with the gradients going through this optimizer's `apply_gradients`.

        Args:
            loss: A callable returning the loss, or a tensor computed under `tape`.
            var_list: The variables, or a callable returning them.
            *args: `tape`, the `tf.GradientTape` of a tensor `loss`.
            **kwargs: The same, by keyword.

        Raises:
            AttributeError: If the wrapped optimizer has no `minimize` (Keras 3).
        """
        return self._self_runner.family.minimize(self.apply_gradients, loss, var_list, *args, **kwargs)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """The wrapped optimizer's, once an update has been applied.

        With `use_ema=True`, Keras's `fit` ends by copying the moving
        averages, which move only on applied updates, into the weights: until
        an update has been applied (`iterations` is 0) nothing is finalized,
        as under Keras's own `gradient_accumulation_steps`.

        Args:
            var_list: The model's trainable variables, as Keras passes them.
        """
        finalize = self.__wrapped__.finalize_variable_values
        if not getattr(self.__wrapped__, "use_ema", False):
            return finalize(var_list)
        core = self._self_core
        applied = keras.ops.convert_to_tensor(core.family.iterations)
        core.backend.when(applied > 0, lambda: finalize(var_list))
        return None

    def __repr__(self) -> str:
        current = self._self_core.settings.replace(n=self.n).as_dict()
        settings = " ".join(f"{k}={v!r}" for k, v in current.items() if not k.startswith("agc"))
        micro_step = self.micro_step
        known = self._self_core.backend.known(micro_step)
        position = str(int(keras.ops.convert_to_numpy(micro_step))) if known else "?"
        return f"<AccumulatingOptimizer {settings} micro_step={position} wrapping {self.__wrapped__!r}>"


# Pickles and messages name the class by its public module.
AccumulatingOptimizer.__module__ = "gradaccum"
_persistence.register(AccumulatingOptimizer)


def _check_settable(settings: Settings, n: Any) -> None:
    """Raises if `n` cannot be set: with `micro_batch_size`, each train step
    of `fit` is one cycle of its own micro-batches."""
    if settings.micro_batch_size is not None:
        raise ValueError(
            f"This optimizer splits each train step into micro-batches of micro_batch_size="
            f"{settings.micro_batch_size}; its cycle is the step's micro-batches, so `n` cannot be set. "
            f"Received: n={n!r}."
        )


def accumulating_in(optimizer: Any) -> AccumulatingOptimizer | None:
    """The AccumulatingOptimizer in `optimizer` (itself or its inner one)."""
    seen = optimizer
    while seen is not None:
        if isinstance(seen, AccumulatingOptimizer):
            return seen
        seen = getattr(seen, "inner_optimizer", None)
    return None
