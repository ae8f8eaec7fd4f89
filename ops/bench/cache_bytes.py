"""Benchmark: cache bytes a host can hold, per storage codec, at true model sizes.

Parts (``--parts``, all by default):

- ``formula``: bytes per template per step and per template for SD 1.5 inpainting at 512 px,
  SDXL inpainting at 1024 px and FLUX.1 Fill at 1024 px under each codec
  (``STENCIL_CACHE_DTYPE``), from the cache formula on the real architectures: the UNets are
  built on the ``meta`` device from their public configs (written below; no weights, no memory) and
  enumerated by ``MaskAwareUNet``; Flux from ``flux_cache_nbytes`` shapes. Compared with FlashPS's
  2.6 GiB per SDXL template. With and without shared CFG rows (``cache_codec.share_rows``): a
  template warm-up records with prompt "" and negative prompt "", so its two CFG rows are
  bit-equal and stored once; a cache recorded with a real prompt (exact-region warm-ups) keeps
  both rows. Template counts (``hosttier``) assume shared rows.
- ``recorded``: one recorded step of a true-size SD 1.5 inpainting UNet (random init from its
  config, float32) at 512 px with CFG (2 rows), encoded with each codec: stored bytes vs formula;
  once with two different text rows (rows differ: stored in full) and once with one text for
  both rows (a warm-up's "" / "": rows shared).
- ``fidelity``: SSIM of edits from compressed vs float32 caches (the same edit, the same
  template, the default fidelity policy) on the trained models at guidance 7.5, and the change in
  SSIM against full compute; the default codec is the most compact with loss <= 0.005.
- ``hosttier``: templates the host tier holds per codec (auto budget of this machine and example
  GPU hosts), and a measured replay: jobs over a few templates, true-size SD 1.5 steps (the
  recorded step's real activations) behind a throttled link (``ThrottledStore``), prefetching
  ahead of an emulated GPU-speed step loop; stall time and host hits per codec.
- ``link``: warm-ups at a read speed storing only the units worth reading (``runner.read_gbps``;
  the service measures its host-to-device copy): stored bytes and edit step time behind that link, vs storing all.
- ``steps`` (not in the default set; its own report): template caches storing n steps of the
  schedule (``STENCIL_CACHE_STEPS``) vs every step, on the three trained models at 20 and 50 steps
  under the ``fast`` and ``balanced`` policies; selects the per-family ``auto`` default (fewest
  stored steps with loss <= 0.005) and prices SDXL's template at it.

    python -m ops.bench.cache_bytes --out docs/bench/cache_bytes.md
    python -m ops.bench.cache_bytes --parts steps --threads 1 --edits 6 --out docs/bench/cache_steps.md \
        --json docs/bench/cache_steps.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ops.bench.harness import cli

log = logging.getLogger(__name__)

CODECS = ("float32", "float16", "bfloat16", "int8")
MiB, GiB = 2**20, 2**30
FLASHPS_SDXL_BYTES = 2.6 * GiB  # FlashPS/InstGenIE (arXiv 2505.20600), as quoted in issue 19
SSIM_LOSS_MAX = 0.005

# Public configs (diffusers UNet2DConditionModel / FluxTransformer2DModel arguments).
# runwayml/stable-diffusion-inpainting unet/config.json
SD15_INPAINT = dict(sample_size=64, in_channels=9, out_channels=4,
                    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                    block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
                    cross_attention_dim=768, attention_head_dim=8)
# diffusers/stable-diffusion-xl-1.0-inpainting-0.1 unet/config.json
SDXL_INPAINT = dict(sample_size=128, in_channels=9, out_channels=4,
                    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                    block_out_channels=(320, 640, 1280), layers_per_block=2, transformer_layers_per_block=(1, 2, 10),
                    attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
                    addition_embed_type="text_time", addition_time_embed_dim=256,
                    projection_class_embeddings_input_dim=2816)
# black-forest-labs/FLUX.1-Fill-dev transformer/config.json
FLUX_FILL = dict(patch_size=1, in_channels=384, out_channels=64, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                 pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
# (name, config, image px, template steps: the pipelines' default num_inference_steps, 50)
MODELS = (("SD 1.5 inpainting", SD15_INPAINT, 512), ("SDXL inpainting", SDXL_INPAINT, 1024),
          ("FLUX.1 Fill", FLUX_FILL, 1024))
STEPS = 50


# -- formula -------------------------------------------------------------------------------------


def unet_on_meta(config: dict, kv_source: str = "cache"):  # type: ignore[no-untyped-def]
    from diffusers import UNet2DConditionModel

    from workers.maskaware.unet import MaskAwareUNet

    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    return MaskAwareUNet(unet, kv_source=kv_source)  # type: ignore[arg-type]


def flux_step_bytes(config: dict, image_px: int, codec: str) -> int:
    """One step of one row (Flux runs no CFG batch): K and V of every block + the output."""
    from workers.engine.cache_codec import stored_nbytes

    n = (image_px // 16) ** 2  # 8x VAE, 2x2 packing
    inner = config["attention_head_dim"] * config["num_attention_heads"]
    blocks = config["num_layers"] + config["num_single_layers"]
    return blocks * 2 * stored_nbytes((1, n, inner), "b.k", codec) + stored_nbytes((1, n, config["out_channels"]), "output", codec)


def step_bytes(name: str, config: dict, image_px: int, codec: str, kv_source: str = "cache",
               shared_rows: bool = False) -> int:
    """Bytes of one step of one job's cache (UNets: CFG, 2 rows) under ``codec``; ``shared_rows``:
    a template warm-up's bit-equal CFG rows stored once (every tensor; Flux has one row anyway)."""
    if "FLUX" in name:
        return flux_step_bytes(config, image_px, codec)
    ctrl = unet_on_meta(config, kv_source)
    lat = image_px // 8
    return ctrl.cache_nbytes(lat, lat, rows=2, codec=codec, shared=ctrl.tensor_names() if shared_rows else ())


def part_formula(args: argparse.Namespace, state: dict) -> list[str]:
    lines = ["## Bytes per template (formula, true architectures)\n",
             f"Per job with classifier-free guidance (UNets: 2 rows; Flux: 1 row, guidance is an input), "
             f"{STEPS} steps (the pipelines' default `num_inference_steps`); layout `kv+y` (the default: "
             "K and V of every transformer block + the last block output of each transformer; Flux: K, V "
             "of all 57 blocks + the output). int8 = K/V 8-bit with a float32 scale per channel, block "
             "outputs 16-bit. *Shared CFG rows*: a template warm-up records with prompt \"\" and negative prompt "
             "\"\", so both rows see bit-equal inputs and (measured on `tiny-sd-inpaint-trained`: every tensor of "
             "every step) record bit-equal activations, which the recorder stores once (`cache_codec.share_rows`, "
             "lossless: rows differing in any bit stay); assumed for every template cache below. Caches recorded "
             "with a real prompt (exact-region warm-ups) keep both rows (the *rows differ* columns).\n",
             "| model | px | codec | MiB / step, rows differ | GiB / template, rows differ | "
             "MiB / step, shared CFG rows | GiB / template, shared CFG rows | vs float32 |",
             "|---|---|---|---|---|---|---|---|"]
    table: dict[tuple[str, str], int] = {}
    full_rows: dict[tuple[str, str], int] = {}
    for name, config, px in MODELS:
        f32 = step_bytes(name, config, px, "float32")
        for codec in CODECS:
            b = full_rows[(name, codec)] = step_bytes(name, config, px, codec)
            sh = table[(name, codec)] = step_bytes(name, config, px, codec, shared_rows=True)
            lines.append(f"| {name} | {px} | {codec} | {b / MiB:.1f} | {b * STEPS / GiB:.2f} | "
                         f"{sh / MiB:.1f} | {sh * STEPS / GiB:.2f} | {b / f32:.3f} |")
    state["formula"] = table  # template caches: shared CFG rows
    state["formula_full_rows"] = full_rows
    y = {c: step_bytes("SDXL inpainting", SDXL_INPAINT, 1024, c, "recompute") for c in ("float32", "float16")}
    sdxl = {c: full_rows[("SDXL inpainting", c)] for c in CODECS}
    sdxl_shared = table[("SDXL inpainting", default := state.get("default", "int8"))]
    per_step_budget = FLASHPS_SDXL_BYTES / STEPS
    lines += ["",
              f"**SDXL vs FlashPS.** FlashPS reports up to 2.6 GiB of activations per SDXL template (issue 19; "
              "its step count is not given in DESIGN.md: assumed the pipeline default, 50 steps, i.e. "
              f"{per_step_budget / MiB:.0f} MiB per step). The target, a quarter of that at the same steps, is "
              f"{FLASHPS_SDXL_BYTES / 4 / GiB:.2f} GiB per template = {per_step_budget / 4 / MiB:.1f} MiB per step. "
              f"Stencil's SDXL cache at 1024 px: {sdxl['float32'] / MiB:.0f} MiB/step in float32, "
              f"{sdxl[default] / MiB:.0f} MiB/step with the default codec (`{default}`), i.e. "
              f"{sdxl[default] * STEPS / GiB:.1f} GiB per 50-step template: "
              f"{sdxl[default] * STEPS / FLASHPS_SDXL_BYTES:.1f}x FlashPS's figure, not a quarter of it. Even "
              f"the `y` layout (`MaskAwareUNet(kv_source='recompute')`: block outputs only) takes "
              f"{y['float16'] / MiB:.0f} MiB/step in 16 bits. 2.6 GiB at 50 steps cannot hold one float16 "
              "tensor of 1024 px SDXL's 64x64 level (640 channels) per transformer block per step for two "
              "CFG rows, so FlashPS's figure must come from a smaller cache (fewer blocks, steps or rows, or "
              "a lower resolution); the target is not met by compression alone (see gaps in the summary). "
              f"With shared CFG rows (a template warm-up) the default codec's SDXL cache is "
              f"{sdxl_shared / MiB:.0f} MiB/step, {sdxl_shared * STEPS / GiB:.1f} GiB per 50-step template "
              f"({sdxl_shared * STEPS / FLASHPS_SDXL_BYTES:.2f}x FlashPS's figure).\n"]
    return lines


# -- recorded ------------------------------------------------------------------------------------


def record_step(config: dict, image_px: int, seed: int = 0, rows_alike: bool = False) -> dict[str, torch.Tensor]:
    """One recorded step (CFG, 2 rows) of a random-init UNet built from ``config``; ``rows_alike``:
    one text for both rows (a template warm-up's prompt "" and negative prompt "")."""
    from diffusers import UNet2DConditionModel

    from workers.maskaware.unet import MaskAwareUNet, RowGroup

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**config).eval()
    ctrl = MaskAwareUNet(unet)
    lat = image_px // 8
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(2, config["in_channels"], lat, lat, generator=g)
    text = torch.randn(2, 77, config["cross_attention_dim"], generator=g)
    sample = sample[:1].expand(2, -1, -1, -1).contiguous()  # CFG: one latent for both rows
    if rows_alike:
        text = text[:1].expand(2, -1, -1).contiguous()
    with torch.no_grad(), ctrl.batch([RowGroup(2, "record")]) as ctx:
        unet(sample, torch.tensor([500, 500]), text)
    rec = ctx.recorded[0]
    assert rec is not None
    ctrl.remove()
    del unet
    return rec


def part_recorded(args: argparse.Namespace, state: dict) -> list[str]:
    from workers.engine import cache_codec

    config = SD15_INPAINT if not args.quick else dict(SD15_INPAINT, block_out_channels=(32, 64, 64, 64),
                                                      cross_attention_dim=32, attention_head_dim=4)
    px = 512 if not args.quick else 128
    t0 = time.perf_counter()
    rec = record_step(config, px, args.seed)
    took = time.perf_counter() - t0
    alike = record_step(config, px, args.seed, rows_alike=True)
    state["recorded"], state["recorded_alike"] = rec, alike
    ctrl = unet_on_meta(config)
    lines = ["## Recorded step vs formula\n",
             f"One recorded step ({'SD 1.5 inpainting architecture' if not args.quick else 'a small UNet (quick)'}, "
             f"random init, float32 weights, {px} px, CFG 2 rows; {took:.1f} s to build and run), encoded with each "
             "codec as the recorder stores it. *Rows differ*: two different text rows (a real prompt); *shared*: one "
             "text for both rows (a template warm-up's \"\" / \"\"), bit-equal rows stored once "
             "(`cache_codec.share_rows`; decoded back bit for bit):\n",
             "| codec | stored MiB | formula MiB | stored MiB, shared | formula MiB, shared | "
             "max abs error / channel max (K/V) | max rel error (Y) | decode ms (CPU, 1 thread pool) |",
             "|---|---|---|---|---|---|---|---|"]
    for codec in CODECS:
        enc = cache_codec.encode(rec, codec)
        stored = sum(t.numel() * t.element_size() for t in enc.values())
        formula = ctrl.cache_nbytes(px // 8, px // 8, rows=2, codec=codec)
        enc_alike = cache_codec.encode(alike, codec)
        shared, names = cache_codec.share_rows(enc_alike, 2)
        stored_sh = sum(t.numel() * t.element_size() for t in shared.values())
        formula_sh = ctrl.cache_nbytes(px // 8, px // 8, rows=2, codec=codec, shared=names)
        assert all(torch.equal(cache_codec.decode_tensor(shared[n], rows=2), cache_codec.decode_tensor(enc_alike[n]))
                   for n in shared), "shared rows must decode bit for bit"
        kv_err, y_err = 0.0, 0.0
        for n, t in rec.items():
            back = cache_codec.decode_tensor(enc[n])
            if cache_codec.is_kv(n):
                ch = t.abs().amax(dim=-2, keepdim=True).clamp_min(1e-12)
                kv_err = max(kv_err, float(((back - t).abs() / ch).max()))
            else:
                y_err = max(y_err, float(((back - t).abs() / t.abs().max()).max()))
        t0 = time.perf_counter()
        for t in enc.values():
            cache_codec.decode_tensor(t)
        dec = time.perf_counter() - t0
        lines.append(f"| {codec} | {stored / MiB:.2f} | {formula / MiB:.2f} | {stored_sh / MiB:.2f} "
                     f"({len(names)}/{len(shared)} shared) | {formula_sh / MiB:.2f} | {kv_err:.2e} | {y_err:.2e} | "
                     f"{dec * 1000:.1f} |")
        state.setdefault("recorded_bytes", {})[codec] = stored
    lines.append("")
    return lines


# -- fidelity ------------------------------------------------------------------------------------


def fidelity_rows(family: str, args: argparse.Namespace, state: dict) -> list[dict[str, Any]]:
    """Per (template, edit, codec): SSIM vs the float32-cache edit and vs full compute."""
    from app.jobs import JobParams
    from app.maskgen import SHAPES, make_mask
    from ops.bench.harness.edits import EDIT_PROMPTS, OPTIONS, Family, edit, metrics, warm
    from workers.engine.template_cache import CacheRecorder

    fam = state.setdefault(f"family-{family}", None) or Family(family)
    state[f"family-{family}"] = fam
    acts = fam.runner_ma.recorder.activations  # type: ignore[union-attr]
    from app.demo import demo_templates

    templates = [img.resize((fam.size, fam.size)) for _n, img in demo_templates(128)][:args.templates]
    empty = np.zeros((fam.size, fam.size), bool)
    warm_params = JobParams(prompt="", seed=0, steps=args.steps, guidance=args.guidance)
    keys: dict[tuple[int, str], Any] = {}
    for codec in CODECS:
        replaced, fam.runner_ma.recorder = fam.runner_ma.recorder, CacheRecorder(acts, codec=codec)
        replaced.close()  # type: ignore[union-attr]  # its writer thread: nothing left to write
        for i, img in enumerate(templates):
            keys[(i, codec)] = warm(fam, f"t{i}-{codec}", img, empty, warm_params)
    rng = np.random.default_rng(args.seed)
    rows = []
    for i, img in enumerate(templates):
        for k in range(args.edits):
            ratio = float(rng.choice([0.05, 0.1, 0.2, 0.35]))
            mask = make_mask(ratio, (fam.size, fam.size), SHAPES[(i + k) % len(SHAPES)], seed=int(rng.integers(1 << 30)))
            if mask.mean() in (0, 1):
                continue
            params = JobParams(prompt=str(rng.choice(EDIT_PROMPTS)), seed=int(rng.integers(1 << 30)),
                               steps=args.steps, guidance=args.guidance)
            tensors, meta = fam.prepare(img, mask, params)
            full = fam.full(tensors, meta)
            pm = tensors["pixel_mask"].bool().numpy()
            for policy in args.policies.split(","):
                outs = {c: fam.decode(edit(fam, OPTIONS[policy], img, mask, params, keys[(i, c)])["latents"])
                        for c in CODECS}
                for c in CODECS:
                    rows.append({"family": family, "policy": policy, "codec": c, "template": i,
                                 "ratio": float(pm.mean()),
                                 "ssim_vs_f32": metrics(outs["float32"], outs[c], pm)["ssim"],
                                 "ssim_vs_full": metrics(full, outs[c], pm)["ssim"]})
    return rows


def part_fidelity(args: argparse.Namespace, state: dict) -> list[str]:
    rows: list[dict[str, Any]] = []
    for family in args.families.split(","):
        rows += fidelity_rows(family, args, state)
    lines = ["## Fidelity: compressed vs float32 caches\n",
             f"Trained models (`tiny-sd-inpaint-trained`, `tiny-flux-fill-trained`, 128 px), guidance {args.guidance}, "
             f"{args.steps} steps, fidelity policies " + ", ".join(f"`{p}`" for p in args.policies.split(","))
             + f" (`fast` is the default; `cache-as-is` takes the cache with no refresh step, the codec's error "
             f"uncorrected), {args.templates} templates x {args.edits} edits "
             "(masks: blob/rect/... shapes at ratios 0.05-0.35, random prompts and seeds). Each template is warmed once "
             "per codec (empty mask, prompt \"\", seed 0, as production); each edit runs from each codec's cache. "
             "Loss = 1 - SSIM(edit from codec cache, same edit from float32 cache); drop = SSIM vs full compute "
             "(float32 cache) minus SSIM vs full compute (codec cache).\n",
             "| family | policy | codec | edits | mean loss | max loss | SSIM vs full | drop |",
             "|---|---|---|---|---|---|---|---|"]
    ok: dict[str, bool] = {c: True for c in CODECS}
    for family in args.families.split(","):
        for policy in args.policies.split(","):
            base = [r["ssim_vs_full"] for r in rows
                    if r["family"] == family and r["policy"] == policy and r["codec"] == "float32"]
            for codec in CODECS:
                sel = [r for r in rows if r["family"] == family and r["policy"] == policy and r["codec"] == codec]
                if not sel:
                    continue
                loss = [1 - r["ssim_vs_f32"] for r in sel]
                vs_full = statistics.mean(r["ssim_vs_full"] for r in sel)
                drop = statistics.mean(base) - vs_full
                ok[codec] &= statistics.mean(loss) <= SSIM_LOSS_MAX and drop <= SSIM_LOSS_MAX
                lines.append(f"| {family} | {policy} | {codec} | {len(sel)} | {statistics.mean(loss):.5f} | "
                             f"{max(loss):.5f} | {vs_full:.4f} | {drop:+.5f} |")
    size = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0}  # compactness order
    passing = [c for c in CODECS if ok[c]]
    default = min(passing, key=lambda c: (size[c], c != "float16")) if passing else "float32"
    state["default"] = default
    lines += ["", f"Criterion: mean loss <= {SSIM_LOSS_MAX} and drop <= {SSIM_LOSS_MAX} for every family and policy. Passing: "
              + ", ".join(f"`{c}`" for c in passing) + f". Selected default codec: `{default}`"
              + (" (quick run: a smoke test, not the measurement)" if args.quick else "") + ".\n"]
    return lines


# -- stored steps --------------------------------------------------------------------------------


STEPS_MODELS = {"sd": ("sd", "tiny-sd-inpaint-trained"), "sdxl-layout": ("sd", "tiny-sd-sdxl-layout-trained"),
                "flux": ("flux", "tiny-flux-fill-trained")}


def steps_rows(label: str, steps: int, counts: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per (edit, policy, stored-step count): the edit from a cache storing that many steps (codec
    ``--steps-codec``) vs the same edit from a float32 every-step cache of the same template, and vs
    full compute."""
    import dataclasses

    from app.demo import demo_templates
    from app.jobs import JobParams
    from app.maskgen import SHAPES, make_mask
    from ops.bench.harness.edits import EDIT_PROMPTS, OPTIONS, Family, edit, metrics, record
    from workers.engine.template_cache import CacheRecorder
    from workers.maskaware.tokens import POOL_THRESHOLD

    family, model = STEPS_MODELS[label]
    fam = Family(family, model=model)
    if family == "sd":  # the service's coarse-level pooling (the harness class default is OR)
        fam.ctrl.pool_threshold = POOL_THRESHOLD  # type: ignore[union-attr]
    templates = [img.resize((fam.size, fam.size)) for _n, img in demo_templates(128)][:args.templates]
    empty = np.zeros((fam.size, fam.size), bool)
    warm_params = JobParams(prompt="", seed=0, steps=steps, guidance=args.guidance)
    keys: dict[tuple[int, int], Any] = {}
    acts = fam.runner_ma.recorder.activations  # type: ignore[union-attr]
    # The reference stores every step losslessly (float32); n-step caches with ``--steps-codec``.
    reference = fam.runner_ma.recorder  # float32
    n_step = reference if args.steps_codec == "float32" else CacheRecorder(acts, codec=args.steps_codec)
    for i, img in enumerate(templates):
        tensors, meta = fam.prepare(img, empty, warm_params)
        base = fam.key(f"t{i}-s{steps}", warm_params, meta)
        for n in [0, *counts]:  # 0: every step
            key = keys[(i, n)] = base if n == 0 else dataclasses.replace(base, layout=f"{base.layout}/steps-{n}")
            assert key.stored_step_count == n
            fam.runner_ma.recorder = reference if n == 0 else n_step
            record(fam.runner_ma, dict(tensors), dict(meta), key)
    fam.runner_ma.recorder = reference
    if n_step is not reference:
        n_step.close()
    rng = np.random.default_rng(args.seed)
    rows = []
    for i, img in enumerate(templates):
        for k in range(args.edits):
            ratio = float(rng.choice([0.05, 0.1, 0.2, 0.35]))
            mask = make_mask(ratio, (fam.size, fam.size), SHAPES[(i + k) % len(SHAPES)],
                             seed=int(rng.integers(1 << 30)))
            if mask.mean() in (0, 1):
                continue
            params = JobParams(prompt=str(rng.choice(EDIT_PROMPTS)), seed=int(rng.integers(1 << 30)),
                               steps=steps, guidance=args.guidance)
            tensors, meta = fam.prepare(img, mask, params)
            full = fam.full(tensors, meta)
            pm = tensors["pixel_mask"].bool().numpy()
            for policy in args.steps_policies.split(","):
                outs = {}
                for n in [0, *counts]:
                    out = edit(fam, OPTIONS[policy], img, mask, params, keys[(i, n)])
                    if out["fallback_steps"] or out["masked_steps"] + out["refresh_steps"] != steps:
                        raise RuntimeError(f"{label} n={n}: {out['fallback_steps']} steps fell back to full compute")
                    outs[n] = fam.decode(out["latents"])
                for n in counts:
                    vs_all = metrics(outs[0], outs[n], pm)
                    rows.append({"model": label, "steps": steps, "policy": policy, "stored": n,
                                 "loss": 1 - vs_all["ssim"], "loss_mask": 1 - vs_all.get("ssim_masked", 1.0),
                                 "ssim_vs_full": metrics(full, outs[n], pm)["ssim"],
                                 "ssim_vs_full_all": metrics(full, outs[0], pm)["ssim"]})
    return rows


def part_steps(args: argparse.Namespace, state: dict) -> list[str]:
    """Template caches storing n steps of the schedule (``STENCIL_CACHE_STEPS``) vs every step."""
    import json

    from workers.engine.template_cache import stored_steps

    counts = sorted({int(c) for c in args.cache_steps_list.split(",")})
    rows: list[dict[str, Any]] = []
    for label in args.steps_models.split(","):
        for steps in (int(x) for x in args.steps_schedules.split(",")):
            rows += steps_rows(label, steps, counts, args)
    lines = ["## Stored steps: template caches storing n steps vs every step\n",
             f"Trained models (`{'`, `'.join(STEPS_MODELS[m][1] for m in args.steps_models.split(','))}`, 128 px; "
             "SD models at the service's coarse-level pooling), guidance "
             f"{args.guidance}, schedules of {args.steps_schedules} steps, policies "
             + ", ".join(f"`{p}`" for p in args.steps_policies.split(","))
             + f", {args.templates} templates x {args.edits} edits (masks at ratios 0.05-0.35, random prompts and "
             "seeds). Each template is warmed once storing every step (float32) and once per n (the middle step of "
             f"each of n equal segments, `workers/engine/template_cache.py`; codec `{args.steps_codec}`); each edit "
             "runs from each. Loss = 1 - SSIM(edit "
             "from the n-step cache, same edit from the every-step cache), whole image and in the mask; drop = "
             "SSIM vs full compute (every-step cache) minus the same from the n-step cache.\n",
             "| model | steps | policy | n stored | stored steps | edits | mean loss | in-mask loss | max loss | "
             "SSIM vs full | drop |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    families = sorted({STEPS_MODELS[m][0] for m in args.steps_models.split(",")})
    worst: dict[str, dict[int, float]] = {f: {n: 0.0 for n in counts} for f in families}
    for label in args.steps_models.split(","):
        for steps in (int(x) for x in args.steps_schedules.split(",")):
            for policy in args.steps_policies.split(","):
                for n in counts:
                    sel = [r for r in rows
                           if (r["model"], r["steps"], r["policy"], r["stored"]) == (label, steps, policy, n)]
                    if not sel:
                        continue
                    loss = statistics.mean(r["loss"] for r in sel)
                    loss_mask = statistics.mean(r["loss_mask"] for r in sel)
                    vs_full = statistics.mean(r["ssim_vs_full"] for r in sel)
                    drop = statistics.mean(r["ssim_vs_full_all"] for r in sel) - vs_full
                    fam_worst = worst[STEPS_MODELS[label][0]]
                    fam_worst[n] = max(fam_worst[n], loss, loss_mask, drop)
                    lines.append(f"| {label} | {steps} | {policy} | {n} | {stored_steps(steps, n)} | {len(sel)} | "
                                 f"{loss:.5f} | {loss_mask:.5f} | {max(r['loss'] for r in sel):.5f} | "
                                 f"{vs_full:.4f} | {drop:+.5f} |")
    passing = {f: [n for n in counts if worst[f][n] <= SSIM_LOSS_MAX] for f in families}
    default = {f: min(passing[f]) if passing[f] else 0 for f in families}
    state["cache_steps_default"] = default
    sdxl = step_bytes("SDXL inpainting", SDXL_INPAINT, 1024, "int8", shared_rows=True)
    lines += ["", f"Criterion, per model family (`sd`: the UNets, both layouts; `flux`): mean loss, in-mask loss "
              f"and drop <= {SSIM_LOSS_MAX} for every model, schedule and policy of the family; the default is the "
              "fewest passing stored steps, else every step (0)."]
    for f in families:
        lines.append(f"- `{f}`: worst per n: " + ", ".join(f"n={n}: {worst[f][n]:.5f}" for n in counts)
                     + "; passing: " + (", ".join(map(str, passing[f])) or "none")
                     + f"; selected default **{default[f]}**" + (" (every step)" if default[f] == 0 else "") + ".")
    lines.append("" if not args.quick else "\n(quick run: a smoke test, not the measurement)\n")
    if default.get("sd"):
        per_template = sdxl * default["sd"]
        lines += ["", f"SDXL inpainting at 1024 px with the default codec (int8, shared CFG rows, {sdxl / MiB:.0f} MiB "
                  f"per stored step): {per_template / GiB:.2f} GiB per template whatever its step count "
                  f"({per_template / MiB:.0f} MiB; {STEPS}-step template before: {sdxl * STEPS / GiB:.1f} GiB); "
                  f"FlashPS's figure 2.6 GiB, the target a quarter of it, {FLASHPS_SDXL_BYTES / 4 / GiB:.2f} GiB: "
                  + ("**met**" if per_template <= FLASHPS_SDXL_BYTES / 4 else "**not met**") + ".\n"]
    if args.json:
        Path(args.json).write_text(json.dumps({"criterion": SSIM_LOSS_MAX, "counts": counts, "worst": worst,
                                               "passing": passing, "default": default, "rows": rows,
                                               "quick": bool(args.quick)}, separators=(",", ":")))  # compact
    return lines


# -- host tier -------------------------------------------------------------------------------------


def part_hosttier(args: argparse.Namespace, state: dict) -> list[str]:
    from workers.engine.host_budget import host_cache_budget, read_meminfo

    total, avail = read_meminfo()
    auto = host_cache_budget(0, 0.5)
    formula = state.get("formula") or {(n, c): step_bytes(n, cfg, px, c, shared_rows=True)
                                       for n, cfg, px in MODELS for c in CODECS}
    hosts = [("this machine (auto)", auto), ("GPU host 256 GiB / 8 GPUs (auto)", int(0.5 * 256 * GiB / 8)),
             ("GPU host 2 TiB / 8 GPUs (auto)", int(0.5 * 2048 * GiB / 8)), ("old default", 2 * GiB)]
    lines = ["## Templates the host tier holds\n",
             f"Auto budget = 0.5 x physical memory / GPU workers per host - weights (`STENCIL_HOST_CACHE_BYTES=0`, "
             f"`workers/engine/host_budget.py`); this machine: {total / GiB:.1f} GiB physical, {avail / GiB:.1f} GiB "
             f"available -> {auto / GiB:.1f} GiB (weights of the worker's model subtracted at start; not here). "
             f"Whole {STEPS}-step templates per worker (template caches: shared CFG rows, see the formula):\n",
             "| model | codec | GiB / template | " + " | ".join(h for h, _ in hosts) + " |",
             "|---|---|---|" + "---|" * len(hosts)]
    for name, _cfg, _px in MODELS:
        for codec in CODECS:
            t = formula[(name, codec)] * STEPS
            lines.append(f"| {name} | {codec} | {t / GiB:.2f} | " + " | ".join(f"{b / t:.1f}" for _h, b in hosts) + " |")
    lines.append("")
    lines += replay(args, state)
    return lines


def replay(args: argparse.Namespace, state: dict) -> list[str]:
    """Jobs over ``templates`` templates (round robin, two passes) through a StepCacheProvider over a
    throttled link; each job prefetches its steps ahead and 'computes' each step for ``step_ms``."""
    from app.storage.local import LocalStore
    from app.storage.throttle import ThrottledStore
    from workers.engine import cache_codec
    from workers.engine.template_cache import StepCacheProvider
    from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey

    if state.get("recorded") is None:
        part_recorded(args, state)
    alike = state["recorded_alike"]
    k, n_tpl = args.replay_steps, args.replay_templates
    # Template caches as stored: one text for both rows, bit-equal CFG rows stored once.
    stored_f32, _shared = cache_codec.share_rows(cache_codec.encode(alike, "float32"), 2)
    step_f32 = sum(t.numel() * 4 for t in stored_f32.values())
    budget = int(args.replay_budget_templates * k * step_f32 * 0.3)  # ~ what holds int8 templates, not float32
    link = args.link_mibps * MiB
    lines = [f"**Prefetch replay (measured).** True-size SD 1.5 steps (the step recorded above with one text for "
             f"both rows, real activations, stored as template caches are: shared CFG rows, {step_f32 / MiB:.0f} MiB "
             f"in float32), {n_tpl} templates x {k} steps, host budget {budget / GiB:.2f} GiB, "
             f"link {args.link_mibps:g} MiB/s + 2 ms per request (`ThrottledStore`), an emulated GPU step of "
             f"{args.step_ms:g} ms (SD 1.5 at 512 px with CFG on an A100-class GPU is ~50 ms per step: bubble.py's "
             f"scale note), prefetch {k} steps ahead from the job's arrival; jobs one after another over the templates "
             "round robin, two passes (the second pass hits whatever the host tier kept). Stall = time the step loop "
             "waited for a step to be resident.\n",
             "| codec | MiB / step | templates in budget | pass-2 host hits | stall pass 1 (s) | stall pass 2 (s) | stall / step pass 2 (ms) |",
             "|---|---|---|---|---|---|---|"]
    for codec in CODECS:
        with tempfile.TemporaryDirectory(prefix="stencil-cb-") as root:
            acts = ActivationStore(LocalStore(Path(root)))
            enc, shared = cache_codec.share_rows(cache_codec.encode(alike, codec), 2)
            nbytes = sum(t.numel() * t.element_size() for t in enc.values())
            keys = [TemplateCacheKey("bench", f"t{i}", 512, 512, "ddim", k, 1.0, "cfg2", "kv+y") for i in range(n_tpl)]
            for key in keys:
                for s in range(k):
                    acts.put_step(key, s, enc, codec=codec, rows=2)
                acts.commit(key, {"codec": codec, "rows": 2, "shared_rows": sorted(shared)})
            store = ThrottledStore(LocalStore(Path(root)), link, 0.002)
            provider = StepCacheProvider(ActivationStore(store), budget, fetch_threads=2)
            stalls = [0.0, 0.0]
            hits = 0
            try:
                for p in range(2):
                    for key in keys:
                        provider.prefetch(key, range(k))
                        for s in range(k):
                            t0 = time.monotonic()
                            if p == 1 and provider.host.peek((key.digest(), s)) is not None:
                                hits += 1
                            while provider.ready(key, s) is None:
                                time.sleep(0.002)
                            stalls[p] += time.monotonic() - t0
                            time.sleep(args.step_ms / 1000)
            finally:
                provider.close()
        held = budget / (nbytes * k)
        lines.append(f"| {codec} | {nbytes / MiB:.1f} | {held:.1f} | {hits}/{n_tpl * k} | {stalls[0]:.2f} | "
                     f"{stalls[1]:.2f} | {stalls[1] / (n_tpl * k) * 1000:.0f} |")
    lines.append("")
    return lines


# -- link-speed unit selection --------------------------------------------------------------------


def part_link(args: argparse.Namespace, state: dict) -> list[str]:
    """Warm-ups storing every unit vs only the units worth loading at a link speed; edits behind it."""
    from app.jobs import JobParams
    from app.maskgen import make_mask
    from app.storage.local import LocalStore
    from app.storage.throttle import ThrottledStore
    from ops.bench.harness.edits import Family
    from ops.bench.harness.engine import run
    from workers.engine.sd_runner import SDRunner
    from workers.engine.template_cache import CacheRecorder, StepCacheProvider
    from workers.maskaware.activation_store import ActivationStore

    fam = state.get("family-sd") if args.link_model == "tiny-sd-inpaint-trained" else None
    fam = fam or Family("sd", model=args.link_model)
    root = Path(tempfile.mkdtemp(prefix="stencil-cb-link-"))
    from app.demo import demo_templates

    img = demo_templates(128)[0][1].resize((fam.size, fam.size))
    empty = np.zeros((fam.size, fam.size), bool)
    params = JobParams(prompt="", seed=0, steps=args.steps, guidance=args.guidance)
    lines = ["## Storing only the units worth loading at a link speed\n",
             f"`{args.link_model}` at 128 px, {args.steps} steps, guidance {args.guidance}, codec `{state.get('default', 'int8')}`. "
             "A warm-up at link speed L stores only the units whose load at L costs less than the compute they save "
             "(`runner_base._select_units`: the plan's online unit cost model at mask ratio 0.2); edits (ratio ~0.2, "
             "cache plan `plan`) then read from a `ThrottledStore` at L, nothing resident (each step fetched when needed, "
             "no prefetch ahead), and compute the missing units fully. Because this CPU computes ~100x slower than a "
             "GPU, the links are scaled down by the same order (bubble.py's convention).\n",
             "| link MiB/s | stored units | stored MiB | vs all units | edit step ms (selected) | edit step ms (all units) | full step ms |",
             "|---|---|---|---|---|---|---|"]
    codec = state.get("default", "int8")
    tensors, meta = fam.prepare(img, empty, params)
    mask = make_mask(0.2, (fam.size, fam.size), "blob", seed=args.seed)
    edit_params = JobParams(prompt="a cat", seed=7, steps=args.steps, guidance=args.guidance)
    e_tensors, e_meta = fam.prepare(img, mask, edit_params)
    run(fam.runner_full, [(dict(e_tensors), dict(e_meta))])  # warm (first-call overheads)
    full_s = _timed(lambda: run(fam.runner_full, [(dict(e_tensors), dict(e_meta))]), args.steps)
    for mibps in args.link_speeds:
        sizes, times = {}, {}
        for label, gbps in (("selected", mibps * MiB / 1e9), ("all", 0.0)):
            acts = ActivationStore(LocalStore(root / f"{mibps}-{label}"))
            runner = SDRunner(fam.pipe.unet, fam.scheduler_config, maskaware=fam.ctrl,
                              caches=StepCacheProvider(ActivationStore(ThrottledStore(LocalStore(root / f"{mibps}-{label}"),
                                                                                      mibps * MiB, 0.002)), 1 << 30),
                              recorder=CacheRecorder(acts, codec=codec), prefetch_steps=0, read_gbps=0.0)
            run(runner, [(dict(e_tensors), dict(e_meta))])  # measure unit costs (full compute)
            key = fam.key(f"link-{mibps}-{label}", params, meta)
            runner.read_gbps = gbps
            out = run(runner, [(tensors, dict(meta, cache_mode="record", cache_key=key.to_dict()))])[0]
            manifest = out["commit"].result(600)
            sizes[label] = (len(manifest.get("units", fam.ctrl.units)), int(manifest["nbytes"]))
            edit_meta = dict(e_meta, cache_mode="masked", cache_key=key.to_dict(), refresh_steps=[])
            times[label] = _timed(lambda: run(runner, [(dict(e_tensors), dict(edit_meta))]), args.steps)
            runner.caches.close()  # type: ignore[union-attr]
            runner.recorder.close()  # type: ignore[union-attr]
        n_units = len(fam.ctrl.units)
        lines.append(f"| {mibps:g} | {sizes['selected'][0]}/{n_units} | {sizes['selected'][1] / MiB:.2f} | "
                     f"{sizes['selected'][1] / sizes['all'][1]:.2f} | {times['selected'] * 1000:.1f} | "
                     f"{times['all'] * 1000:.1f} | {full_s * 1000:.1f} |")
    lines.append("")
    return lines


def _timed(fn: Any, steps: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / steps


PARTS = {"formula": part_formula, "recorded": part_recorded, "fidelity": part_fidelity, "steps": part_steps,
         "hosttier": part_hosttier, "link": part_link}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/cache_bytes.md", threads=2)
    p.add_argument("--parts", default="fidelity,formula,recorded,hosttier,link")
    p.add_argument("--families", default="sd,flux")
    p.add_argument("--templates", type=int, default=4)
    p.add_argument("--edits", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--policies", default="fast,cache-as-is")
    p.add_argument("--steps-models", default="sd,sdxl-layout,flux", help=f"of {', '.join(STEPS_MODELS)}")
    p.add_argument("--steps-schedules", default="20,50", help="schedule lengths of the stored-steps part")
    p.add_argument("--steps-policies", default="fast,balanced")
    p.add_argument("--cache-steps-list", default="2,3,5", help="stored-step counts to measure")
    p.add_argument("--steps-codec", default="float32", choices=CODECS,
                   help="codec of the n-step caches (the every-step reference is float32)")
    p.add_argument("--json", default="", help="the stored-steps part's results as JSON")
    p.add_argument("--replay-steps", type=int, default=5)
    p.add_argument("--replay-templates", type=int, default=3)
    p.add_argument("--replay-budget-templates", type=float, default=4.0)
    p.add_argument("--link-mibps", type=float, default=1024.0)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--link-model", default="tiny-sd-inpaint-trained")
    p.add_argument("--link-speeds", type=lambda s: [float(x) for x in s.split(",")], default=[2000.0, 500.0, 100.0, 20.0])
    run = cli.start(p, argv, __file__, quick=dict(families="sd", templates=1, edits=1, steps=3, policies="fast", replay_steps=2,
                                                   steps_models="sd", steps_schedules="6", steps_policies="fast",
                                                   cache_steps_list="2",
                                                   replay_templates=2, link_speeds=[10.0]))
    state: dict[str, Any] = {}
    lines = ["# True-size: cache bytes per template\n", f"Command: `{run.command}`.\n"]
    for name in run.args.parts.split(","):
        lines += PARTS[name](run.args, state)
    lines.append(f"Total {run.elapsed():.0f} s.")
    run.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
