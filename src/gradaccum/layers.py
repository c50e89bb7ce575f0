"""Layers that follow the accumulation cycle.

- `BatchNormalization`: Keras's `BatchNormalization`, whose moving mean and
  variance are updated once per applied update, with the pooled statistics
  of the cycle's micro-batches, as on the large batch.
- `replace_batch_normalization(model)`: a copy of a model with every
  `keras.layers.BatchNormalization` replaced by it, weights kept.
- `follow(model, optimizer)`: for custom loops whose model is not compiled
  with the accumulating optimizer.

Importing this module makes `Model.compile` point a model's layers at its
optimizer's cycle (see `gradaccum._patches`).
"""

from gradaccum import _patches
from gradaccum._batch_norm import BatchNormalization, follow
from gradaccum._replace import replace_batch_normalization

_patches.install("layers")

__all__ = ["BatchNormalization", "follow", "replace_batch_normalization"]
