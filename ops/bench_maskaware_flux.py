"""Benchmark: one Flux transformer forward (= one denoising step), mask-aware vs full compute.

Same model, same batch (``--batch`` rows, each its own job: own mask, cache, timestep, guidance),
a Flux-architecture ``FluxTransformer2DModel`` of the real class with Flux's head dim (128) and
Fill channel layout. Caches come from a real record-mode warm-up forward of the same inputs
(never zero-filled); masks are blobs and rectangles of the requested token ratio (never raster
prefixes). Configurations are timed interleaved, round-robin, and medians are reported, because
this machine is shared. Also reported: the token-count bound ``(N + T) / (m + T)`` (text tokens are
always computed), a least-squares line of step time vs ratio, and a text-length sweep.

    HF_HUB_OFFLINE=1 .venv/bin/python -m ops.bench_maskaware_flux --out docs/bench/maskaware_flux_results.md
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from workers.maskaware.flux import MaskAwareFlux, RowGroup
from workers.maskaware.flux_tokens import synthetic_token_grid
from workers.models.tiny_flux import build_flux_transformer

log = logging.getLogger("bench_maskaware_flux")

# cpu = this thread's CPU time: with one torch thread all work runs here, so it counts the work done
# and ignores time lost to other processes on a shared machine.
_CLOCK: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


@dataclass
class Setup:
    model: torch.nn.Module
    ctrl: MaskAwareFlux
    kwargs: dict[str, torch.Tensor]
    caches: list[dict[str, torch.Tensor]]
    n_tokens: int
    text_len: int
    clock: Callable[[], float]


def _inputs(args: argparse.Namespace, text_len: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    b, side = args.batch, args.side
    n = side * side
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] += torch.arange(side)[:, None]
    img_ids[..., 2] += torch.arange(side)[None, :]
    return dict(
        hidden_states=torch.randn(b, n, 384, generator=g),
        encoder_hidden_states=torch.randn(b, text_len, args.joint_dim, generator=g),
        pooled_projections=torch.randn(b, 768, generator=g),
        timestep=torch.linspace(0.9, 0.3, b),            # every row at its own step
        guidance=torch.linspace(30.0, 3.5, b),
        img_ids=img_ids.reshape(n, 3),
        txt_ids=torch.zeros(text_len, 3),
    )


def _setup(args: argparse.Namespace, model: torch.nn.Module, ctrl: MaskAwareFlux, text_len: int) -> Setup:
    kwargs = _inputs(args, text_len)
    with ctrl.batch([RowGroup(1, "record") for _ in range(args.batch)]) as ctx:   # real warm-up
        model(**kwargs)
    return Setup(model, ctrl, kwargs, list(ctx.recorded), args.side * args.side, text_len, _CLOCK[args.clock])


def _masks(args: argparse.Namespace, ratio: float) -> list[torch.Tensor]:
    shapes = ("blob", "rect")
    return [synthetic_token_grid(args.side, args.side, ratio, shape=shapes[i % 2], seed=args.seed + 7 * i).flatten()
            for i in range(args.batch)]


def _forward(s: Setup, groups: list[RowGroup] | None) -> tuple[float, torch.Tensor]:
    """One timed forward (and its output, for the correctness check)."""
    t0 = s.clock()
    if groups is None:
        out = s.model(**s.kwargs).sample
    else:
        with s.ctrl.batch(groups):
            out = s.model(**s.kwargs).sample
    return s.clock() - t0, out


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    slope, intercept = np.polyfit(xs, ys, 1)
    pred = slope * np.asarray(xs) + intercept
    ss_res = float(((np.asarray(ys) - pred) ** 2).sum())
    ss_tot = float(((np.asarray(ys) - np.mean(ys)) ** 2).sum())
    return float(slope), float(intercept), 1.0 - ss_res / ss_tot if ss_tot else 1.0


def run_ratio_table(args: argparse.Namespace, s: Setup) -> list[str]:
    """Round-robin timing of full compute and every ratio; returns markdown lines."""
    fmt = s.ctrl.kv_format
    configs: list[tuple[str, float, list[RowGroup] | None, Setup]] = [("full", 1.0, None, s)]
    for r in args.ratios:
        groups = [RowGroup(1, "masked", token_mask=m, cache=c) for m, c in zip(_masks(args, r), s.caches)]
        configs.append((fmt, r, groups, s))
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    full_out = _forward(s, None)[1]
    for i, (fmt, r, groups, fs) in enumerate(configs):        # untimed pass: allocator, correctness
        out = _forward(fs, groups)[1]
        if groups is not None:
            err = max(float((out[k] - full_out[k])[g.token_mask].abs().max()) if g.token_mask.any() else 0.0
                      for k, g in enumerate(groups))
            log.info("check %s r=%.2f: max |masked - full| at masked tokens = %.2e", fmt, r, err)
    for rnd in range(args.rounds):
        for i, (_, _, groups, fs) in enumerate(configs):
            times[i].append(_forward(fs, groups)[0])
        log.info("round %d/%d done", rnd + 1, args.rounds)
    med = {i: statistics.median(v) * 1e3 for i, v in times.items()}
    t_full = med[0]
    n, t = s.n_tokens, s.text_len
    lines = ["| kv_format | ratio (tokens) | step ms (median) | min ms | speedup | token bound (N+T)/(m+T) |",
             "|---|---|---|---|---|---|",
             f"| full compute | 1.000 | {t_full:.1f} | {min(times[0]) * 1e3:.1f} | 1.00 | 1.00 |"]
    xs, ys = [], []
    for i, (_, _, groups, _) in enumerate(configs[1:], start=1):
        m = statistics.mean(int(g.token_mask.sum()) for g in groups)
        xs.append(m / n)
        ys.append(med[i])
        lines.append(f"| {fmt} | {m / n:.3f} | {med[i]:.1f} | {min(times[i]) * 1e3:.1f} | "
                     f"{t_full / med[i]:.2f} | {(n + t) / (m + t):.2f} |")
    slope, intercept, r2 = _fit(xs, ys)
    lines += ["", f"Linear fit ({fmt}), step ms = slope * ratio + intercept: slope {slope:.1f} ms, "
                  f"intercept {intercept:.1f} ms, R^2 {r2:.4f} (intercept / full = {intercept / t_full:.3f})."]
    return lines


def run_text_sweep(args: argparse.Namespace, model: torch.nn.Module, ctrl: MaskAwareFlux) -> list[str]:
    """Speedup at one ratio vs text length: text tokens are always computed, so they set a floor."""
    lines = [f"| text tokens T | full ms | mask-aware ms (r={args.sweep_ratio}) | speedup | token bound |",
             "|---|---|---|---|---|"]
    for t in args.text_sweep:
        s = _setup(args, model, ctrl, t)
        masks = _masks(args, args.sweep_ratio)
        groups = [RowGroup(1, "masked", token_mask=mk, cache=c) for mk, c in zip(masks, s.caches)]
        _forward(s, None), _forward(s, groups)
        tf, tm = [], []
        for _ in range(args.sweep_rounds):
            tf.append(_forward(s, None)[0])
            tm.append(_forward(s, groups)[0])
        f, m_ = statistics.median(tf) * 1e3, statistics.median(tm) * 1e3
        m = statistics.mean(int(mk.sum()) for mk in masks)
        n = s.n_tokens
        lines.append(f"| {t} | {f:.1f} | {m_:.1f} | {f / m_:.2f} | {(n + t) / (m + t):.2f} |")
        log.info("text sweep T=%d: full %.1f ms, masked %.1f ms, speedup %.2f", t, f, m_, f / m_)
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--double", type=int, default=2)
    p.add_argument("--single", type=int, default=4)
    p.add_argument("--side", type=int, default=32, help="image tokens per side (32 -> 1024 tokens, 512x512 px)")
    p.add_argument("--text-len", type=int, default=64)
    p.add_argument("--joint-dim", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.05, 0.1, 0.2, 0.35, 0.5, 1.0])
    p.add_argument("--kv-formats", default="raw,roped")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--text-sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=[0, 128, 512])
    p.add_argument("--sweep-ratio", type=float, default=0.2)
    p.add_argument("--sweep-rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(_CLOCK), default=None,
                   help="cpu = thread CPU time (default with --threads 1: robust on a shared machine), wall otherwise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result tables (markdown) here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    args.clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu needs --threads 1 (intra-op worker threads are not counted)")
    torch.set_grad_enabled(False)

    model = build_flux_transformer(args.seed, num_layers=args.double, num_single_layers=args.single,
                                   attention_head_dim=args.head_dim, num_attention_heads=args.heads,
                                   joint_attention_dim=args.joint_dim, pooled_projection_dim=768)
    inner = args.heads * args.head_dim
    n = args.side * args.side
    fmts = [f for f in args.kv_formats.split(",") if f]
    header = [f"Command: `HF_HUB_OFFLINE=1 .venv/bin/python -m ops.bench_maskaware_flux {' '.join(sys.argv[1:])}`",
              "",
              f"Model: FluxTransformer2DModel, {args.double} double + {args.single} single blocks, inner dim {inner} "
              f"({args.heads} heads x {args.head_dim}), in/out channels 384/64 (Fill). Batch {args.batch} rows, "
              f"{n} image tokens ({args.side}x{args.side}), T = {args.text_len} text tokens, fp32, "
              f"torch threads {args.threads}, clock {args.clock}, {args.rounds} interleaved rounds (median).", ""]
    log.info("%s", " ".join(header))
    lines = list(header)
    for k, fmt in enumerate(fmts):     # one controller installed at a time; each run has its own baseline
        ctrl = MaskAwareFlux(model, kv_format=fmt)
        if k:
            lines += [""]
        lines += run_ratio_table(args, _setup(args, model, ctrl, args.text_len))
        if k == 0 and args.text_sweep:
            lines += ["", f"Text-length sweep at ratio {args.sweep_ratio} (kv_format={fmt}, "
                          f"{args.sweep_rounds} rounds, median):", ""]
            lines += run_text_sweep(args, model, ctrl)
        ctrl.remove()
    for line in lines:
        log.info("%s", line)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
