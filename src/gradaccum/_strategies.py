"""Cycle strategies: how a micro-step adds, and how a cycle ends.

One strategy is chosen per optimizer, once, when its state is built
(`choose`), from the `mode` and what the optimizer family allows:

- `Masked` (`mode="masked"`): every micro-step runs the wrapped optimizer's
  update and keeps its effect only on the apply step, with no branch around
  it (`updates.masked_update`). The accumulators are added into in place and,
  on the apply step, divided in place, so the update reads them directly.
- `Skipped` (`mode="skip"`, optimizers that grow): the update runs only on
  apply steps (`updates.skipped_update`), and inside that branch the
  accumulators are divided in place and applied.
- `SkippedIntoNew` (`mode="skip"`, every other optimizer): the update runs
  only on apply steps too, taking the path through memory that Keras's own
  `gradient_accumulation_steps` takes, so that it costs what that costs:
  each micro-step adds into a new tensor (`acc = acc + g`, which may take
  over the gradient's buffer) instead of in place; the update's branch
  takes reads of the accumulators (and the weight total) as inputs instead
  of reading them itself, since a branch that touches a variable waits for
  every earlier write to it; and it divides them into new tensors its own
  arithmetic can write into (`tensors.quotients`). Memory is about what
  Keras's option takes: the accumulators, and while a micro-step adds,
  each new sum next to the old one. Where the gradients are added in place
  (weighted, as `fit` weighs them, or scaled for the mean), the step that
  ends a cycle hands the sums over instead (`tensors.add_into` with
  `hand_over`): each accumulator takes its micro-gradient's buffer, so
  the update receives sums that nothing else holds and can write into, as
  it can into Keras's temporary `g + acc`. Measured on MLP SGD B=8 in
  graph mode, where SGD's `lr * grad` then writes in place instead of
  allocating: 0.975 [0.950-0.988] of the time per micro-step without.

No strategy clears the accumulators (or the weight total) when a cycle
ends, except for optimizers that grow: a cycle's first micro-step writes
its gradients over whatever they hold (`tensors.add_into`, `max_into`,
`add_scalar`), and zeroes the other accumulators it knows of. An
optimizer that grows (`OptimizerFamily.grows`) may have accumulators that
a traced step was traced before, which it cannot zero; so for those the
update still zeroes the accumulators it applied (`clears_at_end`). Under XLA a
clearing after the update, which reads the sums inside a `tf.cond`, made
XLA copy every accumulator on every micro-step (4.2M elements: 7.0-7.5 ms
per in-between step, against 2.3-3.1 ms this way and 2.5-2.9 ms for the
add alone); elsewhere it was a pass over the accumulators once per cycle.
So between cycles (`micro_step == 0`) the raw accumulators hold the last
cycle's sums (divided, where the mode divides in place), or, where skip
mode handed the sums over, the last micro-gradients: what is seen of
them (`State.settle`) and saved in Keras files is zeros, and checkpoints,
which hold the raw values, restore them into any mode, since every mode
overwrites on the first micro-step. Kept slices (`sparse="slices"`) are
still emptied when a cycle ends: they grow with every micro-step.

Sums held at the scale of their mean. Dividing the sums for the mean is a
pass over all of them once per cycle, which profiles showed as the one pass
skip mode made beyond Keras's own option (Keras divides by a constant,
which TensorFlow folds into the update's first multiply). So every strategy
holds a cycle's sums multiplied by `State.scale`: the reciprocal of the
last cycle's divisor where that is a power of two, else 1. Each
micro-gradient's weight is multiplied by it as it is added (no extra pass),
and a cycle whose divisor equals the last one's ends holding its mean and
divides nothing; any other divides by `divisor * scale`. Scaling by a power
of two is exact, so the mean is bit for bit the same either way, except
for micro-gradient elements within a factor of the divisor of float32's
smallest normal number (about 1e-38), which TensorFlow's CPU kernels flush
to zero one micro-step earlier. The scale changes only when a cycle ends,
and is the same on every replica (the divisor is). What is seen eagerly
and saved in Keras files are the plain sums (`State.unscale`).

All three give the same results (tested).

Variables Keras marks `overwrite_with_gradient` (float8 scales and amax
histories) are not averaged: their "gradient" is their new value, and, as
under Keras's own `gradient_accumulation_steps`, a cycle keeps the
elementwise maximum of its values (`State.keeps_maximum`), which the apply
step writes undivided.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import tensorflow as tf

from gradaccum._agc import AdaptiveClipping
from gradaccum._backend.tensorflow import distribution, tensors, updates
from gradaccum._family import OptimizerFamily
from gradaccum._state import State


class CycleStrategy:
    """What every strategy shares: adding, the mean's divisor, applying.

    Args:
        state: The accumulation state (built).
        family: The wrapped optimizer's family.
        reduction: `"mean"` or `"sum"`.
    """

    # Whether a dense micro-gradient is added into a new tensor.
    into_new = False
    # Whether `add` returns the sums it leaves, handed over on the step that
    # ends a cycle (see `tensors.add_into`), for `finish_if` to apply.
    hands_over_sums = False

    def __init__(
        self,
        state: State,
        family: OptimizerFamily,
        reduction: str,
        agc: AdaptiveClipping | None = None,
    ):
        self.state = state
        self.family = family
        self.reduction = reduction
        # `sparse="slices"`: `tf.IndexedSlices` are kept, not added into rows.
        self.keeps_slices = state.sparse_slices
        # Adaptive gradient clipping of each whole update, or None.
        self.agc = agc
        # Whether any micro-batch was given a weight (decided while tracing).
        self.weighted = False
        # Whether the end of a cycle zeroes the accumulators it applied (see
        # the module docstring).
        self.clears_at_end = family.grows

    def add(
        self, grads: Sequence[Any], indices: Sequence[int], weight: Any, ends: tf.Tensor
    ) -> dict[int, tf.Tensor] | None:
        """Adds one micro-step's (weighted) gradients to the accumulators;
        on a cycle's first micro-step, writes them over what the
        accumulators hold (see the module docstring).

        Args:
            grads: The micro-batch's gradients (None, dense or
                `tf.IndexedSlices`).
            indices: Their variables' indices in the state.
            weight: The micro-batch's weight (a scalar), or None.
            ends: Scalar boolean tensor: this micro-step ends the cycle.

        Returns:
            With `hands_over_sums`, the sums of the accumulators a dense
            gradient was added into, by index, for `finish_if`; else None.
        """
        state = self.state
        if weight is not None:
            self.weighted = True
            weight = tf.cast(weight, tf.float32)
        # Each contribution at the scale the sums are held at (see the module
        # docstring): the weight times a power of two, exact.
        scaled = weight
        if self.reduction == "mean":
            scale = state.scale.value()
            scaled = scale if weight is None else weight * scale
        first = tf.equal(state.micro_step.value(), 0)
        given = set()
        dense: tuple[list[tf.Variable], list[Any]] = ([], [])
        dense_indices = []
        for g, i in zip(grads, indices):
            if g is None:
                continue
            if state.keeps_maximum(i):
                # A weight scales a contribution to a mean or a sum; a
                # maximum has none to scale.
                tensors.max_into(state.accumulators[i], g, first)
            elif self.keeps_slices and isinstance(g, tf.IndexedSlices):
                tensors.append_slices(*state.slice_buffers(i), g, scaled)
            elif isinstance(g, tf.IndexedSlices):
                tensors.scatter_into(state.accumulators[i], g, scaled, first)
            else:
                if self.keeps_slices and state.keeps_slices(i):
                    _refuse_mixed(state.variables[i])
                dense[0].append(state.accumulators[i])
                dense[1].append(g)
                dense_indices.append(i)
            given.add(i)
            state.take_part(i)
        hand_over = ends if self.hands_over_sums else None
        sums = tensors.add_into(*dense, scaled, self.into_new, first, hand_over)
        # Every other accumulator: the last cycle's sums must not count in
        # this one. Not only those of variables taking part when this step
        # was traced: another trace may have made more take part since.
        missing = [a for i, a in enumerate(state.accumulators)
                   if i not in given and not state.keeps_slices(i)]
        if missing:
            tensors.zero_if(first, missing)
        tensors.add_scalar(state.weight_total, tf.constant(1.0) if weight is None else weight, first)
        return None if sums is None else dict(zip(dense_indices, sums))

    def finish_if(
        self,
        keep_new: tf.Tensor,
        included: list[int],
        options: Mapping[str, Any],
        sums: Mapping[int, tf.Tensor] | None = None,
    ) -> None:
        """Runs the update of `included` variables; keeps it on `keep_new`.

        Args:
            keep_new: Scalar boolean tensor: this micro-step ends the cycle.
            included: Indices of the variables taking part.
            options: The wrapped optimizer's extra `apply_gradients`
                arguments (see `OptimizerFamily.apply_options`).
            sums: What `add` returned this micro-step, if anything: sums
                to apply in place of reads of their accumulators.
        """
        total = self.total()
        # Exact: the scale is a power of two.
        divisor = None if total is None else total * self.state.scale.value()
        self.finish_with(keep_new, included, options, divisor, sums or {})
        if total is not None:
            self._rescale_if(keep_new, total)

    def finish_with(
        self,
        keep_new: tf.Tensor,
        included: list[int],
        options: Mapping[str, Any],
        divisor: tf.Tensor | None,
        sums: Mapping[int, tf.Tensor],
    ) -> None:
        """`finish_if`, where `divisor` is what the held sums are divided by
        for the mean (None for `"sum"`); 1 where they hold it already."""
        raise NotImplementedError

    # ------------------------------------------------------------------
    # Shared pieces.

    def total(self) -> tf.Tensor | None:
        """The mean's divisor, the weight total (None for `"sum"`).

        Unweighted, each replica divides its sum by its own micro-batch count
        and the wrapped optimizer's all-reduce adds the replicas' shares, as
        in plain training. Weighted, the divisor is the weight total over all
        replicas (one scalar all-reduce) divided by the replica count, since
        Keras already scales every replica's loss by 1 / replicas.

        Read once per micro-step, after the micro-step's add and outside any
        branch: the all-reduce must not run inside one, and the branches
        that divide take it as an input.
        """
        if self.reduction == "sum":
            return None
        t = self.state.weight_total.value()
        replicas = distribution.replicas_in_sync()
        if self.weighted and replicas > 1:
            t = distribution.sum_over_replicas(t) / float(replicas)
        # An empty (or zero-weight) cycle applies nothing: avoid 0 / 0.
        return tf.where(t > 0, t, tf.ones_like(t))

    def _rescale_if(self, keep_new: tf.Tensor, t: tf.Tensor) -> None:
        """On `keep_new`, sets the scale of the next cycle's sums: the
        reciprocal of this cycle's divisor `t` if that is a power of two of
        at least 1 (a smaller one would scale up, towards overflow), else 1."""
        usable = tf.logical_and(t >= 1.0, tensors.is_power_of_two(t))
        following = tf.where(usable, tf.math.reciprocal(t), tf.ones_like(t))
        scale = self.state.scale
        scale.assign(tensors.select(keep_new, following, scale.value()), read_value=False)

    def _pieces(self, included: list[int]) -> tuple[list[tf.Variable], list[tf.Variable], list[Any]]:
        """The included accumulators, those of them the mean divides (not
        maxima), and their variables."""
        state = self.state
        accumulators = [state.accumulators[i] for i in included]
        divided = [state.accumulators[i] for i in included if not state.keeps_maximum(i)]
        variables = [state.variables[i] for i in included]
        return accumulators, divided, variables

    def with_slices(self, values: list[Any], included: list[int], divisor: Any) -> list[Any]:
        """`values`, with each variable's that keeps slices replaced by its
        cycle's slices divided by `divisor` (a tensor, or None): one
        `tf.IndexedSlices`, as the large batch would hand the optimizer."""
        state = self.state
        out = list(values)
        for k, i in enumerate(included):
            if state.keeps_slices(i):
                kept = state.slice_buffers(i)
                out[k] = tensors.kept_slices(*kept, state.variables[i].shape, divisor)
        return out

    def apply(self, values: Sequence[tf.Tensor], variables: Sequence[Any], options: Mapping[str, Any]) -> None:
        """The wrapped optimizer's update with the accumulated `values`."""
        grads = [tf.cast(g, tf.as_dtype(v.dtype)) for g, v in zip(values, variables)]
        deliver(self.family, self.agc, grads, variables, options)


def deliver(
    family: OptimizerFamily,
    agc: AdaptiveClipping | None,
    grads: Sequence[Any],
    variables: Sequence[Any],
    options: Mapping[str, Any],
) -> None:
    """Hands a whole update's gradients to the wrapped optimizer.

    Clips them first as one device training on the large batch would: AGC
    (if set) on the gradient summed over replicas, then, under several
    replicas where the optimizer would clip each replica's share, its own
    clipping of that sum (see `distribution.clip_as_one_device`). Used for
    the accumulated mean, and with `n=1` for the gradients as they come.
    """
    grads = list(grads)
    replicas = distribution.replicas_in_sync()
    clip = family.replica_clip() if replicas > 1 else None
    if agc is None and clip is None:
        family.apply(grads, variables, options)
        return
    scale = family.gradient_scale()

    def clip_sum(summed: list[Any]) -> list[Any]:
        if agc is not None:
            summed = agc.clip(summed, variables, scale)
        return summed if clip is None else clip(summed)

    if replicas > 1:
        grads = distribution.clip_as_one_device(grads, clip_sum)
    else:
        grads = clip_sum(grads)
    family.apply(grads, variables, options)


def _refuse_mixed(variable: Any) -> None:
    name = getattr(variable, "path", None) or getattr(variable, "name", repr(variable))
    raise ValueError(
        f"With sparse=\"slices\", variable {name!r} received a dense gradient "
        "after tf.IndexedSlices: a variable's gradients must be of one kind "
        "(each traced step decides it). Use sparse=\"rows\" (the default), "
        "which adds both kinds into one accumulator."
    )


def _read(accumulators: Sequence[tf.Variable]) -> list[tf.Tensor]:
    # In replica context: each replica reads its own accumulators.
    # `read_value()`, not `value()`: under MultiWorkerMirroredStrategy the
    # gradient all-reduce needs a read placed on the variable's device.
    # Either read shares the variable's buffer.
    return [a.read_value() for a in accumulators]


class Masked(CycleStrategy):
    """Branch-free: the update runs on every micro-step, kept on apply steps.

    On the apply step each accumulator is divided where it is (for
    `"mean"`) and the update reads the accumulators themselves: no second
    copy of the accumulated gradients is allocated (see
    `tensors.divide_in_place`). An in-between step's update reads the
    undivided sums; its result is discarded anyway.
    """

    def finish_with(
        self,
        keep_new: tf.Tensor,
        included: list[int],
        options: Mapping[str, Any],
        divisor: tf.Tensor | None,
        sums: Mapping[int, tf.Tensor],
    ) -> None:
        accumulators, divided, variables = self._pieces(included)
        family = self.family
        if divisor is not None:
            tensors.divide_if(keep_new, divided, divisor)
        # Every variable the optimizer was built for, not only those in this
        # update: with `ema_overwrite_frequency` Keras overwrites all of them
        # with their moving averages, gradient or not.
        tracked = family.state_variables()
        tracked += [family.model_variable(v) for v in self.state.variables]
        per_variable = None
        if family.per_variable_update is not None:
            per_variable = (family.optimizer, family.per_variable_update)
        updates.masked_update(
            family.strategy(),
            keep_new,
            tracked,
            lambda: self.apply(
                self.with_slices(_read(accumulators), included, divisor),
                variables,
                options,
            ),
            masks_writes=family.masks_writes,
            per_variable=per_variable,
        )
        if self.clears_at_end:
            tensors.zero_if(keep_new, accumulators)
        tensors.clear_slices_if(keep_new, self.state.kept_buffers(included))


class Skipped(CycleStrategy):
    """The update runs only on apply steps; the accumulators are divided in
    place, applied and (for optimizers that grow) zeroed inside its branch."""

    def finish_with(
        self,
        keep_new: tf.Tensor,
        included: list[int],
        options: Mapping[str, Any],
        divisor: tf.Tensor | None,
        sums: Mapping[int, tf.Tensor],
    ) -> None:
        accumulators, divided, variables = self._pieces(included)

        def divide_and_apply(keep_new: tf.Tensor, divisor: tf.Tensor | None = None) -> None:
            if divisor is not None:
                tensors.divide_in_place(divided, divisor)
            values = self.with_slices(_read(accumulators), included, divisor)
            self.apply(values, variables, options)
            if self.clears_at_end:
                # `keep_new` is True here: its negation is a run-time zero.
                tensors.zero(accumulators, tf.logical_not(keep_new))
            tensors.clear_slices(self.state.kept_buffers(included))

        # `keep_new` and the divisor as arguments: they are per-replica inputs.
        inputs = [keep_new] if divisor is None else [keep_new, divisor]
        updates.skipped_update(keep_new, divide_and_apply, *inputs)


class SkippedIntoNew(CycleStrategy):
    """Skip mode along Keras's own path through memory (module docstring)."""

    into_new = True
    hands_over_sums = True

    def finish_with(
        self,
        keep_new: tf.Tensor,
        included: list[int],
        options: Mapping[str, Any],
        divisor: tf.Tensor | None,
        sums: Mapping[int, tf.Tensor],
    ) -> None:
        accumulators, _, variables = self._pieces(included)
        maxima = [self.state.keeps_maximum(i) for i in included]
        # Read here (or as `add` left them, handed over) and handed to the
        # branch (see the module docstring).
        # Only the rest are read: a handed-over accumulator now holds its
        # micro-gradient.
        values = [sums[i] if i in sums else _read([a])[0] for i, a in zip(included, accumulators)]
        inputs = [values] if divisor is None else [values, divisor]

        def apply_sums(values: list[tf.Tensor], divisor: tf.Tensor | None = None) -> None:
            if divisor is not None:
                sums = [v for v, m in zip(values, maxima) if not m]
                quotients = iter(tensors.quotients(sums, divisor) if sums else [])
                values = [v if m else next(quotients) for v, m in zip(values, maxima)]
            self.apply(self.with_slices(values, included, divisor), variables, options)

        updates.skipped_update(keep_new, apply_sums, *inputs)
        tensors.clear_slices_if(keep_new, self.state.kept_buffers(included))


def choose(
    mode: str,
    state: State,
    family: OptimizerFamily,
    reduction: str,
    agc: AdaptiveClipping | None = None,
) -> CycleStrategy:
    """The strategy for `mode` on this optimizer (see the module docstring)."""
    if mode == "masked":
        return Masked(state, family, reduction, agc)
    if not family.grows:
        return SkippedIntoNew(state, family, reduction, agc)
    return Skipped(state, family, reduction, agc)
