"""Exact gradient accumulation for any TensorFlow/Keras optimizer.

Public names: `accumulate`, `accumulating`, `AccumulatingOptimizer`,
`AccumulationState`, and the submodules `gradaccum.callbacks` and
`gradaccum.layers`. Every other
module is private (its name starts with `_`); docs/ARCHITECTURE.md says what
each one owns.
"""

from gradaccum import callbacks, layers
from gradaccum._accumulating import accumulating
from gradaccum._api import accumulate
from gradaccum._proxy import AccumulatingOptimizer
from gradaccum._view import AccumulationState

__all__ = [
    "AccumulatingOptimizer",
    "AccumulationState",
    "accumulate",
    "accumulating",
    "callbacks",
    "layers",
]
__version__ = "0.1.0"
