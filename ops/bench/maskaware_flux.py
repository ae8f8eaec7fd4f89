"""Benchmark: one Flux transformer forward (= one denoising step), mask-aware vs full compute.

Same model, same batch (``--batch`` rows, each its own job: own mask, cache, timestep, guidance),
a Flux-architecture ``FluxTransformer2DModel`` of the real class with Flux's head dim (128) and
Fill channel layout. Caches come from a real record-mode warm-up forward of the same inputs
(never zero-filled); masks are blobs and rectangles of the requested token ratio (never raster
prefixes). Configurations are timed interleaved, round-robin, and medians are reported, because
this machine is shared. Every run first checks masked-token outputs against full compute (aborts
above ``--tol``). Also reported: speedup against the stock forward and against the mask-aware code
at ratio 1 (same packed code, every token computed: isolates what skipping tokens buys), the
token-count bound ``(N + T) / (m + T)`` (text tokens are always computed), a least-squares line of
step time vs ratio, and a text-length sweep.

    python -m ops.bench.maskaware_flux --threads 1 --clock cpu --out /tmp/fbench.md
    # 4096 image tokens (64x64 = 1024x1024 px, real Flux's count at that size):
    python -m ops.bench.maskaware_flux --side 64 --kv-formats raw --text-sweep ""
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from ops.bench.harness import cli
from ops.bench.harness.models import build_flux, flux_image_ids
from ops.bench.harness.timing import CLOCKS, interleave, linear_fit, paired
from workers.maskaware.flux import MaskAwareFlux, RowGroup
from workers.maskaware.flux_tokens import synthetic_token_grid

log = logging.getLogger(__name__)


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
    return dict(
        hidden_states=torch.randn(b, n, 384, generator=g),
        encoder_hidden_states=torch.randn(b, text_len, args.joint_dim, generator=g),
        pooled_projections=torch.randn(b, 768, generator=g),
        timestep=torch.linspace(0.9, 0.3, b),            # every row at its own step
        guidance=torch.linspace(30.0, 3.5, b),
        img_ids=flux_image_ids(side),
        txt_ids=torch.zeros(text_len, 3),
    )


def _setup(args: argparse.Namespace, model: torch.nn.Module, ctrl: MaskAwareFlux, text_len: int,
           row_group: type = RowGroup) -> Setup:
    kwargs = _inputs(args, text_len)
    with ctrl.batch([row_group(1, "record") for _ in range(args.batch)]) as ctx:   # real warm-up
        model(**kwargs)
    return Setup(model, ctrl, kwargs, list(ctx.recorded), args.side * args.side, text_len, CLOCKS[args.clock])


def _check(out: torch.Tensor, full_out: torch.Tensor, masks: list[torch.Tensor], tol: float, where: str) -> float:
    """Max |masked - full| at the masked tokens; above ``tol`` the run aborts (the masked path is wrong)."""
    err = max(float((out[k] - full_out[k])[m].abs().max()) if m.any() else 0.0 for k, m in enumerate(masks))
    if not err <= tol:
        raise RuntimeError(f"mask-aware output differs from full compute by {err:.3e} at {where}")
    return err


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


def run_ratio_table(args: argparse.Namespace, s: Setup) -> list[str]:
    """Round-robin timing of full compute and every ratio; returns markdown lines."""
    fmt = s.ctrl.kv_format
    configs: list[tuple[str, float, list[RowGroup] | None, Setup]] = [("full", 1.0, None, s)]
    for r in args.ratios:
        groups = [RowGroup(1, "masked", token_mask=m, cache=c) for m, c in zip(_masks(args, r), s.caches)]
        configs.append((fmt, r, groups, s))
    full_out = _forward(s, None)[1]
    worst = 0.0
    for i, (fmt, r, groups, fs) in enumerate(configs):        # untimed pass: allocator, correctness
        out = _forward(fs, groups)[1]
        if groups is not None:
            err = _check(out, full_out, [g.token_mask for g in groups], args.tol, f"r={r}")
            log.info("check %s r=%.2f: max |masked - full| at masked tokens = %.2e", fmt, r, err)
            worst = max(worst, err)
    times = interleave(args.rounds, range(len(configs)), lambda i: _forward(configs[i][3], configs[i][2])[0])
    med = {i: statistics.median(v) * 1e3 for i, v in times.items()}
    t_full = med[0]
    n, t = s.n_tokens, s.text_len
    # The mask-aware path at ratio 1 (every token computed through the same packed code) is a second
    # reference: time(r=1) / time(r) isolates what skipping tokens buys from how the packed code
    # compares with the stock forward.
    packed_full = next((med[i] for i, c in enumerate(configs) if c[2] is not None and c[1] >= 1.0), None)
    lines = ["| kv_format | ratio (tokens) | step ms (median) | min ms | speedup vs stock full | "
             "speedup vs own r=1 | token bound (N+T)/(m+T) |",
             "|---|---|---|---|---|---|---|",
             f"| full compute (stock) | 1.000 | {t_full:.1f} | {min(times[0]) * 1e3:.1f} | 1.00 | - | 1.00 |"]
    xs, ys = [], []
    for i, (_, _, groups, _) in enumerate(configs[1:], start=1):
        m = statistics.mean(int(g.token_mask.sum()) for g in groups)
        xs.append(m / n)
        ys.append(med[i])
        own = f"{packed_full / med[i]:.2f}" if packed_full else "-"
        lines.append(f"| {fmt} | {m / n:.3f} | {med[i]:.1f} | {min(times[i]) * 1e3:.1f} | "
                     f"{t_full / med[i]:.2f} | {own} | {(n + t) / (m + t):.2f} |")
    slope, intercept, r2 = linear_fit(xs, ys)
    lines += ["", f"Linear fit ({fmt}), step ms = slope * ratio + intercept: slope {slope:.1f} ms, "
                  f"intercept {intercept:.1f} ms, R^2 {r2:.4f} (intercept / full = {intercept / t_full:.3f}). "
                  f"Max |mask-aware - full| at masked tokens, all ratios: {worst:.2e}."]
    return lines


def run_text_sweep(args: argparse.Namespace, model: torch.nn.Module, ctrl: MaskAwareFlux) -> list[str]:
    """Speedup at one ratio vs text length: text tokens are always computed, so they set a floor."""
    lines = [f"| text tokens T | full ms | mask-aware ms (r={args.sweep_ratio}) | speedup | token bound |",
             "|---|---|---|---|---|"]
    for t in args.text_sweep:
        s = _setup(args, model, ctrl, t)
        masks = _masks(args, args.sweep_ratio)
        groups = [RowGroup(1, "masked", token_mask=mk, cache=c) for mk, c in zip(masks, s.caches)]
        _check(_forward(s, groups)[1], _forward(s, None)[1], masks, args.tol, f"T={t}")
        got = interleave(args.sweep_rounds, (None, 0), lambda k: _forward(s, None if k is None else groups)[0])
        f, m_ = statistics.median(got[None]) * 1e3, statistics.median(got[0]) * 1e3
        m = statistics.mean(int(mk.sum()) for mk in masks)
        n = s.n_tokens
        lines.append(f"| {t} | {f:.1f} | {m_:.1f} | {f / m_:.2f} | {(n + t) / (m + t):.2f} |")
        log.info("text sweep T=%d: full %.1f ms, masked %.1f ms, speedup %.2f", t, f, m_, f / m_)
    return lines


def _load_impl(path: str) -> ModuleType:
    """Another implementation of ``workers/maskaware/flux.py`` (e.g. an older commit's), as its own module."""
    spec = importlib.util.spec_from_file_location("bench_flux_baseline_impl", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def run_ab(args: argparse.Namespace, model: torch.nn.Module, fmt: str) -> list[str]:
    """Paired A/B: the same step on two identical models (same seed), one with the baseline
    implementation's hooks, one with this one's, timed alternately (stock full, A, B per round) so
    both see the same machine load; per-round ratios, medians reported."""
    impl = _load_impl(args.ab)
    model_a = _model(args)
    ctrl_a = impl.MaskAwareFlux(model_a, kv_format=fmt)
    ctrl_b = MaskAwareFlux(model, kv_format=fmt)
    sa = _setup(args, model_a, ctrl_a, args.text_len, impl.RowGroup)
    sb = _setup(args, model, ctrl_b, args.text_len)
    lines = [f"Paired A/B, kv_format={fmt}: A = `{args.ab}`, B = this tree; {args.rounds} rounds of "
             "(stock full, A, B) per ratio, medians of per-round values.", "",
             "| ratio | full ms | A ms | B ms | A speedup | B speedup | B time / A time |",
             "|---|---|---|---|---|---|---|"]
    full_out = _forward(sb, None)[1]
    for r in args.ratios:
        masks = _masks(args, r)
        ga = [impl.RowGroup(1, "masked", token_mask=m, cache=c) for m, c in zip(masks, sa.caches)]
        gb = [RowGroup(1, "masked", token_mask=m, cache=c) for m, c in zip(masks, sb.caches)]
        for s_, g in ((sa, ga), (sb, gb)):
            _check(_forward(s_, g)[1], full_out, masks, args.tol, f"A/B r={r}")
        runs = {"full": (sb, None), "A": (sa, ga), "B": (sb, gb)}
        t = interleave(args.rounds, tuple(runs), lambda k: _forward(*runs[k])[0])
        med = statistics.median
        m_ = statistics.mean(int(m.sum()) for m in masks) / sa.n_tokens
        lines.append(f"| {m_:.3f} | " + " | ".join(f"{med(t[k]) * 1e3:.1f}" for k in runs) + " | "
                     f"{paired(t['full'], t['A']):.2f} | {paired(t['full'], t['B']):.2f} | "
                     f"{paired(t['B'], t['A']):.3f} |")
        log.info("A/B r=%.2f done", r)
    ctrl_a.remove()
    ctrl_b.remove()
    return lines


def _model(args: argparse.Namespace) -> torch.nn.Module:
    return build_flux(args.seed, double=args.double, single=args.single, heads=args.heads, head_dim=args.head_dim,
                      joint_dim=args.joint_dim)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="", clock="auto")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--double", type=int, default=2)
    p.add_argument("--single", type=int, default=4)
    p.add_argument("--side", type=int, default=32, help="image tokens per side (32 -> 1024 tokens, 512x512 px)")
    p.add_argument("--text-len", type=int, default=64)
    p.add_argument("--joint-dim", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--ratios", default="0.05,0.1,0.2,0.35,0.5,1.0")
    p.add_argument("--kv-formats", default="raw,roped")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--text-sweep", default="0,128,512", help="comma-separated text lengths ('' = no sweep)")
    p.add_argument("--sweep-ratio", type=float, default=0.2)
    p.add_argument("--sweep-rounds", type=int, default=3)
    p.add_argument("--tol", type=float, default=1e-4,
                   help="abort if masked-token outputs differ from full compute by more than this")
    p.add_argument("--ab", default=None, metavar="FLUX_PY",
                   help="instead of the tables: paired A/B against another flux.py, e.g. "
                        "`git show 2c0d50d:workers/maskaware/flux.py > /tmp/flux_prev.py`")
    run = cli.start(p, argv, __file__, quick=dict(heads=2, head_dim=32, single=1, double=1, side=8, text_len=8,
                                                  joint_dim=64, ratios="0.2,1.0", rounds=1, kv_formats="raw",
                                                  text_sweep="8", sweep_rounds=1))
    args = run.args
    args.ratios = [float(x) for x in args.ratios.split(",")]
    args.text_sweep = [int(x) for x in args.text_sweep.split(",") if x]
    torch.set_grad_enabled(False)
    model = _model(args)
    inner = args.heads * args.head_dim
    n = args.side * args.side
    fmts = [f for f in args.kv_formats.split(",") if f]
    header = [f"Command: `{run.command}`", "",
              f"Model: FluxTransformer2DModel, {args.double} double + {args.single} single blocks, inner dim {inner} "
              f"({args.heads} heads x {args.head_dim}), in/out channels 384/64 (Fill). Batch {args.batch} rows, "
              f"{n} image tokens ({args.side}x{args.side}), T = {args.text_len} text tokens, fp32, "
              f"torch threads {args.threads}, clock {args.clock}, {args.rounds} interleaved rounds (median).", ""]
    log.info("%s", " ".join(header))
    lines = list(header)
    if args.ab:
        for k, fmt in enumerate(fmts):
            lines += ([""] if k else []) + run_ab(args, model, fmt)
        fmts = []
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
    run.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
