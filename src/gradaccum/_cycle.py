"""The cycle's length: `n`, a schedule of it, and the `n=1` hand-over."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

from gradaccum._validation import check_n

if TYPE_CHECKING:
    import tensorflow as tf


class CycleLength:
    """Micro-batches per applied update: an int that may be set between
    cycles, or a schedule of the applied-update count.

    An int lives in a mirrored variable once built, so that setting it needs
    no retracing. With `n=1` the gradients go straight to the wrapped
    optimizer (`hands_over`); a function traced then keeps doing so, which
    `hand_over_guard` makes a traced step refuse once `n` is no longer 1.

    Args:
        n: An int >= 1 or a callable (checked by the caller).
    """

    def __init__(self, n: int | Callable[[tf.Tensor], Any]):
        self.schedule = None if isinstance(n, int) else n
        self._n = n if isinstance(n, int) else None
        self._variable: tf.Variable | None = None
        # Whether a traced function hands gradients straight over (n=1).
        self._handed_over_in_trace = False

    @property
    def value(self) -> int | Callable[[tf.Tensor], Any]:
        """The int, or the schedule given."""
        return self.schedule if self.schedule is not None else self._n

    @property
    def code(self) -> int:
        """What checkpoints record: the int, 0 for a schedule."""
        return 0 if self.schedule is not None else self._n

    def set(self, value: Any) -> None:
        """Sets an int `n` (see `AccumulatingOptimizer.n`)."""
        if self.schedule is not None:
            raise ValueError(
                "`n` was given as a schedule (a callable); it cannot be set to "
                "an int afterwards. Let the schedule return the new value."
            )
        value = check_n(value)
        if value != 1 and self._n == 1 and self._handed_over_in_trace:
            warnings.warn(
                f"`n` set to {value}, but a function (`tf.function`, `jax.jit`) traced with n=1 hands "
                "gradients straight to the wrapped optimizer and keeps doing "
                "so: trace it anew (for `model.fit`: "
                "`model.make_train_function(force=True)`, or compile again).",
                RuntimeWarning,
                stacklevel=4,
            )
        self._n = value
        if self._variable is not None:
            self._variable.assign(value)

    def build(self) -> None:
        """Creates the variable an int `n` is read from (inside a creation scope)."""
        if self.schedule is None:
            from gradaccum._backend.tensorflow import distribution

            self._variable = distribution.mirrored_counter(self._n, name="n")

    def current(self, applied: Any) -> tf.Tensor:
        """`n` for the current cycle, as an int64 tensor.

        Args:
            applied: The wrapped optimizer's `iterations` (applied updates),
                which a schedule takes.
        """
        import tensorflow as tf

        if self.schedule is not None:
            n = tf.cast(self.schedule(applied), tf.int64)
            if tf.executing_eagerly() and int(n) < 1:
                raise ValueError(
                    f"The `n` schedule returned {int(n)}; it must return an int >= 1."
                )
            return tf.maximum(n, 1)
        if self._variable is None:
            return tf.constant(self._n, dtype=tf.int64)
        return self._variable.value()

    def hands_over(self) -> bool:
        """Whether every micro-batch is a whole batch (`n` is the int 1)."""
        return self._n == 1

    def hand_over_guard(self) -> list[Any]:
        """Ops a step that hands gradients over must run first.

        A trace keeps the hand-over whatever `n` is set to later: traced, the
        guard stops the step from running once `n` is no longer 1.
        """
        import tensorflow as tf

        if tf.executing_eagerly():
            return []
        self._handed_over_in_trace = True
        return [
            tf.debugging.assert_equal(
                self._variable.value(),
                tf.constant(1, tf.int64),
                message=(
                    "gradaccum: this function was traced with n=1, which "
                    "hands gradients straight to the wrapped optimizer, "
                    "but `n` has changed since; trace it anew."
                ),
            )
        ]
