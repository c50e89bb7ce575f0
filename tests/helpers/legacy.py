"""Whether this process runs legacy Keras (tf_keras), and what the tf_keras
suites collect in one that does not.

TensorFlow fixes its Keras flavour when it is imported, so the tf_keras
tests run in their own process with `TF_USE_LEGACY_KERAS=1` (`tox -e
tfkeras`). In a Keras 3 process they are not collected, and the run says
so at its end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")


def collect_only_under_legacy_keras(directory: str) -> tuple[list[str], Callable[[Any], None]]:
    """A tf_keras suite's conftest: `(collect_ignore_glob, pytest_terminal_summary)`."""

    def pytest_terminal_summary(terminalreporter: Any) -> None:
        if not LEGACY:
            terminalreporter.write_line(
                f"{directory} not collected: it needs TF_USE_LEGACY_KERAS=1 "
                "in its own process (tox -e tfkeras)."
            )

    return ([] if LEGACY else ["test_*.py"]), pytest_terminal_summary
