"""Benchmark: per-step denoiser time at true sizes, mask-aware vs full compute, ratios side by side.

Models (random init, public configs, ``workers/models/true_size.py``): SD 1.5 inpainting UNet at
512 px (64x64 latent, CFG batch 2, text 77 x 768), SDXL inpainting UNet at 1024 px (128x128
latent, CFG batch 2, text 77 x 2048, added conditioning ``text_embeds`` [2, 1280] + ``time_ids``
[2, 6] exercised), FLUX.1 Fill transformer at 1024 px (4096 image tokens + 512 T5 tokens, batch
1, guidance embeds) on a measured subset of its blocks (full width; per-block times give the
full-depth step: ``T(57 blocks) = rest + 19 * t_double + 38 * t_single``).

Per model, one run: a record forward captures the template cache from the same inputs (never
zero-filled); a sanity pass compares mask-aware with full compute at every ratio (max |diff| over
the whole output; ratio 1 routes to the stock forward: equal) and warms every shape; then rounds
of [full, every ratio masked (shuffled), ...] with a full step between ratios' blocks of rounds:
speedups are median full step / median masked step, and (beside) the median over rounds of each masked
step against the mean of its round's two full steps (same machine load).
The precision is chosen first by timing one transformer block of each family in float32 and
bfloat16 (``--dtype auto``: the faster one); run one model at a time (``--models``), each run
replaces its model's section of the report and keeps the others'.

    python -m ops.bench.true_size --models sd15 --rounds 5 --out docs/bench/true_size.md
    python -m ops.bench.true_size --models sdxl --dtype bfloat16 --rounds 2 \
        --out docs/bench/true_size.md
    python -m ops.bench.true_size --models flux --dtype bfloat16 --rounds 1 \
        --out docs/bench/true_size.md

One torch thread, CPU time of that thread (``--clock cpu``): the machine is shared, and wall time
with two threads was inflated up to 5x by a neighbour's work during these runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ops.bench.harness import cli
from ops.bench.harness.models import flux_image_ids, job_masks
from ops.bench.harness.timing import CLOCK_TEXT, CLOCKS, cpu_model, loadavg
from workers.maskaware.flux import MaskAwareFlux
from workers.maskaware.flux import RowGroup as FluxGroup
from workers.maskaware.flux_tokens import synthetic_token_grid
from workers.maskaware.tokens import POOL_THRESHOLD
from workers.maskaware.unet import MaskAwareUNet, RowGroup
from workers.models import true_size

log = logging.getLogger(__name__)

MODELS = {"sd15": "sd15-inpaint", "sdxl": "sdxl-inpaint", "flux": "flux-fill-subset"}
# FlashPS paper's inference speedups at mask ratio 0.2 (per image, on GPUs), as DESIGN.md section 5
# ("Numbers to beat (the paper, on GPUs)") and issue 19 quote them: SD 2.1 1.3x, SDXL 2.2x, Flux 1.9x.
FLASHPS_AT_02 = {"sd15": ("SD 2.1", 1.3), "sdxl": ("SDXL", 2.2), "flux": ("Flux", 1.9)}
FLUX_FULL_DEPTH = (19, 38)


# ------------------------------------------------------------------------------------------------
# Precision probe: one block per family, float32 vs bfloat16.


def precision_probe(quick: bool, repeats: int, clock: Callable[[], float]) -> tuple[list[str], dict[str, float]]:
    """Time one SD 1.5 level-0 transformer block (4096 tokens, CFG 2) and one Flux single block
    (4608 tokens) in both dtypes; returns markdown rows and the summed seconds per dtype."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    dim, heads, tokens, text = (64, 2, 256, 8) if quick else (320, 5, 4096, 77)
    fdim, fheads, ftokens = (128, 1, 256) if quick else (3072, 24, 4608)
    rows, totals = [], {"float32": 0.0, "bfloat16": 0.0}
    for dname, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        torch.manual_seed(0)
        blk = BasicTransformerBlock(dim, heads, dim // heads, cross_attention_dim=768 if not quick else 32).eval()
        blk = blk.to(dtype)
        x = torch.randn(2, tokens, dim, dtype=dtype)
        e = torch.randn(2, text, 768 if not quick else 32, dtype=dtype)
        fblk = FluxSingleTransformerBlock(fdim, fheads, fdim // fheads).eval().to(dtype)
        fx = torch.randn(1, ftokens, fdim, dtype=dtype)
        temb = torch.randn(1, fdim, dtype=dtype)
        rope_dim = fdim // fheads
        cos = torch.ones(ftokens, rope_dim)
        sin = torch.zeros(ftokens, rope_dim)
        text_len = 512 if not quick else 8
        ft, fh = fx[:, :text_len], fx[:, text_len:]

        def sd() -> None:
            blk(x, encoder_hidden_states=e)

        def flux() -> None:
            fblk(hidden_states=fh, encoder_hidden_states=ft, temb=temb, image_rotary_emb=(cos, sin))

        for name, fn in ((f"SD 1.5 level-0 BasicTransformerBlock ({dim} ch, {tokens} tokens, batch 2)", sd),
                         (f"Flux single block ({fdim} ch, {ftokens} tokens, batch 1)", flux)):
            with torch.no_grad():
                fn()
                ts = []
                for _ in range(repeats):
                    t0 = clock()
                    fn()
                    ts.append(clock() - t0)
            med = statistics.median(ts)
            totals[dname] += med
            rows.append((name, dname, med))
    lines = ["| block | float32 ms | bfloat16 ms | bf16 speedup |", "|---|---|---|---|"]
    for name in dict.fromkeys(r[0] for r in rows):
        f32 = next(r[2] for r in rows if r[0] == name and r[1] == "float32")
        b16 = next(r[2] for r in rows if r[0] == name and r[1] == "bfloat16")
        lines.append(f"| {name} | {f32 * 1e3:.0f} | {b16 * 1e3:.0f} | {f32 / b16:.2f}x |")
    return lines, totals


# ------------------------------------------------------------------------------------------------
# Timing loop shared by the UNet and Flux runs.


def rounds(n: int, ratios: list[float], full: Callable[[], float], masked: Callable[[float], float],
           seed: int) -> tuple[list[float], dict[float, list[float]], dict[float, list[float]]]:
    """``n`` rounds of [full, ratios shuffled, full]; a masked step's speedup is against the mean of
    its round's two full steps (consecutive rounds share the boundary full step)."""
    rng = random.Random(seed)
    fulls = [full()]
    times: dict[float, list[float]] = {r: [] for r in ratios}
    speed: dict[float, list[float]] = {r: [] for r in ratios}
    for k in range(n):
        order = list(ratios)
        rng.shuffle(order)
        got = {r: masked(r) for r in order}
        fulls.append(full())
        ref = (fulls[-1] + fulls[-2]) / 2
        for r, t in got.items():
            times[r].append(t)
            speed[r].append(ref / t)
        log.info("round %d/%d: full %.2f s, %s", k + 1, n, fulls[-1],
                 ", ".join(f"r={r}: {got[r]:.2f} s" for r in ratios))
    return fulls, times, speed


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


# ------------------------------------------------------------------------------------------------
# UNet models (SD 1.5, SDXL).


def run_unet(key: str, args: argparse.Namespace, dtype: torch.dtype) -> list[str]:
    model_id = MODELS[key]
    s = true_size.shrunk(model_id) if args.quick else true_size.spec(model_id)
    comp = s.components["unet"]
    cfg = comp.config
    latent = (8 if args.quick else 64) if key == "sd15" else (16 if args.quick else 128)
    text_len = 8 if args.quick else 77
    t0 = time.perf_counter()
    unet = true_size.build_module(comp, dtype, seed=args.seed)
    n_par = sum(p.numel() for p in unet.parameters())
    log.info("%s UNet built (%.2f B params, %s) in %.0f s", model_id, n_par / 1e9, dtype, time.perf_counter() - t0)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(2, 9, latent, latent, generator=g).to(dtype)
    t = torch.tensor([500, 500])
    e = torch.randn(2, text_len, cfg["cross_attention_dim"], generator=g).to(dtype)
    kwargs: dict[str, Any] = {}
    added = ""
    if cfg.get("addition_embed_type") == "text_time":
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
        px = latent * 8
        time_ids = torch.tensor([[px, px, 0, 0, px, px]] * 2, dtype=dtype)   # original size, crop, target size
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(2, pooled, generator=g).to(dtype),
                                       "time_ids": time_ids}
        added = f", added conditioning text_embeds [2, {pooled}] + time_ids [2, 6] ({px}, {px}, 0, 0, {px}, {px})"
    ctrl = MaskAwareUNet(unet, kv_source="cache")
    ctrl.pool_threshold = args.pool_threshold
    n_blocks = len(ctrl.block_names)
    clock = CLOCKS[args.clock]
    with torch.no_grad():
        def forward(groups: list[RowGroup] | None) -> torch.Tensor:
            if groups is None:
                return unet(x, t, e, **kwargs).sample
            with ctrl.batch(groups) as ctx:
                out = unet(x, t, e, **kwargs).sample
            forward.ctx = ctx  # type: ignore[attr-defined]
            return out

        forward([RowGroup(2, "record")])
        cache = forward.ctx.recorded[0]  # type: ignore[attr-defined]
        cache_bytes = sum(v.numel() * v.element_size() for v in cache.values())
        full_out = forward(None)
        masks = {r: job_masks(ctrl, r, 1, latent, 8, args.seed)[0] for r in args.ratios}
        groups = {r: [RowGroup(2, "masked", token_mask=masks[r], cache=cache)] for r in args.ratios}
        checks = {}
        for r in args.ratios:       # sanity + warm-up of every shape
            out = forward(groups[r])
            checks[r] = float((out.float() - full_out.float()).abs().max())
            log.info("%s check r=%.2f: max |mask-aware - full| = %.3e", key, r, checks[r])
        scale = float(full_out.float().abs().max())

        def timed(groups_: list[RowGroup] | None) -> float:
            t_ = clock()
            forward(groups_)
            return clock() - t_

        fulls, times, speed = rounds(args.rounds, args.ratios, lambda: timed(None), lambda r: timed(groups[r]),
                                     args.seed)
        split = step_split(unet, clock, forward, [None] + [groups[r] for r in args.ratios])
    ctrl.remove()
    n0 = latent * latent
    pooled = f", coarse-level token pooling by coverage >= {args.pool_threshold:g}" if args.pool_threshold else ""
    head = (f"## {model_id}: {n_par / 1e9:.3f} B-parameter UNet at {latent * 8} px ({latent}x{latent} latent), "
            f"CFG batch 2, {dtype}{pooled}")
    level_share = "; ".join(f"r = {r:g}: " + ", ".join(f"{float(lv.float().mean()):.3f}" for lv in masks[r].levels)
                            for r in args.ratios)
    lines = [head, "", "Command:", "", "```", args.command, "```", "",
             f"- UNet2DConditionModel, public config (in_channels 9, block_out_channels "
             f"{tuple(cfg['block_out_channels'])}, transformer_layers_per_block "
             f"{cfg.get('transformer_layers_per_block', 1)}, cross_attention_dim {cfg['cross_attention_dim']}); "
             f"text {text_len} tokens{added}; both rows at t = 500.",
             f"- Mask-aware: MaskAwareUNet kv_source `cache` (K/V of every block + Y of each transformer's last "
             f"block), {n_blocks} transformer blocks; cache {cache_bytes / 2 ** 20:.0f} MiB per step "
             f"per CFG job in {dtype}. Masks: blob (job 0) at exact pixel ratio, "
             f"{'pooled by coverage' if args.pool_threshold else 'OR-pooled'} to tokens; masked share per level "
             f"(latent, then each coarser level): {level_share}.",
             f"- CPU: {cpu_model()}.",
             f"- {args.rounds} rounds; full step median {_med(fulls) * 1e3:.0f} ms (min {min(fulls) * 1e3:.0f}, "
             f"max {max(fulls) * 1e3:.0f}, {len(fulls)} full steps). Output scale max |full| = {scale:.3g}.", "",
             "| mask ratio | tokens L0 | mask-aware step ms (median) | full step ms (median) | speedup (median full / "
             "median masked) | speedup (median of per-round ratios) | max abs diff vs full (same inputs) |",
             "|---|---|---|---|---|---|---|"]
    for r in args.ratios:
        lines.append(f"| {r:.2f} | {masks[r].count(n0) / n0:.3f} | {_med(times[r]) * 1e3:.0f} | "
                     f"{_med(fulls) * 1e3:.0f} | {_med(fulls) / _med(times[r]):.2f}x | {_med(speed[r]):.2f}x | "
                     f"{checks[r]:.2e} |")
    lines += ["", "Where the step goes (one more forward of each kind with hooks on every `Transformer2DModel`: "
              "its time is the transformer blocks' share, the rest is convolutions, ResNets, up/down sampling "
              "and embeddings, which mask-aware compute leaves on the full map; ceiling = full step / rest, "
              "the speedup if the transformers cost nothing):", "",
              "| forward | step ms | transformers ms | rest ms | transformer share | ceiling |",
              "|---|---|---|---|---|---|"]
    full_total, full_tr = split[0]
    rest = full_total - full_tr
    lines.append(f"| full | {full_total * 1e3:.0f} | {full_tr * 1e3:.0f} | {rest * 1e3:.0f} | "
                 f"{full_tr / full_total:.1%} | {full_total / rest:.2f}x |")
    for r, (tot, tr) in zip(args.ratios, split[1:]):
        lines.append(f"| mask-aware r = {r:.2f} | {tot * 1e3:.0f} | {tr * 1e3:.0f} | {(tot - tr) * 1e3:.0f} | "
                     f"{tr / tot:.1%} | - |")
    lines.append("")
    log.info("%s done: full %.2f s, r=0.2 speedup %s", key, _med(fulls),
             f"{_med(fulls) / _med(times[0.2]):.2f}x" if 0.2 in times else "-")
    tag = section_key(key, args.pool_threshold)
    args.summary[tag] = dict(full=_med(fulls), speed={str(r): _med(fulls) / _med(v) for r, v in times.items()},
                             dtype=str(dtype), label=f"{model_id} {latent * 8} px")
    lines.append(f"<!-- data {json.dumps(args.summary[tag])} -->")
    return lines


def section_key(model: str, pool_threshold: float) -> str:
    """Report section of a run: the model, or model + pooling threshold when not OR (0)."""
    return model if not pool_threshold else f"{model}_pool{round(pool_threshold * 100):02d}"


def step_split(unet: torch.nn.Module, clock: Callable[[], float], forward: Callable[[Any], Any],
               inputs: list[Any]) -> list[tuple[float, float]]:
    """(step seconds, seconds inside ``Transformer2DModel`` modules) of one forward per input: what
    mask-aware compute can shrink vs what it leaves on the full map."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    spent = [0.0]
    started: list[float] = []
    handles = []
    for m in unet.modules():
        if isinstance(m, Transformer2DModel):
            handles.append(m.register_forward_pre_hook(lambda *_: started.append(clock())))
            handles.append(m.register_forward_hook(
                lambda *_: spent.__setitem__(0, spent[0] + clock() - started.pop())))
    out = []
    try:
        for x in inputs:
            spent[0] = 0.0
            t0 = clock()
            forward(x)
            out.append((clock() - t0, spent[0]))
    finally:
        for h in handles:
            h.remove()
    return out


# ------------------------------------------------------------------------------------------------
# Flux Fill (subset of blocks, per-block times).


class BlockClock:
    """Per-block wall seconds of one forward (pre/post forward hooks fire around ModelHook forwards)."""

    def __init__(self, model: torch.nn.Module, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: dict[str, float] = {}
        self._t0: dict[str, float] = {}
        self._handles = []
        for prefix in ("transformer_blocks", "single_transformer_blocks"):
            for i, blk in enumerate(getattr(model, prefix)):
                name = f"{prefix}.{i}"
                self._handles.append(blk.register_forward_pre_hook(lambda *_, n=name: self._pre(n)))
                self._handles.append(blk.register_forward_hook(lambda *_, n=name: self._post(n)))

    def _pre(self, name: str) -> None:
        self._t0[name] = self.clock()

    def _post(self, name: str) -> None:
        self.times[name] = self.clock() - self._t0[name]

    def split(self) -> tuple[float, float]:
        """(mean double-block seconds, mean single-block seconds) of the last forward."""
        d = [v for k, v in self.times.items() if k.startswith("transformer_blocks")]
        s = [v for k, v in self.times.items() if k.startswith("single")]
        return statistics.mean(d), statistics.mean(s)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def run_flux(args: argparse.Namespace, dtype: torch.dtype) -> list[str]:
    model_id = MODELS["flux"]
    s = true_size.shrunk(model_id) if args.quick else true_size.spec(model_id)
    comp = s.components["transformer"]
    cfg = comp.config
    side, text_len = (8, 8) if args.quick else (64, 512)
    t0 = time.perf_counter()
    model = true_size.build_module(comp, dtype, seed=args.seed)
    n_par = sum(p.numel() for p in model.parameters())
    log.info("%s built (%.2f B params, %s) in %.0f s", model_id, n_par / 1e9, dtype, time.perf_counter() - t0)
    g = torch.Generator().manual_seed(args.seed)
    n = side * side
    kw = dict(hidden_states=torch.randn(1, n, cfg["in_channels"], generator=g).to(dtype),
              encoder_hidden_states=torch.randn(1, text_len, cfg["joint_attention_dim"], generator=g).to(dtype),
              pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(dtype),
              timestep=torch.tensor([0.5], dtype=dtype), guidance=torch.tensor([30.0], dtype=dtype),
              img_ids=flux_image_ids(side), txt_ids=torch.zeros(text_len, 3))
    ctrl = MaskAwareFlux(model)
    clock = CLOCKS[args.clock]
    bc = BlockClock(model, clock)
    n_double, n_single = cfg["num_layers"], cfg["num_single_layers"]
    with torch.no_grad():
        with ctrl.batch([FluxGroup(1, "record")]) as ctx:
            model(**kw)
        cache = ctx.recorded[0]
        cache_bytes = sum(v.numel() * v.element_size() for v in cache.values())
        full_out = model(**kw).sample
        masks = {r: synthetic_token_grid(side, side, r, shape="blob", seed=args.seed).flatten() for r in args.ratios}
        groups = {r: [FluxGroup(1, "masked", token_mask=masks[r], cache=cache)] for r in args.ratios}
        checks = {}
        for r in args.ratios:
            with ctrl.batch(groups[r]):
                out = model(**kw).sample
            checks[r] = float((out.float() - full_out.float()).abs().max())
            log.info("flux check r=%.2f: max |mask-aware - full| = %.3e", r, checks[r])
        scale = float(full_out.float().abs().max())
        per_block: dict[Any, list[tuple[float, float, float]]] = {"full": [], **{r: [] for r in args.ratios}}

        def timed(r: float | None) -> float:
            t_ = clock()
            if r is None:
                model(**kw)
            else:
                with ctrl.batch(groups[r]):
                    model(**kw)
            step = clock() - t_
            d, s_ = bc.split()
            per_block["full" if r is None else r].append((step, d, s_))
            return step

        fulls, times, speed = rounds(args.rounds, args.ratios, lambda: timed(None), timed, args.seed)
    bc.remove()
    ctrl.remove()
    nd, ns = FLUX_FULL_DEPTH

    def extrapolate(samples: list[tuple[float, float, float]]) -> tuple[float, float, float, float]:
        step = _med([x[0] for x in samples])
        d = _med([x[1] for x in samples])
        s_ = _med([x[2] for x in samples])
        rest = max(0.0, step - n_double * d - n_single * s_)
        return step, d, s_, rest + nd * d + ns * s_

    fstep, fd, fs, ffull = extrapolate(per_block["full"])
    lines = [f"## {model_id}: FLUX.1 Fill transformer at full width, {n_double} double + {n_single} single blocks "
             f"({n_par / 1e9:.3f} B params), 1024 px, {dtype}" if not args.quick else
             f"## {model_id} (quick: shrunk widths), {dtype}", "",
             "Command:", "", "```", args.command, "```", "",
             f"- FluxTransformer2DModel, public FLUX.1-Fill-dev config (in 384 / out 64 channels, "
             f"{cfg['num_attention_heads']} heads x {cfg['attention_head_dim']}, joint_attention_dim "
             f"{cfg['joint_attention_dim']}, pooled {cfg['pooled_projection_dim']}, guidance embeds) with "
             f"{n_double} of 19 double and {n_single} of 38 single blocks; {n} image tokens ({side}x{side}), "
             f"{text_len} text tokens, batch 1, t = 0.5, guidance 30.",
             f"- Mask-aware: MaskAwareFlux kv_format `{ctrl.kv_format}`; cache {cache_bytes / 2 ** 20:.0f} MiB per step for these "
             f"{n_double + n_single} blocks in {dtype}. Masks: blob token grids at the ratio.",
             f"- {args.rounds} rounds; full step median {fstep * 1e3:.0f} ms (min {min(fulls) * 1e3:.0f}, max "
             f"{max(fulls) * 1e3:.0f}). Output scale max |full| = {scale:.3g}.",
             f"- Full depth (19 + 38 blocks), extrapolated per configuration from medians of per-block times: "
             f"T_57 = rest + 19 * t_double + 38 * t_single, rest = T_step - {n_double} * t_double - "
             f"{n_single} * t_single (embedders, norm_out, proj_out, RoPE tables). Full compute: t_double "
             f"{fd * 1e3:.0f} ms, t_single {fs * 1e3:.0f} ms, T_57 = {ffull:.1f} s.", "",
             "| mask ratio | tokens | mask-aware step ms (subset) | full step ms (subset) | speedup (subset, median "
             "full / median masked) | speedup (subset, median of per-round ratios) | t_double ms | t_single ms | "
             "T_57 s (extrapolated) | speedup at 57 blocks | max abs diff vs full |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    speed57 = {}
    for r in args.ratios:
        _, d, s_, t57 = extrapolate(per_block[r])
        speed57[r] = ffull / t57
        lines.append(f"| {r:.2f} | {float(masks[r].float().mean()):.3f} | {_med(times[r]) * 1e3:.0f} | "
                     f"{fstep * 1e3:.0f} | {fstep / _med(times[r]):.2f}x | {_med(speed[r]):.2f}x | {d * 1e3:.0f} | "
                     f"{s_ * 1e3:.0f} | {t57:.1f} | {speed57[r]:.2f}x | {checks[r]:.2e} |")
    lines.append("")
    args.summary["flux"] = dict(full=fstep, speed={str(r): fstep / _med(v) for r, v in times.items()},
                                speed57={str(r): v for r, v in speed57.items()}, dtype=str(dtype),
                                label=f"{model_id} {side * 16} px", t57=ffull)
    lines.append(f"<!-- data {json.dumps(args.summary['flux'])} -->")
    return lines


# ------------------------------------------------------------------------------------------------
# Report: one section per model (a run replaces its models' sections and keeps the others').


def merge_report(path: str, header: list[str], sections: dict[str, list[str]]) -> str:
    old: dict[str, str] = {}
    if path and Path(path).is_file():
        text = Path(path).read_text()
        for m in re.finditer(r"<!-- section (\w+) -->\n(.*?)<!-- /section \1 -->\n", text, re.S):
            old[m.group(1)] = m.group(2)
    for k, lines in sections.items():
        old[k] = "\n".join(lines) + "\n"
    out = list(header)
    known = ["precision", "sd15", "sdxl", "flux"]
    for k in known + sorted(set(old) - set(known) - {"summary"}) + ["summary"]:
        if k in old:
            out += [f"<!-- section {k} -->", old[k].rstrip("\n"), f"<!-- /section {k} -->"]
    return "\n".join(out) + "\n"


def section_data(path: str) -> dict[str, dict[str, Any]]:
    """The numbers of every model section of an earlier report (its ``<!-- data ... -->`` lines)."""
    if not path or not Path(path).is_file():
        return {}
    text = Path(path).read_text()
    out = {}
    for m in re.finditer(r"<!-- section (\w+) -->\n(.*?)<!-- /section \1 -->\n", text, re.S):
        d = re.search(r"<!-- data (\{.*\}) -->", m.group(2))
        if d:
            out[m.group(1)] = json.loads(d.group(1))
    return out


def summary_section(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Speedup at 0.2 per model (this run's and, from its sections, an earlier run's)."""
    rows = ["## Summary: per-step speedup at mask ratio 0.2 vs FlashPS's per-image speedup", "",
            "| model | precision | full step s | mask-aware speedup at r = 0.2 (per step) | FlashPS at r = 0.2 "
            "(per image) |", "|---|---|---|---|---|"]
    default = section_key("", POOL_THRESHOLD)
    for base in ("sd15", "sdxl", "flux"):
        for k in [base] + sorted(t for t in summary if t.startswith(f"{base}_pool")):
            if k not in summary or "0.2" not in summary[k]["speed"]:
                continue
            s = summary[k]
            sp = s["speed"]["0.2"]
            extra = f"; {s['speed57']['0.2']:.2f}x extrapolated to 57 blocks" \
                if k == "flux" and "0.2" in s.get("speed57", {}) else ""
            pooled = k[len(base):]
            label = s["label"] + (f", coarse levels pooled by coverage >= {int(pooled[5:]) / 100:g}" if pooled else
                                  (", OR-pooled" if base != "flux" else ""))
            label += " (the default)" if base != "flux" and pooled == default else ""
            name, fps = FLASHPS_AT_02[base]
            rows.append(f"| {label} | {s['dtype']} | {s['full']:.2f} | {sp:.2f}x{extra} | {fps}x ({name}) |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/true_size.md", threads=1, clock="auto")
    p.add_argument("--models", default="sd15,sdxl,flux",
                   help="comma-separated: sd15, sdxl, flux (\"\" with --dtype: rewrite the summary from the sections)")
    p.add_argument("--ratios", default="0.05,0.1,0.2,0.4,0.6,0.8,1.0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool-threshold", type=float, default=POOL_THRESHOLD,
                   help="UNet coarse levels' token pooling (default: the service's; 0 = OR)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and compute; auto = the faster of the two in the one-block probe")
    p.add_argument("--probe-repeats", type=int, default=3)
    run = cli.start(p, argv, __file__, quick=dict(models="sd15,sdxl,flux", ratios="0.2,1.0", rounds=1,
                                                  probe_repeats=1))
    args = run.args
    args.command = run.command
    args.ratios = [float(r) for r in args.ratios.split(",")]
    args.summary = {}
    torch.set_grad_enabled(False)
    load0 = loadavg()
    sections: dict[str, list[str]] = {}
    if args.dtype == "auto":   # an explicit dtype keeps an earlier run's probe section
        probe_lines, totals = precision_probe(args.quick, args.probe_repeats, CLOCKS[args.clock])
        dtype = torch.bfloat16 if totals["bfloat16"] < totals["float32"] else torch.float32
        log.info("precision probe: %s; using %s", totals, dtype)
        sections["precision"] = ["## Precision probe (one block per family)", "", "Command:", "", "```",
                                 run.command, "```", "", *probe_lines, "",
                                 f"Chosen for the step timings: `{dtype}` (the faster; later runs pass it with "
                                 "`--dtype`).", ""]
    else:
        dtype = true_size.DTYPES[args.dtype]
    for key in [k for k in args.models.split(",") if k]:  # --models "": only the summary is rewritten
        sections[section_key(key, 0.0 if key == "flux" else args.pool_threshold)] = (
            run_flux(args, dtype) if key == "flux" else run_unet(key, args, dtype))
        gc.collect()   # one model at a time: the last one's weights and caches are freed here
    # Summary: this run's models plus, from an earlier report, the others' (kept in their sections).
    data = dict(section_data(args.out), **args.summary)
    sections["summary"] = summary_section(data) + [
        "", "FlashPS numbers: per-image inference speedups at mask ratio 0.2 on GPUs (FlashPS paper, as quoted in "
        "DESIGN.md section 5 \"Numbers to beat\" and issue 19; "
        "SD 2.1 stands in for SD 1.5 there), ours are per denoising step on this CPU; a step is most of an "
        "image's time, so the per-step speedup bounds the per-image one from above.", ""]
    header = ["# True-size models: per-step mask-aware vs full compute (measured on this CPU)", "",
              "Generated by `ops/bench/true_size.py`, one section per model; each section names the command "
              "that wrote it. Last command:", "", "```", run.command,
              "```", "",
              f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
              f"{torch.__version__}, {torch.get_num_threads()} torch thread(s), clock: {CLOCK_TEXT[args.clock]} "
              "(the machine is shared: one thread's CPU time is what other load does not inflate); load average "
              "before/after the "
              f"last run {load0} / {loadavg()}. Random-init weights from the public configs "
              "(workers/models/true_size.py).", ""]
    run.write(merge_report(args.out, header, sections))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
