"""Every optimizer Keras 3 ships: accumulated training equals large batch."""

import keras
import pytest

from tests.support import MODES, assert_states_close, fit_pair, shipped_optimizers

LR = 1e-2

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(LR),
    "sgd_momentum": lambda: keras.optimizers.SGD(LR, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(LR, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(LR),
    "adam_amsgrad": lambda: keras.optimizers.Adam(LR, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(LR, weight_decay=0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(LR),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(
        LR, momentum=0.5, centered=True
    ),
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


def test_every_builtin_optimizer_is_covered():
    """A new optimizer in `keras.optimizers` must get an entry above."""
    shipped = shipped_optimizers()
    covered = {type(make()).__name__ for make in OPTIMIZERS.values()}
    assert shipped <= covered, sorted(shipped - covered)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_large_batch_after_three_cycles(name, mode):
    ref, acc, _, opt = fit_pair(OPTIMIZERS[name], n=3, micro_batch=4, cycles=3, mode=mode)
    assert opt.mode == mode
    assert acc["iterations"] == 3
    assert int(opt.micro_step) == 0
    assert_states_close(ref, acc)
