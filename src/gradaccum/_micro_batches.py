"""Micro-batches inside `model.fit`'s train step: `accumulate(opt, micro_batch_size=m)`.

`fit(batch_size=B)` keeps `B` as the batch the user means: Keras's original
train step runs once per micro-batch of `m` samples of the batch (the last
one smaller where `m` does not divide `B`), and the accumulating core makes
those `k = ceil(B / m)` micro-steps one cycle (`Cycle.splitting`). So the
optimizer applies once per batch, `iterations`, schedules, callbacks and
checkpoints count updates, and everything a micro-step does (loss counts,
kept `tf.IndexedSlices`, loss scaling, AGC) is the accumulation's own.

Keras's train step of each backend is wrapped (see `gradaccum._patches`);
the loop over micro-batches is the backend's
(`gradaccum._backend.micro_batches.split_train_step`). A step that calls Keras's own
(`super().train_step(data)`) is split there. A model that overrides
`train_step` with a step of its own is not split: its `apply_gradients`
then raises, saying to accumulate across steps with `n` (see `Core.step`).

With `micro_batch_size="auto"`, Keras's train function is wrapped too
(`make_train_function`, `Retrying`): it hands the train step one batch at a
time, has the size chosen on the first (`gradaccum._auto_size`), and where
the device runs out of memory it puts back what the failed step wrote and
runs the same batch again with a smaller size, traced anew.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from keras import ops, tree

from gradaccum import _atomic, _auto_size, _families


def _splitting(model: Any) -> Any:
    """The core that splits `model`'s train step, or None."""
    core = _families.core_in(getattr(model, "optimizer", None))
    if core is None or core.settings.micro_batch_size is None or core.cycle.split is not None:
        return None
    return core


def train_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `train_step` of the TensorFlow, JAX and PyTorch trainers,
    split into micro-batches for a model whose optimizer has a
    `micro_batch_size`."""
    core = _splitting(instance)
    if core is None:
        return wrapped(*args, **kwargs)
    size = core.settings.micro_batch_size
    if size == "auto" or _memory().injecting():
        # This replica's share of the batch; sizes count over all replicas.
        total, replicas = _device().batch_size(_device().step_data(args, kwargs)), _device().replicas(instance)
        if size == "auto":
            size = _auto_size.search_of(core).size or (None if total is None else total * replicas)
            if size is None:
                raise ValueError(
                    "micro_batch_size=\"auto\" chooses the micro-batch in `model.fit`'s train function; "
                    "this train step was called outside it on a batch whose size the trace does not know."
                )
        if _memory().injecting():
            wrapped = _injecting(wrapped, max(1, size // replicas), total, replicas, instance)
    return _device().split_train_step(
        _weighing_samples(wrapped, core), args, kwargs, size, functools.partial(_splitting_into, core), instance
    )


def _weighing_samples(step: Callable[..., Any], core: Any) -> Callable[..., Any]:
    """`step`, whose micro-batch weighs its samples unless its loss hands
    over a count of its own: Keras's `compute_loss` hands over what it
    divided by (`gradaccum._loss_counts`: also None, for a sum), but a
    `compute_loss` of the model's own that calls no Keras loss, or a loss
    function that returns a scalar, tells nothing, and a split batch's
    micro-batches differ in size."""

    def run(*args: Any, **kwargs: Any) -> Any:
        leaf = next(t for t in tree.flatten(_device().step_data(args, kwargs)) if t is not None)
        core.weights.count_next(ops.cast(ops.shape(leaf)[0], "float32"))
        return step(*args, **kwargs)

    return run


def _device() -> Any:
    # The loops are the backend's (imported on use).
    from gradaccum._backend import micro_batches

    return micro_batches


def _memory() -> Any:
    # What the device tells of its memory is the backend's (imported on use).
    from gradaccum._backend import memory

    return memory


def _injecting(step: Callable[..., Any], share: int, total: Any, replicas: int, model: Any) -> Callable[..., Any]:
    """`step`, raising the test hook's out-of-memory error on the micro-batch
    it asks for (`_backend.memory.out_of_memory_above`): of `share`
    samples of this replica's `total`, counted over all `replicas`."""
    known = isinstance(total, int)
    count = -(-total // share) if known else None
    largest = (min(share, total) if known else share) * replicas

    def run(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        return _memory().run_injected(step, args, kwargs, largest, len(calls) == count, model)

    calls: list[None] = []

    return run


def make_train_function(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `make_train_function` of the TensorFlow, JAX and PyTorch
    trainers: for a model whose optimizer has `micro_batch_size="auto"`,
    the train function made is wrapped in a `Retrying` one."""
    result = wrapped(*args, **kwargs)
    core = _families.core_in(getattr(instance, "optimizer", None))
    function = getattr(instance, "train_function", None)
    if core is None or core.settings.micro_batch_size is None or function is None:
        return result
    if core.settings.micro_batch_size == "auto":
        if not isinstance(function, Retrying):
            _device().check_auto(instance)
            instance.train_function = Retrying(instance, core, function)
    elif _device().writes_as_it_runs(instance) and not isinstance(function, Undone):
        instance.train_function = Undone(instance, core, function)
    return result


class Undone:
    """Keras's train function of split steps (`micro_batch_size=m`) that run
    eagerly, which puts back what a step that raises wrote before its update.

    Split, a step's earlier micro-batches have written their metrics,
    statistics and, on PyTorch, the accumulation's counters when a later one
    raises; a counter left mid-cycle would make the next step's cycle start
    there. So the step runs all or nothing (`_saved`). In a `tf.function`
    the accumulation's writes wait until every micro-batch ran (the update
    is deferred), and what the earlier micro-batches wrote to metrics and
    statistics is what plain Keras's step leaves too (with `iterations`
    moved on): keeping it there would cost a third of a small model's step
    (`benchmarks/split_put_back.py`). JAX's step returns what it wrote.

    Args:
        model: The model `fit` trains.
        core: Its optimizer's accumulating core.
        function: Keras's train function.
    """

    def __init__(self, model: Any, core: Any, function: Callable[..., Any]):
        self.model, self.core, self.function = model, core, function

    def __call__(self, *args: Any) -> Any:
        restore = _saved(self.model, self.core)
        try:
            return self.function(*args)
        except BaseException:
            restore()
            raise


class Retrying:
    """Keras's train function with `micro_batch_size="auto"`: one batch at a
    time, run again smaller where the device runs out of memory.

    Keras's function takes the batches as its backend hands them over; this
    one takes them out itself (as many as `steps_per_execution` asks, each
    its own call: `_backend.micro_batches.batch_by_batch`), so that a batch
    that ran out of memory is at hand to run again.

    Args:
        model: The model `fit` trains.
        core: Its optimizer's accumulating core.
        function: Keras's train function.
    """

    def __init__(self, model: Any, core: Any, function: Callable[..., Any]):
        self.model, self.core, self.function = model, core, function
        self.functions: dict[int, Callable[..., Any]] = {}  # a traced function per size

    def __call__(self, *args: Any) -> Any:
        steps = int(getattr(self.model, "steps_per_execution", 1) or 1)
        return _device().batch_by_batch(args, steps, self._run, self.model)

    def _run(self, call: Callable[[Any], Any], data: Any, state: Any = None) -> Any:
        micro_batches = _device()
        search = _auto_size.search_of(self.core)
        batch = micro_batches.batch_size(data)
        batch = int(batch) if batch is not None else None
        if batch is not None:
            measure = _measuring(self.model, search, state, data) if _memory().measures(self.model) else None
            search.start(batch, measure, micro_batches.unit(self.model))
        while True:
            restore = None if state is not None else _saved(self.model, self.core)
            size = search.size
            function = self._function_for(size, state)
            try:
                result = call(function)
            except BaseException as error:
                if restore is not None:
                    restore()
                if not _memory().is_out_of_memory(error) or batch is None:
                    raise
                if state is not None and micro_batches.donated_and_lost(state):
                    raise RuntimeError(
                        "micro_batch_size=\"auto\": the train step ran out of memory after JAX took its "
                        "state (donated buffers), so it cannot be run again. Pass a smaller "
                        "micro_batch_size=... or memory_limit=..."
                    ) from error
                self.functions.pop(size, None)
                search.smaller(batch, error)
                continue
            return result

    def _function_for(self, size: int, state: Any = None) -> Callable[..., Any]:
        """Keras's train function traced for micro-batches of `size` (JAX's
        `fit` holds the model's `state` apart)."""
        if size not in self.functions:
            if self.functions or self.function is None:
                # Traced anew: Keras's function holds the size it was traced with.
                _device().made_anew(self.model, state)
                made = self.model.train_function
                self.model.train_function = self
                self.function = made.function if isinstance(made, Retrying) else made
            self.functions[size] = self.function
            self.function = None
        return self.functions[size]


def _measuring(model: Any, search: Any, state: Any, data: Any) -> Callable[[int], int]:
    """The bytes of `model`'s compiled train step at a given micro-batch
    size (JAX's takes its `state`; TensorFlow's has None)."""

    def measure(size: int) -> int:
        kept, search.size = search.size, size
        try:
            return _memory().step_bytes(model.train_step, state, data)
        finally:
            search.size = kept

    return measure


def _saved(model: Any, core: Any) -> Callable[[], None]:
    """What a split step writes before its update, and how to put it back:
    the model's non-trainable variables (statistics, seeds), its metrics,
    the optimizer's scalars (counters, a loss scale) and the accumulation's
    counters; of a `tf.distribute` variable, every replica's copy. The
    accumulators are left out: a cycle's first micro-step
    writes over them. Nothing is put back where the optimizer's
    `iterations` moved on: the step (or, of several in one call, one of
    them) updated the weights, and what it wrote is then the step's, as
    it is a plain optimizer's."""
    backend = core.backend
    if core.state is None:
        # Built now, so that a step that fails is put back to its state.
        core.build(model.trainable_variables)
    variables, seen = [], set()
    optimizer = model.optimizer
    for v in [*model.non_trainable_variables, *model.metrics_variables,
              *(v for v in optimizer.variables if len(v.shape) == 0)]:
        if id(v) not in seen:
            seen.add(id(v))
            variables.append(v)
    variables = _device().copies(variables)
    values = [backend.snapshot(v) for v in variables]
    state = _atomic.saved(core.state, backend, accumulators=False)
    iterations = backend.snapshot(optimizer.iterations)

    def restore() -> None:
        if int(ops.convert_to_numpy(optimizer.iterations)) != int(ops.convert_to_numpy(iterations)):
            return
        for variable, value in zip(variables, values):
            variable.assign(value)
        state()

    return restore


@contextlib.contextmanager
def _splitting_into(core: Any, count: Any, defer: bool = False) -> Iterator[Callable[[Any], None]]:
    """Runs the block's micro-steps as one cycle of `count` micro-batches.

    With `defer`, they only accumulate, each at the index the loop running
    them hands the function the block gets, and the cycle's update runs once
    the block's loop is done: a loop whose body cannot hold the update (a
    `tf.distribute` strategy's merge calls and all-reduce).
    """
    cycle = core.cycle
    with cycle.splitting(count, defer):
        yield cycle.at
        if defer:
            cycle.at(None)
            state, ends, took_part = core.state, ops.convert_to_tensor(True), cycle.took_part
            state.position.mark(took_part, ends)
            with _atomic.unchanged_if_raised(state, core.backend, ends):
                core._finish_if(ends, count, took_part)


def check_family(settings: Any, family: Any) -> None:
    """Raises if `settings` ask for a `micro_batch_size` with an optimizer
    whose `fit` is not split (only Keras 3's train steps are).

    Raises:
        ValueError: Naming the optimizer's library.
    """
    if settings.micro_batch_size is not None and family.name != "Keras 3":
        raise ValueError(
            f"micro_batch_size={settings.micro_batch_size!r} splits Keras 3's train step inside `model.fit`; "
            f"a {family.name} optimizer's `fit` is not split. Accumulate across steps with "
            "accumulate(optimizer, n=k) and batches of B / k."
        )
