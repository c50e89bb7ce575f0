"""The backend seam: how the accumulation runs on a Keras backend.

The modules above this package decide *what* a micro-step does; the names
here say *how* it is done on a backend. They know nothing of the
accumulation itself.

- `tensorflow` (a package), used by the TensorFlow core
  (`gradaccum._accumulation`, `_state`, `_strategies`):
  - `distribution`: where state lives and where decisions are taken:
    per-replica accumulators (`replica_local`), counters every replica
    advances alike (`mirrored_counter`), creating them outside any traced
    function (`creation_scope`), running code in cross-replica context
    (`in_cross_replica`), all-reduces (`sum_over_replicas`,
    `clip_as_one_device`) and the checks that refuse unsound set-ups.
  - `tensors`: adding gradients into accumulators, or writing them over
    what they hold on a cycle's first micro-step (`add_into`,
    `scatter_into`, `max_into`, `add_scalar`), or keeping their slices
    (`slice_buffers`, `append_slices`, `kept_slices`, `clear_slices_if`),
    branch-free choice (`select`), the end of a cycle (`divide_if`,
    `quotients`), zeroing (`zero_if`), each written for its cost.
  - `updates`: running the wrapped optimizer's update so that its effect
    is kept only on apply steps: `masked_update` (every micro-step runs it;
    no branch encloses it) and `skipped_update` (it runs only on apply
    steps, decided where a branch may be taken).
- `portable`, used by the core for JAX and PyTorch (`gradaccum._portable`),
  which is written with Keras ops: whether a value is traced (`is_traced`),
  adding, dividing and clearing accumulators (in place on PyTorch:
  `add_into`, `quotient`, `divide_in_place`, `clear`), a value kept past
  later writes (`snapshot`), and a branch that JAX can trace (`run_if`).

Importing this package imports no backend: on JAX and PyTorch TensorFlow
need not be installed. `check_supported()` refuses a backend that cannot
train; `gradaccum._engines` picks the core for the active one.
"""

from __future__ import annotations

import keras

SUPPORTED = ("tensorflow", "jax", "torch")

__all__ = ["SUPPORTED", "active", "check_supported"]


def active() -> str:
    """The name of the active Keras backend."""
    return keras.config.backend()


def check_supported() -> None:
    """Raises if the active Keras backend is not one gradaccum runs on.

    Raises:
        ValueError: Naming the active backend and the supported ones.
    """
    backend = active()
    if backend not in SUPPORTED:
        raise ValueError(
            f"gradaccum runs on Keras's {', '.join(SUPPORTED)} backends; the "
            f"active Keras backend is {backend!r}, which cannot train. Set "
            "KERAS_BACKEND to one of those."
        )

