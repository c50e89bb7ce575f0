"""The accumulation state machine (`property_tests.machine`) on the active
backend: every Keras 3 optimizer with random hyperparameters, micro-steps
with `None` gradients and weights, `n` set mid-cycle, `flush()`, Keras-file
saves restored into fresh variables and optimizers, each checked bit for bit
against the plain-Python model and a shadow plain optimizer after every
rule (see the differences from TensorFlow in `property_tests.machine`)."""

from __future__ import annotations

from property_tests.test_state_machine import AccumulationMachine

TestAccumulationMachine = AccumulationMachine.TestCase
