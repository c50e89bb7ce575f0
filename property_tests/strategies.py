"""Hypothesis strategies: optimizers with valid hyperparameters, and runs.

Every optimizer Keras 3 ships is drawn with random valid hyperparameters,
per-update features (clipping, weight decay, EMA) and learning-rate
schedules. Ranges are those where a few updates of a small model stay well
conditioned, so that float32 rounding stays rounding: the learning rate is
bounded per family (Adadelta's is a scale factor, Lion's step is
`lr * sign(...)`), epsilons start at 1e-8.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from property_tests.harness import EXECUTIONS, HEADS, Case, ModelSpec, OptimizerSpec
from tests.helpers import BACKEND, MODES

ALL_HEADS = tuple(range(HEADS))


def log_uniform(low_exp: float, high_exp: float) -> st.SearchStrategy[float]:
    """10**e for e uniform in [low_exp, high_exp], rounded to 3 digits."""
    return st.floats(low_exp, high_exp).map(lambda e: float(f"{10.0 ** e:.3g}"))


def unit(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high).map(lambda v: round(v, 4))


epsilons = log_uniform(-8, -3)
betas_1 = unit(0.0, 0.99)
betas_2 = unit(0.9, 0.9999)


def _family_kwargs(draw: st.DrawFn, family: str) -> dict[str, Any]:
    """The family's own hyperparameters, including its learning rate."""
    lr = log_uniform(-3.5, -1)
    if family == "SGD":
        return {"learning_rate": draw(lr), "momentum": draw(unit(0.0, 0.99)),
                "nesterov": draw(st.booleans())}
    if family in ("Adam", "AdamW"):
        kw = {"learning_rate": draw(lr), "beta_1": draw(betas_1), "beta_2": draw(betas_2),
              "epsilon": draw(epsilons), "amsgrad": draw(st.booleans())}
        if family == "AdamW":
            kw["weight_decay"] = draw(unit(0.0, 0.2))
        return kw
    if family == "RMSprop":
        return {"learning_rate": draw(lr), "rho": draw(unit(0.5, 0.99)),
                "momentum": draw(unit(0.0, 0.9)), "epsilon": draw(epsilons),
                "centered": draw(st.booleans())}
    if family == "Adagrad":
        return {"learning_rate": draw(lr),
                "initial_accumulator_value": draw(unit(0.01, 1.0)),
                "epsilon": draw(epsilons)}
    if family == "Adadelta":
        return {"learning_rate": draw(unit(0.05, 1.0)), "rho": draw(unit(0.5, 0.99)),
                "epsilon": draw(log_uniform(-7, -3))}
    if family in ("Adamax", "Nadam", "Lamb"):
        return {"learning_rate": draw(lr), "beta_1": draw(betas_1),
                "beta_2": draw(betas_2), "epsilon": draw(epsilons)}
    if family == "Ftrl":
        return {"learning_rate": draw(lr),
                "learning_rate_power": draw(unit(-1.0, 0.0)),
                "initial_accumulator_value": draw(unit(0.01, 1.0)),
                "l1_regularization_strength": draw(unit(0.0, 0.01)),
                "l2_regularization_strength": draw(unit(0.0, 0.01)),
                "l2_shrinkage_regularization_strength": draw(unit(0.0, 0.01)),
                "beta": draw(unit(0.0, 1.0))}
    if family == "Lion":
        # Lion rejects beta_1 = 0 (it would be SignSGD).
        return {"learning_rate": draw(log_uniform(-4, -2.5)), "beta_1": draw(unit(0.01, 0.99)),
                "beta_2": draw(unit(0.9, 0.999))}
    if family == "Adafactor":
        return {"learning_rate": draw(lr), "beta_2_decay": draw(unit(-1.0, -0.5)),
                "epsilon_2": draw(log_uniform(-4, -2)),
                "clip_threshold": draw(unit(0.5, 2.0)),
                "relative_step": draw(st.booleans())}
    if family == "Muon":
        return {"learning_rate": draw(lr), "momentum": draw(unit(0.5, 0.99)),
                "nesterov": draw(st.booleans()), "ns_steps": draw(st.integers(1, 5)),
                "adam_beta_1": draw(betas_1), "adam_beta_2": draw(betas_2),
                "adam_weight_decay": draw(unit(0.0, 0.01)),
                "epsilon": draw(epsilons)}
    if family == "ScheduleFreeAdamW":
        # Its update divides by beta_1.
        return {"learning_rate": draw(lr), "beta_1": draw(unit(0.1, 0.99)),
                "beta_2": draw(betas_2), "epsilon": draw(epsilons),
                "warmup_steps": draw(st.integers(0, 3))}
    raise ValueError(f"No hyperparameter strategy for {family!r}.")


FAMILIES = (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
    "Ftrl", "Lion", "Lamb", "Adafactor", "Muon", "ScheduleFreeAdamW",
)

# Families whose learning rate may be a schedule (ScheduleFreeAdamW warms up
# itself; Adafactor's relative step replaces it).
_SCHEDULABLE = set(FAMILIES) - {"ScheduleFreeAdamW", "Adafactor"}


@st.composite
def schedules(draw: st.DrawFn, lr: float) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """A Keras learning-rate schedule starting at `lr` (name, kwargs)."""
    name = draw(st.sampled_from([
        "ExponentialDecay", "PiecewiseConstantDecay", "CosineDecay",
        "InverseTimeDecay", "PolynomialDecay", "CosineDecayRestarts",
    ]))
    steps = draw(st.integers(1, 4))
    if name == "ExponentialDecay":
        kw = {"initial_learning_rate": lr, "decay_steps": steps,
              "decay_rate": draw(unit(0.3, 0.99)), "staircase": draw(st.booleans())}
    elif name == "PiecewiseConstantDecay":
        kw = {"boundaries": [1, 1 + steps], "values": [lr, lr / 2, lr / 4]}
    elif name == "CosineDecay":
        kw = {"initial_learning_rate": lr, "decay_steps": steps + 2,
              "alpha": draw(unit(0.0, 0.5))}
        if draw(st.booleans()):
            kw.update(initial_learning_rate=lr / 4, warmup_target=lr, warmup_steps=steps)
    elif name == "InverseTimeDecay":
        kw = {"initial_learning_rate": lr, "decay_steps": steps,
              "decay_rate": draw(unit(0.1, 2.0)), "staircase": draw(st.booleans())}
    elif name == "PolynomialDecay":
        kw = {"initial_learning_rate": lr, "decay_steps": steps + 1,
              "end_learning_rate": lr / 10, "power": draw(unit(0.5, 2.0)),
              "cycle": draw(st.booleans())}
    else:
        kw = {"initial_learning_rate": lr, "first_decay_steps": steps,
              "t_mul": draw(unit(1.0, 2.0)), "m_mul": draw(unit(0.5, 1.0))}
    return name, tuple(sorted(kw.items()))


# tf_keras: its optimizers since Keras 2.11, and OptimizerV2 ("legacy"),
# which has no weight decay or EMA.
TF_KERAS_FAMILIES = (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
    "Ftrl", "Lion", "Adafactor",
)
TF_KERAS_LEGACY_FAMILIES = (
    "SGD", "Adam", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Ftrl",
)


@st.composite
def optimizers(
    draw: st.DrawFn, families: tuple[str, ...] = FAMILIES, module: str = "keras"
) -> OptimizerSpec:
    """An optimizer of `module` with valid hyperparameters and features.

    `module` is "keras" (Keras 3, the default), "tf_keras" or
    "tf_keras.legacy"; the hyperparameters drawn are those all three share.
    """
    family = draw(st.sampled_from(families))
    kw = _family_kwargs(draw, family)
    clip = draw(st.sampled_from([None, "clipnorm", "clipvalue", "global_clipnorm"]))
    if clip == "clipvalue":
        kw["clipvalue"] = draw(log_uniform(-3, 0))
    elif clip is not None:
        kw[clip] = draw(log_uniform(-2, 1))
    legacy = module == "tf_keras.legacy"
    if not legacy and "weight_decay" not in kw and draw(st.booleans()):
        kw["weight_decay"] = draw(unit(0.0, 0.2))
    if not legacy and draw(st.booleans()):
        kw["use_ema"] = True
        kw["ema_momentum"] = draw(unit(0.0, 0.999))
        kw["ema_overwrite_frequency"] = draw(st.sampled_from([None, 1, 2, 3]))
    schedule = None
    schedulable = family in _SCHEDULABLE and not (legacy and family == "Nadam")
    if schedulable and draw(st.integers(0, 3)) == 0:  # legacy Nadam refuses them
        schedule = draw(schedules(kw.pop("learning_rate")))
    return OptimizerSpec(family, tuple(sorted(kw.items())), schedule, module)


model_specs = st.builds(
    ModelSpec,
    kind=st.sampled_from(["dense", "conv", "embedding", "multi_input"]),
    width=st.sampled_from([3, 6]),
    depth=st.sampled_from([1, 2]),
)

_PARTIAL_HEADS = [(h,) for h in ALL_HEADS]



def tf_keras_optimizers() -> st.SearchStrategy[OptimizerSpec]:
    """Every optimizer tf_keras ships, new and legacy (OptimizerV2)."""
    return st.one_of(
        optimizers(TF_KERAS_FAMILIES, module="tf_keras"),
        optimizers(TF_KERAS_LEGACY_FAMILIES, module="tf_keras.legacy"),
    )


_N = st.integers(2, 4)


@st.composite
def cases(
    draw: st.DrawFn,
    n: st.SearchStrategy[int] = _N,
    modes: tuple[str, ...] | None = None,
    reductions: tuple[str, ...] = ("mean", "sum"),
    optimizer: st.SearchStrategy[OptimizerSpec] | None = None,
    max_cycles: int = 3,
    heads_vary_when_traced: bool = False,
    weighted: bool = False,
    loss_scales: tuple[str | None, ...] | None = None,
) -> Case:
    """A drawn training run (see `harness.Case`).

    In eager runs any head may be left out of the loss on any micro-step. In
    traced runs the heads are one set for the whole run, unless
    `heads_vary_when_traced` (a traced step retraced per set of heads). With
    `weighted`, a third of the runs have ragged micro-batches passed with
    `weight=` their size. `modes` are the executions drawn from (default:
    every one the backend has, eager twice as often on TensorFlow); the
    `update` mode ("masked" or "skip") is drawn on TensorFlow only, where
    it changes what runs.
    """
    if modes is None:
        modes = ("eager",) + EXECUTIONS
    if loss_scales is None:
        # On JAX Keras's loss-scale optimizer cannot run eagerly (its `apply`
        # is a stateful `ops.cond`); tests/mixed_precision/test_mixed_precision.py
        # covers it through `fit` and `stateless_apply`.
        loss_scales = (None,) if BACKEND == "jax" else (None, None, None, "accumulate_lso", "lso_accumulate")
    mode = draw(st.sampled_from(modes))
    n_ = draw(n)
    cycles = draw(st.integers(1, max_cycles))
    extra = draw(st.integers(0, n_ - 1))
    steps = n_ * cycles + extra
    head_sets = st.sampled_from([ALL_HEADS, ALL_HEADS] + _PARTIAL_HEADS)
    if mode == "eager" or heads_vary_when_traced:
        heads = tuple(draw(st.lists(head_sets, min_size=steps, max_size=steps)))
    else:
        heads = (draw(head_sets),) * steps
    loss_scale = draw(st.sampled_from(loss_scales))
    sizes = None
    if weighted and draw(st.integers(0, 2)) == 0:
        # Ragged micro-batches, each weighted by its size (two sizes: each
        # new shape retraces a traced step).
        sizes = tuple(draw(st.lists(st.sampled_from([3, 1]), min_size=steps, max_size=steps)))
        if loss_scale == "lso_accumulate" and "accumulate_lso" in loss_scales:
            # LossScaleOptimizer.apply_gradients takes no `weight`.
            loss_scale = "accumulate_lso"
    return Case(
        model=draw(model_specs),
        optimizer=draw(optimizer if optimizer is not None else optimizers()),
        n=n_,
        reduction=draw(st.sampled_from(reductions)),
        micro_batch=draw(st.integers(1, 4)),
        cycles=cycles,
        extra=extra,
        heads=heads,
        mode=mode,
        data_seed=draw(st.integers(0, 2**16)),
        build_first=draw(st.booleans()),
        loss_scale=loss_scale,
        sizes=sizes,
        update=draw(st.sampled_from(MODES if BACKEND == "tensorflow" else ("masked",))),
    )
