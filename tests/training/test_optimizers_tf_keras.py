"""Every optimizer tf_keras ships, new and legacy: accumulated equals large batch."""

import inspect

import pytest
import tf_keras

from tests.helpers import assert_states_close, fit_pair

LR = 1e-2
new = tf_keras.optimizers
legacy = tf_keras.optimizers.legacy

# The optimizer introduced in Keras 2.11 (`tf_keras.optimizers.*`).
OPTIMIZERS = {
    "sgd": lambda: new.SGD(LR),
    "sgd_momentum": lambda: new.SGD(LR, momentum=0.9),
    "sgd_nesterov": lambda: new.SGD(LR, momentum=0.9, nesterov=True),
    "adam": lambda: new.Adam(LR),
    "adam_amsgrad": lambda: new.Adam(LR, amsgrad=True),
    "adamw": lambda: new.AdamW(LR, weight_decay=0.05),
    "rmsprop": lambda: new.RMSprop(LR),
    "rmsprop_centered": lambda: new.RMSprop(LR, momentum=0.5, centered=True),
    "adagrad": lambda: new.Adagrad(LR),
    "adadelta": lambda: new.Adadelta(1.0),
    "adamax": lambda: new.Adamax(LR),
    "nadam": lambda: new.Nadam(LR),
    "ftrl": lambda: new.Ftrl(
        LR, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3
    ),
    "lion": lambda: new.Lion(1e-3),
    "adafactor": lambda: new.Adafactor(LR),
}

# OptimizerV2 (`tf_keras.optimizers.legacy.*`): updates run in fused kernels.
LEGACY_OPTIMIZERS = {
    "sgd": lambda: legacy.SGD(LR),
    "sgd_momentum": lambda: legacy.SGD(LR, momentum=0.9),
    "sgd_nesterov": lambda: legacy.SGD(LR, momentum=0.9, nesterov=True),
    "adam": lambda: legacy.Adam(LR),
    "adam_amsgrad": lambda: legacy.Adam(LR, amsgrad=True),
    "rmsprop": lambda: legacy.RMSprop(LR),
    "rmsprop_centered": lambda: legacy.RMSprop(LR, momentum=0.5, centered=True),
    "adagrad": lambda: legacy.Adagrad(LR),
    "adadelta": lambda: legacy.Adadelta(1.0),
    "adamax": lambda: legacy.Adamax(LR),
    "nadam": lambda: legacy.Nadam(LR),
    "ftrl": lambda: legacy.Ftrl(
        LR, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3
    ),
}


def _shipped(module, base):
    return {
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, base) and obj is not base
    }


@pytest.mark.parametrize(
    "module, base, table",
    [
        (new, new.Optimizer, OPTIMIZERS),
        (new.experimental, new.Optimizer, OPTIMIZERS),
        (legacy, legacy.Optimizer, LEGACY_OPTIMIZERS),
    ],
    ids=["optimizers", "optimizers.experimental", "optimizers.legacy"],
)
def test_every_builtin_optimizer_is_covered(module, base, table):
    """A new optimizer in tf_keras must get an entry above."""
    covered = {type(make()).__name__ for make in table.values()}
    missing = _shipped(module, base) - covered
    assert not missing, sorted(missing)


@pytest.mark.parametrize(
    "make",
    [pytest.param(m, id=k) for k, m in OPTIMIZERS.items()]
    + [pytest.param(m, id=f"legacy_{k}") for k, m in LEGACY_OPTIMIZERS.items()],
)
def test_matches_large_batch_after_three_cycles(make):
    ref, acc, _, opt = fit_pair(make, n=3, micro_batch=4, cycles=3)
    assert acc["iterations"] == 3
    assert int(opt.micro_step) == 0
    assert_states_close(ref, acc)
