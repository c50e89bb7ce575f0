"""tf_keras counterparts of `tests.support`: models, state, reference runs.

A reference run trains the plain optimizer on batch `B * n`; the subject run
trains `accumulate(optimizer, n)` on micro-batch `B`, from the same initial
weights and in the same data order. tf_keras variables have no `path`, so
state is keyed by variable name.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras

from tests.support import (
    ATOL,
    RTOL,
    assert_states_close,
    assert_states_equal,
    fit,
    make_data,
)

__all__ = [
    "ATOL",
    "GROW_LEGACY",
    "GROW_N",
    "GROW_PATTERNS",
    "RTOL",
    "assert_states_close",
    "assert_states_equal",
    "fit",
    "fit_pair",
    "full_state",
    "grow_grads",
    "grow_reference",
    "grow_state",
    "grow_variables",
    "make_data",
    "make_embedding_model",
    "make_mlp",
    "optimizer_state",
    "optimizer_variables",
    "state_key",
]


def make_mlp(
    in_dim: int = 5,
    out_dim: int = 3,
    widths: tuple[int, ...] = (8,),
    seed: int = 0,
    **dense_kwargs: Any,
) -> tf_keras.Model:
    tf_keras.utils.set_random_seed(seed)
    layers = [tf_keras.Input((in_dim,))]
    for i, w in enumerate(widths):
        layers.append(
            tf_keras.layers.Dense(
                w, activation="tanh", name=f"hidden{i}", **dense_kwargs
            )
        )
    layers.append(tf_keras.layers.Dense(out_dim, name="out", dtype="float32"))
    return tf_keras.Sequential(layers, name="mlp")


def make_embedding_model(
    vocab: int = 20, dim: int = 4, seed: int = 0
) -> tf_keras.Model:
    tf_keras.utils.set_random_seed(seed)
    inputs = tf_keras.Input((3,), dtype="int32")
    h = tf_keras.layers.Embedding(vocab, dim, name="emb")(inputs)
    h = tf_keras.layers.Flatten()(h)
    out = tf_keras.layers.Dense(2, name="out")(h)
    return tf_keras.Model(inputs, out, name="embed")


def optimizer_variables(optimizer: Any) -> list[tf.Variable]:
    """`variables` of either family (a method on OptimizerV2)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def state_key(name: str) -> str:
    """A variable's name without what differs between equivalent runs.

    Slot names start with the name scopes they were created in, which depend
    on the code path that built the optimizer ("Adam/m/hidden0/kernel" from
    `apply_gradients`, "m/hidden0/kernel" from `build`, "cond_1/Adam/iter"
    inside a loss-scale optimizer's `tf.cond`): leading scopes that are an
    optimizer's default name (capitalised; the test models' layer names are
    not) or a `cond` are dropped. So is the process-wide uniquifying suffix
    of unnamed variables ("Variable_3").
    """
    parts = name.split(":")[0].split("/")
    while len(parts) > 1 and re.fullmatch(r"[A-Z]\w*|cond(_\d+)?", parts[0]):
        parts = parts[1:]
    return re.sub(r"_\d+$", "", "/".join(parts))


def optimizer_state(optimizer: Any) -> dict[str, np.ndarray]:
    """Every optimizer variable, keyed "opt/<name>" (`#k` for repeated names)."""
    out: dict[str, np.ndarray] = {}
    for v in optimizer_variables(optimizer):
        key, k = f"opt/{state_key(v.name)}", 1
        while key in out:
            key, k = f"opt/{state_key(v.name)}#{k}", k + 1
        out[key] = np.asarray(v.numpy())
    return out


def full_state(model: tf_keras.Model, optimizer: Any) -> dict[str, np.ndarray]:
    """Model weights, every optimizer variable (by name) and `iterations`."""
    out = {f"model/{state_key(v.name)}": np.asarray(v.numpy()) for v in model.weights}
    out.update(optimizer_state(optimizer))
    out["iterations"] = np.asarray(int(optimizer.iterations.numpy()))
    return out


def fit_pair(
    make_optimizer: Callable[[], Any],
    n: int,
    micro_batch: int = 4,
    cycles: int = 3,
    make_model: Callable[[], tf_keras.Model] = make_mlp,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    loss: Any = "mse",
    **compile_kwargs: Any,
):
    """Trains reference (batch B*n) and subject (accumulate, batch B) with fit.

    Returns `(reference_state, subject_state, subject_model, subject_opt)`.
    """
    from gradaccum import accumulate

    if data is None:
        data = make_data(micro_batch * n * cycles)
    x, y = data
    ref_model = make_model()
    ref_opt = make_optimizer()
    fit(ref_model, ref_opt, x, y, micro_batch * n, loss=loss, **compile_kwargs)
    model = make_model()
    opt = accumulate(make_optimizer(), n)
    fit(model, opt, x, y, micro_batch, loss=loss, **compile_kwargs)
    return full_state(ref_model, ref_opt), full_state(model, opt), model, opt


def mse_grads(model: tf_keras.Model, x, y):
    with tf.GradientTape() as tape:
        loss = tf_keras.losses.MeanSquaredError()(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


# ----------------------------------------------------------------------
# An OptimizerV2 that grows: a loss-scale optimizer first calls it with only
# the variables that have gradients, and it meets the others later.

GROW_N = 2
# The reference, the plain loss-scale optimizer fed each cycle's mean
# gradient (the sum of the given micro-gradients over `n`), adds the same
# float32 values: states agree bit for bit.
# Micro-gradient patterns, two micro-steps per cycle: "a" and "b" have a
# gradient, "-" has None. `b` is first met on an in-between micro-step.
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
    """The plain loss-scale optimizer fed every cycle's mean gradient."""
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


def run_python(code: str) -> str:
    """Runs `code` (dedented) in a fresh Python process; returns its output.

    For what depends on which modules a process has imported (TensorFlow
    fixes its Keras flavour at import).
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
