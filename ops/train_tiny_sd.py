"""Train the small inpainting model that Stencil embeds as its default (CPU only, seeded).

Why: the random-init embedded model demonstrates the mechanics but its outputs are noise, so the
demo shows nothing and fidelity numbers measure noise against noise. This trains, on the images
that ship with scikit-image (no downloads), a model of the same diffusers classes and SD
conventions that really inpaints:

1. an ``AutoencoderKL`` (downscale 8, 4 latent channels) on random crops and flips (MSE + a small
   KL term); its ``scaling_factor`` is set to 1 / std of the latents, as SD's 0.18215 was;
2. the VAE is frozen; latents of many augmented crops, their masked images (masks drawn like
   real ones with ``app.maskgen`` at ratios sampled from the public traces, plus full masks) are
   encoded once;
3. a 9-channel ``UNet2DConditionModel`` (latents 4 + mask 1 + masked-image latents 4) and a small
   ``CLIPTextModel`` are trained with epsilon prediction on SD's scaled-linear 1000-step schedule
   (the one ``tiny_sd.build_scheduler`` samples with), with caption dropout for CFG.

Every stage is seeded; with fixed step counts the run is repeatable. The machine may be shared,
so each stage also has a wall-clock cap: it stops early (and logs the step reached) if the cap is
hit. Weights use an EMA of the parameters, so stopping early never lands mid-LR-schedule.

    python -m ops.train_tiny_sd --out workers/models/trained/tiny-sd-inpaint-trained

Writes the pipeline folder (``save_pretrained`` layout, safetensors), ``training_log.json`` with
the loss curves and held-out metrics, and (with ``--plot``) a loss-curve PNG.
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

log = logging.getLogger("train_tiny_sd")

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
    """All mask ratios of the three public traces (read in place, never copied)."""
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


def reuse_vae(folder: Path, held: torch.Tensor) -> tuple[torch.nn.Module, dict]:
    """The VAE of an earlier run (its training log travels along), re-measured on this run's held-out crops."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(folder / "vae", use_safetensors=True).eval()
    earlier = json.loads((folder / "training_log.json").read_text())
    log.info("reusing the VAE of %s (held-out PSNR %.2f dB)", folder, recon_psnr(vae, held))
    return vae, {**earlier["vae"], "reused_from": str(folder), "reused_from_command": earlier["command"]}


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


@torch.no_grad()
def encode_dataset(vae: torch.nn.Module, crops: Crops, n: int, rng: np.random.Generator,
                   full_mask_share: float) -> dict[str, torch.Tensor]:
    """Latents, masked-image latents and latent-size masks of ``n`` augmented crops, as the
    pipeline builds them (masked image = image * (mask < 0.5); nearest resize of the mask)."""
    out: dict[str, list[torch.Tensor]] = {"latents": [], "masked": [], "mask": [], "src": []}
    for start in range(0, n, 32):
        k = min(32, n - start)
        x, idx = crops.batch(k)
        mask = draw_masks(k, rng, full_mask_share)
        masked = x * (mask < 0.5)
        out["latents"].append(vae.encode(x).latent_dist.sample())
        out["masked"].append(vae.encode(masked).latent_dist.sample())
        out["mask"].append(F.interpolate(mask, size=(LATENT, LATENT)))
        out["src"].append(torch.from_numpy(idx))
    return {k: torch.cat(v) for k, v in out.items()}


def train_unet(args: argparse.Namespace, data: dict[str, torch.Tensor], held: dict[str, torch.Tensor],
               captions: list[str], held_captions: list[str]) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    from diffusers import DDPMScheduler

    from workers.models.tiny_sd import SD_BETAS, build_text_encoder, build_unet, byte_level_clip_tokenizer

    torch.manual_seed(args.seed)
    tok = byte_level_clip_tokenizer()
    unet = build_unet(args.seed, hidden=tuple(args.unet_channels), cross_dim=args.cross_dim,
                      layers_per_block=args.layers_per_block)
    text = build_text_encoder(args.seed, hidden=args.cross_dim, vocab_size=len(tok))
    noise_sched = DDPMScheduler(num_train_timesteps=1000, **SD_BETAS)
    all_caps = [""] + captions + held_captions
    ids = tok(all_caps, padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids
    params = list(unet.parameters()) + list(text.parameters())
    opt = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=1e-4)
    ema_unet, ema_text = EMA(unet, 0.999), EMA(text, 0.999)
    gen = torch.Generator().manual_seed(args.seed)
    n = data["latents"].shape[0]
    curve: list[tuple[int, float]] = []
    held_curve: list[tuple[int, float]] = []
    t0, run, step = time.monotonic(), 0.0, 0

    def target(lat: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the UNet predicts, as diffusers' schedulers read ``prediction_type``."""
        if args.prediction_type == "epsilon":
            return noise
        if args.prediction_type == "v_prediction":
            return noise_sched.get_velocity(lat, noise, t)
        return lat  # "sample": the clean latents

    def loss_on(u: torch.nn.Module, te: torch.nn.Module, d: dict[str, torch.Tensor], cap_idx: torch.Tensor,
                noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = te(ids)[0]
        lat = d["latents"] * args.scaling_factor
        noisy = noise_sched.add_noise(lat, noise, t)
        inp = torch.cat([noisy, d["mask"], d["masked"] * args.scaling_factor], dim=1)
        pred = u(inp, t, encoder_hidden_states=emb[cap_idx]).sample
        return F.mse_loss(pred, target(lat, noise, t))

    # A fixed held-out batch (images never trained on, fixed noise and timesteps).
    hg = torch.Generator().manual_seed(args.seed + 7)
    h_noise = torch.randn(held["latents"].shape, generator=hg)
    h_t = torch.randint(0, 1000, (held["latents"].shape[0],), generator=hg)
    h_cap = 1 + len(captions) + held["src"]

    for step in range(1, args.unet_steps + 1):
        b = torch.randint(0, n, (args.unet_batch,), generator=gen)
        d = {k: v[b] for k, v in data.items()}
        cap = 1 + d["src"]
        drop = torch.rand(args.unet_batch, generator=gen) < args.caption_dropout
        cap = torch.where(drop, torch.zeros_like(cap), cap)
        noise = torch.randn(d["latents"].shape, generator=gen)
        t = torch.randint(0, 1000, (args.unet_batch,), generator=gen)
        warm = min(1.0, step / 100)
        for g in opt.param_groups:
            g["lr"] = args.unet_lr * warm
        loss = loss_on(unet, text, d, cap, noise, t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_unet.update(unet)
        ema_text.update(text)
        run = loss.item() if step == 1 else 0.98 * run + 0.02 * loss.item()
        if step % 10 == 0:
            curve.append((step, run))
        if step % 50 == 0:
            log.info("unet step %d loss %.4f (%.0fs)", step, run, time.monotonic() - t0)
        if step % 200 == 0 or step == 1:
            with torch.no_grad():
                hl = loss_on(ema_unet.model, ema_text.model, held, h_cap, h_noise, h_t).item()
            held_curve.append((step, hl))
            log.info("unet step %d loss %.4f held-out (EMA) %.4f (%.0fs)", step, run, hl, time.monotonic() - t0)
        if time.monotonic() - t0 > args.unet_minutes * 60:
            log.warning("unet: wall-clock cap %.1f min hit at step %d", args.unet_minutes, step)
            break
    with torch.no_grad():
        hl = loss_on(ema_unet.model, ema_text.model, held, h_cap, h_noise, h_t).item()
        rand_u = build_unet(args.seed + 1, hidden=tuple(args.unet_channels), cross_dim=args.cross_dim,
                            layers_per_block=args.layers_per_block).eval()
        rand_t = build_text_encoder(args.seed + 1, hidden=args.cross_dim, vocab_size=len(tok)).eval()
        rl = loss_on(rand_u, rand_t, held, h_cap, h_noise, h_t).item()
    held_curve.append((step, hl))
    log.info("unet held-out %s MSE %.4f (random init %.4f)", args.prediction_type, hl, rl)
    return ema_unet.model, ema_text.model, {
        "steps": step, "seconds": round(time.monotonic() - t0, 1), "loss_curve": curve,
        "heldout_curve": held_curve, "prediction_type": args.prediction_type,
        "heldout_mse": round(hl, 4), "random_init_mse": round(rl, 4)}


def plot(log_data: dict, out: Path) -> None:
    """Loss curves (VAE reconstruction MSE, UNet epsilon MSE train and held-out) as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    s, v = zip(*log_data["vae"]["mse_curve"])
    a.semilogy(s, v)
    a.set(title="VAE reconstruction MSE (train, EMA-smoothed)", xlabel="step")
    s, v = zip(*log_data["unet"]["loss_curve"])
    b.plot(s, v, label="train (smoothed)")
    s, v = zip(*log_data["unet"]["heldout_curve"])
    b.plot(s, v, "o-", label="held-out images (EMA weights)")
    b.set(title=f"UNet denoising loss ({log_data['unet'].get('prediction_type', 'epsilon')} MSE)",
          xlabel="step", yscale="log")
    b.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    log.info("wrote %s", out)


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="workers/models/trained/tiny-sd-inpaint-trained")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    add_data_args(p, vae_steps=4000, vae_minutes=11.0, encode_crops=3072)
    p.add_argument("--unet-channels", type=int, nargs="+", default=[32, 64])
    p.add_argument("--cross-dim", type=int, default=32)
    p.add_argument("--layers-per-block", type=int, default=1)
    p.add_argument("--unet-steps", type=int, default=8000)
    p.add_argument("--unet-batch", type=int, default=24)
    p.add_argument("--unet-lr", type=float, default=1e-3)
    p.add_argument("--unet-minutes", type=float, default=22.0, help="wall-clock cap of the UNet stage")
    p.add_argument("--caption-dropout", type=float, default=0.15)
    p.add_argument("--prediction-type", default="epsilon", choices=["epsilon", "v_prediction", "sample"],
                   help="UNet target; saved in the scheduler config, which every diffusers sampler reads")
    p.add_argument("--vae-from", default="", help="reuse the VAE of a saved pipeline folder (skips stage 1)")
    p.add_argument("--plot", default="docs/bench/training_loss.png")
    args = p.parse_args()
    t_all = time.monotonic()
    rng, crops, held_crops, held_x = setup(args)

    from diffusers import StableDiffusionInpaintPipeline

    from workers.models.tiny_sd import build_scheduler, byte_level_clip_tokenizer

    names = list(TRAIN_SOURCES)

    if args.vae_from:
        vae, vae_log = reuse_vae(Path(args.vae_from), held_x)
    else:
        vae, vae_log = train_vae(args, crops, held_x)
    vae.requires_grad_(False)
    t_enc = time.monotonic()
    data = encode_dataset(vae, crops, args.encode_crops, rng, args.full_mask_share)
    held = encode_dataset(vae, held_crops, 64, np.random.default_rng(args.seed + 2), args.full_mask_share)
    std = float(data["latents"].std())
    args.scaling_factor = round(1.0 / std, 5)
    log.info("encoded %d crops in %.0fs; latent std %.4f -> scaling_factor %.5f",
             args.encode_crops, time.monotonic() - t_enc, std, args.scaling_factor)
    vae.register_to_config(scaling_factor=args.scaling_factor)

    unet, text, unet_log = train_unet(args, data, held, [TRAIN_SOURCES[n] for n in names], list(HELD_OUT.values()))
    scheduler = build_scheduler()
    scheduler.register_to_config(prediction_type=args.prediction_type)
    pipe = StableDiffusionInpaintPipeline(
        vae=vae, text_encoder=text, tokenizer=byte_level_clip_tokenizer(), unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    out = Path(args.out)
    pipe.save_pretrained(out, safe_serialization=True)
    record = {"command": "python -m ops.train_tiny_sd " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if k != "scaling_factor"),
              "torch_threads": args.threads, "total_seconds": round(time.monotonic() - t_all, 1),
              "scaling_factor": args.scaling_factor, "train_sources": TRAIN_SOURCES, "held_out": HELD_OUT,
              "vae": vae_log, "unet": unet_log}
    (out / "training_log.json").write_text(json.dumps(record, indent=1))
    log.info("saved %s (total %.0fs)", out, record["total_seconds"])
    if args.plot:
        plot(record, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
