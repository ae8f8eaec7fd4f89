"""What the trainers share: the images and captions, crops, masks, the VAE stage, EMA and set-up.

The images ship with scikit-image (files inside the wheel: no downloads); masks are drawn like
production ones (``app.maskgen`` shapes at ratios of the public traces). ``ops/train/sd.py`` and
``ops/train/flux.py`` (and the adapter trainers) build on these names.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

log = logging.getLogger(__name__)

SIZE = 128
LATENT = SIZE // 8

# Source images bundled with scikit-image (files inside the wheel: no downloads) and a caption
# per image. HELD_OUT images are never trained on; held-out metrics are measured on them.
TRAIN_SOURCES: dict[str, str] = {
    "astronaut": "an astronaut",
    "chelsea": "a cat",
    "coffee": "a cup of coffee",
    "rocket": "a rocket",
    "camera": "a man with a camera",
    "coins": "coins",
    "moon": "the moon",
    "brick": "a brick wall",
    "grass": "grass",
    "gravel": "gravel",
    "page": "a page of text",
    "text": "text",
    "colorwheel": "a color wheel",
    "hubble_deep_field": "galaxies in space",
    "immunohistochemistry": "cells under a microscope",
    "retina": "a retina",
    "logo": "a logo",
}
HELD_OUT: dict[str, str] = {"clock": "a clock", "stereo_motorcycle": "a motorcycle"}


def load_source(name: str, max_side: int = 384) -> Image.Image:
    """An RGB image from ``skimage.data`` (gray -> RGB, alpha over white), at most ``max_side`` short side."""
    from skimage import data

    arr = getattr(data, name)()
    if isinstance(arr, tuple):  # stereo_motorcycle: (left, right, disparity)
        arr = arr[0]
    arr = np.asarray(arr)
    if arr.dtype == bool:
        arr = arr.astype(np.uint8) * 255
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    if arr.shape[-1] == 4:
        alpha = arr[..., 3:4].astype(np.float32) / 255
        arr = (arr[..., :3] * alpha + 255 * (1 - alpha)).astype(np.uint8)
    img = Image.fromarray(arr.astype(np.uint8)).convert("RGB")
    short = min(img.size)
    if short > max_side:
        f = max_side / short
        img = img.resize((round(img.width * f), round(img.height * f)), Image.BICUBIC)
    return img


@dataclass
class Crops:
    """Random crops and flips of source images, each crop covering 35-100% of the short side."""

    images: list[Image.Image]
    rng: np.random.Generator
    min_cover: float = 0.35
    size: int = SIZE

    def sample(self, idx: int) -> np.ndarray:
        """A crop as a 128x128 view would show it; ``size`` < 128 takes a random window of that
        view (same pixel statistics, cheaper steps for the convolutional VAE)."""
        img = self.images[idx]
        short = min(img.size)
        cover = self.rng.uniform(self.min_cover, 1.0)
        side = max(SIZE, int(round(short * cover)))
        x = int(self.rng.integers(0, img.width - side + 1))
        y = int(self.rng.integers(0, img.height - side + 1))
        crop = img.crop((x, y, x + side, y + side)).resize((SIZE, SIZE), Image.BICUBIC)
        if self.size < SIZE:
            ox, oy = (int(v) for v in self.rng.integers(0, SIZE - self.size + 1, size=2))
            crop = crop.crop((ox, oy, ox + self.size, oy + self.size))
        arr = np.asarray(crop, dtype=np.float32) / 127.5 - 1.0
        if self.rng.random() < 0.5:
            arr = arr[:, ::-1]
        return arr.transpose(2, 0, 1).copy()

    def batch(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        idx = self.rng.integers(0, len(self.images), size=n)
        return torch.from_numpy(np.stack([self.sample(int(i)) for i in idx])), idx


def trace_ratios() -> np.ndarray:
    """All mask ratios of the three public traces (shipped in ``ops/data/mask_ratios``)."""
    from ops.sim.traces import load_trace

    return np.concatenate([load_trace(t) for t in ("spring", "controlnet", "adetailer")])


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in [-1, 1] (as uint8-range images would be measured)."""
    mse = ((a.clamp(-1, 1) - b.clamp(-1, 1)) / 2).pow(2).mean().item()
    return float(10 * np.log10(1.0 / max(mse, 1e-12)))


@torch.no_grad()
def recon_psnr(vae: torch.nn.Module, held: torch.Tensor) -> float:
    """PSNR of a VAE's round trip (posterior mode) of the held-out crops."""
    rec = torch.cat([vae.decode(vae.encode(c).latent_dist.mode()).sample for c in held.split(16)])
    return psnr(rec, held)


class EMA:
    """Exponential moving average of parameters (warm-up decay), for weights that do not depend
    on where a time-capped run stopped."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.n = decay, 0

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.n += 1
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        for e, p in zip(self.model.parameters(), model.parameters()):
            e.mul_(d).add_(p.detach(), alpha=1 - d)


def train_vae(args: argparse.Namespace, crops: Crops, held: torch.Tensor,
              build: Callable[[int], torch.nn.Module] | None = None) -> tuple[torch.nn.Module, dict]:
    """Stage 1: the VAE (``build(seed)``; default SD's 4-channel VAE of ``--vae-channels``)."""
    if build is None:
        from workers.models.tiny_sd import build_vae

        def build(seed: int) -> torch.nn.Module:
            return build_vae(seed, block_out_channels=tuple(args.vae_channels))

    torch.manual_seed(args.seed)
    vae = build(args.seed).train()
    random_vae = build(args.seed + 1).eval()
    # Start the posterior narrow (log-variance about -8): with a unit-variance start, sampled
    # latents are mostly noise and the decoder learns slowly; the pipeline samples latents, so the
    # variance stays a trained output (the KL term still regularises it), just from a sane start.
    # Without a quant conv (Flux's VAE) the log-variance is the encoder's last conv's second half.
    with torch.no_grad():
        qc = vae.quant_conv if vae.quant_conv is not None else vae.encoder.conv_out
        half = qc.out_channels // 2
        qc.weight[half:].mul_(0.01)
        qc.bias[half:].fill_(args.init_logvar)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    ema = EMA(vae, 0.998)
    curve: list[tuple[int, float]] = []
    t0, run = time.monotonic(), 0.0
    step = 0
    vae_crops = Crops(crops.images, crops.rng, crops.min_cover, size=args.vae_crop)
    for step in range(1, args.vae_steps + 1):
        x, _ = vae_crops.batch(args.vae_batch)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        mse = F.mse_loss(rec, x)
        loss = mse + args.kl_weight * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema.update(vae)
        run = mse.item() if step == 1 else 0.95 * run + 0.05 * mse.item()
        if step % 25 == 0:
            curve.append((step, run))
        if step % 50 == 0:
            log.info("vae step %d mse %.5f kl %.1f (%.0fs)", step, run, post.kl().mean().item(),
                     time.monotonic() - t0)
        if time.monotonic() - t0 > args.vae_minutes * 60:
            log.warning("vae: wall-clock cap %.1f min hit at step %d", args.vae_minutes, step)
            break
    vae = ema.model
    trained_psnr, random_psnr = recon_psnr(vae, held), recon_psnr(random_vae, held)
    log.info("vae held-out PSNR %.2f dB (random init %.2f dB)", trained_psnr, random_psnr)
    return vae, {"steps": step, "seconds": round(time.monotonic() - t0, 1), "mse_curve": curve,
                 "heldout_psnr_db": round(trained_psnr, 2), "random_init_psnr_db": round(random_psnr, 2)}


def optimise(name: str, steps: int, minutes: float, lr: float, opt: torch.optim.Optimizer,
             emas: list[tuple[torch.nn.Module, EMA]], batch_loss: Callable[[], torch.Tensor],
             held_loss: Callable[[], torch.Tensor], log_every: int = 0) -> tuple[int, list, list, float, float]:
    """The denoiser stage of both trainers: learning rate warmed up over 100 steps, gradients clipped to
    norm 1, EMA weights, a smoothed loss curve, the EMA weights' held-out loss every 200 steps and at the
    end, a wall-clock cap. Returns (steps, curve, held-out curve, final held-out loss, start time)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    curve: list[tuple[int, float]] = []
    held_curve: list[tuple[int, float]] = []
    t0, run, step = time.monotonic(), 0.0, 0
    for step in range(1, steps + 1):
        loss = batch_loss()
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / 100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for model, ema in emas:
            ema.update(model)
        run = loss.item() if step == 1 else 0.98 * run + 0.02 * loss.item()
        if step % 10 == 0:
            curve.append((step, run))
        if log_every and step % log_every == 0:
            log.info("%s step %d loss %.4f (%.0fs)", name, step, run, time.monotonic() - t0)
        if step % 200 == 0 or step == 1:
            with torch.no_grad():
                hl = held_loss().item()
            held_curve.append((step, hl))
            log.info("%s step %d loss %.4f held-out (EMA) %.4f (%.0fs)", name, step, run, hl, time.monotonic() - t0)
        if time.monotonic() - t0 > minutes * 60:
            log.warning("%s: wall-clock cap %.1f min hit at step %d", name, minutes, step)
            break
    with torch.no_grad():
        hl = held_loss().item()
    held_curve.append((step, hl))
    return step, curve, held_curve, hl, t0


def draw_masks(k: int, rng: np.random.Generator, full_mask_share: float) -> torch.Tensor:
    """``[k, 1, SIZE, SIZE]`` masks drawn like production ones (``app.maskgen`` shapes at ratios of
    the public traces, clipped to 0.01-0.9), plus a share of full masks."""
    from app.maskgen import SHAPES, make_mask

    ratios = trace_ratios()
    masks = []
    for _ in range(k):
        if rng.random() < full_mask_share:
            masks.append(np.ones((SIZE, SIZE), bool))
            continue
        r = float(np.clip(rng.choice(ratios), 0.01, 0.9))
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        masks.append(make_mask(r, (SIZE, SIZE), shape, seed=int(rng.integers(1 << 30))))
    return torch.from_numpy(np.stack(masks)[:, None].astype(np.float32))


def add_data_args(p: argparse.ArgumentParser, *, vae_steps: int, vae_minutes: float, encode_crops: int) -> None:
    """Options of the stages both trainers share: the VAE and the encoded crops."""
    p.add_argument("--vae-channels", type=int, nargs=4, default=[16, 32, 64, 64])
    p.add_argument("--vae-steps", type=int, default=vae_steps)
    p.add_argument("--vae-batch", type=int, default=8)
    p.add_argument("--vae-crop", type=int, default=64, help="training window of the VAE (<= 128)")
    p.add_argument("--vae-lr", type=float, default=1e-3)
    p.add_argument("--vae-minutes", type=float, default=vae_minutes, help="wall-clock cap of the VAE stage")
    p.add_argument("--kl-weight", type=float, default=1e-6)
    p.add_argument("--init-logvar", type=float, default=-8.0, help="initial posterior log-variance")
    p.add_argument("--encode-crops", type=int, default=encode_crops)
    p.add_argument("--full-mask-share", type=float, default=0.1)


def setup(args: argparse.Namespace) -> tuple[np.random.Generator, Crops, Crops, torch.Tensor]:
    """Logging, threads, seeds; the training and held-out crops and 64 held-out images."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    crops = Crops([load_source(n) for n in TRAIN_SOURCES], rng)
    held_crops = Crops([load_source(n) for n in HELD_OUT], np.random.default_rng(args.seed + 1))
    held_x, _ = held_crops.batch(64)
    return rng, crops, held_crops, held_x



def command(module: str, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> str:
    """The command line that repeats a run with every option spelled out (kept in its training log)."""
    return f"python -m {module} " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in skip)


def save(pipe, out: Path, record: dict) -> None:  # type: ignore[no-untyped-def]
    """The pipeline folder (``save_pretrained``, safetensors) with its ``training_log.json``."""
    pipe.save_pretrained(out, safe_serialization=True)
    (out / "training_log.json").write_text(json.dumps(record, indent=1))
    log.info("saved %s (total %.0fs)", out, record["total_seconds"])
