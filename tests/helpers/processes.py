"""Code run in a fresh Python process.

For what depends on which modules a process has imported (TensorFlow fixes
its Keras flavour at import; `import gradaccum` must not import TensorFlow
on JAX and PyTorch) and for the README's recipes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import gradaccum


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


REPO_ROOT = Path(__file__).resolve().parents[2]
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy")


def free_loopback_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def process_env(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a worker on loopback: no proxies (nor
    the keys in `drop`), the same gradaccum and tests package on its path,
    and `extra` set."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARIABLES and k not in drop}
    src = str(Path(gradaccum.__file__).resolve().parent.parent)
    paths = [src, str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    env.update(extra)
    return env


def run_processes(
    module: str,
    args: Callable[[int, Path], list[str]],
    env: Callable[[int], dict[str, str]],
    folder: Path,
    deadline_s: float,
    count: int = 2,
) -> list[dict[str, np.ndarray]]:
    """Runs `count` processes of `python -m module *args(i, output)` under
    one deadline, killing all of them on timeout or on any failure, and
    returns the arrays each saved to its `output` (an `.npz` in `folder`).

    Raises:
        AssertionError: If a process failed or the deadline passed, with
            the end of each process's log.
    """
    outputs = [folder / f"process{i}.npz" for i in range(count)]
    logs = [folder / f"process{i}.log" for i in range(count)]
    procs: list[subprocess.Popen] = []
    try:
        for i in range(count):
            with open(logs[i], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, *args(i, outputs[i])],
                    cwd=REPO_ROOT, env=env(i), stdout=log, stderr=subprocess.STDOUT,
                ))
        deadline = time.monotonic() + deadline_s
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    codes = [p.returncode for p in procs]
    if codes != [0] * count:
        tails = "\n".join(
            f"--- process {i} (exit {codes[i]}):\n" + logs[i].read_text(errors="replace")[-3000:] for i in range(count)
        )
        raise AssertionError(f"processes failed or ran past {deadline_s} s (killed):\n{tails}")
    return [dict(np.load(path)) for path in outputs]
