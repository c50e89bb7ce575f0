"""The backend seam: what the accumulation needs from a Keras backend.

The modules above this package decide *what* a micro-step does; the names
here say *how* it is done on a backend. A backend is a package with three
modules, imported here under fixed names:

- `distribution`: where state lives and where decisions are taken:
  per-replica accumulators (`replica_local`), counters every replica advances
  alike (`mirrored_counter`), creating them outside any traced function
  (`creation_scope`), running code in cross-replica context
  (`in_cross_replica`), all-reduces (`sum_over_replicas`,
  `clip_as_one_device`) and the checks that refuse unsound set-ups.
- `tensors`: adding a gradient into an accumulator (`add_into`), or keeping
  its slices (`slice_buffers`, `append_slices`, `kept_slices`,
  `clear_slices_if`), branch-free choice (`select`), the end of a cycle
  (`divide_if`, `zero_if`, `quotients`, `zero_buffers`, `cleared_if`), each
  written for its cost.
- `updates`: running the wrapped optimizer's update so that its effect is
  kept only on apply steps: `masked_update` (every micro-step runs it; no
  branch encloses it) and `skipped_update` (it runs only on apply steps,
  decided where a branch may be taken).

Only TensorFlow is implemented. `check_supported()` refuses another Keras
backend by name when an optimizer is wrapped.
"""

from __future__ import annotations

import keras

from gradaccum._backend.tensorflow import distribution, tensors, updates

SUPPORTED = ("tensorflow",)

__all__ = ["SUPPORTED", "check_supported", "distribution", "tensors", "updates"]


def check_supported() -> None:
    """Raises if the active Keras backend is not one gradaccum runs on.

    Raises:
        ValueError: Naming the active backend and the supported ones.
    """
    backend = keras.config.backend()
    if backend not in SUPPORTED:
        raise ValueError(
            f"gradaccum runs on Keras's {', '.join(SUPPORTED)} backend; the "
            f"active Keras backend is {backend!r}. Set KERAS_BACKEND=tensorflow."
        )
