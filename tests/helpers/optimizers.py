"""The Keras 3 optimizers every sweep covers, and what Keras ships."""

from __future__ import annotations

import inspect

import keras

LR = 1e-2

# One entry per optimizer Keras 3 ships, with its variants.
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(LR),
    "sgd_momentum": lambda: keras.optimizers.SGD(LR, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(LR, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(LR),
    "adam_amsgrad": lambda: keras.optimizers.Adam(LR, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(LR, weight_decay=0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(LR),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(LR, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(LR),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(LR),
    "nadam": lambda: keras.optimizers.Nadam(LR),
    "ftrl": lambda: keras.optimizers.Ftrl(
        LR, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3
    ),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "lamb": lambda: keras.optimizers.Lamb(LR),
    "adafactor": lambda: keras.optimizers.Adafactor(LR),
    "muon": lambda: keras.optimizers.Muon(LR),
    "schedule_free_adamw": lambda: keras.optimizers.ScheduleFreeAdamW(LR),
}


def shipped_optimizers() -> set[str]:
    """Names of the optimizers `keras.optimizers` ships (wrappers excluded)."""
    wrappers = {"Optimizer", "LossScaleOptimizer", "MultiOptimizer", "OptimizerMap"}
    return {
        name
        for name, obj in vars(keras.optimizers).items()
        if inspect.isclass(obj)
        and issubclass(obj, keras.optimizers.Optimizer)
        and name not in wrappers
    }
