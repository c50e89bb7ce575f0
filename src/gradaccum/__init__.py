"""Exact gradient accumulation for any TensorFlow/Keras optimizer."""

from gradaccum import callbacks
from gradaccum.patching import accumulating
from gradaccum.proxy import AccumulatingOptimizer, accumulate

__all__ = ["AccumulatingOptimizer", "accumulate", "accumulating", "callbacks"]
__version__ = "0.1.0"
