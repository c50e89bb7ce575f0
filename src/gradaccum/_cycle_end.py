"""The end of a cycle: its update, handed to the backend, and its delivery.

`end_cycle` decides which variables the cycle's update involves (those that
took part in the cycle, see docs/ARCHITECTURE.md), the mean's divisor, and hands the
backend the update (`gradaccum._backend.Update`), which runs so that it
takes effect only on the step that ends the cycle. The update's gradients
reach the wrapped optimizer through `deliver`, which clips them as one
device training on the large batch would.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from keras import ops

from gradaccum import _compensated
from gradaccum._backend import Update
from gradaccum._state import variable_name


def end_cycle(core: Any, ends: Any, steps: Any, took_part: set[int] | None) -> None:
    """Hands the backend `core`'s cycle update, to take effect if `ends`
    (after the cycle of `steps` micro-steps is measured, if the noise
    scale is: before the update divides the accumulators).

    The update involves only the variables that took part in the cycle,
    as the large batch's: decided here where that is known on the host;
    elsewhere, those that did not take part in this micro-step (all, for
    `flush`: `took_part` is None) are left out at run time by the
    backend, if it can (`Backend.masks_each`).
    """
    backend, state = core.backend, core.state
    in_update = state.may_take_part()
    in_cycle = state.position.took_part()
    if in_cycle is not None:
        in_update = [i for i in in_update if i in in_cycle]
    state.check_never_took_part(ends)
    conditions = {}
    undecided = [k for k, i in enumerate(in_update) if took_part is None or i not in took_part]
    if undecided and in_cycle is None:
        if state.took_part is not None and backend.masks_each(core.family):
            conditions = {k: state.position.took_part_in_cycle(in_update[k]) for k in undecided}
        elif state.took_part is not None and backend.known(ends):  # eager: read which took part
            flags = backend.saved(state.took_part, False)
            in_update = [i for k, i in enumerate(in_update) if k not in undecided or flags[i] > 0]
        elif took_part is not None:  # traced on JAX, or a tf_keras optimizer
            _warn_undecided(core, [state.variables[in_update[k]] for k in undecided])
    divisor = _divisor(core)
    variables = [state.variables[i] for i in in_update]
    kept = {k: state.kept[i] for k, i in enumerate(in_update) if i in state.kept}

    # A compensated sum is `a - c` (`gradaccum._compensated`): divided here
    # in float32, not in place in bfloat16.
    compensated = {k: state.compensations[i] for k, i in enumerate(in_update) if state.compensated(i)}

    def apply(values: list[Any], divisor: Any = divisor, masking: Any = None) -> None:
        # `divisor`: a skipped update's branch input on TensorFlow;
        # `masking`: when the update's writes take effect (`Update.apply`).
        values = list(values)
        for k, compensation in compensated.items():
            total = ops.cast(values[k], "float32") - ops.cast(backend.read(compensation), "float32")
            values[k] = total if divisor is None else total / ops.cast(divisor, "float32")
        grads = [ops.cast(v, w.dtype) for v, w in zip(values, variables)]
        for k, held in kept.items():
            sliced = backend.kept_slices(held, divisor)
            grads[k] = grads[k] if sliced is None else sliced
        deliver(core, grads, variables, core.options, masking)

    accumulators = [state.accumulators[i] for i in in_update]
    update = Update(
        ends=ends,
        accumulators=accumulators,
        divided=[not state.keeps_maximum(i) and not state.compensated(i) for i in in_update],
        divisor=divisor,
        apply=apply,
        family=core.family,
        variables=state.variables,
        took_part=variables,
        conditions=conditions,
    )
    if state.noise is not None:

        def sums() -> list[Any]:
            return [_held(backend, state, i) for i in range(len(state.accumulators)) if not state.keeps_maximum(i)]

        state.noise.measure(ends, steps, sums, state.weight_total)
    backend.finish(update, core.settings.mode)
    if core.family.grows:
        # A step traced before an accumulator was added cannot zero it on
        # a cycle's first micro-step; the end of a cycle does instead.
        backend.tensors.zero_if(ends, accumulators)


def _held(backend: Any, state: Any, i: int) -> Any:
    """What variable `i`'s cycle has summed so far, on this replica: its
    accumulator, or its kept slices (whose accumulator stays empty)."""
    if state.keeps_slices(i):
        slices = backend.kept_local(state.kept[i])
        if slices is not None:
            return slices
    if state.compensated(i):
        return _compensated.held(backend, state.accumulators[i], state.compensations[i])
    return backend.read(state.accumulators[i])


def deliver(
    core: Any, grads: Sequence[Any], variables: Sequence[Any], options: Mapping[str, Any], masking: Any = None
) -> None:
    """Hands a whole update's gradients to the wrapped optimizer.

    Clips them first as one device training on the large batch would: AGC
    (if set) on the gradient summed over replicas and unscaled, then, under
    several replicas where the optimizer would clip each replica's share,
    its own clipping of that sum. Used for the accumulated mean, and with
    `n=1` for the gradients as they come.
    """
    grads = list(grads)
    family, agc, backend = core.family, core.agc, core.backend
    replicas = backend.replicas.count()
    clip = family.replica_clip() if replicas > 1 else None
    if agc is not None or clip is not None:
        scale = family.gradient_scale()

        def clip_sum(summed: list[Any]) -> list[Any]:
            if agc is not None:
                summed = agc.clip(summed, variables, scale)
            return summed if clip is None else clip(summed)

        grads = backend.replicas.clip_as_one_device(grads, clip_sum) if replicas > 1 else clip_sum(grads)
    family.apply(grads, variables, options, masking)


def _divisor(core: Any) -> Any:
    """The mean's divisor, the weight total (None for `"sum"`).

    Unweighted, each replica divides its sum by its own micro-batch count
    and the wrapped optimizer's all-reduce adds the replicas' shares, as
    in plain training. Weighted, the divisor is the weight total over all
    replicas (one scalar all-reduce) divided by the replica count, since
    Keras already scales every replica's loss by 1 / replicas. Read
    outside any branch: the all-reduce must not run inside one.
    """
    if core.settings.reduction == "sum":
        return None
    total = core.backend.read(core.state.weight_total)
    replicas = core.backend.replicas.count()
    if core.weighted and replicas > 1:
        total = core.backend.replicas.sum(total) / float(replicas)
    # An empty (or zero-weight) cycle applies nothing: avoid 0 / 0.
    return ops.where(total > 0, total, ops.ones_like(total))


def _warn_undecided(core: Any, variables: list[Any]) -> None:
    """Warns once per optimizer that variables that did not take part in
    this step get an update even in a cycle they take no part in."""
    if core.warned_undecided:
        return
    core.warned_undecided = True
    warnings.warn(
        f"gradaccum: variables {[variable_name(v) for v in variables]} receive no gradient in "
        "this step. Where they receive none in a whole cycle, the large batch leaves them and "
        f"their optimizer state alone; with this optimizer ({core.family.name}) on this backend "
        "the cycle's update gives them a zero gradient instead, so momentum, Adam's moments and "
        "weight decay still move them. Keras 3 optimizers on TensorFlow and PyTorch leave them "
        "alone.",
        stacklevel=5,
    )
