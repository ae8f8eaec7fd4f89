"""Train a small canny-edge ControlNet for the trained inpainting model (CPU, seeded, time-capped).

Why: per-job ControlNets need a real one whose effect is measurable: inside the mask, the fill
should follow the edges of a control image. It must work in the stock
``StableDiffusionControlNetInpaintPipeline`` with the trained 9-channel inpainting UNet, so
training reproduces exactly what that pipeline feeds the ControlNet.

What ``StableDiffusionControlNetInpaintPipeline`` (diffusers 0.42.1) gives the ControlNet, per
denoising step (``__call__``, section 8):

- ``sample``: ``control_model_input = latent_model_input`` taken *before* the pipeline concatenates
  ``mask`` and ``masked_image_latents`` for a 9-channel UNet, i.e. only the **4 noisy latent
  channels** (``scheduler.scale_model_input`` applied: the identity for DDIM), doubled along the
  batch for classifier-free guidance (negative + positive prompt) unless ``guess_mode``;
- ``timestep``: the sampler's timestep ``t`` (0-999 on the 1000-step training schedule);
- ``encoder_hidden_states``: the prompt embeddings (negative and positive with CFG);
- ``controlnet_cond``: the control image from ``control_image_processor`` (``do_normalize=False``,
  RGB): **3 channels in [0, 1]** at the output size, repeated for CFG (not in guess mode);
- ``conditioning_scale``: ``controlnet_conditioning_scale`` x ``controlnet_keep[i]``, where
  ``keep`` is 0 outside ``[control_guidance_start, control_guidance_end]`` (defaults 0 and 1: all
  steps); the ControlNet multiplies its residuals by it. **This pipeline's default
  ``controlnet_conditioning_scale`` is 0.5** (``StableDiffusionControlNetPipeline``'s is 1.0), so
  the training passes ``conditioning_scale=0.5`` to the ControlNet (``--conditioning-scale``):
  a default call then reproduces training exactly; 1.0 doubles the residuals;
- ``guess_mode=True``: the ControlNet runs on the positive half only and the negative half gets
  zero residuals (residuals are also scaled by a log-spaced ramp in the ControlNet).

The residuals go into the UNet, whose input is ``cat(latents, mask, masked_image_latents)``
(9 channels) as in ``StableDiffusionInpaintPipeline``.

How ``ControlNetModel.from_unet`` treats a 9-channel UNet: it copies ``unet.config.in_channels``
(9) and ``conv_in``'s 9-channel weights, so the ControlNet it returns expects 9 input channels
and the stock pipeline's 4-channel ``control_model_input`` fails in its first convolution. Here
``conv_in`` is replaced by a 4-channel convolution initialised with the UNet's ``conv_in``
weights for the 4 noisy-latent channels (the mask / masked-image slices are dropped: the
pipeline never gives them to the ControlNet) and ``in_channels`` is registered as 4, so the
saved config loads as a 4-input ControlNet. Everything else is ``from_unet``'s: down blocks,
mid block, time embedding copied from the trained UNet; zero convolutions; the conditioning
embedding (16, 32, 96, 256) from scratch.

Training (as diffusers' ``examples/controlnet/train_controlnet.py``): VAE, UNet and text encoder
frozen; only the ControlNet trains; conditioning = ``skimage.feature.canny`` edges (gray image,
``--canny-sigma``) of the *target* crop as a white-on-black RGB image in [0, 1]; the loss is the
base model's x0 MSE with the UNet input ``cat(noisy, mask, masked-image latents)`` and the
ControlNet input ``noisy`` (4 channels), conditioning scale 0.5 (above); masks drawn like
production ones (``draw_masks``) with 40 % full masks (the edges matter where there is no
context); 15 % empty captions, because with CFG the ControlNet also runs on the negative-prompt
half. Weights are an EMA of the parameters. ``--init-from`` continues a saved ControlNet (fresh
optimizer and EMA), for a run that stopped on its wall-clock cap while still improving. Weights
are stored as float16 (4 MB instead of 8; ``ControlNetModel.from_pretrained`` loads them as
float32 unless told otherwise).

    python -m ops.train.controlnet --out workers/models/trained/tiny-sd-controlnet-canny
    python -m ops.train.controlnet --init-from workers/models/trained/tiny-sd-controlnet-canny --steps 600
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ops.train.common import EMA, HELD_OUT, LATENT, TRAIN_SOURCES, Crops, draw_masks, load_source

log = logging.getLogger("train_controlnet")

BASE = Path("workers/models/trained/tiny-sd-inpaint-trained")
CANNY_SIGMA = 2.0


def canny_edges(img: np.ndarray, sigma: float = CANNY_SIGMA) -> np.ndarray:
    """Boolean HxW canny edges of an ``uint8`` RGB image (gray first), as the control and as the score's detector."""
    from skimage.color import rgb2gray
    from skimage.feature import canny

    return canny(rgb2gray(np.asarray(img)[..., :3]), sigma=sigma)


def control_image(edges: np.ndarray):  # type: ignore[no-untyped-def]
    """The control image a user passes: white edges on black, RGB."""
    from PIL import Image

    return Image.fromarray(np.repeat(edges[..., None], 3, axis=2).astype(np.uint8) * 255)


def controlnet_from_inpaint_unet(unet: torch.nn.Module):  # type: ignore[no-untyped-def]
    """``ControlNetModel.from_unet`` with a 4-channel ``conv_in`` (see the module docstring)."""
    from diffusers import ControlNetModel

    cn = ControlNetModel.from_unet(unet, conditioning_channels=3)
    old = cn.conv_in
    lat = 4
    conv = torch.nn.Conv2d(lat, old.out_channels, kernel_size=old.kernel_size, padding=old.padding)
    with torch.no_grad():
        conv.weight.copy_(unet.conv_in.weight[:, :lat])
        conv.bias.copy_(unet.conv_in.bias)
    cn.conv_in = conv
    cn.register_to_config(in_channels=lat)
    return cn


@torch.no_grad()
def encode_controlled(vae: torch.nn.Module, crops: Crops, n: int, rng: np.random.Generator,
                      full_mask_share: float, sigma: float) -> dict[str, torch.Tensor]:
    """Latents, masked-image latents (original with the hole), latent-size masks, caption indices
    and canny edges (``[n, 1, 128, 128]`` bool) of ``n`` augmented crops."""
    out: dict[str, list[torch.Tensor]] = {"latents": [], "masked": [], "mask": [], "src": [], "edges": []}
    for start in range(0, n, 32):
        k = min(32, n - start)
        x, idx = crops.batch(k)
        mask = draw_masks(k, rng, full_mask_share)
        u8 = ((x.permute(0, 2, 3, 1).numpy() + 1) * 127.5).round().clip(0, 255).astype(np.uint8)
        out["edges"].append(torch.from_numpy(np.stack([canny_edges(a, sigma) for a in u8]))[:, None])
        out["latents"].append(vae.encode(x).latent_dist.sample())
        out["masked"].append(vae.encode(x * (mask < 0.5)).latent_dist.sample())
        out["mask"].append(F.interpolate(mask, size=(LATENT, LATENT)))
        out["src"].append(torch.from_numpy(idx))
    return {k: torch.cat(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="workers/models/trained/tiny-sd-controlnet-canny")
    p.add_argument("--base", default=str(BASE), help="the trained inpainting pipeline folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--encode-crops", type=int, default=1536)
    p.add_argument("--full-mask-share", type=float, default=0.4)
    p.add_argument("--conditioning-scale", type=float, default=0.5,
                   help="the StableDiffusionControlNetInpaintPipeline default controlnet_conditioning_scale")
    p.add_argument("--caption-dropout", type=float, default=0.15)
    p.add_argument("--canny-sigma", type=float, default=CANNY_SIGMA)
    p.add_argument("--minutes", type=float, default=22.0, help="wall-clock cap of the training loop")
    p.add_argument("--checkpoint-dir", default="", help="also save the EMA weights here every 400 steps")
    p.add_argument("--save-dtype", default="float16", choices=["float16", "float32"],
                   help="dtype of the saved weights (float16 halves the file; from_pretrained loads it as float32)")
    p.add_argument("--init-from", default="", help="continue from a saved ControlNet folder (its training_log.json "
                   "is kept under 'continued_from')")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_all, c_all = time.monotonic(), time.process_time()

    from diffusers import DDPMScheduler, StableDiffusionInpaintPipeline

    base = StableDiffusionInpaintPipeline.from_pretrained(args.base, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False)
    vae, unet, text, tok = base.vae.eval(), base.unet.eval(), base.text_encoder.eval(), base.tokenizer
    for m in (vae, unet, text):
        m.requires_grad_(False)
    sf = vae.config.scaling_factor
    assert base.scheduler.config.prediction_type == "sample", "this trainer follows the base model's x0 objective"
    noise_sched = DDPMScheduler.from_config(base.scheduler.config)

    rng = np.random.default_rng(args.seed)
    crops = Crops([load_source(n) for n in TRAIN_SOURCES], rng)
    held_crops = Crops([load_source(n) for n in HELD_OUT], np.random.default_rng(args.seed + 1))
    t_enc, c_enc = time.monotonic(), time.process_time()
    data = encode_controlled(vae, crops, args.encode_crops, rng, args.full_mask_share, args.canny_sigma)
    held = encode_controlled(vae, held_crops, 48, np.random.default_rng(args.seed + 2), args.full_mask_share,
                             args.canny_sigma)
    enc_wall, enc_cpu = time.monotonic() - t_enc, time.process_time() - c_enc
    log.info("encoded %d crops (+48 held-out) in %.0f s wall / %.0f s CPU; edge density %.3f",
             args.encode_crops, enc_wall, enc_cpu, data["edges"].float().mean().item())

    names = list(TRAIN_SOURCES)
    captions = [""] + [TRAIN_SOURCES[n] for n in names] + list(HELD_OUT.values())
    ids = tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids
    with torch.no_grad():
        emb_all = text(ids)[0]

    earlier = None
    if args.init_from:
        from diffusers import ControlNetModel

        controlnet = ControlNetModel.from_pretrained(args.init_from).train()
        earlier = json.loads((Path(args.init_from) / "training_log.json").read_text())
        log.info("continuing from %s (%d earlier steps)", args.init_from, earlier["steps"])
    else:
        controlnet = controlnet_from_inpaint_unet(unet).train()
    n_params = sum(q.numel() for q in controlnet.parameters())
    log.info("ControlNet: %d parameters (in_channels %d, conditioning channels 3)", n_params,
             controlnet.config.in_channels)
    opt = torch.optim.AdamW(controlnet.parameters(), lr=args.lr, weight_decay=1e-4)
    ema = EMA(controlnet, args.ema)

    def loss_on(cn: torch.nn.Module | None, d: dict[str, torch.Tensor], cap: torch.Tensor, noise: torch.Tensor,
                t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x0 MSE (overall, inside the mask) with the ControlNet's residuals (``cn=None``: the base model)."""
        emb = emb_all[cap]
        lat = d["latents"] * sf
        noisy = noise_sched.add_noise(lat, noise, t)
        kw = {}
        if cn is not None:
            cond = d["edges"].float().expand(-1, 3, -1, -1)
            down, mid = cn(noisy, t, encoder_hidden_states=emb, controlnet_cond=cond,
                           conditioning_scale=args.conditioning_scale, return_dict=False)
            kw = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
        pred = unet(torch.cat([noisy, d["mask"], d["masked"] * sf], dim=1), t, encoder_hidden_states=emb, **kw).sample
        err = (pred - lat).pow(2)
        inside = (err * d["mask"]).sum() / (d["mask"].sum() * err.shape[1]).clamp_min(1)
        return err.mean(), inside

    hg = torch.Generator().manual_seed(args.seed + 7)
    h_noise = torch.randn(held["latents"].shape, generator=hg)
    h_t = torch.randint(0, 1000, (held["latents"].shape[0],), generator=hg)
    h_cap = 1 + len(names) + held["src"]

    def held_loss(cn: torch.nn.Module | None) -> tuple[float, float]:
        with torch.no_grad():
            a, b = loss_on(cn, held, h_cap, h_noise, h_t)
        return round(a.item(), 5), round(b.item(), 5)

    base_held = held_loss(None)
    log.info("held-out x0 MSE of the base model (no ControlNet): %.4f (inside mask %.4f)", *base_held)
    gen = torch.Generator().manual_seed(args.seed)
    n = data["latents"].shape[0]
    curve: list[tuple[int, float, float]] = []
    held_curve: list[tuple[int, float, float]] = [(0, *base_held)]
    t0, c0 = time.monotonic(), time.process_time()
    run = run_in = 0.0
    step = 0
    for step in range(1, args.steps + 1):
        b = torch.randint(0, n, (args.batch,), generator=gen)
        d = {k: v[b] for k, v in data.items()}
        cap = 1 + d["src"]
        cap = torch.where(torch.rand(args.batch, generator=gen) < args.caption_dropout, torch.zeros_like(cap), cap)
        noise = torch.randn(d["latents"].shape, generator=gen)
        t = torch.randint(0, 1000, (args.batch,), generator=gen)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / 50)
        loss, inside = loss_on(controlnet, d, cap, noise, t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(controlnet.parameters(), 1.0)
        opt.step()
        ema.update(controlnet)
        run = loss.item() if step == 1 else 0.95 * run + 0.05 * loss.item()
        run_in = inside.item() if step == 1 else 0.95 * run_in + 0.05 * inside.item()
        if step % 10 == 0:
            curve.append((step, round(run, 5), round(run_in, 5)))
        if step % 100 == 0:
            hl = held_loss(ema.model)
            held_curve.append((step, *hl))
            log.info("step %d loss %.4f (inside mask %.4f) held-out EMA %.4f (inside %.4f) (%.0f s)",
                     step, run, run_in, hl[0], hl[1], time.monotonic() - t0)
        if args.checkpoint_dir and step % 400 == 0:
            ema.model.save_pretrained(Path(args.checkpoint_dir) / f"step{step}", safe_serialization=True)
        if time.monotonic() - t0 > args.minutes * 60:
            log.warning("wall-clock cap %.1f min hit at step %d", args.minutes, step)
            break
    train_wall, train_cpu = time.monotonic() - t0, time.process_time() - c0
    final_held = held_loss(ema.model)
    if held_curve[-1][0] != step:
        held_curve.append((step, *final_held))
    log.info("held-out x0 MSE: base %.4f (inside %.4f) -> with ControlNet %.4f (inside %.4f)", *base_held, *final_held)

    out = Path(args.out)
    copy.deepcopy(ema.model).to(getattr(torch, args.save_dtype)).save_pretrained(out, safe_serialization=True)
    record = {
        "command": "python -m ops.train.controlnet " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "base": args.base, "torch_threads": args.threads, "parameters": n_params, "steps": step,
        "encode_seconds": {"wall": round(enc_wall, 1), "cpu": round(enc_cpu, 1)},
        "train_seconds": {"wall": round(train_wall, 1), "cpu": round(train_cpu, 1)},
        "total_seconds": {"wall": round(time.monotonic() - t_all, 1), "cpu": round(time.process_time() - c_all, 1)},
        "heldout_mse_base": base_held[0], "heldout_mse_base_inside_mask": base_held[1],
        "heldout_mse_controlnet": final_held[0], "heldout_mse_controlnet_inside_mask": final_held[1],
        "loss_curve_step_all_inside": curve, "heldout_curve_step_all_inside": held_curve,
    }
    if earlier is not None:
        record["continued_from"] = earlier
        record["total_steps"] = earlier.get("total_steps", earlier["steps"]) + step
    (out / "training_log.json").write_text(json.dumps(record, indent=1))
    log.info("saved %s (%.0f s wall, %.0f s CPU in all)", out, record["total_seconds"]["wall"],
             record["total_seconds"]["cpu"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
