"""The optimizer proxy: `AccumulatingOptimizer`, and its core kind.

`AccumulatingOptimizer` is a `wrapt.ObjectProxy`: to everyone else it is the
optimizer it wraps. It comes in two kinds, both subclasses, and
`AccumulatingOptimizer(optimizer, ...)` makes the one that fits `optimizer`:

- `_Core` (this module) wraps a plain optimizer and accumulates: its own
  state is one `gradaccum._accumulation.Accumulation`.
- `gradaccum._loss_scale.LossScaleFront` wraps a loss-scale optimizer and
  accumulates inside it, through a `_Core` installed as its inner optimizer.

The public surface (`n`, `reduction`, `mode`, `micro_step`, `will_apply`,
`accumulation_state`, `built`, `flush`, `minimize`, configs) is defined once, here,
on the `Accumulation` both kinds share; each kind defines `build`,
`apply_gradients` and `apply`.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Sequence

import keras
import numpy as np
import wrapt

from gradaccum import _backend, _engines, _families, _saving
from gradaccum._agc import AdaptiveClipping
from gradaccum._family import OptimizerFamily
from gradaccum._store import CHILD, UNTRACKED, check_saved_settings, owns_key, read_store
from gradaccum._view import AccumulationState
from gradaccum._validation import (
    check_mode,
    check_n,
    check_n_or_schedule,
    check_reduction,
    check_sparse,
    check_weigh_by,
)

if TYPE_CHECKING:
    import tensorflow as tf

    from gradaccum._accumulation import Accumulation


class AccumulatingOptimizer(wrapt.ObjectProxy):
    """A Keras optimizer that applies one update every `n` micro-batches.

    The proxy is the wrapped optimizer to everyone else: `isinstance`,
    `learning_rate`, `iterations`, `variables`, `get_config()` and `build()`
    reach the wrapped instance. Each call of `apply_gradients()` (or
    `apply()`) adds the gradients to float32 accumulators; on every `n`-th
    call the wrapped optimizer applies their mean (or sum) once, so clipping,
    weight decay, EMA, constraints, learning-rate schedules and `iterations`
    see exactly what training on the `n`-times larger batch sees.

    By default (`mode="masked"`) the update is branch-free: every call runs
    the wrapped optimizer's update and keeps its result only on the apply
    step. With `mode="skip"` the update runs only on the apply step.

    Wrapping a loss-scale optimizer accumulates inside it, on its inner
    optimizer: the result is still the loss-scale optimizer to other code,
    and a non-finite micro-batch is dropped, not counted.

    Create it with `gradaccum.accumulate()`.

    Args:
        optimizer: The Keras optimizer instance to wrap.
        n: Micro-batches per update: an int >= 1, or a schedule, a callable
            that takes the number of applied updates (an int64 tensor) and
            returns the int for the next cycle; it runs inside the graph on
            every micro-step, so it must be written with TensorFlow ops (for
            example `lambda step: tf.where(step < 100, 2, 8)`).
        reduction: `"mean"` applies the (weighted) mean of the micro-gradients
            (for mean-reduced losses), `"sum"` their (weighted) sum.
        mode: `"masked"` or `"skip"`: whether the wrapped optimizer's update
            runs on every micro-step (its result kept only on the apply
            step) or only on the apply step.
        weigh_by: `"count"` weighs each micro-batch of `model.fit` by the
            count its compiled loss was divided by (valid entries of a masked
            loss, the sum of sample weights for
            `"mean_with_sample_weight"`, the size of a ragged batch), so the
            update is the mean over every entry of the cycle, as on the
            large batch; `"batch"` weighs every micro-batch alike. An
            explicit `weight` passed to `apply_gradients` wins either way.
        sparse: `"rows"` adds `tf.IndexedSlices` gradients into their rows;
            `"slices"` keeps the cycle's slices and hands the optimizer all
            of them as one `tf.IndexedSlices`, as the large batch would
            (see `gradaccum.accumulate`).
        agc: Adaptive gradient clipping of each update's gradient (made by
            `accumulate()` from its `agc`, `agc_eps` and `agc_exclude`), or
            None.

    Raises:
        TypeError: If `optimizer` is not a Keras optimizer or `n` is neither
            an int nor a callable.
        ValueError: If `n < 1`, `reduction`, `mode`, `weigh_by` or `sparse` is
            unknown, `optimizer` already accumulates gradients, or the active
            Keras backend is not TensorFlow.
    """

    # The kinds (see `register_kind`), asked in order whether they wrap an
    # optimizer; the last one takes the rest.
    _KINDS: ClassVar[list[type]] = []

    def __new__(cls, optimizer: Any = None, *args: Any, **kwargs: Any) -> AccumulatingOptimizer:
        if cls is AccumulatingOptimizer:
            cls = next(kind for kind in cls._KINDS if kind._handles(optimizer))
        return super().__new__(cls)

    @classmethod
    def _handles(cls, optimizer: Any) -> bool:
        """Whether this kind wraps `optimizer`."""
        return True

    def __init__(self, optimizer: Any, family: OptimizerFamily, accumulation: Accumulation):
        super().__init__(optimizer)
        # The wrapped optimizer's family, and the accumulation this proxy runs.
        self._self_family = family
        self._self_accumulation = accumulation
        # What a Keras file loaded before the optimizer was built: assigned
        # once it is (see `load_own_variables`).
        self._self_loaded: dict[str, np.ndarray] | None = None

    # ------------------------------------------------------------------
    # Settings and state.

    @property
    def n(self) -> int | Callable[[tf.Tensor], Any]:
        """Micro-batches per applied update: an int, or the schedule given.

        Set it to an int between cycles (`opt.n = 8`); the change needs no
        retracing, except to or from `n=1`: with `n=1` gradients go straight
        to the wrapped optimizer, and a `tf.function` traced then keeps doing
        so, so trace it anew after such a change. Setting another `n` after
        such a trace warns, and running that function then raises (not
        under XLA, which drops run-time assertions). Set mid-cycle, the current
        cycle ends on the first micro-step at which it holds at least the new
        `n` micro-batches, and applies the mean over all of them.

        Raises:
            TypeError/ValueError: When set to anything but an int >= 1, or
                when `n` was given as a schedule.
        """
        return self._self_accumulation.cycle.value

    @n.setter
    def n(self, value: int) -> None:
        self._self_accumulation.set_n(value)

    @property
    def reduction(self) -> str:
        """`"mean"` or `"sum"`: how the micro-gradients are combined."""
        return self._self_accumulation.reduction

    @property
    def mode(self) -> str:
        """`"masked"` or `"skip"`: when the wrapped optimizer's update runs."""
        return self._self_accumulation.mode

    @property
    def weigh_by(self) -> str:
        """`"count"` or `"batch"`: what a `model.fit` micro-batch weighs."""
        return self._self_accumulation.weigh_by

    @property
    def sparse(self) -> str:
        """`"rows"` or `"slices"`: how `tf.IndexedSlices` gradients are kept."""
        return self._self_accumulation.sparse

    @property
    def agc(self) -> float | None:
        """Adaptive gradient clipping's factor λ, or None (off)."""
        agc = self._self_accumulation.agc
        return None if agc is None else agc.clip_factor

    @property
    def agc_eps(self) -> float:
        """The smallest weight norm an AGC cap is computed from."""
        agc = self._self_accumulation.agc
        return 1e-3 if agc is None else agc.eps

    @property
    def agc_exclude(self) -> Any:
        """What AGC leaves out: None, a predicate, or variables and names."""
        agc = self._self_accumulation.agc
        return None if agc is None else agc.exclude

    @property
    def micro_step(self) -> tf.Tensor:
        """Micro-batches accumulated in the current cycle (int64, 0..n-1)."""
        return self._self_accumulation.micro_step()

    @property
    def will_apply(self) -> tf.Tensor:
        """Boolean tensor: the next micro-step applies an update."""
        return self._self_accumulation.will_apply()

    @property
    def built(self) -> bool:
        """Whether the wrapped optimizer and the accumulation state are built."""
        return self._self_accumulation.built

    @built.setter
    def built(self, value: bool) -> None:
        self.__wrapped__.built = value

    @property
    def accumulation_state(self) -> AccumulationState | None:
        """A read-only view of the accumulation state; None until built.

        See `gradaccum.AccumulationState`. For inspection and tests: the
        variables in it are the live ones, not copies, and writing them
        changes the cycle.
        """
        return self._self_accumulation.view()

    def flush(self) -> None:
        """Applies what the current cycle holds now, if it holds anything.

        The update is the (weighted) mean over the micro-batches actually
        accumulated (or their sum, for `reduction="sum"`); the cycle then
        starts afresh. With an empty cycle nothing changes. Usable eagerly
        and inside `tf.function`.
        """
        self._self_accumulation.flush()

    def minimize(self, loss: Any, var_list: Any, *args: Any, **kwargs: Any) -> Any:
        """Computes the gradients of `loss` and accumulates them.

        The `minimize` of a tf_keras optimizer (which its `Model.fit` calls),
        with the gradients going through this optimizer's `apply_gradients`.

        Args:
            loss: The loss tensor (with `tape`) or a callable returning it.
            var_list: The variables to minimize `loss` for.
            *args: The wrapped optimizer's further `minimize` arguments
                (`tape`, ...).
            **kwargs: The same, by name.

        Returns:
            What the wrapped optimizer's `minimize` returns.

        Raises:
            AttributeError: If the wrapped optimizer has no `minimize`
                (Keras 3).
        """
        return self._self_family.minimize(self.apply_gradients, loss, var_list, *args, **kwargs)

    # ------------------------------------------------------------------
    # Keras files (`.keras`, `.weights.h5`).
    #
    # Keras loads a file into a freshly compiled model before its optimizer
    # has stepped, and a plain optimizer then drops its saved state with a
    # warning (its slots do not exist yet). The proxy keeps what it was
    # given and loads it once the optimizer and the accumulation state are
    # built, so a run resumed that way continues exactly where it stopped.

    def save_own_variables(self, store: Any) -> None:
        """Saves the wrapped optimizer's variables and the accumulation state.

        Unbuilt, but holding values loaded from a file, it saves those.

        Args:
            store: The Keras weights store to write to.
        """
        if self._self_loaded is not None and not self.built:
            for key, value in self._self_loaded.items():
                store[key] = value
            return
        self._save_now(store)

    def load_own_variables(self, store: Any) -> None:
        """Loads what `save_own_variables` wrote, now or once built.

        A built optimizer loads the store at once. An unbuilt one (a model
        compiled but not trained yet, as `model.load_weights` and
        `keras.models.load_model` of a model built later meet it) keeps the
        values and assigns them once it is built, by `build` or its first
        step: the wrapped optimizer's variables (slots, `iterations`) and the
        partial cycle. A store written by the plain optimizer loads into the
        wrapped one and leaves the accumulators empty.

        Args:
            store: The Keras weights store to read from.

        Raises:
            ValueError: If the store was written with another `n` or
                `reduction` (at once), or for another model (when the values
                are assigned).
        """
        values = read_store(store)
        check_saved_settings(values, self._self_accumulation.cycle.code, self.reduction)
        waiting = self._self_loaded is not None
        self._self_loaded = values
        if not waiting:
            self._self_accumulation.when_built(self._load_kept)

    def _load_kept(self) -> None:
        values, self._self_loaded = self._self_loaded, None
        self._load_now(values)

    def _save_now(self, store: Any) -> None:
        """Saves this kind's state into a Keras weights store."""
        raise NotImplementedError

    def _load_now(self, values: dict[str, np.ndarray]) -> None:
        """Loads what `_save_now` wrote, into the built optimizer."""
        raise NotImplementedError

    # ------------------------------------------------------------------
    # Configs.

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> AccumulatingOptimizer:
        """Re-creates an `AccumulatingOptimizer` from its serialized config.

        Args:
            config: The `"config"` part of what `keras.saving.serialize_keras_object`
                writes for an `AccumulatingOptimizer`: the wrapped optimizer's
                serialized config, `n`, `reduction`, `mode`, `weigh_by` and
                AGC's `agc`, `agc_eps` and `agc_exclude`.
            custom_objects: Passed on to Keras's deserialization.

        Returns:
            A new `AccumulatingOptimizer` around a new wrapped optimizer.

        Raises:
            ValueError: If `config` lacks `optimizer` or `n`.
        """
        optimizer, n, reduction, mode, weigh_by, sparse, agc = _saving.arguments(config, custom_objects)
        return AccumulatingOptimizer(
            optimizer, n, reduction=reduction, mode=mode, weigh_by=weigh_by, sparse=sparse,
            agc=agc, _adopt=True,
        )

    # ------------------------------------------------------------------
    # Pickling and copying.
    #
    # `wrapt.ObjectProxy` refuses to be pickled or copied. A Keras optimizer
    # pickles through its `.keras` serialization (`KerasSaveable.__reduce__`),
    # and `copy.copy`/`copy.deepcopy` go the same way: the result is a new
    # optimizer with the same config, unbuilt if the original was built (its
    # slots are skipped with a warning), keeping `iterations` and the learning
    # rate if it was not. A proxy's copy is a new proxy, with the same `n`,
    # `reduction` and `mode`, around what Keras makes of the wrapped
    # optimizer; like the slots, a built proxy's accumulators are not copied.
    # (`weigh_by`, `sparse` and AGC's settings travel too; variables AGC
    # leaves out travel as their paths.)
    # A loss-scale optimizer's copy holds a copy of the accumulating inner
    # optimizer (serialized as itself), which the new front adopts.

    @classmethod
    def _rebuilt(
        cls,
        optimizer: Any,
        n: Any,
        reduction: str,
        mode: str,
        weigh_by: str = "count",
        sparse: str = "rows",
        agc: AdaptiveClipping | None = None,
    ) -> AccumulatingOptimizer:
        return AccumulatingOptimizer(
            optimizer, n, reduction=reduction, mode=mode, weigh_by=weigh_by, sparse=sparse,
            agc=agc, _adopt=True,
        )

    def _portable_agc(self) -> AdaptiveClipping | None:
        agc = self._self_accumulation.agc
        return None if agc is None else agc.portable()

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return (
            AccumulatingOptimizer._rebuilt,
            (self.__wrapped__, self.n, self.reduction, self.mode, self.weigh_by, self.sparse,
             self._portable_agc()),
        )

    def __reduce__(self) -> tuple:
        return self.__reduce_ex__(2)

    def __copy__(self) -> AccumulatingOptimizer:
        return self._rebuilt(
            copy.copy(self.__wrapped__),
            self.n,
            self.reduction,
            self.mode,
            self.weigh_by,
            self.sparse,
            self._portable_agc(),
        )

    def __deepcopy__(self, memo: dict) -> AccumulatingOptimizer:
        return self._rebuilt(
            copy.deepcopy(self.__wrapped__, memo),
            copy.deepcopy(self.n, memo),
            self.reduction,
            self.mode,
            self.weigh_by,
            self.sparse,
            self._portable_agc(),
        )

    def __repr__(self) -> str:
        position = "?"
        micro_step = self.micro_step
        if _known(micro_step):
            position = str(int(keras.ops.convert_to_numpy(micro_step)))
        return (
            f"<AccumulatingOptimizer n={self.n} "
            f"reduction={self.reduction!r} mode={self.mode!r} weigh_by={self.weigh_by!r} "
            f"sparse={self.sparse!r} "
            f"micro_step={position} "
            f"wrapping {self.__wrapped__!r}>"
        )


def _known(value: Any) -> bool:
    """Whether a tensor's value is known (not inside a trace)."""
    if keras.config.backend() == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    from gradaccum._backend import portable as control

    return not control.is_traced(value)


# Pickles refer to the class by its public name, not this private module.
AccumulatingOptimizer.__module__ = "gradaccum"


def register_kind(kind: type) -> type:
    """Makes `AccumulatingOptimizer(optimizer)` ask `kind._handles(optimizer)`
    before the kinds registered earlier."""
    AccumulatingOptimizer._KINDS.insert(0, kind)
    return kind


def accumulation_of(proxy: AccumulatingOptimizer) -> Accumulation:
    """The accumulation a proxy runs (a loss-scale front shares its core's)."""
    return proxy._self_accumulation


def accumulating_in(optimizer: Any) -> AccumulatingOptimizer | None:
    """The AccumulatingOptimizer in `optimizer` (itself or its inner one)."""
    seen = optimizer
    while seen is not None:
        if isinstance(seen, AccumulatingOptimizer):
            return seen
        seen = getattr(seen, "inner_optimizer", None)
    return None


def wrappable_family(optimizer: Any) -> OptimizerFamily:
    """The family of `optimizer`, or raises if it cannot be wrapped."""
    _backend.check_supported()
    if isinstance(optimizer, AccumulatingOptimizer):
        raise ValueError(
            "`optimizer` is already an AccumulatingOptimizer "
            f"(n={optimizer.n}); wrapping it again would accumulate twice. "
            "Pass the plain optimizer, or set the number of micro-batches "
            "on the existing wrapper."
        )
    family = _families.family_of(optimizer)
    if family is None:
        hint = ""
        if isinstance(optimizer, (int, type)) or callable(optimizer):
            hint = (
                " To decorate an optimizer class or factory, call "
                "`accumulate(n=...)` with `n` as a keyword."
            )
        raise TypeError(
            f"`optimizer` must be an optimizer instance ({_families.names()}). "
            f"Received: {optimizer!r} of type {type(optimizer).__name__}.{hint}"
        )
    attribute = family.inner_attribute()
    if attribute is not None and isinstance(getattr(optimizer, attribute), AccumulatingOptimizer):
        raise ValueError(
            "`optimizer` is a loss-scale optimizer around an "
            "AccumulatingOptimizer already; wrapping it would accumulate twice."
        )
    family.check()
    return family


@register_kind
class _Core(AccumulatingOptimizer):
    """The kind that accumulates: wraps an optimizer that is not a loss-scale one."""

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        n: int | Callable[[tf.Tensor], Any],
        reduction: str = "mean",
        mode: str = "masked",
        weigh_by: str = "count",
        sparse: str = "rows",
        *,
        agc: AdaptiveClipping | None = None,
        _adopt: bool = False,
    ):
        family = wrappable_family(optimizer)
        accumulation = _engines.accumulation_class()(
            family,
            check_n_or_schedule(n),
            check_reduction(reduction),
            check_mode(mode),
            check_weigh_by(weigh_by),
            on_built=self._restore_deferred,
            sparse=check_sparse(sparse),
            agc=agc,
        )
        super().__init__(optimizer, family, accumulation)
        if family.built:
            accumulation.build(family.trainable_variables())

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the wrapped optimizer (if needed) and the accumulators.

        Without a call of `build`, the first `apply_gradients` builds the
        optimizer for the variables it names. A Keras 3 or tf_keras 2.11+
        optimizer then refuses gradients for other variables. A tf_keras
        OptimizerV2 (`tf_keras.optimizers.legacy`) creates its state per
        variable lazily, and so does the proxy around it: a gradient for a
        variable met later (one that a loss-scale optimizer left out of an
        earlier call because its gradient was `None`) adds that variable's
        slots and accumulator then, and calling `build` again with more
        variables adds those. Growing works eagerly and on the first trace
        of a `tf.function`; a later trace cannot create variables and raises
        `ValueError`, so build such an optimizer with all variables first
        (`opt.build(model.trainable_variables)`).

        Checkpoints hold the accumulators by position, in the order the
        optimizer met the variables: those of the first `build` (or first
        `apply_gradients`), then each one added later. Restore a checkpoint
        into an optimizer that holds the same variables in that order: built
        with them before the restore, or unbuilt, if its first step after the
        restore meets them all (it then builds in that order and the
        deferred values land). A step that would end the cycle while restored
        sums wait for variables not met yet raises `ValueError` (a traced one
        raises whenever it cannot add them). An optimizer built with all
        variables before its first step, as above, always restores into one
        built the same way.

        Args:
            variables: The trainable variables the optimizer will update.
        """
        self._self_accumulation.build(variables)

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Any]],
        weight: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Accumulates one micro-batch of gradients; applies every `n`-th.

        Args:
            grads_and_vars: `(gradient, variable)` pairs. A gradient may be
                `None` (counted as zeros) or a `tf.IndexedSlices`.
            weight: Optional weight of this micro-batch (a number >= 0 or a
                scalar tensor), for example its sample or token count. The
                update applies `sum(w_i * g_i) / sum(w_i)` (`"mean"`) or
                `sum(w_i * g_i)` (`"sum"`). Omitted, the micro-batch weighs
                the count its loss was divided by if the loss was computed by
                `model.compute_loss` (as in `model.fit`) and `weigh_by` is
                `"count"`, else 1.
            **kwargs: Further keyword arguments of the wrapped optimizer's
                `apply_gradients` (a tf_keras optimizer's `name`,
                `skip_gradients_aggregation`,
                `experimental_aggregate_gradients`), passed to it on the
                applied update. A Keras 3 optimizer takes none.

        Returns:
            What the wrapped optimizer's `apply_gradients` returns: its
            `iterations` (applied updates), or for a tf_keras OptimizerV2
            traced in a graph an op.

        Raises:
            TypeError: If a keyword argument is not one the wrapped
                optimizer's `apply_gradients` takes; see also `apply()`.
            ValueError: See `apply()`.
        """
        family = self._self_family
        options = family.apply_options(**kwargs)
        pairs = list(grads_and_vars)
        if pairs:
            grads, variables = zip(*pairs)
            self._self_accumulation.step(grads, variables, weight, options)
        return family.apply_gradients_result()

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[Any] | None = None,
        weight: Any = None,
    ) -> None:
        """Accumulates one micro-batch of gradients; applies every `n`-th.

        Args:
            grads: One gradient per variable (`None` counts as zeros).
            trainable_variables: The variables, in the order of `grads`; if
                omitted, those the optimizer was built with.
            weight: Optional weight of this micro-batch; see `apply_gradients`.

        Raises:
            TypeError: If `weight` is not a number or scalar tensor.
            ValueError: If a variable is not one the optimizer was built for
                (and cannot be added to it, see `build`), if `grads` does not
                match the built variables, if every gradient is `None`, or if
                `weight` is negative or not finite.
        """
        self._self_accumulation.step(grads, trainable_variables, weight, {})

    @property
    def variables(self) -> Any:
        """The wrapped optimizer's variables; on JAX and PyTorch followed by
        the accumulation state's (the accumulators, the micro-step counter,
        the weight total and an int `n`), so that `model.fit` on JAX carries
        them from step to step as it carries the optimizer's."""
        variables = self.__wrapped__.variables
        own = self._self_accumulation.own_variables()
        return list(variables) + own if own else variables

    def stateless_apply(
        self, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Sequence[Any]
    ) -> tuple[list[Any], list[Any]]:
        """Accumulates one micro-batch without side effects (JAX, PyTorch).

        What JAX's `model.fit` calls, inside `jax.jit` or not; usable in a
        custom training loop the same way.

        Args:
            optimizer_variables: The values of `optimizer.variables` (the
                wrapped optimizer's, then the accumulation state's).
            grads: One gradient per trainable variable the optimizer was
                built for.
            trainable_variables: Those variables' values.

        Returns:
            `(trainable_variables, optimizer_variables)`: their new values,
            changed only by a micro-step that completes the cycle (but the
            accumulation state's).

        Raises:
            ValueError: If the optimizer is not built or the lists do not
                match its variables.
            NotImplementedError: On the TensorFlow backend, where the
                accumulation writes TensorFlow variables directly: call
                `apply` or `apply_gradients`.
        """
        accumulation = self._self_accumulation
        if not hasattr(accumulation, "stateless_apply"):
            raise NotImplementedError(
                "stateless_apply() of an accumulating optimizer is not "
                "available on the TensorFlow backend; call `apply()` or "
                "`apply_gradients()`."
            )
        return accumulation.stateless_apply(
            self.apply, self.variables, optimizer_variables, grads, trainable_variables
        )

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """The wrapped optimizer's, once an update has been applied.

        With `use_ema=True`, Keras's `fit` ends by overwriting the weights
        with their moving averages. The averages move only on applied
        updates (the first one sets them to the weights), so a `fit` shorter
        than one cycle would copy in their initial zeros. Until an update
        has been applied (`iterations` is 0) nothing is finalized and the
        weights stay as they are, as under Keras's own
        `gradient_accumulation_steps`, whose averages then still equal the
        weights.

        Args:
            var_list: The model's trainable variables.
        """
        finalize = self.__wrapped__.finalize_variable_values
        if not getattr(self.__wrapped__, "use_ema", False):
            return finalize(var_list)
        if keras.config.backend() != "tensorflow":
            # JAX's `fit` calls this eagerly, after writing the state back.
            if int(keras.ops.convert_to_numpy(self._self_family.iterations)) > 0:
                finalize(var_list)
            return None
        import tensorflow as tf

        # A read, not the variable: under a strategy it is a MirroredVariable.
        applied = tf.convert_to_tensor(self._self_family.iterations)
        if tf.executing_eagerly():
            if int(applied) > 0:
                finalize(var_list)
            return None
        tf.cond(applied > 0, lambda: finalize(var_list), lambda: None)
        return None

    # ------------------------------------------------------------------
    # Persistence: the wrapped optimizer's, plus the accumulation state.

    def _restore_deferred(self, module: tf.Module | None) -> None:
        """Restores state a checkpoint held for the module before it existed
        (TensorFlow; on other backends there is no module)."""
        if module is None:
            return
        self.__wrapped__._handle_deferred_dependencies(name=CHILD, trackable=module)

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        children = dict(self.__wrapped__._trackable_children(save_type, **kwargs))
        state = self._self_accumulation.state
        if state is not None:
            children[CHILD] = state.module
        return children

    def _lookup_dependency(self, name: str, cached_dependencies: Any = None) -> Any:
        if name == CHILD:
            state = self._self_accumulation.state
            return None if state is None else state.module
        return self.__wrapped__._lookup_dependency(name, cached_dependencies)

    def _save_now(self, store: Any) -> None:
        self.__wrapped__.save_own_variables(store)
        # Built by a LossScaleOptimizer, the wrapped optimizer lists no
        # variable its `build` created directly (Nadam's `_u_product`), and
        # Keras's file would lose them.
        for k, v in enumerate(self._self_family.untracked_variables()):
            store[f"{UNTRACKED}{k}"] = np.asarray(keras.ops.convert_to_numpy(v))
        state = self._self_accumulation.state
        if state is not None:
            state.save(store)

    def _load_now(self, values: dict[str, np.ndarray]) -> None:
        self.__wrapped__.load_own_variables({k: v for k, v in values.items() if not owns_key(k)})
        untracked = [k for k in values if k.startswith(UNTRACKED)]
        if untracked:
            targets = self._self_family.untracked_variables()
            if len(targets) != len(untracked):
                raise ValueError(
                    f"The file holds {len(untracked)} optimizer variables that "
                    f"the wrapped optimizer does not list in `variables`, but "
                    f"this one has {len(targets)}: it was saved from another "
                    "optimizer or wrapping (a LossScaleOptimizer around it or not)."
                )
            for k, v in enumerate(targets):
                v.assign(np.asarray(values[f"{UNTRACKED}{k}"]))
        if any(owns_key(k) and not k.startswith(UNTRACKED) for k in values):
            self._self_accumulation.state.load({k: v for k, v in values.items() if not k.startswith(UNTRACKED)})
