"""Benchmark: one UNet forward (one denoising step), mask-aware vs full compute.

Same model, same batch (``--jobs`` CFG jobs = 2 rows each, each job at its own timestep), real
caches recorded by a warm-up forward on the same inputs (never zero-filled), realistic mask
shapes (blobs and rectangles of the requested ratio, OR-pooled per level; never raster prefixes).
Full and masked forwards alternate (ratios in a shuffled order per repeat); the speedup is the
median over repeats of (full step / the masked step right after it), so a neighbour's load on the
shared cores hurts both sides alike. Transformer-block time is measured with
forward hooks on every ``BasicTransformerBlock`` (CPU ops are synchronous, so wall time is
exact); ``f`` = that share of the full step, Amdahl bound = 1 / ((1 - f) + f * r).

    python -m ops.bench.maskaware_unet --threads 1 --clock cpu --out docs/bench/maskaware_unet.md
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock

from ops.bench.harness import cli
from ops.bench.harness.models import add_unet_shape_args, job_masks, unet_from_args
from ops.bench.harness.policies import policy_costs, policy_row, policy_table
from ops.bench.harness.timing import CLOCK_TEXT, CLOCKS, interleave, linear_fit, loadavg, median
from workers.maskaware.unet import MaskAwareUNet, RowGroup

log = logging.getLogger(__name__)


class BlockTimer:
    """Sums time spent inside BasicTransformerBlock forwards (``clock``: wall or thread CPU)."""

    def __init__(self, unet: torch.nn.Module, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.total = 0.0
        self._t0 = 0.0
        self._handles = []
        for m in unet.modules():
            if isinstance(m, BasicTransformerBlock):
                self._handles.append(m.register_forward_pre_hook(self._pre))
                self._handles.append(m.register_forward_hook(self._post))

    def _pre(self, *_: object) -> None:
        self._t0 = self.clock()

    def _post(self, *_: object) -> None:
        self.total += self.clock() - self._t0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class Sample:
    step: float
    blocks: float


def timed(fn: Callable[[], object], timer: BlockTimer) -> Sample:
    timer.total = 0.0
    t0 = timer.clock()
    fn()
    return Sample(timer.clock() - t0, timer.total)


def bench_layout(unet: UNet2DConditionModel, kv_source: str, args: argparse.Namespace,
                 inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], resnets: str = "full") -> dict[str, object]:
    x, t, e = inputs
    ctrl = MaskAwareUNet(unet, kv_source=kv_source, resnets=resnets)  # type: ignore[arg-type]
    layout, step_bytes = ctrl.cache_layout, ctrl.cache_nbytes(args.latent, args.latent, rows=2)
    timer = BlockTimer(unet, CLOCKS[args.clock])
    try:
        with torch.no_grad():
            with ctrl.batch([RowGroup(2, "record") for _ in range(args.jobs)]) as ctx:
                unet(x, t, e)  # warm-up + real caches from the same inputs
            caches = ctx.recorded
            full_groups = [RowGroup(2, "full") for _ in range(args.jobs)]
            masks = {r: job_masks(ctrl, r, args.jobs, args.latent, args.vae_factor, args.seed)
                     for r in args.ratios}

            def forward(groups: list[RowGroup]) -> Callable[[], None]:
                def go() -> None:
                    with ctrl.batch(groups):
                        unet(x, t, e)
                return go

            masked_groups = {r: [RowGroup(2, "masked", token_mask=m, cache=c) for m, c in zip(masks[r], caches)]
                             for r in args.ratios}
            for r in args.ratios:  # warm every shape once
                forward(masked_groups[r])()
            # Per round, every ratio (shuffled: no fixed position) as a full step and the masked step
            # right after it.
            pairs = interleave(args.repeats, args.ratios, lambda r: (timed(forward(full_groups), timer),
                                                                     timed(forward(masked_groups[r]), timer)),
                               rng=random.Random(args.seed), label=f"{kv_source}, ResNets {resnets} ")
    finally:
        timer.remove()
        ctrl.remove()
    full = [f for r in args.ratios for f, _ in pairs[r]]
    t_full = median(s.step for s in full)
    f = median(s.blocks / s.step for s in full)
    n_tokens = args.latent * args.latent
    rows = []
    for r in args.ratios:
        masked = [m for _, m in pairs[r]]
        speedup = median(a.step / b.step for a, b in pairs[r])  # each masked step against the full step before it
        bound = 1.0 / ((1 - f) + f * r)
        level0 = statistics.mean(m.count(n_tokens) / n_tokens for m in masks[r])
        coarse = statistics.mean(m.ratios()[-1] for m in masks[r])
        rows.append(dict(ratio=r, level0=level0, coarse=coarse, t_masked=median(s.step for s in masked),
                         blocks_masked=median(s.blocks for s in masked), speedup=speedup, bound=bound,
                         share=speedup / bound, spread=(min(s.step for s in masked), max(s.step for s in masked))))
    return dict(kv_source=kv_source, resnets=resnets, layout=layout, t_full=t_full, f=f,
                blocks_full=median(s.blocks for s in full),
                full_spread=(min(s.step for s in full), max(s.step for s in full)), rows=rows,
                fit=linear_fit([row["ratio"] for row in rows], [row["t_masked"] for row in rows]),
                cache_step_bytes=step_bytes)


def render(results: list[dict[str, object]], args: argparse.Namespace, loads: tuple, cmd: str) -> str:
    lines = ["# Mask-aware UNet step: measured on this machine", "",
             "Command (from the repo root):", "", "```", cmd, "```", "",
             f"- Model: SD-architecture 9-channel `UNet2DConditionModel`, block_out_channels {args.hidden}, "
             f"layers_per_block {args.layers_per_block}, transformer_layers_per_block {args.transformer_layers}, "
             f"cross_attention_dim {args.cross_dim}, heads of 64 dims, random init (seed {args.seed}), fp32.",
             f"- Latent {args.latent}x{args.latent} ({args.latent ** 2} tokens at the first transformer level), "
             f"text length {args.text_len}; batch = {args.jobs} CFG jobs = {2 * args.jobs} rows, "
             "each job at its own timestep.",
             f"- Masks: pixel masks {args.latent * args.vae_factor}x{args.latent * args.vae_factor}, "
             "even jobs an irregular blob, odd jobs a rectangle, exact pixel ratio r; OR-pooled to "
             "tokens (level-0 and coarsest-level token ratios shown), no dilation.",
             f"- Caches recorded by a warm-up forward on the same inputs. {args.repeats} repeats, "
             "full and masked steps alternating, ratios shuffled per repeat; times are medians, speedup "
             f"is the median of paired (full / next masked) ratios. Clock: {CLOCK_TEXT[args.clock]}. Threads: "
             f"{torch.get_num_threads()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs. Load average before/after: {loads[0]} / {loads[1]}.", ""]
    for res in results:
        slope, intercept, r2 = res["fit"]  # type: ignore[misc]
        resnets = ", ResNets masked too" if res["resnets"] == "masked" else ""
        lines += [f"## kv_source = `{res['kv_source']}`{resnets} (cache layout `{res['layout']}`, "
                  f"{res['cache_step_bytes'] / 2 ** 20:.2f} MiB per step per CFG job)", "",
                  f"Full step: {res['t_full'] * 1e3:.0f} ms (min/max {res['full_spread'][0] * 1e3:.0f}/"
                  f"{res['full_spread'][1] * 1e3:.0f}); transformer blocks "
                  f"{res['blocks_full'] * 1e3:.0f} ms, f = {res['f']:.3f}.", "",
                  "| r (pixel) | token ratio L0 / coarsest | masked step ms (min-max) | blocks ms "
                  "(share of full blocks) | speedup | Amdahl bound | share of bound |",
                  "|---|---|---|---|---|---|---|"]
        for row in res["rows"]:  # type: ignore[union-attr]
            lines.append(
                f"| {row['ratio']:.2f} | {row['level0']:.3f} / {row['coarse']:.3f} | {row['t_masked'] * 1e3:.0f} "
                f"({row['spread'][0] * 1e3:.0f}-{row['spread'][1] * 1e3:.0f}) | {row['blocks_masked'] * 1e3:.0f} "
                f"({row['blocks_masked'] / res['blocks_full']:.3f}) | "
                f"{row['speedup']:.2f}x | {row['bound']:.2f}x | {row['share'] * 100:.0f}% |")
        lines += ["", f"Linear fit of masked step time vs r: slope {slope * 1e3:.0f} ms per unit ratio, "
                  f"intercept {intercept * 1e3:.0f} ms, R^2 = {r2:.4f}.", ""]
    lines += policy_lines(results, args)
    lines += ["## Cache size of real models (`MaskAwareUNet.cache_nbytes`, fp16, CFG rows, 50 steps)", "",
              "| model | layout | blocks | MiB per step | GiB per template | MiB per step as template caches are "
              "stored (int8 codec, CFG rows shared) |", "|---|---|---|---|---|---|"]
    for name, blocks, layout, per_step, stored in real_cache_sizes():
        lines.append(f"| {name} | `{layout}` | {blocks} | {per_step / 2 ** 20:.0f} | {50 * per_step / 2 ** 30:.1f} | "
                     f"{stored / 2 ** 20:.0f} |")
    return "\n".join(lines) + "\n"


def real_cache_sizes() -> list[tuple[str, int, str, int, int]]:
    """Cache bytes per step of SD1.5 at 512 px and SDXL at 1024 px (built on the meta device), in
    fp16 and as a template warm-up stores them (int8 codec, CFG rows shared); with ``kv+y+r``
    mask-aware ResNets' tensors too."""
    sd15 = dict(block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
                down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
    sdxl = dict(block_out_channels=(320, 640, 1280), cross_attention_dim=2048, attention_head_dim=(5, 10, 20),
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                transformer_layers_per_block=(1, 2, 10), use_linear_projection=True)
    out = []
    for name, cfg, latent in (("SD1.5, 512 px", sd15, 64), ("SDXL, 1024 px", sdxl, 128)):
        with torch.device("meta"):
            unet = UNet2DConditionModel(in_channels=9, out_channels=4, layers_per_block=2, **cfg)
        for kv, resnets in (("cache", "full"), ("recompute", "full"), ("cache", "masked")):
            ctrl = MaskAwareUNet(unet, kv_source=kv, resnets=resnets)  # type: ignore[arg-type]
            out.append((name, len(ctrl.block_names), ctrl.cache_layout,
                        ctrl.cache_nbytes(latent, latent, rows=2, dtype=torch.float16),
                        ctrl.cache_nbytes(latent, latent, rows=2, codec="int8", shared=ctrl.tensor_names())))
            ctrl.remove()
    return out


def policy_lines(results: list[dict[str, object]], args: argparse.Namespace) -> list[str]:
    """Where both ResNet modes were timed (K/V from the cache), a job's cost under each fidelity policy."""
    by_mode = {res["resnets"]: res for res in results if res["kv_source"] == "cache"}
    if set(by_mode) != {"full", "masked"}:
        return []
    rows = []
    for whole, masked in zip(by_mode["full"]["rows"], by_mode["masked"]["rows"]):  # type: ignore[call-overload]
        if whole["ratio"] < 1.0:
            costs = policy_costs({"": whole["speedup"], "+resnets": masked["speedup"]})
            rows.append(policy_row(f"UNet {args.hidden}", args.jobs, whole["ratio"], costs))
    return ["## Fidelity policies", "", *policy_table(rows, "the speedups above"), ""]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/maskaware_unet.md", threads=2, clock="wall")
    add_unet_shape_args(p)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--vae-factor", type=int, default=8)
    p.add_argument("--ratios", default="0.05,0.1,0.2,0.35,0.5,1.0")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-source", default="cache,recompute")
    p.add_argument("--resnets", default="full", help="full,masked: ResNets on the whole map and/or "
                   "at the masked tokens too (with kv-source cache; workers/maskaware/resnets.py)")
    run = cli.start(p, argv, __file__, quick=dict(hidden="32,64", latent=16, cross_dim=64, text_len=8,
                                                  ratios="0.2,1.0", repeats=1, kv_source="cache", threads=1))
    args = run.args
    args.hidden = tuple(int(c) for c in args.hidden.split(","))
    args.ratios = [float(r) for r in args.ratios.split(",")]
    loads_before = loadavg()
    unet = unet_from_args(args)
    g = torch.Generator().manual_seed(args.seed)
    b = 2 * args.jobs
    x = torch.randn(b, 9, args.latent, args.latent, generator=g)
    t = torch.tensor([int(900 - 800 * k / max(1, args.jobs - 1)) for k in range(args.jobs) for _ in range(2)])
    e = torch.randn(b, args.text_len, args.cross_dim, generator=g)
    results = []
    variants = [(kv, rn) for kv in args.kv_source.split(",") for rn in args.resnets.split(",")
                if rn == "full" or kv == "cache"]
    for kv, rn in variants:
        res = bench_layout(unet, kv, args, (x, t, e), resnets=rn)
        results.append(res)
        for row in res["rows"]:  # type: ignore[union-attr]
            log.info("%s/%s r=%.2f masked %.0f ms full %.0f ms speedup %.2fx bound %.2fx share %.0f%%", kv, rn,
                     row["ratio"], row["t_masked"] * 1e3, res["t_full"] * 1e3, row["speedup"], row["bound"],
                     row["share"] * 100)
    run.write(render(results, args, (loads_before, loadavg()), run.command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
