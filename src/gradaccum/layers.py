"""Layers that follow the accumulation cycle.

- `BatchNormalization`: Keras's `BatchNormalization`, whose moving mean and
  variance are updated once per applied update, with the pooled statistics
  of the cycle's micro-batches, as on the large batch.
- `replace_batch_normalization(model)`: a copy of a model with every
  `keras.layers.BatchNormalization` replaced by it, weights kept.
- `follow(model, optimizer)`: for custom loops whose model is not compiled
  with the accumulating optimizer.
"""

from gradaccum._batch_norm import BatchNormalization, follow, install
from gradaccum._replace import replace_batch_normalization

install()

__all__ = ["BatchNormalization", "follow", "replace_batch_normalization"]
