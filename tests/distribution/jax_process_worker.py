"""One process of a two-process JAX `DataParallel` run (for tests).

Started by `tests/distribution/test_processes_jax.py`: joins the other process through
`jax.distributed.initialize` on 127.0.0.1 (CPU collectives over loopback),
trains `accumulate(Adam, n)` with `model.fit` under `DataParallel` over both
processes' devices, each process feeding its half of every micro-batch, and
writes its weights and optimizer variables (replicated: each process holds
them whole) to the `.npz` file named on the command line. It also records
whether a train step fell back to all-reducing its gradients per micro-step.

Given a `MEMORY_LIMIT`, it trains `accumulate(Adam, micro_batch_size="auto",
memory_limit=MEMORY_LIMIT)` instead, on batches of `MICRO_BATCH * N` (each
process feeding its half of every batch), and records the size chosen; given
`OUT_OF_MEMORY_ABOVE` too, its train step runs out of memory above that size
(`out_of_memory_above`). A `MemoryError` from `fit` is recorded (`error`)
and the process leaves at once: the other may be waiting inside a collective.

    python -m tests.distribution.jax_process_worker COORDINATOR_PORT PROCESS_ID OUTPUT.npz \
        [MEMORY_LIMIT [OUT_OF_MEMORY_ABOVE]]
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

N = 4
MICRO_BATCH = 8  # global: 4 samples per process
CYCLES = 3
LR = 1e-2
# With micro_batch_size="auto": a hidden layer wide enough that activations,
# not the state, decide what fits.
AUTO_WIDTHS = (256,)


def data():
    """The whole run's data, in the order one device sees it."""
    from tests.helpers import make_data

    return make_data(MICRO_BATCH * N * CYCLES)


def process_share(a, process: int, processes: int = 2, batch: int = MICRO_BATCH):
    """This process's rows of every batch of `batch` samples, in order."""
    per = batch // processes
    steps = a.reshape(-1, batch, *a.shape[1:])
    return steps[:, process * per:(process + 1) * per].reshape(-1, *a.shape[1:])


def _collectives_on_loopback() -> None:
    """Binds gloo's collectives to 127.0.0.1: by default it binds to the
    address the host name resolves to, which need not be loopback. Must run
    after `jax.distributed.initialize` and before JAX makes its CPU client."""
    import functools

    import jax  # noqa: F401
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    collectives = _jax.make_gloo_tcp_collectives(distributed.global_state.client, hostname="127.0.0.1")
    registered = xla_bridge._backend_factories["cpu"]
    xla_bridge.register_backend_factory(
        "cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
        priority=registered.priority, fail_quietly=False,
    )


def main(
    port: str, process: int, output: str, memory_limit: int | None = None, out_of_memory_above: int | None = None
) -> None:
    """Trains and writes the state (the test process sets `KERAS_BACKEND=jax`
    and no `XLA_FLAGS`: one CPU device per process)."""
    import jax

    # CPU collectives across processes: gloo over TCP (JAX 0.10's default,
    # named so that a changed default cannot silently change the test).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process, coordinator_bind_address=f"127.0.0.1:{port}",
        initialization_timeout=60,
        heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30,
    )
    _collectives_on_loopback()
    import keras
    import numpy as np

    from gradaccum import accumulate
    from gradaccum._backend.memory import out_of_memory_above as injected
    from tests.helpers import full_state, make_mlp

    assert jax.process_count() == 2 and len(jax.devices()) == 2, jax.devices()
    # Each process feeds its own share of every micro-batch (already split).
    distribution = keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False)
    keras.distribution.set_distribution(distribution)
    x, y = data()
    if memory_limit is None:
        model, opt, batch = make_mlp(), accumulate(keras.optimizers.Adam(LR), N), MICRO_BATCH
    else:
        model = make_mlp(widths=AUTO_WIDTHS)
        opt = accumulate(keras.optimizers.Adam(LR), micro_batch_size="auto", memory_limit=memory_limit)
        batch = MICRO_BATCH * N
    model.compile(optimizer=opt, loss="mse")
    running_out = injected(out_of_memory_above) if out_of_memory_above is not None else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, running_out:
        warnings.simplefilter("always")
        try:
            model.fit(process_share(x, process, batch=batch), process_share(y, process, batch=batch),
                      batch_size=batch // 2, shuffle=False, verbose=0)
        except MemoryError as error:
            print(f"MemoryError: {error}", flush=True)
            np.savez(output, error=np.asarray(str(error)))
            os._exit(0)
    fell_back = any("all-reduced on every micro-step" in str(w.message) for w in caught)
    local = [v for v in opt.variables if "gradaccum_accumulator" in v.path]
    state = full_state(model, opt)
    state["fell_back"] = np.asarray(fell_back)
    state["local_accumulators"] = np.asarray(sum(v.shape[0] == 2 for v in local))
    if memory_limit is not None:
        state["micro_batch_size"] = np.asarray(opt.micro_batch_size)
    np.savez(output, **state)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *(int(a) for a in sys.argv[4:6]))
