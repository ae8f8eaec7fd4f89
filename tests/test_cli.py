"""The ``stencil`` command: demo on embedded defaults, model save, and the client commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.embedded import EmbeddedStack
from app.maskgen import make_mask
from tests.test_service import SIZE, template

pytestmark = pytest.mark.integration


def stencil(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_demo_writes_pngs_and_summary(tmp_path: Path) -> None:
    env = dict(os.environ, STENCIL_HOME=str(tmp_path / "home"))
    out = tmp_path / "out"
    proc = stencil("demo", "--jobs", "4", "--out", str(out), "--steps", "10", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["jobs"]) == 4
    ratios = {round(j["mask_ratio"], 2) for j in summary["jobs"]}
    assert len(ratios) == 4, "masks of different sizes"
    for job in summary["jobs"]:
        assert job["status"] == "done" and Path(job["output"]).is_file() and job["latency_s"] > 0
        assert Image.open(job["output"]).size == (128, 128)
    assert "4/4 done" in proc.stdout


def test_saved_model_loads_in_the_stock_pipeline(saved_model: Path) -> None:
    from diffusers import StableDiffusionInpaintPipeline

    pipe = StableDiffusionInpaintPipeline.from_pretrained(saved_model)
    assert pipe.unet.config.in_channels == 9
    assert pipe.vae_scale_factor == 8


def test_cli_submit_status_wait_cancel(stack: EmbeddedStack, tmp_path: Path) -> None:
    env = stack.env()
    image, mask = tmp_path / "t.png", tmp_path / "m.png"
    template(50).save(image)
    Image.fromarray(make_mask(0.2, (SIZE, SIZE)).astype(np.uint8) * 255).save(mask)
    out = tmp_path / "out.png"
    proc = stencil("submit", "--template", str(image), "--mask", str(mask), "--prompt", "a hat", "--steps", "6",
                   "--wait", "--timeout", "120", "--out", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.splitlines()[0]
    assert Image.open(out).size == (SIZE, SIZE)
    status = json.loads(stencil("status", job_id, env=env).stdout)
    assert status["status"] == "done" and status["id"] == job_id
    # A long job, cancelled from the CLI.
    proc = stencil("submit", "--template", str(image), "--mask", str(mask), "--steps", "200", env=env)
    long_id = proc.stdout.strip()
    assert stencil("cancel", long_id, env=env).returncode == 0
    waited = stencil("wait", long_id, "--timeout", "60", env=env)
    assert waited.returncode == 1 and json.loads(waited.stdout)["status"] == "cancelled"
    assert stencil("cancel", long_id, env=env).returncode == 1, "cancelling an ended job reports it"
