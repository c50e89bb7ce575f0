"""Adaptive gradient clipping in NumPy: the reference the AGC tests compare to.

Written from the paper's reference code (Brock et al. 2021, `unitwise_norm`
and `my_clip` in the NFNets repository), independently of
`gradaccum._agc`, in float64.
"""

from __future__ import annotations

import numpy as np


def np_unit_norm(a: np.ndarray) -> np.ndarray:
    """The norm of each output unit (one number for vectors and scalars)."""
    a = a.astype(np.float64)
    if np.squeeze(a).ndim <= 1:
        return np.sqrt(np.sum(a * a))
    if a.ndim in (2, 3):
        return np.sqrt(np.sum(a * a, axis=0, keepdims=True))
    if a.ndim == 4:
        return np.sqrt(np.sum(a * a, axis=(0, 1, 2), keepdims=True))
    raise ValueError(a.shape)


def np_agc(g: np.ndarray, w: np.ndarray, factor: float, eps: float):
    """`(g clipped, as float32; units clipped; units left as they were)`."""
    max_norm = np.maximum(np_unit_norm(w), eps) * factor
    grad_norm = np_unit_norm(g)
    trigger = grad_norm < max_norm
    clipped = g * (max_norm / np.maximum(grad_norm, 1e-6))
    out = np.where(trigger, g, clipped).astype(np.float32)
    return out, int(np.sum(~trigger)), int(np.sum(trigger))
