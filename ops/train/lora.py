"""Train a small style LoRA (PEFT) for the trained inpainting model (CPU, seeded, time-capped).

Why: per-job LoRA adapters need real adapters whose effect is visible and measurable, trained on
the base model's own objective, so that loading one with the stock
``StableDiffusionInpaintPipeline.load_lora_weights`` changes *what the masked region becomes*
while the template outside the mask stays the template.

Objective (the base model's, see its model card and ``ops/train/sd.py``): the 9-channel
UNet input ``cat(noisy latents, mask, masked-image latents)`` on SD's scaled-linear 1000-step
schedule, x0 ("sample") prediction read from the model's scheduler config, MSE on the clean
latents, 15 % empty captions (the CFG branch runs with the adapter loaded too).

Training pairs (built once, then encoded with the frozen VAE):

- crop ``x``: random crops/flips of the base model's training images (``Crops``), the held-out
  images (``HELD_OUT``) only for the held-out loss;
- mask ``m``: drawn like production masks (``draw_masks``: ``app.maskgen`` shapes at the public
  traces' ratios), with a larger share of full masks than the base's 10 % (15 %) so batches
  carry the style over whole images too;
- **target = style(x) inside the mask, x outside** (a hard composite at the pixel mask);
- **masked image = x * (m < 0.5)**: the *original* with the hole, exactly what the pipeline builds
  from the template at inference.

Why this pairing: at inference the adapter only ever sees an unstyled template around the hole,
so the masked image must be unstyled; and outside the mask the x0 UNet copies its masked-image
channels, so a target styled there too would teach the adapter to restyle the template (what the
serving side's ``keep_unmasked`` and mask-aware caching must not get). Styling only the hole
teaches "fill the hole, in the style, continuing an unstyled surrounding".

LoRA as diffusers' ``train_text_to_image_lora.py`` / ``train_dreambooth_lora.py`` add it:
``unet.add_adapter(LoraConfig(r, lora_alpha=r, init_lora_weights="gaussian",
target_modules=["to_q", "to_k", "to_v", "to_out.0"]))`` and, with ``--text-encoder-rank``, the
same on the ``CLIPTextModel``'s ``q_proj/k_proj/v_proj/out_proj``; only the LoRA weights train;
saved with ``StableDiffusionInpaintPipeline.save_lora_weights`` from
``convert_state_dict_to_diffusers(get_peft_model_state_dict(...))`` plus the adapter metadata
(``peft_config["default"].to_dict()``, as ``diffusers.training_utils._collate_lora_metadata``).
Weights are an EMA of the LoRA parameters, so a wall-clock stop never lands mid-schedule.

    python -m ops.train.lora --style sepia --text-encoder-rank 4   # -> workers/models/trained/loras/sepia
    python -m ops.train.lora --style noir                          # recommended scale 0.5 (its model card)
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

from ops.train.common import EMA, HELD_OUT, LATENT, TRAIN_SOURCES, Crops, draw_masks, load_source
from ops.train.styles import STYLES, apply_style

log = logging.getLogger("train_lora")

BASE = Path("workers/models/trained/tiny-sd-inpaint-trained")
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def styled_composite(x: torch.Tensor, mask: torch.Tensor, style: str) -> torch.Tensor:
    """``style(x)`` where ``mask >= 0.5``, ``x`` elsewhere (images in [-1, 1], ``[B, 3, H, W]``)."""
    u8 = ((x.permute(0, 2, 3, 1).numpy() + 1) * 127.5).round().clip(0, 255).astype(np.uint8)
    styled = np.stack([apply_style(style, a) for a in u8]).astype(np.float32) / 127.5 - 1.0
    s = torch.from_numpy(styled).permute(0, 3, 1, 2)
    return torch.where(mask >= 0.5, s, x)


@torch.no_grad()
def encode_pairs(vae: torch.nn.Module, crops: Crops, n: int, rng: np.random.Generator, style: str,
                 full_mask_share: float) -> dict[str, torch.Tensor]:
    """Target latents (style inside the mask), masked-image latents (original with the hole),
    latent-size masks (nearest, as the pipeline resizes them) and caption indices of ``n`` crops."""
    out: dict[str, list[torch.Tensor]] = {"latents": [], "masked": [], "mask": [], "src": []}
    for start in range(0, n, 32):
        k = min(32, n - start)
        x, idx = crops.batch(k)
        mask = draw_masks(k, rng, full_mask_share)
        out["latents"].append(vae.encode(styled_composite(x, mask, style)).latent_dist.sample())
        out["masked"].append(vae.encode(x * (mask < 0.5)).latent_dist.sample())
        out["mask"].append(F.interpolate(mask, size=(LATENT, LATENT)))
        out["src"].append(torch.from_numpy(idx))
    return {k: torch.cat(v) for k, v in out.items()}


def lora_config(rank: int, targets: list[str]):  # type: ignore[no-untyped-def]
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--style", required=True, choices=sorted(STYLES))
    p.add_argument("--out", default="", help="default workers/models/trained/loras/<style>")
    p.add_argument("--base", default=str(BASE), help="the trained inpainting pipeline folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rank", type=int, default=8, help="UNet LoRA rank (lora_alpha = rank)")
    p.add_argument("--text-encoder-rank", type=int, default=0, help="0: no text-encoder LoRA")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--text-lr", type=float, default=1e-3)
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--encode-crops", type=int, default=1024)
    p.add_argument("--full-mask-share", type=float, default=0.15)
    p.add_argument("--caption-dropout", type=float, default=0.15)
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock cap of the training loop")
    args = p.parse_args(argv)
    out = Path(args.out or f"workers/models/trained/loras/{args.style}")
    args.out = str(out)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_all, c_all = time.monotonic(), time.process_time()

    from diffusers import DDPMScheduler, StableDiffusionInpaintPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    base = StableDiffusionInpaintPipeline.from_pretrained(args.base, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False)
    vae, unet, text, tok = base.vae.eval(), base.unet, base.text_encoder, base.tokenizer
    for m in (vae, unet, text):
        m.requires_grad_(False)
    sf = vae.config.scaling_factor
    pred_type = base.scheduler.config.prediction_type
    # The training noise schedule: the model's own betas, 1000 steps, as its base trainer used.
    noise_sched = DDPMScheduler.from_config(base.scheduler.config)
    assert pred_type == "sample", "this trainer follows the base model's x0 objective"

    rng = np.random.default_rng(args.seed)
    crops = Crops([load_source(n) for n in TRAIN_SOURCES], rng)
    held_crops = Crops([load_source(n) for n in HELD_OUT], np.random.default_rng(args.seed + 1))
    t_enc, c_enc = time.monotonic(), time.process_time()
    data = encode_pairs(vae, crops, args.encode_crops, rng, args.style, args.full_mask_share)
    held = encode_pairs(vae, held_crops, 48, np.random.default_rng(args.seed + 2), args.style, args.full_mask_share)
    enc_wall, enc_cpu = time.monotonic() - t_enc, time.process_time() - c_enc
    log.info("encoded %d training pairs (+48 held-out) in %.0f s wall / %.0f s CPU", args.encode_crops, enc_wall,
             enc_cpu)

    names = list(TRAIN_SOURCES)
    captions = [""] + [TRAIN_SOURCES[n] for n in names] + list(HELD_OUT.values())
    ids = tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids

    unet.add_adapter(lora_config(args.rank, UNET_TARGETS))
    groups = [{"params": [q for q in unet.parameters() if q.requires_grad], "lr": args.lr}]
    if args.text_encoder_rank:
        text.add_adapter(lora_config(args.text_encoder_rank, TEXT_TARGETS))
        groups.append({"params": [q for q in text.parameters() if q.requires_grad], "lr": args.text_lr})
    n_unet = sum(q.numel() for q in groups[0]["params"])
    n_text = sum(q.numel() for q in groups[1]["params"]) if args.text_encoder_rank else 0
    log.info("LoRA parameters: unet %d (rank %d), text encoder %d (rank %d)", n_unet, args.rank, n_text,
             args.text_encoder_rank)
    trainable = [q for g in groups for q in g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    base_lrs = [g["lr"] for g in groups]
    ema_unet = EMA(unet, args.ema)
    ema_text = EMA(text, args.ema) if args.text_encoder_rank else None

    def loss_on(u: torch.nn.Module, te: torch.nn.Module, d: dict[str, torch.Tensor], cap: torch.Tensor,
                noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x0 MSE (overall, and over the latent pixels inside the mask)."""
        emb = te(ids)[0]
        lat = d["latents"] * sf
        noisy = noise_sched.add_noise(lat, noise, t)
        pred = u(torch.cat([noisy, d["mask"], d["masked"] * sf], dim=1), t, encoder_hidden_states=emb[cap]).sample
        err = (pred - lat).pow(2)
        inside = (err * d["mask"]).sum() / (d["mask"].sum() * err.shape[1]).clamp_min(1)
        return err.mean(), inside

    hg = torch.Generator().manual_seed(args.seed + 7)
    h_noise = torch.randn(held["latents"].shape, generator=hg)
    h_t = torch.randint(0, 1000, (held["latents"].shape[0],), generator=hg)
    h_cap = 1 + len(names) + held["src"]

    def held_loss() -> tuple[float, float]:
        with torch.no_grad():
            a, b = loss_on(ema_unet.model, ema_text.model if ema_text else text, held, h_cap, h_noise, h_t)
        return round(a.item(), 5), round(b.item(), 5)

    base_held = held_loss()  # LoRA B matrices start at zero: this is the base model
    log.info("held-out x0 MSE before training (= base model): %.4f (inside mask %.4f)", *base_held)
    gen = torch.Generator().manual_seed(args.seed)
    n = data["latents"].shape[0]
    curve: list[tuple[int, float, float]] = []
    held_curve: list[tuple[int, float, float]] = [(0, *base_held)]
    t0, c0 = time.monotonic(), time.process_time()
    run = run_in = 0.0
    step = 0
    unet.train()
    for step in range(1, args.steps + 1):
        b = torch.randint(0, n, (args.batch,), generator=gen)
        d = {k: v[b] for k, v in data.items()}
        cap = 1 + d["src"]
        cap = torch.where(torch.rand(args.batch, generator=gen) < args.caption_dropout, torch.zeros_like(cap), cap)
        noise = torch.randn(d["latents"].shape, generator=gen)
        t = torch.randint(0, 1000, (args.batch,), generator=gen)
        warm = min(1.0, step / 50)
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * warm
        loss, inside = loss_on(unet, text, d, cap, noise, t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        ema_unet.update(unet)
        if ema_text is not None:
            ema_text.update(text)
        run = loss.item() if step == 1 else 0.95 * run + 0.05 * loss.item()
        run_in = inside.item() if step == 1 else 0.95 * run_in + 0.05 * inside.item()
        if step % 10 == 0:
            curve.append((step, round(run, 5), round(run_in, 5)))
        if step % 100 == 0:
            hl = held_loss()
            held_curve.append((step, *hl))
            log.info("step %d loss %.4f (inside mask %.4f) held-out EMA %.4f (inside %.4f) (%.0f s)",
                     step, run, run_in, hl[0], hl[1], time.monotonic() - t0)
        if time.monotonic() - t0 > args.minutes * 60:
            log.warning("wall-clock cap %.1f min hit at step %d", args.minutes, step)
            break
    train_wall, train_cpu = time.monotonic() - t0, time.process_time() - c0
    final_held = held_loss()
    if held_curve[-1][0] != step:
        held_curve.append((step, *final_held))
    log.info("held-out x0 MSE: base %.4f (inside %.4f) -> LoRA %.4f (inside %.4f)", *base_held, *final_held)

    unet_sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(ema_unet.model))
    text_sd = (convert_state_dict_to_diffusers(get_peft_model_state_dict(ema_text.model))
               if ema_text is not None else None)
    out.mkdir(parents=True, exist_ok=True)
    StableDiffusionInpaintPipeline.save_lora_weights(
        out, unet_lora_layers=unet_sd, text_encoder_lora_layers=text_sd, safe_serialization=True,
        unet_lora_adapter_metadata=ema_unet.model.peft_config["default"].to_dict(),
        text_encoder_lora_adapter_metadata=(ema_text.model.peft_config["default"].to_dict()
                                            if ema_text is not None else None))
    record = {
        "command": "python -m ops.train.lora " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "style": args.style, "base": args.base, "torch_threads": args.threads,
        "unet_lora_params": n_unet, "text_encoder_lora_params": n_text,
        "steps": step, "encode_seconds": {"wall": round(enc_wall, 1), "cpu": round(enc_cpu, 1)},
        "train_seconds": {"wall": round(train_wall, 1), "cpu": round(train_cpu, 1)},
        "total_seconds": {"wall": round(time.monotonic() - t_all, 1), "cpu": round(time.process_time() - c_all, 1)},
        "heldout_mse_base": base_held[0], "heldout_mse_base_inside_mask": base_held[1],
        "heldout_mse_lora": final_held[0], "heldout_mse_lora_inside_mask": final_held[1],
        "loss_curve_step_all_inside": curve, "heldout_curve_step_all_inside": held_curve,
    }
    (out / "training_log.json").write_text(json.dumps(record, indent=1))
    log.info("saved %s (%.0f s wall, %.0f s CPU in all)", out, record["total_seconds"]["wall"],
             record["total_seconds"]["cpu"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
