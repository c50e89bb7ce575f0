"""The gradient noise scale, measured from each cycle's micro-gradients.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
appendix A.1) estimate the true gradient's squared norm |G|² and the trace
of the per-sample gradient covariance tr(Σ) from gradients of two batch
sizes: the expected squared norm of a mean gradient over B samples is
|G|² + tr(Σ) / B. A cycle has both sizes at hand: its micro-batches (each
of weight w_i) and the accumulated mean over all of them (weight W = Σ w_i).
With k micro-batches and

    S = Σ w_i |g_i|²             (added while the gradients are added)
    |G_big|² = |Σ w_i g_i|² / W² (read from the accumulators once per cycle)

E[S / W] = |G|² + k tr(Σ) / W, so the small batch is B_small = W / k (the
mean micro-batch weight; with equal weights S / W is the plain mean of the
|g_i|²) and the big one B_big = W, and the paper's unbiased estimators are

    tr(Σ) ≈ (S - W |G_big|²) / (k - 1)
    |G|²  ≈ (k |G_big|² - S / W) / (k - 1).

Each is smoothed by an exponential moving average over cycles (decay
`noise_decay`), started at 0 and divided by the average's total weight
1 - decay^t after t cycles, as Adam corrects its moments: early on that is
the plain mean of the cycles so far, later the moving average. The noise
scale is their ratio B_simple = tr(Σ) / |G|², in the units of the weights.

Under a `tf.distribute` strategy each replica measures its own micro-batches
(measuring communicates nothing): Keras's `fit` divides each
replica's loss by the replica count R, so its gradients are scaled back by
R. The state is replica-local, read as the sum over replicas: each replica
keeps its estimates divided by R (their sum is the replicas' mean) and its
mean micro-batch weight (their sum is the global micro-batch's). An adaptive
`n` is chosen from those sums, so that every replica chooses the same; each
holds 1/R of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from keras import ops

# The state's scalars, in the order `variables()` lists them.
NAMES = ("square_sum", "gradient_sq", "trace", "norm", "cycles", "batch", "next_n")


class Noise:
    """The noise-scale state of one optimizer and its arithmetic.

    Args:
        backend: The backend's hooks.
        family: The wrapped optimizer's family (where variables are placed).
        decay: The moving averages' decay, in [0, 1).
        schedule: A `gradaccum._adaptive.NoiseScaleSchedule` that chooses
            the next cycle's `n` from the estimates, or None.
    """

    def __init__(self, backend: Any, family: Any, decay: float, schedule: Any = None):
        self._backend = backend
        self._decay = decay
        self.schedule = schedule
        made = {name: backend.scalar_variable(family, f"noise_{name}") for name in NAMES}
        # S of the current cycle (see the module docstring).
        self.square_sum = made["square_sum"]
        # The moving averages of the estimates of |G|² and tr(Σ), and that
        # of 1 (their total weight, 1 - decay^t), which they are divided by.
        self.gradient_sq = made["gradient_sq"]
        self.trace = made["trace"]
        self.norm = made["norm"]
        # Cycles measured: 0 until one has been (then no estimate exists).
        self.cycles = made["cycles"]
        # The mean micro-batch weight of the latest cycle measured.
        self.batch = made["batch"]
        # With a `schedule`, the next cycle's `n` (0 until one is measured).
        self.next_n = made["next_n"]

    def variables(self) -> list[Any]:
        """The state's variables, in the order of `NAMES`."""
        return [self.square_sum, self.gradient_sq, self.trace, self.norm, self.cycles, self.batch, self.next_n]

    def add(self, grads: Sequence[Any], weight: Any, first: Any) -> None:
        """Adds `weight * |g|²` of one micro-step's gradients `grads` to S
        (sets it on a cycle's first micro-step)."""
        self._backend.tensors.add_squared_norm(self.square_sum, list(grads), weight, first)

    def measure(self, ends: Any, steps: Any, sums: Callable[[], list[Any]], weight_total: Any) -> None:
        """Updates the estimates from the cycle that `ends` (if it does):
        `steps` micro-steps, whose weighted sums `sums()` reads (before the
        update divides them; called only where the cycle ends) and whose
        weights sum to `weight_total`. A cycle of one micro-batch has one
        batch size only, and measures nothing."""
        backend = self._backend
        if isinstance(steps, int):  # known on the host: no device read
            if not ends or steps < 2:
                return
            condition: Any = True
        else:
            condition = ops.logical_and(ends, ops.greater_equal(steps, 2))
        replicas = float(backend.replicas.count())
        decay, schedule = self._decay, self.schedule

        def update() -> None:
            total = ops.cast(backend.read(weight_total), "float32")
            k = ops.cast(steps, "float32")
            safe = ops.where(total > 0, total, ops.ones_like(total))
            big = backend.tensors.squared_norm(sums()) / ops.square(safe)
            small = backend.read(self.square_sum) / safe
            # Each replica's gradients are 1/R of its own mean's: scaled back
            # by R², then divided by R, so that the replicas' sum is their mean.
            scale = replicas
            trace = (small - big) * safe / (k - 1.0) * scale
            gradient_sq = (k * big - small) / (k - 1.0) * scale
            measured = total > 0
            pairs = ((self.trace, trace), (self.gradient_sq, gradient_sq), (self.norm, 1.0 / replicas))
            for variable, estimate in pairs:
                old = backend.read(variable)
                backend.assign(variable, ops.where(measured, decay * old + (1.0 - decay) * estimate, old))
            cycles = backend.read(self.cycles)
            backend.assign(self.cycles, ops.where(measured, cycles + 1.0 / replicas, cycles))
            batch = ops.where(measured, total / k, backend.read(self.batch))
            backend.assign(self.batch, batch)

        backend.when(condition, update, writes=self.variables())
        if schedule is not None:
            self._choose(condition, steps, weight_total, replicas)

    def _choose(self, condition: Any, steps: Any, weight_total: Any, replicas: float) -> None:
        """Sets the next cycle's `n` where a cycle was measured, from the
        estimates summed over replicas (their mean) and the global
        micro-batch weight: the same on every replica. Outside the branch
        of the cycle's end, since under several replicas the sums are an
        all-reduce (of four scalars, on every micro-step), and a collective
        cannot run in a branch."""
        backend = self._backend
        read = backend.read
        local = ops.stack([read(self.gradient_sq), read(self.trace), read(self.batch),
                           ops.cast(read(weight_total), "float32")])
        gradient_sq, trace, batch, total = ops.unstack(backend.replicas.sum(local))
        # Each replica holds 1/replicas of the choice: read as the sum, as the estimates.
        held = read(self.next_n)
        current = ops.maximum(held * replicas, ops.cast(steps, "float32"))
        chosen = self.schedule.next_n(current, gradient_sq, trace, batch)
        measured = ops.logical_and(condition, total > 0)
        backend.assign(self.next_n, ops.where(measured, chosen / replicas, held))

    def read(self) -> dict[str, float] | None:
        """The latest estimates as Python floats (reads the device), or None
        before a cycle has been measured: `noise_scale` (B_simple; inf while
        the estimate of |G|² is not positive, where the noise is too large
        for a cycle to resolve the gradient), `gradient_sq`, `trace`,
        `cycles` and `batch`."""
        backend = self._backend
        with backend.eagerly():
            values = {name: float(backend.saved(v, False)) for name, v in zip(NAMES, self.variables())}
        if round(values["cycles"]) < 1:
            return None
        values["cycles"] = float(round(values["cycles"]))
        norm = values.pop("norm")  # > 0 once a cycle is measured (decay < 1)
        values["gradient_sq"] /= norm
        values["trace"] /= norm
        gradient_sq, trace = values["gradient_sq"], values["trace"]
        values["noise_scale"] = trace / gradient_sq if gradient_sq > 0 else math.inf
        del values["square_sum"]
        return values


def latest(core: Any) -> float | None:
    """`core`'s latest noise-scale estimate (reads the device), or None
    before a cycle has been measured.

    Raises:
        ValueError: If the noise scale is not measured.
    """
    if not core.settings.noise_scale:
        raise ValueError(
            "The gradient noise scale is not measured: wrap the optimizer with "
            "accumulate(optimizer, n, noise_scale=True)."
        )
    noise = None if core.state is None else core.state.noise
    values = None if noise is None else noise.read()
    return None if values is None else values["noise_scale"]


def view_fields(noise: Noise | None, readable: bool) -> dict[str, Any]:
    """The noise scale's fields of `AccumulationState`: None where it is
    not measured, or not `readable` (inside a traced function)."""
    read = (noise.read() if noise is not None and readable else None) or {}
    return {
        "noise_scale": read.get("noise_scale"),
        "gradient_sq": read.get("gradient_sq"),
        "gradient_trace": read.get("trace"),
        "noise_batch": read.get("batch"),
        "noise_cycles": None if not read else int(read["cycles"]),
    }
