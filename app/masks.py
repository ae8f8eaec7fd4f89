"""Mask conversions usable on the client side (no model dependencies)."""

from __future__ import annotations

import numpy as np
from PIL import Image


class InvalidInput(ValueError):
    """User input that cannot be processed; the message is the job's failure reason."""


def mask_from_array(array: np.ndarray) -> Image.Image:
    """A mask from a numpy array: bool, 0/1 floats or 0-255 integers."""
    arr = np.asarray(array)
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[..., 0]
    if arr.ndim != 2:
        raise InvalidInput(f"mask array must be 2-D (got shape {arr.shape})")
    if arr.dtype == bool:
        arr = arr.astype(np.uint8) * 255
    elif np.issubdtype(arr.dtype, np.floating):
        arr = (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)
    else:
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    return Image.fromarray(arr, mode="L")
