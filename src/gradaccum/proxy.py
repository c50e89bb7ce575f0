"""The optimizer proxy: `accumulate()` and `AccumulatingOptimizer`."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterable, Sequence

import keras
import tensorflow as tf
import wrapt

from gradaccum._validation import (
    _check_mode,
    _check_n,
    _check_n_or_schedule,
    _check_reduction,
    _check_weight,
)
from gradaccum.adapters import _adapter_for, _families
from gradaccum.distribution import (
    _creation_scope,
    _local_copy,
    _mirrored_counter,
    _replica_local,
)
from gradaccum.loss_scaling import _inner_attribute, _install
from gradaccum.masking import (
    _divide_if,
    _divide_in_place,
    _masked_update,
    _select,
    _zero,
    _zero_if,
)
from gradaccum.serialization import (
    _AccumulationState,
    _Saveable,
    _install_keras_serialization,
)
from gradaccum.skipping import (
    _cleared_if,
    _quotients,
    _shares_zeros,
    _skipped_update,
    _zero_buffers,
)


def _accumulator_dtype(variable: Any) -> tf.DType:
    dtype = tf.as_dtype(variable.dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32


def _check_optimizer(optimizer: Any) -> Any:
    """Returns the adapter for `optimizer`, or raises if it cannot be wrapped."""
    if isinstance(optimizer, AccumulatingOptimizer):
        raise ValueError(
            "`optimizer` is already an AccumulatingOptimizer "
            f"(n={optimizer.n}); wrapping it again would accumulate twice. "
            "Pass the plain optimizer, or set the number of micro-batches "
            "on the existing wrapper."
        )
    adapter = _adapter_for(optimizer)
    if adapter is None:
        hint = ""
        if isinstance(optimizer, (int, type)) or callable(optimizer):
            hint = (
                " To decorate an optimizer class or factory, call "
                "`accumulate(n=...)` with `n` as a keyword."
            )
        raise TypeError(
            f"`optimizer` must be an optimizer instance ({_families()}). "
            f"Received: {optimizer!r} of type {type(optimizer).__name__}.{hint}"
        )
    attribute = _inner_attribute(optimizer)
    if attribute is not None and isinstance(
        getattr(optimizer, attribute), AccumulatingOptimizer
    ):
        raise ValueError(
            "`optimizer` is a loss-scale optimizer around an "
            "AccumulatingOptimizer already; wrapping it would accumulate twice."
        )
    adapter.check()
    return adapter


class AccumulatingOptimizer(_Saveable, wrapt.ObjectProxy):
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
    step (see `gradaccum.masking`). With `mode="skip"` the update runs only
    on the apply step (see `gradaccum.skipping`).

    Wrapping a loss-scale optimizer accumulates inside it, on its inner
    optimizer: the result is still the loss-scale optimizer to other code,
    and a non-finite micro-batch is dropped, not counted (see
    `gradaccum.loss_scaling`).

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

    Raises:
        TypeError: If `optimizer` is not a Keras optimizer or `n` is neither
            an int nor a callable.
        ValueError: If `n < 1`, `reduction` or `mode` is unknown, or
            `optimizer` already accumulates gradients.
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        n: int | Callable[[tf.Tensor], Any],
        reduction: str = "mean",
        mode: str = "masked",
        *,
        _adopt: bool = False,
    ):
        attribute = _inner_attribute(optimizer)
        adopted = None
        if _adopt and attribute is not None:
            # Deserializing: the loss-scale optimizer's inner optimizer was
            # saved as the accumulating one.
            adopted = getattr(optimizer, attribute)
            if not isinstance(adopted, AccumulatingOptimizer):
                adopted = None
        adapter = _adapter_for(optimizer) if adopted is not None else _check_optimizer(optimizer)
        n = _check_n_or_schedule(n)
        reduction = _check_reduction(reduction)
        mode = _check_mode(mode)
        super().__init__(optimizer)
        self._self_adapter = adapter
        # Where the accumulation happens: this proxy, or for a loss-scale
        # optimizer an AccumulatingOptimizer installed as its inner optimizer.
        self._self_core: AccumulatingOptimizer = self
        if adopted is not None:
            self._self_core = adopted
            return
        if attribute is not None:
            self._self_core = _install(
                optimizer,
                attribute,
                lambda inner: AccumulatingOptimizer(
                    inner, n, reduction=reduction, mode=mode
                ),
            )
            return
        self._self_schedule = None if isinstance(n, int) else n
        self._self_n = n if isinstance(n, int) else None
        self._self_n_variable: tf.Variable | None = None
        # Whether a traced function hands gradients straight over (n=1).
        self._self_bypass_traced = False
        self._self_reduction = reduction
        self._self_mode = mode
        self._self_state: _AccumulationState | None = None
        # Skip mode without growth: zero vectors the accumulators are
        # pointed at after each update (see `gradaccum.skipping`).
        self._self_zeros: dict[tf.DType, tf.Variable] | None = None
        self._self_variables: list[Any] = []
        self._self_index: dict[Any, int] = {}
        # Indices of variables that have received a gradient: they take part
        # in every update from then on (zeros on micro-steps without one).
        self._self_seen: set[int] = set()
        # Whether any micro-batch was given a weight (decided while tracing).
        self._self_weighted = False
        # A weight handed over by an outer loss-scale proxy for the next call.
        self._self_pending_weight: Any = None
        # Extra `apply_gradients` arguments of the latest call (tf_keras).
        self._self_apply_options: dict[str, Any] = {}
        if adapter.built:
            self._build_state(adapter.trainable_variables())

    # ------------------------------------------------------------------
    # Own properties.

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
        core = self._self_core
        return core._self_schedule if core._self_schedule is not None else core._self_n

    @n.setter
    def n(self, value: int) -> None:
        core = self._self_core
        if core._self_schedule is not None:
            raise ValueError(
                "`n` was given as a schedule (a callable); it cannot be set to "
                "an int afterwards. Let the schedule return the new value."
            )
        value = _check_n(value)
        if value != 1 and core._self_n == 1 and core._self_bypass_traced:
            warnings.warn(
                f"`n` set to {value}, but a `tf.function` traced with n=1 hands "
                "gradients straight to the wrapped optimizer and keeps doing "
                "so: trace it anew (for `model.fit`: "
                "`model.make_train_function(force=True)`, or compile again).",
                RuntimeWarning,
                stacklevel=2,
            )
        core._self_n = value
        if core._self_n_variable is not None:
            core._self_n_variable.assign(value)

    @property
    def reduction(self) -> str:
        """`"mean"` or `"sum"`: how the micro-gradients are combined."""
        return self._self_core._self_reduction

    @property
    def mode(self) -> str:
        """`"masked"` or `"skip"`: when the wrapped optimizer's update runs."""
        return self._self_core._self_mode

    @property
    def micro_step(self) -> tf.Tensor:
        """Micro-batches accumulated in the current cycle (int64, 0..n-1)."""
        state = self._self_core._self_state
        if state is None:
            return tf.constant(0, dtype=tf.int64)
        return tf.identity(state.micro_step)

    @property
    def will_apply(self) -> tf.Tensor:
        """Boolean tensor: the next micro-step applies an update."""
        core = self._self_core
        return core.micro_step + 1 >= core._current_n()

    @property
    def built(self) -> bool:
        if self._self_core is not self:
            return self._self_core.built
        return self._self_adapter.built and self._self_state is not None

    @built.setter
    def built(self, value: bool) -> None:
        self.__wrapped__.built = value

    def _current_n(self) -> tf.Tensor:
        """`n` for the current cycle, as an int64 tensor."""
        if self._self_schedule is not None:
            n = tf.cast(self._self_schedule(self._self_adapter.iterations), tf.int64)
            if tf.executing_eagerly() and int(n) < 1:
                raise ValueError(
                    f"The `n` schedule returned {int(n)}; it must return an int >= 1."
                )
            return tf.maximum(n, 1)
        if self._self_n_variable is None:
            return tf.constant(self._self_n, dtype=tf.int64)
        return self._self_n_variable.value()

    # ------------------------------------------------------------------
    # Building.

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
        if self._self_core is not self:
            # The wrapper's own `build` if it has one (a tf_keras
            # OptimizerV2 has none): it builds the core and its own state.
            build = getattr(self.__wrapped__, "build", None) or self._self_core.build
            build(list(variables))
            return
        adapter = self._self_adapter
        if not adapter.built:
            adapter.build(variables)
        if self._self_state is None:
            self._build_state(adapter.trainable_variables())
        elif adapter.grows:
            self._indices_of(list(variables))  # adds those not met yet

    def _build_state(self, variables: list[Any]) -> None:
        adapter = self._self_adapter
        with _creation_scope(adapter.strategy()):
            accumulators = self._new_accumulators(variables)
            micro_step = _mirrored_counter(0, name="micro_step")
            weight_total = _replica_local(tf.constant(0.0), name="weight_total")
            if (
                self._self_mode == "skip"
                and not adapter.grows
                and all(_shares_zeros(a) for a in accumulators)
            ):
                self._self_zeros = _zero_buffers(accumulators)
            if self._self_schedule is None:
                self._self_n_variable = _mirrored_counter(self._self_n, name="n")
        self._self_variables = variables
        self._self_index = {adapter.var_key(v): i for i, v in enumerate(variables)}

        def n_code() -> int:  # what checkpoints record: 0 for a schedule
            return 0 if self._self_schedule is not None else self._self_n

        self._self_state = _AccumulationState(
            accumulators, micro_step, weight_total, n_code, self._self_reduction,
            self._self_seen,
        )
        self._restore_deferred_state()

    def _new_accumulators(self, variables: Sequence[Any]) -> list[tf.Variable]:
        """One zero accumulator per variable (inside `_creation_scope`)."""
        adapter = self._self_adapter
        return [
            _replica_local(
                tf.zeros(v.shape, dtype=_accumulator_dtype(v)),
                name="accumulator",
                colocate_with=adapter.model_variable(v),
            )
            for v in variables
        ]

    def _indices_of(self, variables: Sequence[Any]) -> list[int]:
        var_key = self._self_adapter.var_key
        new: dict[Any, Any] = {}
        for v in variables:
            key = var_key(v)
            if key not in self._self_index:
                new.setdefault(key, v)
        if new:
            if not self._self_adapter.grows:
                v = next(iter(new.values()))
                name = getattr(v, "path", None) or getattr(v, "name", repr(v))
                raise ValueError(
                    f"Received a gradient for variable {name!r}, which this "
                    "optimizer was not built for. It was built for "
                    f"{len(self._self_variables)} variables: "
                    f"{[getattr(u, 'path', u.name) for u in self._self_variables]}."
                    " Build a new optimizer for a new set of variables."
                )
            self._grow(list(new.values()))
        return [self._self_index[var_key(v)] for v in variables]

    def _grow(self, variables: list[Any]) -> None:
        """Extends the state to variables met after `build`.

        For optimizers that create their per-variable state lazily (a tf_keras
        OptimizerV2, which a loss-scale optimizer may first call with only the
        variables that have gradients): their slots and accumulators are
        created as `build` creates them, and the variables are appended to the
        built ones, so existing indices (and checkpoint positions) stay.
        """
        adapter = self._self_adapter
        traced = not tf.executing_eagerly()
        try:
            with _creation_scope(adapter.strategy()):
                accumulators = self._new_accumulators(variables)
            adapter.grow(variables)  # last: nothing is recorded if a creation fails
        except ValueError as error:
            if not traced:
                raise
            names = [getattr(v, "name", repr(v)) for v in variables]
            raise ValueError(
                f"Received gradients for variables {names}, which this "
                "optimizer was not built for, inside a `tf.function` that "
                "cannot create their accumulation state (a `tf.function` "
                "creates variables on its first trace only). Build the "
                "optimizer with all variables before the first step: "
                "`opt.build(model.trainable_variables)`."
            ) from error
        start = len(self._self_variables)
        for i, v in enumerate(variables):
            self._self_index[adapter.var_key(v)] = start + i
        self._self_variables.extend(variables)
        # Appended to the tracked list: checkpointed as the next positions,
        # and restored there from a checkpoint read before they existed.
        self._self_state.accumulators.extend(accumulators)

    # ------------------------------------------------------------------
    # Applying.

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
                `sum(w_i * g_i)` (`"sum"`); omitted, every micro-batch weighs 1.
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
        if self._self_core is not self:
            return self._through_wrapper(
                weight, self._self_adapter.apply_gradients, grads_and_vars, **kwargs
            )
        options = self._self_adapter.apply_options(**kwargs)
        pairs = list(grads_and_vars)
        if pairs:
            grads, variables = zip(*pairs)
            self._apply(grads, variables, weight, options)
        return self._self_adapter.apply_gradients_result()

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
        minimize = getattr(self._self_adapter, "minimize", None)
        if minimize is None:
            raise AttributeError(
                f"{type(self.__wrapped__).__name__!r} object has no attribute "
                "'minimize'"
            )
        return minimize(self, loss, var_list, *args, **kwargs)

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
        if self._self_core is not self:
            return self._through_wrapper(
                weight, self.__wrapped__.apply, grads, trainable_variables
            )
        self._apply(grads, trainable_variables, weight, {})

    def _apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[Any] | None,
        weight: Any,
        options: dict[str, Any],
    ) -> None:
        # The wrapped optimizer's extra `apply_gradients` arguments, for the
        # update this cycle ends with (also when `flush()` ends it).
        self._self_apply_options = options
        weight = _check_weight(weight)
        if weight is None:
            weight, self._self_pending_weight = self._self_pending_weight, None
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When `trainable_variables` is omitted the optimizer must "
                    "already be built: call `optimizer.build(variables)` first."
                )
            if len(grads) != len(self._self_variables):
                raise ValueError(
                    f"Received {len(grads)} gradients for an optimizer built "
                    f"for {len(self._self_variables)} variables."
                )
            trainable_variables = self._self_variables
        else:
            trainable_variables = list(trainable_variables)
            if len(grads) != len(trainable_variables):
                raise ValueError(
                    f"Received {len(grads)} gradients for "
                    f"{len(trainable_variables)} variables."
                )
        if not grads:
            return
        if not self.built:
            self.build(trainable_variables)
        indices = self._indices_of(trainable_variables)
        if all(g is None for g in grads):
            raise ValueError(
                "No gradients provided for any variable (every gradient is "
                "None)."
            )
        if self._self_n == 1 and weight is None and not self._self_seen:
            # Every micro-batch is a whole batch: hand the gradients over as
            # they are. Accumulating first would densify `IndexedSlices`
            # (summing repeated rows, which Keras applies one by one) and give
            # variables without a gradient zeros instead of skipping them.
            # (Once anything was accumulated, with another `n` set before,
            # the accumulating path below finishes that cycle instead.)
            still_one = []
            if not tf.executing_eagerly():
                # A trace keeps this path whatever `n` is set to later: stop
                # it from running once `n` is no longer 1.
                self._self_bypass_traced = True
                still_one = [
                    tf.debugging.assert_equal(
                        self._self_n_variable.value(),
                        tf.constant(1, tf.int64),
                        message=(
                            "gradaccum: this function was traced with n=1, which "
                            "hands gradients straight to the wrapped optimizer, "
                            "but `n` has changed since; trace it anew."
                        ),
                    )
                ]
            with tf.control_dependencies(still_one):
                self._self_adapter.apply(
                    grads, trainable_variables, **self._self_apply_options
                )
            return
        self._refresh_seen()
        state = self._self_state
        self._check_unmet(lambda: state.micro_step.value() + 1 >= self._current_n())
        self._accumulate(grads, indices, weight)
        count = state.micro_step.value() + 1
        self._finish_cycle_if(count >= self._current_n(), count)

    def flush(self) -> None:
        """Applies what the current cycle holds now, if it holds anything.

        The update is the (weighted) mean over the micro-batches actually
        accumulated (or their sum, for `reduction="sum"`); the cycle then
        starts afresh. With an empty cycle nothing changes. Usable eagerly
        and inside `tf.function`.
        """
        core = self._self_core
        if core is not self:
            return core.flush()
        if self._self_state is None:
            return
        self._refresh_seen()
        if not self._self_seen:
            return
        strategy = self._self_adapter.strategy()
        in_replica = tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()
        if strategy.num_replicas_in_sync > 1 and not in_replica:
            # Each replica flushes its own share, as on a micro-step.
            with strategy.scope():
                strategy.run(self._flush_here)
            return
        self._flush_here()

    def _flush_here(self) -> None:
        count = self._self_state.micro_step.value()
        self._check_unmet(lambda: count > 0)
        self._finish_cycle_if(count > 0, count)

    def _refresh_seen(self) -> None:
        """After a restore: variables holding gradients take part again.

        Which variables take part is known from the gradients this object
        has seen; state restored from a checkpoint or file may hold sums for
        variables that have had no gradient here yet. Reads the accumulators
        once (eagerly, also while tracing).
        """
        state = self._self_state
        if not state._restored:
            return
        state._restored = False
        with tf.init_scope():
            for i, acc in enumerate(state.accumulators):
                if i not in self._self_seen and bool(
                    tf.reduce_any(tf.not_equal(tf.convert_to_tensor(acc), 0)).numpy()
                ):
                    self._self_seen.add(i)

    def _through_wrapper(
        self, weight: Any, call: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Calls the loss-scale optimizer, handing `weight` to the core."""
        self._self_core._self_pending_weight = _check_weight(weight)
        try:
            return call(*args, **kwargs)
        finally:
            self._self_core._self_pending_weight = None

    def _accumulate(self, grads: list[Any], indices: list[int], weight: Any) -> None:
        """Adds one micro-step's (weighted) gradients to the accumulators.

        In place, or into new tensors in skip mode with zero buffers (see
        `gradaccum.skipping`).
        """
        state = self._self_state
        into_new = self._self_zeros is not None
        if weight is not None:
            self._self_weighted = True
            weight = tf.cast(weight, tf.float32)
        for g, i in zip(grads, indices):
            if g is None:
                continue
            acc = state.accumulators[i]
            w = None if weight is None else tf.cast(weight, acc.dtype)
            if isinstance(g, tf.IndexedSlices):
                values = tf.cast(g.values, acc.dtype)
                values = values if w is None else values * w
                _local_copy(acc).scatter_add(
                    tf.IndexedSlices(values, g.indices, g.dense_shape)
                )
            else:
                g = tf.cast(g, acc.dtype)
                g = g if w is None else g * w
                if into_new:
                    acc.assign(acc.value() + g, read_value=False)
                else:
                    acc.assign_add(g)
            self._self_seen.add(i)
        state.weight_total.assign_add(tf.constant(1.0) if weight is None else weight)

    def _finish_cycle_if(self, keep_new: tf.Tensor, count: tf.Tensor) -> None:
        """Runs the update (masked or skipped); on `keep_new`, keeps it and clears the cycle.

        On the apply step each accumulator is divided where it is (for
        `"mean"`) and the update reads the accumulators themselves: no
        second copy of the accumulated gradients is allocated (see
        `_divide_in_place`). Masked, an in-between step's update reads the
        undivided sums; its result is discarded anyway. Skipped with zero
        buffers, see `_skip_and_clear`.
        """
        adapter = self._self_adapter
        state = self._self_state
        included = sorted(i for i in self._self_seen if i < len(state.accumulators))
        self._check_left_out(keep_new, included)
        accumulators = [state.accumulators[i] for i in included]
        variables = [self._self_variables[i] for i in included]
        written = [adapter.model_variable(v) for v in variables]
        cleared = accumulators + [state.weight_total]
        options = self._self_apply_options

        def apply(values: list[tf.Tensor]) -> None:
            grads = [tf.cast(g, tf.as_dtype(v.dtype)) for g, v in zip(values, variables)]
            adapter.apply_accumulated(grads, variables, **options)

        def read(accumulators: list[tf.Variable]) -> list[tf.Tensor]:
            # In replica context: each replica reads its own accumulators.
            # `read_value()`, not `value()`: under MultiWorkerMirroredStrategy
            # the gradient all-reduce needs a read placed on the variable's
            # device. Either read shares the variable's buffer.
            return [a.read_value() for a in accumulators]

        def apply_accumulated() -> None:
            apply(read(accumulators))

        if self._self_zeros is not None:
            self._skip_and_clear(keep_new, read(accumulators), cleared, apply)
        elif self._self_mode == "skip":

            def apply_and_clear(keep_new: tf.Tensor) -> None:
                divisor = self._mean_divisor()
                if divisor is not None:
                    _divide_in_place(accumulators, divisor())
                apply_accumulated()
                # `keep_new` is True here: its negation is a run-time zero.
                _zero(cleared, tf.logical_not(keep_new), after=written)

            # `keep_new` as an argument: it is a per-replica input.
            _skipped_update(keep_new, apply_and_clear, keep_new)
        else:
            divisor = self._mean_divisor()
            if divisor is not None:
                _divide_if(keep_new, accumulators, divisor)
            tracked = adapter.state_variables()
            # Every variable the optimizer was built for, not only those in
            # this update: with `ema_overwrite_frequency` Keras overwrites all
            # of them with their moving averages, gradient or not.
            tracked += [adapter.model_variable(v) for v in self._self_variables]
            _masked_update(
                adapter.strategy(),
                keep_new,
                tracked,
                apply_accumulated,
                masks_writes=adapter.masks_writes,
            )
            _zero_if(keep_new, cleared, after=written)
        state.micro_step.assign(_select(keep_new, tf.zeros_like(count), count))

    def _skip_and_clear(
        self,
        keep_new: tf.Tensor,
        values: list[tf.Tensor],
        cleared: list[tf.Variable],
        apply: Callable[[list[tf.Tensor]], None],
    ) -> None:
        """Skip mode with zero buffers (see `gradaccum.skipping`).

        The update takes `values`, reads of the accumulators, as inputs of
        its branch and `apply`s their quotients, new tensors that its own
        arithmetic can write into; then `cleared` are pointed at zeros.
        """
        divisor = self._mean_divisor()
        # Read here, not in the branch: a branch that reads the weight total
        # would make the clearing below wait for the whole update.
        inputs = [values] if divisor is None else [values, divisor()]

        def apply_sums(values: list[tf.Tensor], divisor: tf.Tensor | None = None) -> None:
            apply(values if divisor is None else _quotients(values, divisor))

        _skipped_update(keep_new, apply_sums, *inputs)
        _cleared_if(keep_new, cleared, self._self_zeros)

    def _check_unmet(self, ends_cycle: Callable[[], tf.Tensor]) -> None:
        """Refuses to end a cycle without restored sums it cannot hold yet.

        A checkpoint of an optimizer that grew (see `build`) may hold
        accumulators for variables that an optimizer restored from it has
        not met yet: their restore waits until they are added, and an update
        before then would leave their accumulated gradients out. Raises
        eagerly if `ends_cycle()`; while tracing, always (a traced step that
        has not met them never will, and an assertion in the graph would not
        stop the step's writes).
        """
        unmet = sorted(i for i in self._self_seen if i >= len(self._self_variables))
        if not unmet:
            return
        message = (
            "The restored accumulation state holds gradients for "
            f"variables at positions {unmet}, which this optimizer has not "
            f"met yet (it holds {len(self._self_variables)}); an update now "
            "would leave them out. Build the optimizer with all variables, in "
            "the order the saved one met them, before its first step after "
            "the restore: `opt.build(model.trainable_variables)`."
        )
        if not tf.executing_eagerly() or bool(ends_cycle()):
            raise ValueError(message)

    def _check_left_out(self, keep_new: tf.Tensor, included: list[int]) -> None:
        """Refuses to drop gradients a traced step cannot see.

        Which variables take part in an update is decided while a step is
        traced, from the variables that have received gradients so far. A
        `tf.function` traced before some variable first received a gradient
        (for example one trace per task in multi-task training) leaves it out;
        if it then runs an apply step while that variable has accumulated
        gradients, they would be neither applied nor cleared. That raises
        instead. Eager steps always see every variable.
        """
        if tf.executing_eagerly():
            return
        left_out = [i for i in range(len(self._self_variables)) if i not in self._self_seen]
        if not left_out:
            return
        accumulators = self._self_state.accumulators
        pending = tf.reduce_any(
            tf.stack([tf.reduce_any(tf.not_equal(accumulators[i], 0)) for i in left_out])
        )
        names = [getattr(self._self_variables[i], "path", str(i)) for i in left_out]
        tf.debugging.Assert(
            tf.logical_not(tf.logical_and(keep_new, pending)),
            [
                "gradaccum: this traced step was traced before variables "
                f"{names} first received gradients, and leaves them out of the "
                "update, but they hold accumulated gradients now. Trace every "
                "step after each variable has received a gradient once (for "
                "example run one step per task eagerly first), or trace this "
                "step anew (a new tf.function)."
            ],
        )

    def _mean_divisor(self) -> Callable[[], tf.Tensor] | None:
        """What the accumulated sum is divided by (None for `"sum"`).

        Unweighted, each replica divides its sum by its own micro-batch count
        and the wrapped optimizer's all-reduce adds the replicas' shares, as
        in plain training. Weighted, the divisor is the weight total over all
        replicas (one scalar all-reduce) divided by the replica count, since
        Keras already scales every replica's loss by 1 / replicas.

        Returns a function that gives the divisor, to be called where it is
        needed (inside the branch that divides); the all-reduce, which must
        not run inside a branch, runs here, unconditionally.
        """
        if self._self_reduction == "sum":
            return None
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        context = tf.distribute.get_replica_context()
        total = None
        if self._self_weighted and replicas > 1 and context is not None:
            total = context.all_reduce(
                tf.distribute.ReduceOp.SUM, self._self_state.weight_total.value()
            ) / float(replicas)

        def divisor() -> tf.Tensor:
            t = self._self_state.weight_total.value() if total is None else total
            # An empty (or zero-weight) cycle applies nothing: avoid 0 / 0.
            return tf.where(t > 0, t, tf.ones_like(t))

        return divisor

    def __repr__(self) -> str:
        position = "?"
        if tf.executing_eagerly():
            position = str(int(self.micro_step.numpy()))
        return (
            f"<AccumulatingOptimizer n={self.n} "
            f"reduction={self.reduction!r} mode={self.mode!r} micro_step={position} "
            f"wrapping {self.__wrapped__!r}>"
        )


def accumulate(
    optimizer: keras.optimizers.Optimizer | None = None,
    n: int | Callable[[tf.Tensor], Any] | None = None,
    *,
    reduction: str = "mean",
    mode: str = "masked",
) -> AccumulatingOptimizer | Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives an optimizer gradient accumulation over `n` micro-batches.

    ```python
    opt = accumulate(keras.optimizers.Adam(1e-3), n=4)
    AccAdam = accumulate(n=4)(keras.optimizers.Adam)   # decorator form
    ```

    Args:
        optimizer: A Keras optimizer instance. Omit it to get a decorator for
            an optimizer class or factory function.
        n: Micro-batches per applied update: an int >= 1, or a schedule (a
            callable of the applied-update count returning the int for the next
            cycle, written with TensorFlow ops; see `AccumulatingOptimizer`).
        reduction: `"mean"` (default) applies the mean of the micro-batch
            gradients, as training on the large batch with a mean-reduced loss
            does; `"sum"` applies their sum (for sum-reduced losses). Weighted
            micro-batches (`apply_gradients(..., weight=w)`) give the weighted
            mean or sum.
        mode: `"masked"` (default) runs the wrapped optimizer's update on
            every micro-step and keeps its result only on the apply step,
            with no branch around it: every micro-step runs the same
            operations, including the optimizer's replica synchronisation.
            `"skip"` runs the update only on the apply step (a `tf.cond`
            decided in cross-replica context, so it works under
            `MirroredStrategy`): in-between micro-steps cost only the
            accumulation. Both give the same result.

    Returns:
        An `AccumulatingOptimizer` around the very `optimizer` passed in, or,
        without `optimizer`, a decorator whose result builds one per call.

    Raises:
        TypeError: If `n` is missing or neither an int nor a callable, or
            `optimizer` is not a Keras optimizer.
        ValueError: If `n < 1`, `reduction` or `mode` is unknown, or
            `optimizer` already accumulates gradients.
    """
    if n is None:
        raise TypeError(
            "accumulate() requires `n`, the number of micro-batches per update."
        )
    n = _check_n_or_schedule(n)
    reduction = _check_reduction(reduction)
    mode = _check_mode(mode)
    if optimizer is not None:
        return AccumulatingOptimizer(optimizer, n, reduction=reduction, mode=mode)

    def decorator(factory: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(factory):
            raise TypeError(
                "accumulate(n=...) decorates an optimizer class or factory "
                f"function. Received: {factory!r} of type "
                f"{type(factory).__name__}."
            )

        @functools.wraps(factory, updated=())
        def make(*args: Any, **kwargs: Any) -> AccumulatingOptimizer:
            return AccumulatingOptimizer(
                factory(*args, **kwargs), n, reduction=reduction, mode=mode
            )

        return make

    return decorator


_install_keras_serialization(AccumulatingOptimizer)
