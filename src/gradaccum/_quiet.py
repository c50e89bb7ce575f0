"""A quiet start for `python -m gradaccum.demo`: the backend's start-up
messages kept off the screen. Imports nothing of Keras.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

DEMO = "gradaccum.demo"


def started_as(module: str) -> bool:
    """Whether this process was started as `python -m module`."""
    argv = list(getattr(sys, "orig_argv", ()))
    return "-m" in argv[:-1] and argv[argv.index("-m") + 1] == module


def import_keras() -> None:
    """Imports Keras, and so its backend, with standard error silenced and
    TensorFlow's C++ logging (once started) limited to errors."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with stderr_silenced():
        import keras  # noqa: F401


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """Sends the process's standard error (file descriptor 2) to /dev/null.

    TensorFlow's C++ start-up messages (CPU features, CUDA probing, oneDNN)
    are written before its logging settings are read, so only this keeps
    them off the screen. Python's own errors raised inside still propagate
    and are printed once the descriptor is back.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
