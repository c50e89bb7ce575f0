"""Exact gradient accumulation for any TensorFlow/Keras optimizer."""

from gradaccum.proxy import AccumulatingOptimizer, accumulate

__all__ = ["AccumulatingOptimizer", "accumulate"]
__version__ = "0.1.0"
