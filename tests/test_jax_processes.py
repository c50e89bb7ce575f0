"""Two JAX processes on 127.0.0.1, `DataParallel` over both: `fit` with
gradaccum equals one device on the large batch.

Starts two `tests.jax_process_worker` processes (a free loopback port for
JAX's coordinator; the CPU collectives run over loopback too), waits for
both under one deadline, killing both on timeout or failure, and compares
what each trained with a reference trained here on one device: the plain
optimizer on the large batch, same initial weights, same data order.
Run by the `keras3-jax` tox environment.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

import gradaccum
from tests import jax_process_worker as worker
from tests.helpers import assert_states_close, fit, full_state, make_mlp

pytestmark = pytest.mark.skipif(keras.config.backend() != "jax", reason="JAX's multi-process runtime")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Each process imports JAX and Keras, connects and compiles one train step:
# ~20 s in all on a loaded machine.
DEADLINE_S = 150
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy")


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in PROXY_VARIABLES}
    # The processes import the same gradaccum and tests package as this one.
    src = str(Path(gradaccum.__file__).resolve().parent.parent)
    paths = [src, str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]
    env.update(
        PYTHONPATH=os.pathsep.join(paths), JAX_PLATFORMS="cpu", KERAS_BACKEND="jax",
    )
    env.pop("XLA_FLAGS", None)
    return env


def _run(tmp_path: Path) -> list[dict[str, np.ndarray]]:
    port = _free_loopback_port()
    outputs = [tmp_path / f"process{i}.npz" for i in range(2)]
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    try:
        for i in range(2):
            with open(logs[i], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.jax_process_worker", str(port), str(i), str(outputs[i])],
                    cwd=REPO_ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                ))
        deadline = time.monotonic() + DEADLINE_S
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
    if codes != [0, 0]:
        tails = "\n".join(
            f"--- process {i} (exit {codes[i]}):\n" + logs[i].read_text(errors="replace")[-3000:] for i in range(2)
        )
        raise AssertionError(f"processes failed or ran past {DEADLINE_S} s (killed):\n{tails}")
    return [dict(np.load(path)) for path in outputs]


def test_fit_over_two_processes_equals_one_device_on_the_large_batch(tmp_path):
    x, y = worker.data()
    reference = make_mlp()
    reference_opt = keras.optimizers.Adam(worker.LR)
    fit(reference, reference_opt, x, y, worker.MICRO_BATCH * worker.N)
    expected = full_state(reference, reference_opt)

    results = _run(tmp_path)
    for result in results:
        # The accumulators were device-local, and no step fell back to an
        # all-reduce per micro-step.
        assert not result.pop("fell_back")
        assert int(result.pop("local_accumulators")) == len(reference.trainable_variables)
        assert int(result["iterations"]) == worker.CYCLES
        assert_states_close(expected, result)
