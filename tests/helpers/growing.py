"""An OptimizerV2 (tf_keras) that grows, for the loss-scale tests.

A tf_keras loss-scale optimizer drops `None` gradients, so the accumulating
OptimizerV2 inside it first meets only the variables that have gradients
and meets the others later. Micro-gradient patterns, two micro-steps per
cycle: "a" and "b" have a gradient, "-" has None; `b` is first met on an
in-between micro-step.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import tensorflow as tf
import tf_keras

from tests.helpers.state import full_state

GROW_N = 2
GROW_PATTERNS = ["a-", "a-", "-b", "ab", "ab", "ab", "a-", "-b"]
GROW_LEGACY = {
    "sgd": lambda: tf_keras.optimizers.legacy.SGD(0.1),
    "adam": lambda: tf_keras.optimizers.legacy.Adam(0.1),
}


def grow_variables():
    # Different shapes: accumulators mixed up between variables cannot pass.
    return [
        tf.Variable(np.array([1.0, -2.0], np.float32), name="a"),
        tf.Variable(np.array([0.5, 3.0, -1.0], np.float32), name="b"),
    ]


def grow_grads(k):
    """Micro-step `k`'s gradients, `None` where its pattern says so."""
    rng = np.random.default_rng(k)
    pattern = GROW_PATTERNS[k]
    shapes = [(2,), (3,)]
    return [
        tf.constant(rng.normal(size=shape).astype(np.float32)) if c != "-" else None
        for c, shape in zip(pattern, shapes)
    ]


def grow_state(variables, opt):
    return full_state(SimpleNamespace(weights=variables), opt)


def grow_reference(make):
    """The plain loss-scale optimizer fed every cycle's mean gradient.

    It adds the same float32 values as the accumulating optimizer (the sum
    of the given micro-gradients over `n`): states agree bit for bit.
    """
    variables = grow_variables()
    opt = tf_keras.mixed_precision.LossScaleOptimizer(make())
    for start in range(0, len(GROW_PATTERNS), GROW_N):
        cycle = [grow_grads(k) for k in range(start, start + GROW_N)]
        mean = []
        for per_variable in zip(*cycle):
            given = [g for g in per_variable if g is not None]
            mean.append(None if not given else tf.add_n(given) / GROW_N)
        opt.apply_gradients(zip(mean, variables))
    return grow_state(variables, opt)
