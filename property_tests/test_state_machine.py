"""The accumulation state machine (see `property_tests.machine`) for Keras 3
on the active backend.

Every Keras 3 optimizer with random hyperparameters, alone or with a
`keras.optimizers.LossScaleOptimizer` in either order; micro-steps with
`None` gradients (and `tf.IndexedSlices` on TensorFlow) and weights, `n` set
mid-cycle, `flush()`, checkpoints restored into fresh variables and
optimizers, each checked bit for bit against the plain-Python model and a
shadow plain optimizer after every rule (see the differences between the
backends in `property_tests.machine`).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from hypothesis import settings

from property_tests.harness import OptimizerSpec, scaled
from property_tests.machine import MachineBase, start_rule
from property_tests.strategies import optimizers
from tests.helpers import optimizer_state, optimizer_variables


class AccumulationMachine(MachineBase):
    LSO = keras.optimizers.LossScaleOptimizer
    LOSS_SCALE_KEYS = ("opt/step_counter", "opt/dynamic_scale")

    start = start_rule(optimizers())

    def _variable(self, value: np.ndarray, name: str) -> Any:
        return keras.Variable(value, name=name)

    def _make_lso(self, inner: Any, initial_scale: float, growth: int) -> Any:
        return self.LSO(inner, initial_scale=initial_scale, dynamic_growth_steps=growth)

    def _optimizer_state(self, optimizer: Any) -> dict[str, np.ndarray]:
        return optimizer_state(optimizer)

    def _optimizer_variables(self, optimizer: Any) -> list[Any]:
        return optimizer_variables(optimizer)

    def _loss_scale(self) -> tuple[float, int]:
        return (
            float(keras.ops.convert_to_numpy(self.opt.dynamic_scale)),
            int(keras.ops.convert_to_numpy(self.opt.step_counter)),
        )


AccumulationMachine.TestCase.settings = settings(scaled(30), stateful_step_count=40)
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
                    scale_exponent=0, growth=1, update="masked")
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
    second) is left out of the second cycle's update, as without the
    restore and as in the large batch."""
    _replay([("dense", "dense", "dense")] * 2
            + ["save", "restore"] + [("dense", "none", "dense")] * 2)
