"""The accumulation state machine (see `property_tests.machine`) for tf_keras.

Every optimizer tf_keras ships, new (`tf_keras.optimizers.*`) and legacy
(`tf_keras.optimizers.legacy.*`, OptimizerV2), with random hyperparameters,
alone or with `tf_keras.mixed_precision.LossScaleOptimizer` in either order.
tf_keras's loss-scale optimizer differs from Keras 3's in three documented
ways the model follows: gradients reach `apply_gradients` unscaled (by
`get_unscaled_gradients`), the scale never halves below 1, and around the
accumulating optimizer a dropped micro-batch still adds 1 to `iterations`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from hypothesis import settings

from gradaccum import accumulate
from property_tests.harness import scaled
from property_tests.machine import MachineBase, start_rule
from property_tests.strategies import tf_keras_optimizers
from tests.helpers import optimizer_state, optimizer_variables


class TfKerasAccumulationMachine(MachineBase):
    LSO = tf_keras.mixed_precision.LossScaleOptimizer
    MIN_SCALE = 1.0
    LEAVES_ABSENT_ALONE = False
    DROPPED_BUMPS_ITERATIONS = ("lso_accumulate",)

    start = start_rule(tf_keras_optimizers())

    def _variable(self, value: np.ndarray, name: str) -> Any:
        return tf.Variable(value, name=name)

    def _subject(self):
        if self.wrap != "lso_accumulate":
            return super()._subject()
        # Built before wrapping, with every variable: built lazily, on the
        # loss-scale optimizer's first `apply_gradients`, it would first know
        # only the variables that had gradients then (a new tf_keras
        # optimizer refuses the others later; an OptimizerV2 adds them, see
        # tests/mixed_precision/test_mixed_precision_tf_keras.py).
        inner = self.spec.make()
        core = accumulate(inner, self.n, **self._accumulate_kwargs())
        core.build(self.vars)
        top = self._make_lso(core, self.initial_scale, self.growth)
        self._build(top, self.vars)
        return top, inner

    def _make_lso(self, inner: Any, initial_scale: float, growth: int) -> Any:
        return self.LSO(inner, initial_scale=initial_scale, dynamic_growth_steps=growth)

    def _build(self, optimizer: Any, variables: list[Any]) -> None:
        build = getattr(optimizer, "build", None)
        if build is not None:
            build(variables)
        else:  # OptimizerV2 (and its loss-scale optimizer) create slots so
            optimizer._create_all_weights(variables)

    def _optimizer_variables(self, optimizer: Any) -> list[Any]:
        return optimizer_variables(optimizer)

    def _optimizer_state(self, optimizer: Any) -> dict[str, np.ndarray]:
        return optimizer_state(optimizer)

    def _after_shadow_skipped(self) -> None:
        # tf_keras's Nadam caches `_u_product` per step by a Python counter
        # that a skipped step leaves behind `iterations`, so the plain
        # optimizer compounds the product twice on its next step. gradaccum
        # keeps the counter at `iterations + 1` (documented in the README),
        # as plain training has it on every step without a skip.
        self._sync_u_product_counter()

    def _after_shadow_restored(self) -> None:
        # Setting the shadow's variables back to a checkpoint's moves its
        # `iterations` back but not that counter, which then says the product
        # of a later step is already cached; plain training restored into a
        # fresh optimizer, as the subject is, recomputes it.
        self._sync_u_product_counter()

    def _sync_u_product_counter(self) -> None:
        inner = getattr(self.shadow, "inner_optimizer", self.shadow)
        if hasattr(inner, "_u_product_counter"):
            inner._u_product_counter = int(inner.iterations.numpy()) + 1

    def _loss_scale(self) -> tuple[float, int]:
        return float(self.opt.loss_scale), int(self.opt.dynamic_counter.numpy())

    def _unscaled(self, grads: list[Any]) -> list[Any]:
        return self.opt.get_unscaled_gradients(grads)


TfKerasAccumulationMachine.TestCase.settings = settings(scaled(20), stateful_step_count=30)
TestTfKerasAccumulationMachine = TfKerasAccumulationMachine.TestCase

