"""Code run in a fresh Python process.

For what depends on which modules a process has imported (TensorFlow fixes
its Keras flavour at import; `import gradaccum` must not import TensorFlow
on JAX and PyTorch) and for the README's recipes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Runs `code` (dedented) in a fresh interpreter, with `env` added to
    this process's environment; asserts it succeeded and returns its output."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout
