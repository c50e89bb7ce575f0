"""Two JAX processes on 127.0.0.1, `DataParallel` over both: `fit` with
gradaccum equals one device on the large batch.

Starts two `tests.distribution.jax_process_worker` processes (a free loopback port for
JAX's coordinator; the CPU collectives run over loopback too), waits for
both under one deadline, killing both on timeout or failure, and compares
what each trained with a reference trained here on one device: the plain
optimizer on the large batch, same initial weights, same data order.
Run by the `keras3-jax` tox environment.
"""

from __future__ import annotations

import re
from pathlib import Path

import keras
import numpy as np
import pytest

from tests.distribution import jax_process_worker as worker
from tests.helpers import assert_states_close, fit, full_state, make_mlp
from tests.helpers.processes import free_loopback_ports, process_env, run_processes

pytestmark = pytest.mark.skipif(keras.config.backend() != "jax", reason="JAX's multi-process runtime")

# Each process imports JAX and Keras, connects and compiles one train step:
# ~20 s in all on a loaded machine.
DEADLINE_S = 150


def _run(tmp_path: Path, arguments: tuple[tuple[int, ...], ...] = ((), ())) -> list[dict[str, np.ndarray]]:
    """Runs both workers; `arguments[i]` are process i's after its output
    (`MEMORY_LIMIT`, `OUT_OF_MEMORY_ABOVE`: see the worker)."""
    port = free_loopback_ports(1)[0]
    # One CPU device per process: no XLA_FLAGS.
    env = process_env(drop=("XLA_FLAGS",), JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    return run_processes(
        "tests.distribution.jax_process_worker",
        lambda i, output: [str(port), str(i), str(output), *map(str, arguments[i])],
        lambda i: env, tmp_path, DEADLINE_S,
    )


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


def test_auto_micro_batch_size_is_agreed_by_processes_given_different_limits(tmp_path):
    """Process 0 has room for the whole batch, process 1 not: XLA's analysis
    of this step on the CPU gives ~107 kB for the whole batch of 32 and
    ~96 kB split in micro-batches of 16. Both trace the smaller size (else
    their programs' collectives differ and the run fails) and train as one
    device on the large batch."""
    batch = worker.MICRO_BATCH * worker.N
    x, y = worker.data()
    reference = make_mlp(widths=worker.AUTO_WIDTHS)
    reference_opt = keras.optimizers.Adam(worker.LR)
    fit(reference, reference_opt, x, y, batch)
    expected = full_state(reference, reference_opt)

    results = _run(tmp_path, ((2**40,), (100_000,)))
    sizes = [int(result.pop("micro_batch_size")) for result in results]
    assert sizes[0] == sizes[1] < batch, sizes
    for result in results:
        assert not result.pop("fell_back")
        assert int(result.pop("local_accumulators")) == len(reference.trainable_variables)
        assert int(result["iterations"]) == worker.CYCLES
        assert_states_close(expected, result)


def test_a_process_whose_step_does_not_fit_at_one_sample_stops_every_process(tmp_path):
    """Process 1's limit holds no step at all: both processes raise (none
    waits for the other in the agreement)."""
    errors = [str(result["error"]) for result in _run(tmp_path, ((2**40,), (4000,)))]
    assert "another process's train step does not fit even at micro-batches of 1 sample" in errors[0], errors
    assert re.search(r"needs \d+ bytes .* has 4000 bytes \(memory_limit\)", errors[1]), errors


def test_running_out_of_memory_on_one_process_raises_instead_of_running_again(tmp_path):
    """Process 1's step runs out of memory above 16 samples, process 0's
    fits: process 1 cannot run the batch again smaller (process 0 runs the
    step they agreed on and waits for process 1 in its collectives), so it
    raises; process 0 stops by itself (JAX's distributed runtime ends it
    once process 1 is gone) instead of waiting past the deadline (a kill's
    exit -9)."""
    with pytest.raises(AssertionError, match=r"--- process 0 \(exit (?!-9\))-?\d+\)"):
        _run(tmp_path, ((2**40,), (2**40, 16)))
    error = str(np.load(tmp_path / "process1.npz")["error"])
    assert "ran out of memory on this process" in error and "micro_batch_size=" in error, error
