"""Train the small Flux Fill-architecture model Stencil embeds for Flux (CPU only, seeded).

Why: the random-init tiny Flux Fill outputs noise, so Flux fidelity numbers measured noise
against noise. This trains, on the images that ship with scikit-image (no downloads; the data,
crops, masks and VAE stage of ``ops/train/common.py``), a model of Flux Fill's classes that
really inpaints:

1. a 16-channel ``AutoencoderKL`` without quant convs (Flux's VAE layout); its ``shift_factor``
   and ``scaling_factor`` are set from the latents' mean and std, as Flux's 0.1159 / 0.3611 were;
2. latents of augmented crops and of their masked images (masks drawn like production ones) are
   encoded once; the mask and masked-image latents are packed by ``FluxFillPipeline``'s own
   ``prepare_mask_latents`` (64 + 256 channels), the latents by ``_pack_latents``;
3. a ``FluxTransformer2DModel`` (in 384, out 64, guidance embedding) is trained with the
   rectified-flow velocity target ``noise - x0`` at sigmas drawn as Flux's shifted schedule
   visits them (logit-normal, shifted for this sequence length). The CLIP and T5 text encoders
   stay at their seeded init and frozen, as Flux's are (pretrained there): prompt embeddings
   are computed once, with ``FluxFillPipeline.encode_prompt`` (512 T5 tokens, as at inference).
   The guidance embedding sees guidance drawn from 1-30 (no teacher to distil CFG from here, so
   the model learns to accept any guidance value; it does not learn CFG's effect).

The velocity target lets the model reproduce the template outside the mask for any noise: there
the masked-image latents give x0, so v = (x_t - x0) / sigma is determined and Euler steps land on
x0 whatever the seed (``tests/test_trained_flux.py`` checks it).

    python -m ops.train.flux --out workers/models/trained/tiny-flux-fill-trained
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ops.train import common

log = logging.getLogger(__name__)
LATENT = common.SIZE // 8


def build_pipeline(args: argparse.Namespace, vae: torch.nn.Module | None = None, seed: int | None = None):  # type: ignore[no-untyped-def]
    """The Flux Fill pipeline of this model's shape (``seed`` for the random-init weights)."""
    from diffusers import FluxFillPipeline

    from workers.models.tiny_flux import (
        build_clip_text_encoder,
        build_flow_scheduler,
        build_flux_transformer,
        build_flux_vae,
        build_t5_encoder,
        unigram_t5_tokenizer,
    )
    from workers.models.tiny_sd import byte_level_clip_tokenizer

    seed = args.seed if seed is None else seed
    tok, tok2 = byte_level_clip_tokenizer(), unigram_t5_tokenizer()
    pipe = FluxFillPipeline(
        scheduler=build_flow_scheduler(),
        vae=vae if vae is not None else build_flux_vae(seed, block_out_channels=tuple(args.vae_channels)),
        text_encoder=build_clip_text_encoder(seed, hidden=args.text_dim, vocab_size=len(tok)),
        tokenizer=tok,
        text_encoder_2=build_t5_encoder(seed, d_model=args.text_dim, vocab_size=len(tok2)),
        tokenizer_2=tok2,
        transformer=build_flux_transformer(seed, num_layers=args.double, num_single_layers=args.single,
                                           attention_head_dim=args.head_dim, num_attention_heads=args.heads,
                                           joint_attention_dim=args.text_dim, pooled_projection_dim=args.text_dim))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def encode(pipe, crops: common.Crops, n: int, rng: np.random.Generator,  # type: ignore[no-untyped-def]
           full_mask_share: float) -> dict[str, torch.Tensor]:
    """Raw VAE latents of ``n`` crops and their masked images, the pixel masks, the source index."""
    out: dict[str, list[torch.Tensor]] = {"latents": [], "masked": [], "mask": [], "src": []}
    for start in range(0, n, 32):
        k = min(32, n - start)
        x, idx = crops.batch(k)
        mask = common.draw_masks(k, rng, full_mask_share)
        out["latents"].append(pipe.vae.encode(x).latent_dist.sample())
        out["masked"].append(pipe.vae.encode(x * (1 - mask)).latent_dist.sample())  # FluxFill: image * (1 - mask)
        out["mask"].append(mask)
        out["src"].append(torch.from_numpy(idx))
    return {k: torch.cat(v) for k, v in out.items()}


def model_inputs(pipe, d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """(packed normalised x0 [B, N, 64], packed condition [B, N, 320]) as FluxFillPipeline builds them."""
    b = d["latents"].shape[0]
    cfg = pipe.vae.config
    x0 = pipe._pack_latents((d["latents"] - cfg.shift_factor) * cfg.scaling_factor, b, 16, LATENT, LATENT)
    mask, masked = pipe.prepare_mask_latents(d["mask"], d["masked"], b, 16, 1, common.SIZE, common.SIZE, torch.float32,
                                             torch.device("cpu"), None)
    return x0, torch.cat((masked, mask), dim=-1)


def sample_sigmas(n: int, gen: torch.Generator, shift: float) -> torch.Tensor:
    """Logit-normal sigmas, shifted as Flux's dynamic shifting does at this sequence length."""
    s = torch.sigmoid(torch.randn(n, generator=gen))
    return shift * s / (1 + (shift - 1) * s)


def train_transformer(args: argparse.Namespace, pipe, data: dict[str, torch.Tensor],  # type: ignore[no-untyped-def]
                      held: dict[str, torch.Tensor], captions: list[str], held_captions: list[str]) -> dict:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    torch.manual_seed(args.seed)
    model = pipe.transformer.train()
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(prompt=[""] + captions + held_captions, prompt_2=None,
                                                      device=torch.device("cpu"))
    cfg = pipe.scheduler.config
    n_tokens = (LATENT // 2) ** 2
    shift = math.exp(calculate_shift(n_tokens, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift,
                                     cfg.max_shift))
    img_ids = pipe._prepare_latent_image_ids(1, LATENT // 2, LATENT // 2, torch.device("cpu"), torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    ema = common.EMA(model, 0.999)
    gen = torch.Generator().manual_seed(args.seed)
    n = data["latents"].shape[0]

    def loss_on(m: torch.nn.Module, d: dict[str, torch.Tensor], cap: torch.Tensor, noise: torch.Tensor,
                sigma: torch.Tensor, guidance: torch.Tensor) -> torch.Tensor:
        x0, cond = model_inputs(pipe, d)
        s = sigma[:, None, None]
        xt = (1 - s) * x0 + s * noise
        pred = m(hidden_states=torch.cat((xt, cond), dim=2), timestep=sigma, guidance=guidance,
                 pooled_projections=pooled[cap], encoder_hidden_states=embeds[cap], txt_ids=text_ids,
                 img_ids=img_ids, return_dict=False)[0]
        return F.mse_loss(pred, noise - x0)

    hg = torch.Generator().manual_seed(args.seed + 7)
    hb = held["latents"].shape[0]
    h_noise = torch.randn(hb, n_tokens, 64, generator=hg)
    h_sigma, h_guid = sample_sigmas(hb, hg, shift), 1 + 29 * torch.rand(hb, generator=hg)
    h_cap = 1 + len(captions) + held["src"]

    def batch_loss() -> torch.Tensor:
        b = torch.randint(0, n, (args.batch,), generator=gen)
        d = {k: v[b] for k, v in data.items()}
        cap = 1 + d["src"]
        cap = torch.where(torch.rand(args.batch, generator=gen) < args.caption_dropout, torch.zeros_like(cap), cap)
        noise = torch.randn(args.batch, n_tokens, 64, generator=gen)
        sigma = sample_sigmas(args.batch, gen, shift)
        guidance = 1 + 29 * torch.rand(args.batch, generator=gen)
        return loss_on(model, d, cap, noise, sigma, guidance)

    step, curve, held_curve, hl, t0 = common.optimise(
        "transformer", args.steps, args.minutes, args.lr, opt, [(model, ema)], batch_loss,
        lambda: loss_on(ema.model, held, h_cap, h_noise, h_sigma, h_guid))
    with torch.no_grad():
        rl = loss_on(build_pipeline(args, pipe.vae, seed=args.seed + 1).transformer, held, h_cap, h_noise, h_sigma,
                     h_guid).item()
    pipe.transformer = ema.model.eval()
    log.info("transformer held-out velocity MSE %.4f (random init %.4f)", hl, rl)
    return {"steps": step, "seconds": round(time.monotonic() - t0, 1), "loss_curve": curve,
            "heldout_curve": held_curve, "heldout_mse": round(hl, 4), "random_init_mse": round(rl, 4),
            "sigma_shift": round(shift, 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="workers/models/trained/tiny-flux-fill-trained")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    common.add_data_args(p, vae_steps=3000, vae_minutes=9.0, encode_crops=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--double", type=int, default=2)
    p.add_argument("--single", type=int, default=2)
    p.add_argument("--text-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--minutes", type=float, default=26.0, help="wall-clock cap of the transformer stage")
    p.add_argument("--caption-dropout", type=float, default=0.15)
    args = p.parse_args(argv)
    t_all = time.monotonic()
    rng, crops, held_crops, held_x = common.setup(args)
    from workers.models.tiny_flux import build_flux_vae

    vae, vae_log = common.train_vae(args, crops, held_x,
                             build=lambda seed: build_flux_vae(seed, block_out_channels=tuple(args.vae_channels)))
    vae.requires_grad_(False).eval()
    pipe = build_pipeline(args, vae)
    t_enc = time.monotonic()
    data = encode(pipe, crops, args.encode_crops, rng, args.full_mask_share)
    held = encode(pipe, held_crops, 32, np.random.default_rng(args.seed + 2), args.full_mask_share)
    shift, std = float(data["latents"].mean()), float(data["latents"].std())
    vae.register_to_config(shift_factor=round(shift, 5), scaling_factor=round(1.0 / std, 5))
    log.info("encoded %d crops in %.0fs; latent mean %.4f std %.4f", args.encode_crops, time.monotonic() - t_enc,
             shift, std)
    tlog = train_transformer(args, pipe, data, held, list(common.TRAIN_SOURCES.values()),
                             list(common.HELD_OUT.values()))
    record = {"command": common.command("ops.train.flux", args),
              "torch_threads": args.threads, "total_seconds": round(time.monotonic() - t_all, 1),
              "shift_factor": vae.config.shift_factor, "scaling_factor": vae.config.scaling_factor,
              "train_sources": common.TRAIN_SOURCES, "held_out": common.HELD_OUT, "vae": vae_log, "transformer": tlog}
    common.save(pipe, Path(args.out), record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
