"""The tf_keras tests need a legacy Keras 2 process (see `tests.helpers.legacy`)."""

from tests.helpers.legacy import collect_only_under_legacy_keras

collect_ignore_glob, pytest_terminal_summary = collect_only_under_legacy_keras("tests/tf_keras")
