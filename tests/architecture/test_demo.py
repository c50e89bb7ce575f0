"""`python -m gradaccum.demo` on the active backend: quiet, and exact."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import BACKEND
from tests.helpers.processes import process_env, run_python


def test_the_demo_runs_quietly_on_the_active_backend():
    """Run as the README runs it: nothing on standard error (so no backend
    start-up messages before its first line), its first line its own, on
    the active backend, and matching the large batch."""
    env = process_env(drop=("TF_CPP_MIN_LOG_LEVEL",), KERAS_BACKEND=BACKEND)
    result = subprocess.run(
        [sys.executable, "-m", "gradaccum.demo", "--epochs", "1"], capture_output=True, text=True, timeout=300, env=env
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr == ""
    assert lines[0].startswith("digits: ") and f"{BACKEND} backend" in lines[0], result.stdout[:3000]
    assert lines[-1] == "OK: accumulated training matches large-batch training"


def test_the_demo_imports_tensorflow_only_on_its_backend():
    out = run_python(
        """
        import sys
        from gradaccum import demo
        assert demo.main(["--epochs", "1", "--n", "2"]) == 0
        print("tensorflow" in sys.modules)
        """,
        env={"KERAS_BACKEND": BACKEND},
    )
    assert out.splitlines()[-1] == str(BACKEND == "tensorflow")
