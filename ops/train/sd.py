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

    python -m ops.train.sd --out workers/models/trained/tiny-sd-inpaint-trained

Writes the pipeline folder (``save_pretrained`` layout, safetensors), ``training_log.json`` with
the loss curves and held-out metrics, and (with ``--plot``) a loss-curve PNG.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ops.train import common

log = logging.getLogger(__name__)


def reuse_vae(folder: Path, held: torch.Tensor) -> tuple[torch.nn.Module, dict]:
    """The VAE of an earlier run (its training log travels along), re-measured on this run's held-out crops."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(folder / "vae", use_safetensors=True).eval()
    earlier = json.loads((folder / "training_log.json").read_text())
    log.info("reusing the VAE of %s (held-out PSNR %.2f dB)", folder, common.recon_psnr(vae, held))
    return vae, {**earlier["vae"], "reused_from": str(folder), "reused_from_command": earlier["command"]}


@torch.no_grad()
def encode_dataset(vae: torch.nn.Module, crops: common.Crops, n: int, rng: np.random.Generator,
                   full_mask_share: float) -> dict[str, torch.Tensor]:
    """Latents, masked-image latents and latent-size masks of ``n`` augmented crops, as the
    pipeline builds them (masked image = image * (mask < 0.5); nearest resize of the mask)."""
    out: dict[str, list[torch.Tensor]] = {"latents": [], "masked": [], "mask": [], "src": []}
    for start in range(0, n, 32):
        k = min(32, n - start)
        x, idx = crops.batch(k)
        mask = common.draw_masks(k, rng, full_mask_share)
        masked = x * (mask < 0.5)
        out["latents"].append(vae.encode(x).latent_dist.sample())
        out["masked"].append(vae.encode(masked).latent_dist.sample())
        out["mask"].append(F.interpolate(mask, size=(common.LATENT, common.LATENT)))
        out["src"].append(torch.from_numpy(idx))
    return {k: torch.cat(v) for k, v in out.items()}


def build_unet_for(args: argparse.Namespace) -> torch.nn.Module:
    """The untrained UNet of a run's arguments (its shape and layout; seeded)."""
    from workers.models.tiny_sd import build_unet

    return build_unet(args.seed, hidden=tuple(args.unet_channels), cross_dim=args.cross_dim,
                      layers_per_block=args.layers_per_block, layout=args.unet_layout,
                      transformer_layers=tuple(args.transformer_layers) if args.transformer_layers else None)


def train_unet(args: argparse.Namespace, data: dict[str, torch.Tensor], held: dict[str, torch.Tensor],
               captions: list[str], held_captions: list[str]) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    from diffusers import DDPMScheduler

    from workers.models.tiny_sd import SD_BETAS, build_text_encoder, build_unet, byte_level_clip_tokenizer

    torch.manual_seed(args.seed)
    tok = byte_level_clip_tokenizer()
    unet = build_unet_for(args)
    text = build_text_encoder(args.seed, hidden=args.cross_dim, vocab_size=len(tok))
    noise_sched = DDPMScheduler(num_train_timesteps=1000, **SD_BETAS)
    all_caps = [""] + captions + held_captions
    ids = tok(all_caps, padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids
    params = list(unet.parameters()) + list(text.parameters())
    opt = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=1e-4)
    ema_unet, ema_text = common.EMA(unet, 0.999), common.EMA(text, 0.999)
    gen = torch.Generator().manual_seed(args.seed)
    n = data["latents"].shape[0]

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

    def batch_loss() -> torch.Tensor:
        b = torch.randint(0, n, (args.unet_batch,), generator=gen)
        d = {k: v[b] for k, v in data.items()}
        cap = 1 + d["src"]
        drop = torch.rand(args.unet_batch, generator=gen) < args.caption_dropout
        cap = torch.where(drop, torch.zeros_like(cap), cap)
        noise = torch.randn(d["latents"].shape, generator=gen)
        t = torch.randint(0, 1000, (args.unet_batch,), generator=gen)
        return loss_on(unet, text, d, cap, noise, t)

    step, curve, held_curve, hl, t0 = common.optimise(
        "unet", args.unet_steps, args.unet_minutes, args.unet_lr, opt, [(unet, ema_unet), (text, ema_text)],
        batch_loss, lambda: loss_on(ema_unet.model, ema_text.model, held, h_cap, h_noise, h_t), log_every=50)
    with torch.no_grad():
        rand_u = build_unet(args.seed + 1, hidden=tuple(args.unet_channels), cross_dim=args.cross_dim,
                            layers_per_block=args.layers_per_block).eval()
        rand_t = build_text_encoder(args.seed + 1, hidden=args.cross_dim, vocab_size=len(tok)).eval()
        rl = loss_on(rand_u, rand_t, held, h_cap, h_noise, h_t).item()
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="workers/models/trained/tiny-sd-inpaint-trained")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    common.add_data_args(p, vae_steps=4000, vae_minutes=11.0, encode_crops=3072)
    p.add_argument("--unet-channels", type=int, nargs="+", default=[32, 64])
    p.add_argument("--cross-dim", type=int, default=32)
    p.add_argument("--layers-per-block", type=int, default=1)
    p.add_argument("--unet-layout", default="sd", choices=["sd", "sdxl"],
                   help="where the transformers sit (workers/models/tiny_sd.LAYOUTS): sdxl = none at the finest "
                        "level, the deepest at the coarsest, to measure coarse-level mask pooling")
    p.add_argument("--transformer-layers", type=int, nargs="*", default=[],
                   help="transformer depth per level (SDXL: 1 2 10); default: 1 everywhere")
    p.add_argument("--unet-steps", type=int, default=8000)
    p.add_argument("--unet-batch", type=int, default=24)
    p.add_argument("--unet-lr", type=float, default=1e-3)
    p.add_argument("--unet-minutes", type=float, default=22.0, help="wall-clock cap of the UNet stage")
    p.add_argument("--caption-dropout", type=float, default=0.15)
    p.add_argument("--prediction-type", default="epsilon", choices=["epsilon", "v_prediction", "sample"],
                   help="UNet target; saved in the scheduler config, which every diffusers sampler reads")
    p.add_argument("--vae-from", default="", help="reuse the VAE of a saved pipeline folder (skips stage 1)")
    p.add_argument("--plot", default="docs/bench/training_loss.png")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    t_all = time.monotonic()
    rng, crops, held_crops, held_x = common.setup(args)

    from diffusers import StableDiffusionInpaintPipeline

    from workers.models.tiny_sd import build_scheduler, byte_level_clip_tokenizer


    if args.vae_from:
        vae, vae_log = reuse_vae(Path(args.vae_from), held_x)
    else:
        vae, vae_log = common.train_vae(args, crops, held_x)
    vae.requires_grad_(False)
    t_enc = time.monotonic()
    data = encode_dataset(vae, crops, args.encode_crops, rng, args.full_mask_share)
    held = encode_dataset(vae, held_crops, 64, np.random.default_rng(args.seed + 2), args.full_mask_share)
    std = float(data["latents"].std())
    args.scaling_factor = round(1.0 / std, 5)
    log.info("encoded %d crops in %.0fs; latent std %.4f -> scaling_factor %.5f",
             args.encode_crops, time.monotonic() - t_enc, std, args.scaling_factor)
    vae.register_to_config(scaling_factor=args.scaling_factor)

    unet, text, unet_log = train_unet(args, data, held, list(common.TRAIN_SOURCES.values()),
                                      list(common.HELD_OUT.values()))
    scheduler = build_scheduler()
    scheduler.register_to_config(prediction_type=args.prediction_type)
    pipe = StableDiffusionInpaintPipeline(
        vae=vae, text_encoder=text, tokenizer=byte_level_clip_tokenizer(), unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    record = {"command": common.command("ops.train.sd", args, skip=("scaling_factor",)),
              "torch_threads": args.threads, "total_seconds": round(time.monotonic() - t_all, 1),
              "scaling_factor": args.scaling_factor, "train_sources": common.TRAIN_SOURCES, "held_out": common.HELD_OUT,
              "vae": vae_log, "unet": unet_log}
    common.save(pipe, Path(args.out), record)
    if args.plot:
        plot(record, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
