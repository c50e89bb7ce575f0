"""`python -m gradaccum.demo` on the active backend: quiet, and exact."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import BACKEND
from tests.helpers.processes import process_env

# As `python -m gradaccum.demo --epochs 1` runs it (`runpy` imports the
# package first, then runs the module as `__main__`), and then says whether
# TensorFlow was imported.
_RUN_AS_MAIN = textwrap.dedent(
    """
    import atexit, runpy, sys
    atexit.register(lambda: print("tensorflow imported:", "tensorflow" in sys.modules))
    sys.argv[1:] = ["--epochs", "1"]
    runpy.run_module("gradaccum.demo", run_name="__main__", alter_sys=True)
    """
)


def test_the_demo_runs_quietly_on_the_active_backend():
    """Its first line is its own (no backend start-up messages before it, on
    standard error either), it trains on the active backend, matches the
    large batch, and imports TensorFlow only where that is the backend."""
    env = process_env(drop=("TF_CPP_MIN_LOG_LEVEL",), KERAS_BACKEND=BACKEND)
    result = subprocess.run(
        [sys.executable, "-c", _RUN_AS_MAIN],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        env=env,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout[-3000:]
    assert lines[0].startswith("digits: ") and f"{BACKEND} backend" in lines[0], result.stdout[:3000]
    assert "OK: accumulated training matches large-batch training" in lines
    assert lines[-1] == f"tensorflow imported: {BACKEND == 'tensorflow'}"
