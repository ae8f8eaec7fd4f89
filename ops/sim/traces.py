"""The public mask-ratio traces (FlashPS/InstGenIE artifact), shipped in ``ops/data/mask_ratios``.

Location: ``STENCIL_TRACES_DIR`` or the repository's ``ops/data/mask_ratios`` (source and terms in
its README). The ``.txt`` trace is a
Python list literal: parsed with ``ast.literal_eval`` (never ``eval``).
"""

from __future__ import annotations

import ast
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "data" / "mask_ratios"
TRACES = {
    "spring_festival": "spring_festival_mask_ratio_original.npy",  # production face swap / try-on
    "controlnet": "controlnet_inpaint_mask_ratios_1918.npy",  # ControlNet inpainting, has 0 and ~1
    "adetailer": "adetailor_mask_ratio.txt",  # ADetailer face/hand restoration
}
ALIASES = {"spring": "spring_festival"}  # the short name the benchmarks' options use (not a fourth trace)


def traces_dir() -> Path:
    return Path(os.environ.get("STENCIL_TRACES_DIR", str(DEFAULT_DIR)))


@lru_cache(maxsize=None)
def load_trace(name: str) -> np.ndarray:
    """Mask ratios of one trace as float64 in [0, 1] (read-only array)."""
    try:
        path = traces_dir() / TRACES[ALIASES.get(name, name)]
    except KeyError as exc:
        raise ValueError(f"unknown trace {name!r}; known: {sorted(TRACES)} or {sorted(ALIASES)}") from exc
    if path.suffix == ".npy":
        arr = np.load(path, allow_pickle=False)
    else:
        arr = np.asarray(ast.literal_eval(path.read_text()), dtype=np.float64)
    arr = np.clip(np.asarray(arr, dtype=np.float64).reshape(-1), 0.0, 1.0)
    arr.setflags(write=False)
    return arr
