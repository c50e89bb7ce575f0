"""Hypothesis profiles for the property suite, which files this process
collects, and TensorFlow set-up.

A file's name says where it runs, as under `tests/` (see `tests/conftest.py`):
`test_x.py` on every Keras 3 backend, `test_x_tensorflow.py` on TensorFlow
only and `test_x_tf_keras.py` under tf_keras only.

Profiles (select with the `HYPOTHESIS_PROFILE` environment variable):

- `ci` (default): few examples per property, so the whole suite runs in a
  few minutes on two CPU cores.
- `thorough`: many more examples, for a long run before a release.
- `pinned`: only the `@example(...)` regressions (bugs found before).

Both print the reproduction blob of a failing example
(`@reproduce_failure(...)`) and store failures in the local example database
(`.hypothesis/`, not under version control), so a failure found once is
replayed first on the next run.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    import tensorflow as tf

    # Same device layout as tests/conftest.py (two logical CPUs), whichever
    # of the two directories is collected first; single-device code runs on
    # /cpu:0.
    try:
        _cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:  # already initialised by the other conftest
        pass

# After TensorFlow's set-up: importing the helpers imports Keras.
from tests.helpers.collection import pytest_ignore_collect  # noqa: E402, F401  (the hook)

_COMMON = dict(
    # Tracing a tf.function takes longer than Hypothesis's default deadline.
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

settings.register_profile(
    "ci",
    max_examples=10,
    # No shrinking budget beyond what a failure needs; the explain phase
    # re-runs examples and costs more than it tells on these tests.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    **_COMMON,
)
settings.register_profile("thorough", max_examples=200, **_COMMON)
settings.register_profile("pinned", phases=[Phase.explicit], **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
