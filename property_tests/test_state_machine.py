"""A state machine against a plain-Python model of the accumulation.

Hypothesis interleaves micro-steps (dense, sparse and `None` gradients),
non-finite micro-batches under a `LossScaleOptimizer`, checkpoint writes,
restores into freshly built variables and optimizers, and reads of
`micro_step` and `iterations` (eagerly and inside a `tf.function`).

The model keeps the accumulated sums in float32 NumPy arrays, the position
in the cycle, which variables have had a gradient, and the loss scale. On
every n-th micro-step it hands the mean (or sum) of the sums to a *shadow*:
the same plain optimizer on its own copy of the variables. Both run the
same float32 operations in the same order, so after every rule the
accumulating optimizer's variables, optimizer state and accumulators must
equal the model's bit for bit (`np.array_equal`).

Not modelled yet: changing `n` at a cycle boundary (not supported; see the
accumulation-schedules issue).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from gradaccum import accumulate
from property_tests.harness import OptimizerSpec, optimizer_state, scaled
from property_tests.strategies import optimizers

LSO = keras.optimizers.LossScaleOptimizer
# (name, shape); "table" may get `tf.IndexedSlices` gradients, like an
# Embedding's.
VARIABLES = (("kernel", (3, 2)), ("bias", (2,)), ("table", (6, 2)))
SPARSE = 2
# Loss-scaled gradients are scaled by a power of two, so unscaling is exact.
WRAPS = ("none", "accumulate_lso", "lso_accumulate")
# Loss-scale state, checked against the model rather than the shadow.
_LOSS_SCALE_KEYS = ("opt/step_counter", "opt/dynamic_scale")


def _initial_values() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(size=shape).astype("float32") for _, shape in VARIABLES]


class _Model:
    """What the accumulating optimizer should hold, in plain Python."""

    def __init__(self, n: int, reduction: str, scale: float | None, growth: int):
        self.n, self.reduction = n, reduction
        self.sums = [np.zeros(shape, np.float32) for _, shape in VARIABLES]
        self.count = 0  # micro-batches in the current cycle
        self.applied = 0
        self.seen: set[int] = set()
        self.scale, self.growth, self.good_steps = scale, growth, 0

    def copy(self) -> "_Model":
        other = _Model(self.n, self.reduction, self.scale, self.growth)
        other.sums = [s.copy() for s in self.sums]
        other.count, other.applied = self.count, self.applied
        other.seen = set(self.seen)
        other.good_steps = self.good_steps
        return other

    def finite_loss_scale_step(self) -> None:
        if self.scale is None:
            return
        if self.good_steps == self.growth - 1:
            self.scale, self.good_steps = self.scale * 2, 0
        else:
            self.good_steps += 1

    def non_finite_loss_scale_step(self) -> None:
        self.scale, self.good_steps = self.scale / 2, 0


class AccumulationMachine(RuleBasedStateMachine):
    checkpoints = Bundle("checkpoints")

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="gradaccum-props-")
        self.saved = 0

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------
    # Building.

    def _variables(self, values: list[np.ndarray]) -> list[keras.Variable]:
        return [keras.Variable(v, name=name) for v, (name, _) in zip(values, VARIABLES)]

    def _subject(self):
        """(top-level optimizer, the Keras optimizer inside) for the config."""
        inner = self.spec.make()
        if self.wrap == "none":
            top = accumulate(inner, self.n, reduction=self.reduction)
        elif self.wrap == "accumulate_lso":
            top = accumulate(
                LSO(inner, initial_scale=self.initial_scale,
                    dynamic_growth_steps=self.growth),
                self.n, reduction=self.reduction,
            )
        else:
            top = LSO(accumulate(inner, self.n, reduction=self.reduction),
                      initial_scale=self.initial_scale, dynamic_growth_steps=self.growth)
        top.build(self.vars)
        return top, inner

    @initialize(
        spec=optimizers(),
        n=st.integers(1, 4),
        reduction=st.sampled_from(["mean", "sum"]),
        wrap=st.sampled_from(WRAPS),
        scale_exponent=st.integers(0, 15),
        growth=st.integers(1, 4),
    )
    def start(self, spec, n, reduction, wrap, scale_exponent, growth):
        self.spec, self.n, self.reduction, self.wrap = spec, n, reduction, wrap
        self.initial_scale = float(2**scale_exponent)
        self.growth = growth
        initial = _initial_values()
        self.vars = self._variables(initial)
        self.opt, self.inner = self._subject()
        self.shadow_vars = self._variables(initial)
        self.shadow = spec.make()
        if wrap != "none":
            # The same wrapper structure (Keras tracks some optimizer
            # variables differently under a LossScaleOptimizer), at a scale
            # of 1 that never grows: it applies the gradients it is given.
            self.shadow = LSO(self.shadow, initial_scale=1.0, dynamic_growth_steps=2**30)
        self.shadow.build(self.shadow_vars)
        scale = None if wrap == "none" else self.initial_scale
        self.model = _Model(n, reduction, scale, growth)
        self.read_fn = None

    # ------------------------------------------------------------------
    # Rules.

    @rule(
        data=st.data(),
        kinds=st.lists(st.sampled_from(["dense", "dense", "none", "sparse"]),
                       min_size=len(VARIABLES), max_size=len(VARIABLES)),
        magnitude=st.sampled_from([1e-3, 1.0, 10.0]),
        seed=st.integers(0, 2**16),
    )
    def micro_step(self, data, kinds, magnitude, seed):
        """One micro-batch: per variable a dense, sparse or `None` gradient."""
        if all(k == "none" for k in kinds):
            kinds = ["dense"] + list(kinds[1:])
        rng = np.random.default_rng(seed)
        grads = []  # unscaled: (kind, dense array, rows or None)
        for i, ((_, shape), kind) in enumerate(zip(VARIABLES, kinds)):
            if kind == "none":
                grads.append(None)
            elif kind == "sparse" and i == SPARSE:
                rows = data.draw(
                    st.lists(st.integers(0, shape[0] - 1), min_size=1,
                             max_size=shape[0], unique=True),
                    label="rows",
                )
                values = (rng.normal(size=(len(rows), shape[1])) * magnitude).astype("float32")
                grads.append(("sparse", values, np.asarray(rows, np.int64)))
            else:
                grads.append(("dense", (rng.normal(size=shape) * magnitude).astype("float32"), None))
        self._apply(grads, poison=False)

    @precondition(lambda self: self.wrap != "none")
    @rule(which=st.integers(0, len(VARIABLES) - 1), value=st.sampled_from([np.inf, -np.inf, np.nan]))
    def non_finite_micro_step(self, which, value):
        """A micro-batch whose scaled gradient overflowed: it is dropped."""
        grads = []
        for i, (_, shape) in enumerate(VARIABLES):
            g = np.full(shape, 0.5, np.float32)
            if i == which:
                g.flat[0] = value
            grads.append(("dense", g, None))
        self._apply(grads, poison=True)

    def _apply(self, grads, poison: bool) -> None:
        model = self.model
        scale = model.scale if model.scale is not None else None
        to_tf = []
        for (name, shape), g in zip(VARIABLES, grads):
            if g is None:
                to_tf.append(None)
                continue
            kind, values, rows = g
            if scale is not None:
                values = values * np.float32(scale)
            if kind == "sparse":
                to_tf.append(tf.IndexedSlices(tf.constant(values), tf.constant(rows),
                                              tf.constant(shape, tf.int64)))
            else:
                to_tf.append(tf.constant(values))
        self.opt.apply_gradients(zip(to_tf, self.vars))

        if poison:
            model.non_finite_loss_scale_step()
            return
        model.finite_loss_scale_step()
        present = [i for i, g in enumerate(grads) if g is not None]
        if model.n == 1:
            # n=1 is the plain optimizer: the gradients as they are.
            self.shadow.apply(
                [self._shadow_grad(grads[i], i) for i in present],
                [self.shadow_vars[i] for i in present],
            )
            model.applied += 1
            return
        for i in present:
            kind, values, rows = grads[i]
            if kind == "sparse":
                np.add.at(model.sums[i], rows, values)
            else:
                model.sums[i] += values
            model.seen.add(i)
        model.count += 1
        if model.count == model.n:
            included = sorted(model.seen)
            denominator = np.float32(model.n if model.reduction == "mean" else 1)
            self.shadow.apply(
                [tf.constant(model.sums[i] / denominator) for i in included],
                [self.shadow_vars[i] for i in included],
            )
            model.sums = [np.zeros_like(s) for s in model.sums]
            model.count = 0
            model.applied += 1

    @staticmethod
    def _shadow_grad(g, i):
        kind, values, rows = g
        if kind == "sparse":
            return tf.IndexedSlices(tf.constant(values), tf.constant(rows),
                                    tf.constant(VARIABLES[i][1], tf.int64))
        return tf.constant(values)

    @rule(target=checkpoints)
    def write_checkpoint(self):
        """Saves variables and optimizer mid-cycle; remembers the model."""
        self.saved += 1
        path = tf.train.Checkpoint(vars=self.vars, optimizer=self.opt).write(
            os.path.join(self.tmp, f"ckpt-{self.saved}")
        )
        shadow = ([v.numpy() for v in self.shadow_vars],
                  [v.numpy() for v in self.shadow.variables])
        return path, self.model.copy(), shadow

    @rule(checkpoint=checkpoints)
    def restore_into_fresh_objects(self, checkpoint):
        """Restores a checkpoint into new variables and a new optimizer."""
        path, model, (shadow_vars, shadow_opt) = checkpoint
        self.vars = self._variables([np.zeros(s, np.float32) for _, s in VARIABLES])
        self.opt, self.inner = self._subject()
        status = tf.train.Checkpoint(vars=self.vars, optimizer=self.opt).read(path)
        status.assert_consumed()
        self.model = model.copy()
        for v, value in zip(self.shadow_vars, shadow_vars):
            v.assign(value)
        for v, value in zip(self.shadow.variables, shadow_opt):
            v.assign(value)
        self.read_fn = None

    @rule()
    def read_counters(self):
        """Reading `micro_step`/`iterations`, eagerly or traced, changes nothing."""
        if self.read_fn is None:
            opt, acc_opt = self.opt, self.acc_opt
            self.read_fn = tf.function(lambda: (acc_opt.micro_step, opt.iterations))
        micro_step, iterations = self.read_fn()
        assert int(micro_step) == int(self.acc_opt.micro_step) == self.model.count
        assert int(iterations) == int(self.opt.iterations) == self.model.applied

    # ------------------------------------------------------------------
    # Invariants, after every rule.

    @property
    def acc_opt(self):
        """The AccumulatingOptimizer (inside the LossScaleOptimizer, or top)."""
        return self.opt.inner_optimizer if self.wrap == "lso_accumulate" else self.opt

    @invariant()
    def matches_the_model_bit_for_bit(self):
        if not hasattr(self, "model"):
            return
        model = self.model
        assert int(self.acc_opt.micro_step) == model.count
        assert int(self.opt.iterations) == model.applied
        for v, s in zip(self.vars, self.shadow_vars):
            assert np.array_equal(v.numpy(), s.numpy()), v.path
        mine, theirs = optimizer_state(self.opt), optimizer_state(self.shadow)
        assert sorted(mine) == sorted(theirs)
        for key in mine:
            if key not in _LOSS_SCALE_KEYS:
                assert np.array_equal(mine[key], theirs[key]), key
        state = self.acc_opt._self_core._self_state
        for acc, expected in zip(state.accumulators, model.sums):
            assert np.array_equal(acc.numpy(), expected)
        if model.scale is not None:
            lso = self.opt
            assert float(lso.dynamic_scale.numpy()) == model.scale
            assert int(lso.step_counter.numpy()) == model.good_steps


AccumulationMachine.TestCase.settings = settings(scaled(15), stateful_step_count=25)
TestAccumulationMachine = AccumulationMachine.TestCase


# ----------------------------------------------------------------------
# Failures the machine found, replayed step by step.

_ADAFACTOR = OptimizerSpec(
    "Adafactor",
    (("beta_2_decay", -1.0), ("clip_threshold", 1.0), ("epsilon_2", 0.01),
     ("learning_rate", 0.1), ("relative_step", False)),
)


def _replay(steps):
    state = AccumulationMachine()
    try:
        state.start(spec=_ADAFACTOR, n=2, reduction="mean", wrap="none",
                    scale_exponent=0, growth=1)
        state.matches_the_model_bit_for_bit()
        saved = None
        for step in steps:
            if step == "save":
                saved = state.write_checkpoint()
            elif step == "restore":
                state.restore_into_fresh_objects(checkpoint=saved)
            else:
                state.micro_step(data=None, kinds=list(step), magnitude=1e-3, seed=0)
            state.matches_the_model_bit_for_bit()
    finally:
        state.teardown()


def test_restored_mid_cycle_a_variable_without_gradient_still_applies():
    """Which variables had gradients was not saved: after a mid-cycle
    restore, `table` (no gradient on the apply step) was left out of the
    update, its accumulated sum neither applied nor cleared."""
    _replay([("dense", "dense", "dense"), "save", "restore", ("dense", "dense", "none")])


def test_restored_a_variable_seen_in_an_earlier_cycle_still_takes_part():
    """After a restore, `bias` (seen in the first cycle, no gradient in the
    second) must still get its zero gradient, as without the restore."""
    _replay([("dense", "dense", "dense")] * 2
            + ["save", "restore"] + [("dense", "none", "dense")] * 2)
