"""What each fidelity option costs per denoising step, side by side in one run, and the frontier.

The options of ``ops/bench/fidelity.py`` differ in which kind of step they run: ``full``
(full compute), ``masked`` (template cache as is), ``offset`` (template cache shifted by the
job's offset, ``runner_base.OffsetCache``) and ``refresh`` (full compute that records the job's
own activations and sets its offset). This measures each kind through the engine's runner
(``SDRunner`` / ``FluxRunner`` with the real controllers, a real warm-up cache, resident as after
prefetch) on the benchmark-size models of ``BENCHMARKS.md`` (UNet (320, 640) at 4096 tokens, CFG;
Flux 2 double + 4 single blocks, inner dim 512, 1024 tokens), interleaved over rounds, in thread
CPU time (1 thread: insensitive to other load). A job's denoising time under an option is the sum
over its schedule of ``steps`` steps; speedup = ``steps`` x full / that. With ``--fidelity JSON``
(``ops/bench/fidelity.py --json``) it writes the frontier: fidelity vs speedup per option.

    python -m ops.bench.policy_speed --families sd,flux --fidelity docs/bench/fidelity_sd.json \
        --out docs/bench/policy_speed.md
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

import torch

from ops.bench.harness import cli
from ops.bench.harness.edits import OPTIONS
from ops.bench.harness.policies import option_seconds
from ops.bench.harness.step_bench import Bench
from ops.bench.harness.timing import interleave

log = logging.getLogger(__name__)
KINDS = ("full", "masked", "offset", "refresh")


def measure(bench: Bench, ratio: float, rounds: int, per_kind: int) -> dict[str, float]:
    """Median per-step CPU seconds of each step kind at ``ratio``, interleaved over ``rounds``: a
    full job, a masked job, and a job anchored at step 0 (one refresh step, then offset steps)."""
    def steps(kind: str) -> dict[str, list[float]]:
        job = bench.job(ratio, "full" if kind == "full" else "masked", [0] if kind == "anchored" else [])
        if kind != "anchored":
            return {kind: [bench.step(job) for _ in range(per_kind)]}
        got = {"refresh": [bench.step(job)], "offset": [bench.step(job) for _ in range(per_kind)]}
        assert job.state.refresh_steps == 1 and job.state.delta is not None
        return got

    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    for per_round in interleave(rounds, ("full", "masked", "anchored"), steps).values():
        for got in per_round:
            for kind, seconds in got.items():
                samples[kind] += seconds
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/policy_speed.md", threads=None)
    p.add_argument("--families", default="sd,flux")
    p.add_argument("--ratios", default="0.2")
    p.add_argument("--steps", type=int, default=20, help="the schedule the options are evaluated on")
    p.add_argument("--warm-steps", type=int, default=6, help="steps recorded by the warm-up")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--per-kind", type=int, default=2, help="steps of each kind per round")
    p.add_argument("--fidelity", default="", help="ops/bench/fidelity.py --json output(s), comma-separated")
    p.add_argument("--resnets", default="full", help="full,masked: SD's ResNets on the whole map and/or at the "
                   "masked tokens too (workers/maskaware/resnets.py; options named option+resnets, as in "
                   "ops/bench/fidelity.py)")
    run = cli.start(p, argv, __file__, quick=dict(families="flux", warm_steps=2, rounds=1, per_kind=1))
    args = run.args
    torch.set_num_threads(1)  # thread CPU time counts all the work only with one thread
    torch.set_grad_enabled(False)
    lines = ["# Fidelity options: per-step cost and the fidelity/speed frontier\n",
             f"Command: `{run.command}`. Thread CPU time, 1 thread, median per step kind; warm-up of "
             f"{args.warm_steps} recorded steps; a job's time under an option is evaluated on a "
             f"{args.steps}-step schedule from the measured per-kind costs.\n",
             "| family | model | ratio | full ms | masked ms | offset ms | refresh ms | "
             + " | ".join(f"{o} speedup" for o in OPTIONS) + " | balanced keeps |",
             "|---|---|---|---|---|---|---|" + "---|" * len(OPTIONS) + "---|"]
    speed: dict[tuple[str, float], dict[str, float]] = {}  # (family, ratio) -> option (+resnets) -> speedup
    for family in args.families.split(","):
        for resnets in args.resnets.split(",") if family == "sd" else ["full"]:
            suffix = "+resnets" if resnets == "masked" else ""
            bench = Bench(family, args.warm_steps, args.seed, resnets=resnets)
            bench.warm()
            for ratio in (float(r) for r in args.ratios.split(",")):
                costs = measure(bench, ratio, args.rounds, args.per_kind)
                full_job = args.steps * costs["full"]
                ups = {name: full_job / option_seconds(costs, o, args.steps) for name, o in OPTIONS.items()}  # type: ignore[operator]
                speed.setdefault((family, ratio), {}).update({name + suffix: up for name, up in ups.items()})
                kept = (1 - 1 / ups["balanced"]) / (1 - 1 / ups["cache-as-is"])
                lines.append(f"| {family}{suffix} | {bench.shape} | {ratio:g} | "
                             + " | ".join(f"{costs[k] * 1e3:.0f}" for k in KINDS) + " | "
                             + " | ".join(f"{ups[o]:.2f}x" for o in OPTIONS) + f" | {kept:.0%} |")
                log.info("%s%s r=%g %s", family, suffix, ratio, {k: round(v * 1e3) for k, v in costs.items()})
    lines += ["", "`balanced keeps` = share of the per-job time that mask-aware compute without refresh "
              "(`cache-as-is`) saves which `balanced` still saves. `exact-region` runs masked steps only "
              "(plus one warm-up of its own per region, not counted). `sd+resnets`: the UNet's ResNets "
              "computed at the masked tokens too (`workers/maskaware/resnets.py`; its steps read the ResNets' "
              "outputs from the cache as well)."]
    if args.fidelity:
        lines += ["", *frontier(args.fidelity.split(","), speed)]
    lines.append(f"\n({run.elapsed():.0f} s)")
    run.write(lines)
    return 0


def frontier(paths: list[str], speed: dict[tuple[str, float], dict[str, float]]) -> list[str]:
    """Fidelity (mean over traces) next to the speedup at the measured ratio, per option."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows += json.loads(Path(path).read_text())["summary"]
    out = ["## Frontier: fidelity vs speedup per option\n",
           "Fidelity: mean over the traces' edits of `ops/bench/fidelity.py` (trained models, 20 steps); "
           "speedup: per-job denoising time at the first measured ratio above.\n",
           "| family | guidance | option | SSIM | SSIM in mask | PSNR dB | speedup |", "|---|---|---|---|---|---|---|"]
    for fam in sorted({r["family"] for r in rows}):
        ups = next((v for (f, _r), v in speed.items() if f == fam), None)
        for g in sorted({r["guidance"] for r in rows if r["family"] == fam}):
            for opt in [o + suffix for suffix in ("", "+resnets") for o in OPTIONS]:
                sel = [r for r in rows if r["family"] == fam and r["guidance"] == g and r["option"] == opt]
                if not sel:
                    continue
                n = sum(r["edits"] for r in sel)
                mean = {c: sum(r[c] * r["edits"] for r in sel) / n for c in ("ssim", "ssim_masked", "psnr")}
                up = f"{ups[opt]:.2f}x" if ups and opt in ups else "n/a"
                out.append(f"| {fam} | {g:g} | {opt} | {mean['ssim']:.3f} | {mean['ssim_masked']:.3f} | "
                           f"{mean['psnr']:.1f} | {up} |")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
