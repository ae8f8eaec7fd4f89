"""Realistic mask shapes of a target ratio: rectangles, blobs (ellipses) and free-form strokes.

Benchmarks and the demo draw mask ratios from the public traces; this module turns a ratio into a
shape like the ones users draw (not a raster prefix). Each generator scales one size parameter by
bisection until the masked share is within ``tol`` of the target.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("rect", "blob", "stroke")


def _draw(shape: str, size: tuple[int, int], scale: float, rng_state: dict) -> np.ndarray:
    w, h = size
    img = Image.new("L", size, 0)
    d = ImageDraw.Draw(img)
    cx, cy, aspect, pts = rng_state["cx"], rng_state["cy"], rng_state["aspect"], rng_state["pts"]
    if shape == "rect":
        rw, rh = scale * w * aspect, scale * h / aspect
        d.rectangle([cx * w - rw / 2, cy * h - rh / 2, cx * w + rw / 2, cy * h + rh / 2], fill=255)
    elif shape == "blob":
        rw, rh = scale * w * aspect, scale * h / aspect
        d.ellipse([cx * w - rw / 2, cy * h - rh / 2, cx * w + rw / 2, cy * h + rh / 2], fill=255)
        for (px, py) in pts[:3]:  # lumps make it irregular
            r = scale * min(w, h) * 0.35
            d.ellipse([px * w - r, py * h - r, px * w + r, py * h + r], fill=255)
    elif shape == "stroke":
        width = max(1, int(scale * min(w, h) * 0.5))
        xy = [(px * w, py * h) for (px, py) in pts]
        d.line(xy, fill=255, width=width, joint="curve")
        for x, y in xy:
            d.ellipse([x - width / 2, y - width / 2, x + width / 2, y + width / 2], fill=255)
    else:
        raise ValueError(f"unknown mask shape {shape!r}; known: {SHAPES}")
    return np.asarray(img) >= 128


def make_mask(ratio: float, size: tuple[int, int], shape: str = "blob", seed: int = 0,
              tol: float = 0.01) -> np.ndarray:
    """A boolean HxW mask of ``shape`` covering about ``ratio`` of the image."""
    w, h = size
    if ratio <= 0:
        return np.zeros((h, w), dtype=bool)
    if ratio >= 1:
        return np.ones((h, w), dtype=bool)
    rng = np.random.default_rng(seed)
    state = {"cx": rng.uniform(0.3, 0.7), "cy": rng.uniform(0.3, 0.7), "aspect": rng.uniform(0.7, 1.4),
             "pts": [tuple(rng.uniform(0.15, 0.85, 2)) for _ in range(5)]}
    lo, hi = 0.0, 3.0
    best = _draw(shape, size, hi, state)
    for _ in range(30):
        mid = (lo + hi) / 2
        mask = _draw(shape, size, mid, state)
        got = mask.mean()
        if abs(got - ratio) < abs(best.mean() - ratio):
            best = mask
        if abs(got - ratio) <= tol:
            return mask
        if got < ratio:
            lo = mid
        else:
            hi = mid
    return best
