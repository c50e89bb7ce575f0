"""The accumulation state on a backend whose optimizers run on Keras ops.

One `keras.Variable` per accumulator, the micro-step counter, the sum of
micro-batch weights and, for an int `n`, `n` itself: all of them listed by
`variables()`, which the proxy appends to the wrapped optimizer's
`variables`. On JAX that list is the optimizer state `model.fit` and
`stateless_apply` carry from step to step, so the accumulation state travels
with it; reading `n` from a variable lets `opt.n = 8` take effect between
`fit` calls without tracing again.

An accumulator's value counts only while the cycle has begun (`micro_step`
above 0). The update does not clear the accumulators: traced by JAX, a
select writing zeros after the `cond` that reads the sums would keep each
sum alive beside it, a copy of the parameters on every micro-step. A
cycle's first micro-step writes over them instead
(`gradaccum._backend.portable.add_into`), and what is seen or saved of a
cycle not begun is zeros (`settle`, `save`).

Which variables take part in updates (those that have received a gradient)
is known while a step is traced, and kept in Python. Keras files hold the
same `gradaccum_*` keys as on TensorFlow (`gradaccum._store`).
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
from keras.src.backend.common.stateless_scope import in_stateless_scope

from gradaccum._backend.portable import clear, is_traced
from gradaccum._store import (
    _REDUCTION_CODES,
    KEY,
    _encode_names,
    check_saved_settings,
    relative_names,
    saved_accumulators,
)


def accumulator_dtype(variable: Any) -> str:
    """float32, or float64 for a float64 variable: sums of micro-gradients
    of float16 or bfloat16 variables would round at every micro-step."""
    return "float64" if keras.backend.standardize_dtype(variable.dtype) == "float64" else "float32"


class State:
    """The accumulation state for one optimizer's variables.

    Args:
        variables: The trainable variables the optimizer is built for.
        n: The int `n` (its variable is created), or None for a schedule.
        n_code: What files record of `n` (0 for a schedule).
        reduction: `"mean"` or `"sum"`.
    """

    def __init__(self, variables: Sequence[Any], n: int | None, n_code: int, reduction: str):
        self.variables = list(variables)
        self._index = {id(v): i for i, v in enumerate(self.variables)}
        self.n_code = n_code
        self.reduction = reduction

        def make(name: str, shape: Any, dtype: str, value: Any = 0) -> keras.Variable:
            return keras.Variable(
                np.full(shape, value, dtype=dtype), dtype=dtype, trainable=False,
                name=f"gradaccum_{name}",
            )

        self.accumulators = [
            make(f"accumulator_{i}", tuple(v.shape), accumulator_dtype(v))
            for i, v in enumerate(self.variables)
        ]
        self.micro_step = make("micro_step", (), "int32")
        self.weight_total = make("weight_total", (), "float32")
        self.n = None if n is None else make("n", (), "int32", n)
        # Whether each variable has received a gradient (takes part in updates).
        self.seen = [False] * len(self.variables)

    def variables_list(self) -> list[keras.Variable]:
        """Every variable of the state, in a fixed order."""
        own = [*self.accumulators, self.micro_step, self.weight_total]
        return own if self.n is None else own + [self.n]

    def indices_of(self, variables: Sequence[Any]) -> list[int]:
        """The positions of `variables`.

        Raises:
            ValueError: If one of them is not a variable the optimizer was
                built for.
        """
        indices = []
        for v in variables:
            i = self._index.get(id(v))
            if i is None:
                raise ValueError(
                    f"Unknown variable {getattr(v, 'path', v)!r}: the optimizer "
                    "was built for other variables. Build it with all the "
                    "variables it will update (`opt.build(model.trainable_variables)`)."
                )
            indices.append(i)
        return indices

    def participants(self) -> list[int]:
        return [i for i, seen in enumerate(self.seen) if seen]

    def begun(self) -> bool:
        """Whether the current cycle holds a micro-batch (outside a trace)."""
        return int(keras.ops.convert_to_numpy(self.micro_step.value)) > 0

    def settle(self) -> None:
        """Zeroes the accumulators between cycles, where they still hold the
        sums of the cycle last applied; a no-op inside a trace or a
        `StatelessScope`, whose writes would not last."""
        if in_stateless_scope() or is_traced(self.micro_step.value) or self.begun():
            return
        for acc in self.accumulators:
            clear(acc)

    def save(self, store: Any) -> None:
        """Writes the state into a Keras weights store (the TensorFlow keys)."""
        store[f"{KEY}n"] = np.asarray(self.n_code, dtype=np.int64)
        store[f"{KEY}reduction"] = np.asarray(_REDUCTION_CODES[self.reduction])
        store[f"{KEY}micro_step"] = np.asarray(keras.ops.convert_to_numpy(self.micro_step), np.int64)
        store[f"{KEY}weight_total"] = np.asarray(keras.ops.convert_to_numpy(self.weight_total))
        store[f"{KEY}seen"] = np.asarray(self.seen, dtype=bool)
        store[f"{KEY}names"] = _encode_names(relative_names(self.variables))
        begun = self.begun()
        for i, acc in enumerate(self.accumulators):
            value = np.asarray(keras.ops.convert_to_numpy(acc))
            store[f"{KEY}accumulator_{i}"] = value if begun else np.zeros_like(value)

    def load(self, store: Any) -> None:
        """Reads what `save` wrote, here or on TensorFlow.

        Raises:
            ValueError: If the store was written with another `n`,
                `reduction` or model.
        """
        check_saved_settings(store, self.n_code, self.reduction)
        source, values = saved_accumulators(store, self.variables, [a.shape for a in self.accumulators])
        if any(k.startswith(f"{KEY}kept_values_") for k in store.keys()):
            raise ValueError(
                "The saved state holds sparse=\"slices\" slices, which only "
                "the TensorFlow backend keeps; load it on TensorFlow."
            )
        for acc, value in zip(self.accumulators, values):
            acc.assign(value.astype(acc.dtype))
        self.micro_step.assign(int(np.asarray(store[f"{KEY}micro_step"])))
        if f"{KEY}seen" in store.keys():
            saved = np.asarray(store[f"{KEY}seen"], dtype=bool)
            self.seen = [bool(saved[j]) for j in source]
        else:
            self.seen = [bool(np.any(v)) for v in values]
        if f"{KEY}weight_total" in store.keys():
            self.weight_total.assign(float(np.asarray(store[f"{KEY}weight_total"])))
        else:
            self.weight_total.assign(float(np.asarray(store[f"{KEY}micro_step"])))
