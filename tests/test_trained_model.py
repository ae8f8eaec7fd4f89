"""The trained embedded default (workers/models/trained/): it loads in the stock pipeline, its VAE
reconstructs images it never saw far better than a random-init VAE, an inpaint keeps the template
outside the mask far better than the random-init model, and it is what the embedded default and
``stencil model save`` write."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.maskgen import make_mask
from app.settings import Settings
from tests.support.pipes import sd_pipe
from workers.models.loader import TRAINED_DIR, ensure_model_dir, model_identity

MODEL = TRAINED_DIR / "tiny-sd-inpaint-trained"


_pipe = sd_pipe


@pytest.fixture(scope="module")
def trained():  # type: ignore[no-untyped-def]
    return _pipe(MODEL)


@pytest.fixture(scope="module")
def random_init(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The random-init model of the same classes (its VAE is built with the trained VAE's widths)."""
    from workers.models.tiny_sd import build_pipeline, build_vae

    pipe = build_pipeline(0)
    widths = tuple(json.loads((MODEL / "vae" / "config.json").read_text())["block_out_channels"])
    pipe.vae = build_vae(0, block_out_channels=widths)
    return pipe


def _inpaint(pipe, template: Image.Image, mask: np.ndarray, *, seed: int, guidance: float) -> np.ndarray:  # type: ignore[no-untyped-def]
    """One 12-step "a cat" edit at 128 px through the stock pipeline."""
    out = pipe(prompt="a cat", image=template, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
               height=128, width=128, num_inference_steps=12, guidance_scale=guidance,
               generator=torch.Generator("cpu").manual_seed(seed)).images[0]
    return np.asarray(out)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    err = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean()
    return float(10 * np.log10(255**2 / max(err, 1e-12)))


def test_loads_with_from_pretrained_and_records_its_training(trained) -> None:  # type: ignore[no-untyped-def]
    log = json.loads((MODEL / "training_log.json").read_text())
    assert trained.unet.config.in_channels == 9 and trained.vae_scale_factor == 8
    assert trained.vae.config.scaling_factor == pytest.approx(log["scaling_factor"])
    assert trained.vae.config.scaling_factor != pytest.approx(0.18215)  # measured, not SD's constant
    assert log["vae"]["heldout_psnr_db"] > log["vae"]["random_init_psnr_db"]
    assert log["unet"]["heldout_mse"] < 0.5 * log["unet"]["random_init_mse"]
    assert trained.scheduler.config.prediction_type == log["unet"]["prediction_type"]
    assert (MODEL / "README.md").is_file()


def test_vae_reconstructs_held_out_crops_better_than_random_init(trained, random_init) -> None:  # type: ignore[no-untyped-def]
    """Crops of images the model never trained on (other seed than the training's own check)."""
    from ops.train.common import HELD_OUT, Crops, load_source

    x, _ = Crops([load_source(n) for n in HELD_OUT], np.random.default_rng(1234)).batch(12)

    def recon_psnr(vae: torch.nn.Module) -> float:
        with torch.no_grad():
            y = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
        to8 = lambda t: ((t + 1) * 127.5).round().numpy()  # noqa: E731
        return _psnr(to8(x), to8(y))

    got, base = recon_psnr(trained.vae), recon_psnr(random_init.vae)
    assert got >= 16.0, got
    assert got >= base + 4.0, (got, base)


def test_inpaint_keeps_template_outside_mask_and_fills_plausibly(trained, random_init) -> None:  # type: ignore[no-untyped-def]
    from app.demo import demo_templates

    name, template = demo_templates(128)[1]  # chelsea
    mask = make_mask(0.15, (128, 128), "blob", seed=3)
    src = np.asarray(template)

    got, base = (_inpaint(p, template, mask, seed=5, guidance=3.0) for p in (trained, random_init))
    keep = ~mask
    outside, outside_base = _psnr(got[keep], src[keep]), _psnr(base[keep], src[keep])
    assert outside >= 15.0 and outside >= outside_base + 2.5, (outside, outside_base)
    # Inside the mask a fill is a generation, not a copy. Logged, not asserted: a smooth fill of the
    # surrounding colours (what this model does, see the model card) is not closer to the covered
    # pixels' colour histogram than random-init noise is, so this measure cannot tell plausibility.
    # Measure: L1 distance of per-channel 16-bin colour histograms, fill vs what it covered.
    def hist_dist(img: np.ndarray) -> float:
        return float(sum(np.abs(np.histogram(img[mask][:, c], 16, (0, 256))[0] / mask.sum()
                                - np.histogram(src[mask][:, c], 16, (0, 256))[0] / mask.sum()).sum()
                         for c in range(3)))

    inside, inside_base = hist_dist(got), hist_dist(base)
    logging.getLogger(__name__).info("outside-mask PSNR to template %.1f dB (random init %.1f); in-mask colour "
                                     "histogram distance %.2f (random init %.2f)", outside, outside_base,
                                     inside, inside_base)
    assert not np.array_equal(got[mask], src[mask])  # an edit, not a copy of the template


def test_output_outside_the_mask_does_not_depend_on_the_seed(trained) -> None:  # type: ignore[no-untyped-def]
    """What mask-aware caching relies on (real inpainting models behave so): outside the mask a
    full-compute edit reproduces the template whatever the noise, so activations cached from a
    warm-up with another seed stand in for the edit's own. The epsilon-prediction model this one
    replaced failed it (two seeds agreed to 15 dB there)."""
    from app.demo import demo_templates

    _name, template = demo_templates(128)[0]
    mask = make_mask(0.12, (128, 128), "blob", seed=1)
    outs = [_inpaint(trained, template, mask, seed=seed, guidance=1.0) for seed in (1, 2)]
    keep = ~mask
    assert _psnr(outs[0][keep], outs[1][keep]) >= 28.0


def test_trained_model_is_the_embedded_default_and_saves(tmp_path: Path) -> None:
    import dataclasses

    default = {f.name: f.default for f in dataclasses.fields(Settings)}["model_id"]
    assert default == "tiny-sd-inpaint-trained"
    home_copy = ensure_model_dir(Settings.from_env(home=tmp_path / "home", model_dir="", model_id=default))
    assert model_identity(home_copy) == model_identity(MODEL)
    out = tmp_path / "saved"
    proc = subprocess.run([sys.executable, "-m", "app.cli", "model", "save", str(out), "--model", default],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == \
        (MODEL / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
