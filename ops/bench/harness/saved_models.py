"""The GPU benchmarks' models, saved once per work folder by ``stencil model save`` (true size, or the
tiny twin under ``--quick``); shared by ``e2e_gpu`` and ``addons_gpu``."""

from __future__ import annotations

import argparse
from pathlib import Path

# --model: (true-size model, the tiny one --quick uses, image side in px)
MODELS = {"sd15": ("sd15-inpaint", "tiny-sd-inpaint", 512), "sdxl": ("sdxl-inpaint", "tiny-sdxl-inpaint", 1024)}


def save_model(args: argparse.Namespace, workdir: Path) -> Path:
    """The benchmark's model, written by ``stencil model save`` (once per workdir)."""
    from app.cli import main as stencil

    true_size, tiny, _ = MODELS[args.model]
    model_id = tiny if args.quick else true_size
    out = workdir / model_id
    if not (out / "model_index.json").is_file():
        argv = ["model", "save", str(out), "--model", model_id] + ([] if args.quick else ["--dtype", args.dtype])
        if stencil(argv) != 0:
            raise RuntimeError(f"stencil {' '.join(argv)} failed")
    return out
