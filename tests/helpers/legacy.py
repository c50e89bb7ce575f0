"""Whether this process runs legacy Keras (tf_keras).

TensorFlow fixes its Keras flavour when it is imported, so the tf_keras
tests run in their own process with `TF_USE_LEGACY_KERAS=1` (`tox -e
tfkeras`), which collects only them (`tests.helpers.collection`).
"""

from __future__ import annotations

import os

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")
