"""Which accumulating core runs on the active Keras backend.

- TensorFlow: `gradaccum._accumulation.Accumulation`, written for
  `tf.distribute` (replica-local accumulators, one all-reduce per cycle in
  skip mode), XLA, `tf.IndexedSlices` and tf_keras.
- JAX and PyTorch: `gradaccum._portable.accumulation.Accumulation`, written
  with Keras ops for `StatelessScope` (JAX's `fit` and `stateless_apply`)
  and eager PyTorch; its state travels in the optimizer's `variables`.

Both have the interface of `gradaccum._accumulation_base.AccumulationBase`,
their common base, which the proxy and everything around it (loss scaling,
loss counts, files, `accumulating()`, callbacks) use. Each is imported only
when chosen, so TensorFlow is imported only on its backend.
"""

from __future__ import annotations

from typing import Any

from gradaccum import _backend


def accumulation_class() -> type[Any]:
    """The `Accumulation` class for the active Keras backend.

    Raises:
        ValueError: If the active backend cannot train (numpy, openvino).
    """
    _backend.check_supported()
    if _backend.active() == "tensorflow":
        from gradaccum._accumulation import Accumulation
    else:
        from gradaccum._portable.accumulation import Accumulation
    return Accumulation
