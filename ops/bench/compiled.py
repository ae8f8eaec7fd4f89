"""Compiled vs eager denoising steps (``STENCIL_COMPILE``), full and mask-aware, side by side in one run.

Per model (an SD-architecture inpainting UNet; ``--models``: a tiny one and a mid-size one), one
CFG job per step:

- full step: the UNet forward, eager vs ``torch.compile(dynamic=True)`` (what ``SDRunner`` runs for a
  step without mask-aware work when ``STENCIL_COMPILE`` is on);
- mask-aware step: the masked tokens against a real recorded cache at ``--ratio``, with the packed
  per-block computations eager vs compiled (``MaskAwareUNet(compile=...)``).

Compilation (the first call of each compiled path) is timed separately; then each of the four
configurations runs once per round, interleaved in a shuffled order, CPU time of the one compute
thread. Outputs of the compiled paths are compared with eager (max abs difference).

    python -m ops.bench.compiled --out docs/bench/compiled.md
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch

from ops.bench.harness import cli
from ops.bench.harness.models import build_sd_unet, job_masks
from ops.bench.harness.timing import interleave, median
from workers.compiled import BlockKernels, Compiled
from workers.maskaware.unet import MaskAwareUNet, RowGroup

log = logging.getLogger(__name__)
CONFIGS = ("full-eager", "full-compiled", "masked-eager", "masked-compiled")
NAN = float("nan")


def bench_model(hidden: tuple[int, ...], latent: int, args: Any) -> dict[str, Any]:
    """Compile times, per-configuration step times and output differences for one UNet."""
    unet = build_sd_unet(hidden, latent, 1, 1, 768 if hidden[0] >= 320 else 32, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(2, 9, latent, latent, generator=g)
    t = torch.tensor([500, 500])
    e = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    ctrl = MaskAwareUNet(unet)
    eager_k, compiled_k = ctrl.kernels, ctrl.block_kernels(args.mode)
    full_c = Compiled(unet, "UNet forward", args.mode)
    out: dict[str, Any] = {"hidden": hidden, "latent": latent,
                           "params_m": sum(p.numel() for p in unet.parameters()) / 1e6}
    with torch.no_grad():
        with ctrl.batch([RowGroup(2, "record")]) as ctx:
            ref_full = unet(x, t, e, return_dict=False)[0]
        cache = ctx.recorded[0]
        masks = {r: job_masks(ctrl, r, 1, latent, 8, args.seed)[0] for r in (args.ratio, args.ratio2)}

        def masked(kernels: BlockKernels, ratio: float) -> torch.Tensor:
            ctrl.kernels = kernels
            with ctrl.batch([RowGroup(2, "masked", token_mask=masks[ratio], cache=cache)]):
                return unet(x, t, e, return_dict=False)[0]

        ref_masked = masked(eager_k, args.ratio)
        paths = args.paths.split(",")
        configs = [c for c in CONFIGS if c.split("-")[0] in paths]
        out["compile_full_s"], out["diff_full"] = NAN, NAN
        if "full" in paths:
            start = time.perf_counter()
            got_full = full_c(x, t, e, return_dict=False)[0]
            out["compile_full_s"] = time.perf_counter() - start
            out["diff_full"] = float((got_full - ref_full).abs().max())
        start = time.perf_counter()
        got_masked = masked(compiled_k, args.ratio)
        out["compile_masked_s"] = time.perf_counter() - start
        start = time.perf_counter()
        masked(compiled_k, args.ratio2)  # another token count: dynamic shapes, no new graph expected
        out["other_ratio_first_call_s"] = time.perf_counter() - start
        out["diff_masked"] = float((got_masked - ref_masked).abs().max())
        out["eager_fallbacks"] = [c.name for c in (full_c, *compiled_k.compiled()) if c.failed]
        runs = {"full-eager": lambda: unet(x, t, e, return_dict=False),
                "full-compiled": lambda: full_c(x, t, e, return_dict=False),
                "masked-eager": lambda: masked(eager_k, args.ratio),
                "masked-compiled": lambda: masked(compiled_k, args.ratio)}

        def measure(name: str) -> float:
            start = time.thread_time()
            runs[name]()
            return time.thread_time() - start

        samples = interleave(args.rounds, configs, measure, rng=random.Random(args.seed), label=f"{hidden} ")
    ctrl.kernels = eager_k
    ctrl.remove()
    out["seconds"] = {k: median(samples.get(k, [])) for k in CONFIGS}
    out["samples"] = samples
    return out


def report(run: cli.Run, results: list[dict[str, Any]]) -> list[str]:
    args = run.args
    lines = [
        "# Compiled vs eager denoising steps\n",
        f"Command: `{run.command}` ({run.elapsed():.0f} s){' - QUICK: smoke run' if args.quick else ''}. "
        f"`torch.compile(dynamic=True, mode={args.mode!r})` (inductor), torch {torch.__version__}, one thread, "
        f"CPU time of the compute thread, median of {args.rounds} interleaved rounds; one CFG job (2 rows) "
        f"per step, mask-aware steps at mask ratio {args.ratio} against a recorded cache.\n",
        "| UNet (params) | tokens | full eager (s) | full compiled (s) | full speedup | masked eager (s) "
        "| masked compiled (s) | masked speedup | compile: full (s) | compile: packed (s) "
        "| first call at ratio %s (s) | max abs diff full / masked |" % args.ratio2,
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["seconds"]
        lines.append(
            f"| {tuple(r['hidden'])} ({r['params_m']:.0f} M) | {r['latent'] ** 2} | {s['full-eager']:.4f} "
            f"| {s['full-compiled']:.4f} | {s['full-eager'] / s['full-compiled']:.2f}x | {s['masked-eager']:.4f} "
            f"| {s['masked-compiled']:.4f} | {s['masked-eager'] / s['masked-compiled']:.2f}x "
            f"| {r['compile_full_s']:.1f} | {r['compile_masked_s']:.1f} | {r['other_ratio_first_call_s']:.2f} "
            f"| {r['diff_full']:.1e} / {r['diff_masked']:.1e} |")
    fallbacks = sorted({n for r in results for n in r["eager_fallbacks"]})
    lines += ["", f"Eager fallbacks (compilation failed): {', '.join(fallbacks) if fallbacks else 'none'}.", "",
              "Compile times are wall time of the first call (inductor generates and builds C++ kernels; "
              "a warm inductor cache on disk shortens later starts). The 'first call at another ratio' column "
              "shows whether a new token count recompiled (dynamic shapes: it should cost about one step).", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/compiled.md")
    p.add_argument("--models", default="32,64@16;320,640@64",
                   help="UNet block widths @ latent side, ';'-separated")
    p.add_argument("--mode", default="default", help="STENCIL_COMPILE mode to measure")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--ratio2", type=float, default=0.35)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--paths", default="full,masked", help="full and/or masked")
    # quick: the packed (mask-aware) path only; compiling a whole UNet takes minutes on a cold cache
    run = cli.start(p, argv, __file__, quick=dict(models="32,32@8", rounds=1, paths="masked"))
    args = run.args
    results = []
    for spec in args.models.split(";"):
        widths, latent = spec.split("@")
        results.append(bench_model(tuple(int(w) for w in widths.split(",")), int(latent), args))
    run.write(report(run, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
