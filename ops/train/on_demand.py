"""Trained models that the repository does not ship: trained by their recorded command the first
time a benchmark needs them.

Why: the repository travels whole to GPU machines, so its tracked files stay small
(tests/test_repository_size.py), and a benchmark-only model's weights would take half of that.
Such a model's folder keeps its README (model card and this command), its training log and its
UNet config; the weights are git-ignored and written into the same folder, where the loader reads
trained models. The command is seeded and stops at a fixed step count: it repeats the recorded run.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

# The recorded runs' paths (--vae-from, --plot) are relative to the repository root. The trained
# models' folder is the loader's TRAINED_DIR (not imported: the loader names these commands).
REPO_ROOT = Path(__file__).resolve().parents[2]
TRAINED_DIR = REPO_ROOT / "workers" / "models" / "trained"

# Model id -> (trainer module, its arguments but --out). The recorded run of the SDXL-layout model
# stopped on its 30-minute cap at UNet step 5128 (its training_log.json); the same run stops there by
# count, with a cap far from it.
RECIPES: dict[str, tuple[str, ...]] = {
    "tiny-sd-sdxl-layout-trained": (
        "ops.train.sd", "--threads", "2", "--vae-from", "workers/models/trained/tiny-sd-inpaint-trained",
        "--encode-crops", "2560", "--unet-steps", "5128", "--unet-minutes", "240", "--prediction-type", "sample",
        "--unet-channels", "64", "128", "128", "--unet-layout", "sdxl", "--transformer-layers", "1", "1", "3",
        "--plot", "docs/bench/training_loss_sdxl_layout.png"),
}


def training_argv(model_id: str, out: str | Path | None = None,
                  recipes: Mapping[str, tuple[str, ...]] = RECIPES) -> list[str]:
    """The trainer's arguments (``--out`` first: the model's folder unless ``out`` is given)."""
    module, *args = recipes[model_id]
    return ["--out", str(out or f"workers/models/trained/{model_id}"), *args]


def command(model_id: str) -> str:
    """The shell command that trains ``model_id`` in place, run from the repository root."""
    return shlex.join(["python", "-m", RECIPES[model_id][0], *training_argv(model_id)])


def ensure_trained(model_id: str, trained_dir: Path = TRAINED_DIR,
                   recipes: Mapping[str, tuple[str, ...]] = RECIPES) -> Path:
    """The model's folder, trained first if it has no weights (once across processes: under a file
    lock, into a temporary folder whose files are moved in with ``model_index.json`` last, so no
    loader ever reads a half-written model)."""
    folder = trained_dir / model_id
    if (folder / "model_index.json").is_file():
        return folder
    if model_id not in recipes:
        raise FileNotFoundError(f"{folder} holds no model and {model_id!r} has no training recipe "
                                f"(known: {sorted(recipes)})")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".train.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "model_index.json").is_file():
            return folder
        tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".train-"))
        argv = [sys.executable, "-m", recipes[model_id][0], *training_argv(model_id, tmp, recipes)]
        log.warning("%s has no weights: training them (the run its README records; %s)", folder, shlex.join(argv))
        try:
            done = subprocess.run(argv, cwd=REPO_ROOT, check=False)
            if done.returncode:
                raise RuntimeError(f"training {model_id} failed (exit {done.returncode}): {shlex.join(argv)}")
            _move_in(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("trained %s into %s", model_id, folder)
    return folder


def _move_in(src: Path, dst: Path) -> None:
    """Every file of ``src`` to the same place under ``dst``, ``model_index.json`` last."""
    files = sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.name == "model_index.json")
    for path in files:
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
