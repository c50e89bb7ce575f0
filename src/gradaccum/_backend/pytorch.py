"""The hooks on PyTorch: in place, and nothing read back from the device.

Keras's PyTorch trainer runs eagerly: each operation is queued for the
device, and reading a tensor's value into Python (`bool`, `item`, `int`,
`float`, `tolist`, `numpy`, `cpu`) waits until the device has run all of
them. So the cycle's position lives on the host (`HostPosition`): the core
knows whether a micro-step is a cycle's first and whether it ends the cycle
from Python integers, writes the saved counter without reading it, and each
hook here receives those conditions as Python booleans. The accumulators are
added into in place, every variable in one multi-tensor operation
(`torch._foreach_*`), and divided in place on the apply step. A weight passed
as a tensor is checked on the device (an asynchronous assertion).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradaccum._backend import StateVariables, Update
from gradaccum._backend.keras_ops import KerasOpsBackend
from gradaccum._backend.position import HostPosition, Position
from gradaccum._backend.tensors import KerasOpsTensors


def _values(variables: Sequence[Any]) -> list[torch.Tensor]:
    return [v.value for v in variables]


class TorchTensors(KerasOpsTensors):
    """The hooks of `gradaccum._backend.Tensors` on PyTorch: in place, every
    variable in one multi-tensor operation; `first` is a Python boolean."""

    def add_into(self, accumulators: Sequence[Any], grads: Sequence[Any], weight: Any, first: bool) -> None:
        targets = _values(accumulators)
        if not targets:
            return
        values = [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, targets)]
        with torch.no_grad():
            if first:
                torch._foreach_copy_(targets, values)
                if weight is not None:
                    torch._foreach_mul_(targets, weight)
            elif weight is None:
                torch._foreach_add_(targets, values)
            else:
                # The product rounded, then the sum, as on every backend: a
                # fused multiply-add (`alpha=`, `addcmul`) rounds once.
                torch._foreach_add_(targets, torch._foreach_mul(values, weight))

    def max_into(self, accumulators: Sequence[Any], values: Sequence[Any], first: bool) -> None:
        with torch.no_grad():
            for target, value in zip(_values(accumulators), values):
                value = value.to(target.dtype)
                if first:
                    target.copy_(value)
                else:
                    torch.maximum(target, value, out=target)

    def add_scalar(self, total: Any, value: Any, first: bool) -> None:
        target = total.value
        with torch.no_grad():
            if not first:
                target.add_(value)
            elif isinstance(value, float):
                target.fill_(value)
            else:
                target.copy_(value)

    def squared_norm(self, values: Sequence[Any]) -> Any:
        tensors = [v.value if hasattr(v, "value") else v for v in values]
        if not tensors:
            return torch.zeros((), dtype=torch.float32)
        with torch.no_grad():
            if all(t.dtype == torch.float32 for t in tensors):
                # The `dtype` argument takes a slower kernel on the CPU.
                norms = torch.stack(torch._foreach_norm(tensors, 2))
            else:
                norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
            return torch.dot(norms, norms)

    def add_squared_norm(self, total: Any, values: Sequence[Any], weight: Any, first: bool) -> None:
        # Four kernels per micro-step: the norms (one multi-tensor kernel),
        # their stack, its dot product, and a multiply-add (or a multiply).
        square = self.squared_norm(values)
        target = total.value
        with torch.no_grad():
            if weight is None and first:
                target.copy_(square)
            elif weight is None:
                target.add_(square)
            elif first:
                torch.mul(square, weight, out=target)
            else:
                target.addcmul_(square, torch.as_tensor(weight, dtype=target.dtype))

    def zero_if(self, condition: bool, variables: Sequence[Any]) -> None:
        if condition and variables:
            with torch.no_grad():
                torch._foreach_zero_(_values(variables))

    def assert_that(self, condition: Callable[[], Any], message: str) -> Any:
        torch._assert_async(condition(), message)


class TorchBackend(KerasOpsBackend):
    """The hooks of `gradaccum._backend.Backend` on PyTorch."""

    reads_back = False

    def __init__(self) -> None:
        super().__init__()
        self.tensors = TorchTensors(self.local)

    def create_state(
        self, family: Any, variables: Sequence[Any], n: int | None, dtype: str = "float32"
    ) -> StateVariables:
        # Which variables took part in the cycle is kept on the host.
        return super().create_state(family, variables, n, dtype)._replace(took_part=None)

    def position(self, counter: Any, flags: Any) -> Position:
        return HostPosition(self, counter)

    def snapshot(self, variable: Any) -> Any:
        # A write copies into the tensor the variable holds.
        return variable.value.detach().clone()

    def assign(self, variable: Any, value: Any) -> None:
        if not isinstance(value, int):
            variable.assign(value)
            return
        with torch.no_grad():
            variable.value.fill_(value)

    def masks_each(self, family: Any) -> bool:
        # Nothing to mask: the cycle's participation is known on the host.
        return False

    def finish(self, update: Update, mode: str) -> None:
        if not update.ends:
            return
        values = []
        with torch.no_grad():
            for accumulator, divided in zip(update.accumulators, update.divided):
                target = accumulator.value
                if divided and update.divisor is not None:
                    target.div_(update.divisor.to(target.dtype))
                values.append(target)
        update.apply(values)

    def when(self, condition: Any, fn: Callable[[], None], writes: Sequence[Any] = ()) -> None:
        if bool(condition):
            fn()
