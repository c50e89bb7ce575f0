"""The tf_keras property tests need a legacy Keras 2 process.

TensorFlow fixes its Keras flavour when it is imported, so these run in
their own process with `TF_USE_LEGACY_KERAS=1` (`tox -e tfkeras`). In a
Keras 3 process they are not collected, and the run says so at its end.
"""

import os

_LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")

if not _LEGACY:
    collect_ignore_glob = ["test_*.py"]

    def pytest_terminal_summary(terminalreporter):
        terminalreporter.write_line(
            "property_tests/tf_keras not collected: they need "
            "TF_USE_LEGACY_KERAS=1 in their own process (tox -e tfkeras)."
        )
