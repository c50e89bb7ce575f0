"""A state machine against a plain-Python model of the accumulation.

Shared by the Keras 3 machine (`test_state_machine.py`, on every backend)
and the tf_keras one (`test_state_machine_tf_keras.py`); each
supplies its optimizer family.

Hypothesis interleaves micro-steps (dense, sparse and `None` gradients,
weighted or not), non-finite micro-batches under a `LossScaleOptimizer`,
setting `n` (between cycles or mid-cycle), `flush()`, checkpoint writes,
restores into freshly built variables and optimizers, and reads of
`micro_step` and `iterations` (eagerly and inside a `tf.function`).

The model keeps the accumulated sums in float32 NumPy arrays, the position
in the cycle, which variables have had a gradient, and the loss scale. On
every n-th micro-step it hands the mean (or sum) of the sums to a *shadow*:
the same plain optimizer on its own copy of the variables. Both run the
same float32 operations in the same order, so after every rule the
accumulating optimizer's variables, optimizer state and accumulators must
equal the model's bit for bit (`np.array_equal`).

`n` is an int (which the rules may set) or a schedule: a drawn table of
`n` per applied update, its last entry repeated, passed as a callable of
`iterations` written with Keras ops.

On JAX and PyTorch the machine runs the same rules eagerly, with these differences: gradients are dense (only TensorFlow
has `tf.IndexedSlices`), checkpoints are the Keras-file stores
(`save_own_variables`/`load_own_variables`) instead of `tf.train.Checkpoint`,
counters are read eagerly only, and on JAX no loss-scale optimizer joins in
(Keras's cannot run eagerly there; see `tests/mixed_precision/test_mixed_precision.py`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import keras
import numpy as np
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
from tests.helpers import BACKEND, MODES

if BACKEND == "tensorflow":
    import tensorflow as tf

# (name, shape); "table" may get `tf.IndexedSlices` gradients, like an
# Embedding's.
VARIABLES = (("kernel", (3, 2)), ("bias", (2,)), ("table", (6, 2)))
SPARSE = 2
# Loss-scaled gradients are scaled by a power of two, so unscaling is exact.
WRAPS = ("none",) if BACKEND == "jax" else ("none", "accumulate_lso", "lso_accumulate")
# `n`: an int, or a schedule given as the table of n for updates 0, 1, ...
NS = st.one_of(
    st.integers(1, 4),
    st.lists(st.integers(1, 4), min_size=2, max_size=4).map(tuple),
)


def start_rule(specs: st.SearchStrategy[Any]) -> Any:
    """The machines' `@initialize` rule, drawing the optimizer from `specs`.

    A subclass of `MachineBase` sets `start = start_rule(<its optimizers>)`.
    """

    @initialize(
        spec=specs,
        n=NS,
        reduction=st.sampled_from(["mean", "sum"]),
        wrap=st.sampled_from(WRAPS),
        scale_exponent=st.integers(0, 15),
        growth=st.integers(1, 4),
        # The mode changes what runs on TensorFlow only.
        update=st.sampled_from(MODES if BACKEND == "tensorflow" else ("masked",)),
    )
    def start(self, spec, n, reduction, wrap, scale_exponent, growth, update):
        self._start(spec, n, reduction, wrap, scale_exponent, growth, update)

    return start


def _n_argument(n: int | tuple[int, ...]) -> Any:
    """What `accumulate` is given for a drawn `n`."""
    if isinstance(n, int):
        return n
    ops = keras.ops
    table = ops.convert_to_tensor(n, "int32")
    last = len(n) - 1
    return lambda step: ops.take(table, ops.minimum(ops.cast(step, "int32"), last))


def _tensor(values: np.ndarray) -> Any:
    if BACKEND == "tensorflow":
        return tf.constant(values)
    return keras.ops.convert_to_tensor(values)


def _saveables(optimizer: Any) -> list[Any]:
    """The optimizer and the inner optimizers a Keras file saves under it."""
    found = [optimizer]
    while getattr(found[-1], "inner_optimizer", None) is not None:
        found.append(found[-1].inner_optimizer)
    return found


def _sparse(values: np.ndarray, rows: np.ndarray, shape: tuple[int, ...]) -> Any:
    return tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant(shape, tf.int64))


def _initial_values() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(size=shape).astype("float32") for _, shape in VARIABLES]


class _Model:
    """What the accumulating optimizer should hold, in plain Python."""

    def __init__(self, n: int, reduction: str, scale: float | None, growth: int,
                 min_scale: float = 0.0, leaves_absent_alone: bool = True):
        self.n, self.reduction = n, reduction  # n: an int or a schedule table
        # Whether a variable without a gradient in a whole cycle is left out
        # of its update, as in the large batch (else it takes part with zeros).
        self.leaves_absent_alone = leaves_absent_alone
        self.min_scale = min_scale
        self.sums = [np.zeros(shape, np.float32) for _, shape in VARIABLES]
        self.total = np.float32(0.0)  # sum of the cycle's micro-batch weights
        self.count = 0  # micro-batches in the current cycle
        self.applied = 0  # the optimizer's `iterations`
        self.seen: set[int] = set()
        self.in_cycle: set[int] = set()  # variables with a gradient in this cycle
        self.scale, self.growth, self.good_steps = scale, growth, 0

    def copy(self) -> _Model:
        other = _Model(self.n, self.reduction, self.scale, self.growth, self.min_scale, self.leaves_absent_alone)
        other.in_cycle = set(self.in_cycle)
        other.sums = [s.copy() for s in self.sums]
        other.total, other.count, other.applied = self.total, self.count, self.applied
        other.seen = set(self.seen)
        other.good_steps = self.good_steps
        return other

    def current_n(self) -> int:
        """`n` for the current cycle (a schedule reads `iterations`)."""
        if isinstance(self.n, int):
            return self.n
        return self.n[min(self.applied, len(self.n) - 1)]

    def passes_through(self, weight: float | None) -> bool:
        """An int n=1, unweighted, nothing accumulated ever: the plain optimizer."""
        return self.n == 1 and weight is None and not self.seen

    def add(self, grads, weight: float | None) -> None:
        w = None if weight is None else np.float32(weight)
        for i, g in enumerate(grads):
            if g is None:
                continue
            kind, values, rows = g
            values = values if w is None else values * w
            if kind == "sparse":
                np.add.at(self.sums[i], rows, values)
            else:
                self.sums[i] += values
            self.seen.add(i)
            self.in_cycle.add(i)
        self.total = np.float32(self.total + (np.float32(1.0) if w is None else w))
        self.count += 1

    def update(self) -> tuple[list[int], list[np.ndarray]]:
        """The gradients the cycle applies: sum, or sum / total weight."""
        included = sorted(self.in_cycle if self.leaves_absent_alone else self.seen)
        if self.reduction == "sum":
            grads = [self.sums[i] for i in included]
        else:
            divisor = self.total if self.total > 0 else np.float32(1.0)
            grads = [self.sums[i] / divisor for i in included]
        return included, grads

    def clear(self) -> None:
        self.sums = [np.zeros_like(s) for s in self.sums]
        self.total, self.count = np.float32(0.0), 0
        self.in_cycle = set()
        self.applied += 1

    def finite_loss_scale_step(self) -> None:
        if self.scale is None:
            return
        if self.good_steps == self.growth - 1:
            self.scale, self.good_steps = self.scale * 2, 0
        else:
            self.good_steps += 1

    def non_finite_loss_scale_step(self) -> None:
        self.scale, self.good_steps = max(self.scale / 2, self.min_scale), 0


class MachineBase(RuleBasedStateMachine):
    """Rules and invariants; a subclass names the optimizer family.

    Subclasses set `start = start_rule(...)` (their optimizers) and define
    these family hooks.
    """

    checkpoints = Bundle("checkpoints")
    # The family's loss-scale optimizer, and the smallest scale it halves to.
    LSO: Any = None
    # Whether the family leaves a variable without a gradient in a whole
    # cycle out of the update (Keras 3's; tf_keras's take part with zeros).
    LEAVES_ABSENT_ALONE = True
    MIN_SCALE = 0.0
    # Wrappings in which a dropped micro-batch still adds 1 to `iterations`.
    DROPPED_BUMPS_ITERATIONS: tuple[str, ...] = ()
    # Loss-scale state keys, checked against the model, not the shadow.
    LOSS_SCALE_KEYS: tuple[str, ...] = ()

    def _variable(self, value: np.ndarray, name: str) -> Any:
        raise NotImplementedError

    def _make_lso(self, inner: Any, initial_scale: float, growth: int) -> Any:
        raise NotImplementedError

    def _optimizer_state(self, optimizer: Any) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _optimizer_variables(self, optimizer: Any) -> list[Any]:
        raise NotImplementedError

    def _loss_scale(self) -> tuple[float, int]:
        """The subject's (scale, finite steps since it last grew)."""
        raise NotImplementedError

    def _unscaled(self, grads: list[Any]) -> list[Any]:
        """What the caller hands `apply_gradients` for scaled gradients."""
        return grads

    def _build(self, optimizer: Any, variables: list[Any]) -> None:
        optimizer.build(variables)

    def _after_shadow_skipped(self) -> None:
        """Called after the shadow's loss-scale optimizer skipped a step."""

    def _after_shadow_restored(self) -> None:
        """Called after the shadow's variables were set back to a checkpoint's."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="gradaccum-props-")
        self.saved = 0

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------
    # Building.

    def _variables(self, values: list[np.ndarray]) -> list[Any]:
        return [self._variable(v, name) for v, (name, _) in zip(values, VARIABLES)]

    def _subject(self):
        """(top-level optimizer, the Keras optimizer inside) for the config."""
        inner = self.spec.make()
        kwargs = self._accumulate_kwargs()
        if self.wrap == "none":
            top = accumulate(inner, self.n, **kwargs)
        elif self.wrap == "accumulate_lso":
            top = accumulate(
                self._make_lso(inner, self.initial_scale, self.growth), self.n, **kwargs
            )
        else:
            top = self._make_lso(
                accumulate(inner, self.n, **kwargs), self.initial_scale, self.growth
            )
        self._build(top, self.vars)
        return top, inner

    def _accumulate_kwargs(self) -> dict[str, Any]:
        """`accumulate`'s arguments besides the optimizer and `n`."""
        # The model adds sparse gradients into rows (`_Model.add`).
        return {"reduction": self.reduction, "mode": self.update, "sparse": "rows"}

    def _start(self, spec, n, reduction, wrap, scale_exponent, growth, update="masked"):
        self.spec, self.reduction, self.wrap, self.update = spec, reduction, wrap, update
        self.n = _n_argument(n)
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
            self.shadow = self._make_lso(self.shadow, 1.0, 2**30)
        self._build(self.shadow, self.shadow_vars)
        scale = None if wrap == "none" else self.initial_scale
        self.model = _Model(n, reduction, scale, growth, self.MIN_SCALE, self.LEAVES_ABSENT_ALONE)
        self.read_fn = None

    # ------------------------------------------------------------------
    # Rules.

    @rule(
        data=st.data(),
        kinds=st.lists(st.sampled_from(["dense", "dense", "none", "sparse"]),
                       min_size=len(VARIABLES), max_size=len(VARIABLES)),
        magnitude=st.sampled_from([1e-3, 1.0, 10.0]),
        seed=st.integers(0, 2**16),
        weight=st.sampled_from([None, None, 0.0, 0.5, 1.0, 3.0, 7.25]),
    )
    def micro_step(self, data, kinds, magnitude, seed, weight=None):
        """One micro-batch: per variable a dense, sparse or `None` gradient.

        Optionally weighted (`apply_gradients(..., weight=w)`); a
        LossScaleOptimizer around the accumulating one takes no `weight`.
        """
        if self.wrap == "lso_accumulate":
            weight = None
        if all(k == "none" for k in kinds):
            kinds = ["dense"] + list(kinds[1:])
        if BACKEND == "tensorflow" and self.spec.family == "Nadam" and dict(self.spec.kwargs).get("use_ema"):
            # The documented fallback, in both modes, for EMA's averages of an
            # optimizer updated by snapshot (docs/guides/modes.md): each moves
            # from its variable as updated with the gradient 0, warned.
            kinds = ["dense" if k == "none" else k for k in kinds]
        rng = np.random.default_rng(seed)
        grads = []  # unscaled: (kind, dense array, rows or None)
        for i, ((_, shape), kind) in enumerate(zip(VARIABLES, kinds)):
            if kind == "none":
                grads.append(None)
            elif kind == "sparse" and i == SPARSE and BACKEND == "tensorflow":
                rows = data.draw(
                    st.lists(st.integers(0, shape[0] - 1), min_size=1,
                             max_size=shape[0], unique=True),
                    label="rows",
                )
                values = (rng.normal(size=(len(rows), shape[1])) * magnitude).astype("float32")
                grads.append(("sparse", values, np.asarray(rows, np.int64)))
            else:
                grads.append(("dense", (rng.normal(size=shape) * magnitude).astype("float32"), None))
        self._apply(grads, poison=False, weight=weight)

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

    def _apply(self, grads, poison: bool, weight: float | None = None) -> None:
        model = self.model
        to_tf = []
        for (_name, shape), g in zip(VARIABLES, grads):
            if g is None:
                to_tf.append(None)
                continue
            kind, values, rows = g
            if model.scale is not None:
                values = values * np.float32(model.scale)
            if kind == "sparse":
                to_tf.append(_sparse(values, rows, shape))
            else:
                to_tf.append(_tensor(values))
        if model.scale is not None:
            to_tf = self._unscaled(to_tf)
        if weight is None:
            self.opt.apply_gradients(zip(to_tf, self.vars))
        else:
            self.opt.apply_gradients(zip(to_tf, self.vars), weight=weight)

        if poison:
            model.non_finite_loss_scale_step()
            if self.wrap in self.DROPPED_BUMPS_ITERATIONS:
                # Documented: the skipped step still counts, for the plain
                # loss-scale optimizer too; the shadow skips one as well.
                self.shadow.apply_gradients(zip(to_tf, self.shadow_vars))
                self._after_shadow_skipped()
                model.applied += 1
            return
        model.finite_loss_scale_step()
        if model.passes_through(weight):
            present = [i for i, g in enumerate(grads) if g is not None]
            self.shadow.apply_gradients(zip(
                [self._shadow_grad(grads[i], i) for i in present],
                [self.shadow_vars[i] for i in present],
            ))
            model.applied += 1
            return
        model.add(grads, weight)
        # A cycle ends at the first micro-step holding at least n batches
        # (more than n only if `n` was lowered mid-cycle).
        if model.count >= model.current_n():
            self._apply_cycle()

    def _apply_cycle(self) -> None:
        included, grads = self.model.update()
        self.shadow.apply_gradients(
            zip([_tensor(g) for g in grads], [self.shadow_vars[i] for i in included])
        )
        self.model.clear()

    @rule()
    def flush(self):
        """`flush()` applies a partial cycle now (nothing if it is empty)."""
        self.acc_opt.flush()
        if self.model.count > 0:
            self._apply_cycle()

    @precondition(lambda self: isinstance(self.model.n, int))
    @rule(n=st.integers(1, 4))
    def set_n(self, n):
        """`opt.n = k`, at a boundary or mid-cycle (see `n`'s docstring)."""
        self.acc_opt.n = n
        self.model.n = self.n = n
        self.read_fn = None

    @staticmethod
    def _shadow_grad(g, i):
        kind, values, rows = g
        if kind == "sparse":
            return _sparse(values, rows, VARIABLES[i][1])
        return _tensor(values)

    @rule(target=checkpoints)
    def write_checkpoint(self):
        """Saves variables and optimizer mid-cycle; remembers the model."""
        self.saved += 1
        if BACKEND == "tensorflow":
            path = tf.train.Checkpoint(vars=self.vars, optimizer=self.opt).write(
                os.path.join(self.tmp, f"ckpt-{self.saved}")
            )
        else:  # what a Keras file holds: one store per optimizer, outer first
            stores = []
            for opt in _saveables(self.opt):
                store: dict[str, np.ndarray] = {}
                opt.save_own_variables(store)
                stores.append(store)
            path = ([v.numpy() for v in self.vars], stores)
        shadow = ([v.numpy() for v in self.shadow_vars],
                  [v.numpy() for v in self._optimizer_variables(self.shadow)])
        return path, self.model.copy(), shadow

    @rule(checkpoint=checkpoints)
    def restore_into_fresh_objects(self, checkpoint):
        """Restores a checkpoint into new variables and a new optimizer."""
        path, model, (shadow_vars, shadow_opt) = checkpoint
        self.n = _n_argument(model.n)  # a checkpoint restores into the same `n` only
        self.vars = self._variables([np.zeros(s, np.float32) for _, s in VARIABLES])
        self.opt, self.inner = self._subject()
        if BACKEND == "tensorflow":
            status = tf.train.Checkpoint(vars=self.vars, optimizer=self.opt).read(path)
            status.assert_consumed()
        else:
            values, stores = path
            for v, value in zip(self.vars, values):
                v.assign(value)
            # Keras loads an object's own variables, then its children's.
            for opt, store in zip(_saveables(self.opt), stores):
                opt.load_own_variables(dict(store))
        self.model = model.copy()
        for v, value in zip(self.shadow_vars, shadow_vars):
            v.assign(value)
        for v, value in zip(self._optimizer_variables(self.shadow), shadow_opt):
            v.assign(value)
        self._after_shadow_restored()
        self.read_fn = None

    @rule()
    def read_counters(self):
        """Reading `micro_step`/`iterations`, eagerly or traced, changes nothing."""
        if self.read_fn is None:
            opt, acc_opt = self.opt, self.acc_opt
            self.read_fn = lambda: (acc_opt.micro_step, opt.iterations)
            if BACKEND == "tensorflow":
                self.read_fn = tf.function(self.read_fn)
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
        # NaN where the shadow has NaN too (an optimizer drawn with a learning
        # rate that decays to 0 and `learning_rate_power=0`, Ftrl's, divides by
        # zero in both): the same bits.
        for v, s in zip(self.vars, self.shadow_vars):
            assert np.array_equal(v.numpy(), s.numpy(), equal_nan=True), v.name
        mine = self._optimizer_state(self.opt)
        theirs = self._optimizer_state(self.shadow)
        assert sorted(mine) == sorted(theirs)
        for key in mine:
            if key not in self.LOSS_SCALE_KEYS:
                assert np.array_equal(mine[key], theirs[key], equal_nan=True), key
        state = self.acc_opt.accumulation_state
        if state is None:  # built on its first micro-step (OptimizerV2)
            assert not any(np.any(s) for s in model.sums)
        else:
            for acc, expected in zip(state.accumulators, model.sums):
                assert np.array_equal(acc.numpy(), expected)
        if model.scale is not None:
            assert self._loss_scale() == (model.scale, model.good_steps)
