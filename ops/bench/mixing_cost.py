"""What mixing image sizes in one denoising step costs on this machine: the runner's step on batches
of one size, of two and four sizes together (one UNet call per size, in lockstep threads packing the
transformer blocks or one after the other: ``--modes``; the service's choice: ``mixed_size_calls``
in workers/engine/sd_runner.py), and the same jobs as separate steps.

Why: continuous batching's size affinity (``workers/engine/scheduler.py``) keeps a crowded batch to
few sizes because every size in a step is one more denoiser call; this measures that call's price,
so the scheduler's rule rests on a number of this machine and not on the fitted predictor alone;
and it chooses how the runner makes those calls on this kind of device (``mixed_size_calls``).

Each composition is the real ``SDRunner`` (``MaskAwareUNet``, a template cache recorded per size)
on mask-aware CFG jobs of the embedded trained SD model, timed as ``stencil profile`` times it
(one warm step, then ``--repeats`` steps; the process's CPU time with one torch thread, since the
lockstep threads compute one at a time), compositions in a shuffled order every round so drift of a
shared machine hits them alike; medians over the rounds.

    python -m ops.bench.mixing_cost --out docs/bench/mixing_cost.md
"""

from __future__ import annotations

import random
import statistics
import time

from ops.bench.harness import cli
from ops.bench.harness.runner_timing import JobSpec, RunnerTimer, load_model
from workers.engine.sd_runner import MIXED_SIZE_CALLS

BIG, OTHER = (16, 16), (16, 12)  # latent (h, w): 128x128 and 96x128 (width x height) pictures
SIZES = (BIG, OTHER, (12, 16), (8, 16))  # + 128x96 and 128x64: the mixed-size benchmark's four sizes


def compositions(n: int, ratio: float) -> dict[str, list[JobSpec]]:
    """n jobs of one size, n-1 + 1 and n/2 + n/2 mixed, and the parts of each mix alone."""
    def jobs(hw: tuple[int, int], k: int, first: int = 0) -> list[JobSpec]:
        return [JobSpec(ratio, True, "blob", 100 + first + i, hw) for i in range(k)]

    half, quarter = n // 2, max(n // 4, 1)
    fours = {f"{quarter} {k}": jobs(hw, quarter, 20 * i) for i, (k, hw) in enumerate(zip("ABCD", SIZES))}
    return {f"{n} A": jobs(BIG, n), f"{n - 1} A": jobs(BIG, n - 1), "1 B": jobs(OTHER, 1),
            f"{n - 1} A + 1 B": jobs(BIG, n - 1) + jobs(OTHER, 1), f"{half} A": jobs(BIG, half),
            f"{half} B": jobs(OTHER, half, 50), f"{half} A + {half} B": jobs(BIG, half) + jobs(OTHER, half, 50),
            **fours, " + ".join(fours): [j for part in fours.values() for j in part]}


def measure(timer: RunnerTimer, comps: dict[str, list[JobSpec]], modes: list[str], rounds: int, repeats: int,
            seed: int) -> dict[str, float]:
    """Median CPU milliseconds of one step of each composition; a composition that mixes sizes once
    per way of making its calls (``name [mode]``)."""
    runs = [(name, mode) for name, jobs in comps.items()
            for mode in (modes if len({j.latent_hw for j in jobs}) > 1 else [None])]
    samples: dict[tuple[str, str | None], list[float]] = {r: [] for r in runs}
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(runs)
        for name, mode in runs:
            if mode:  # one size: no per-size calls to make
                timer.runner.mixed_sizes = mode
            samples[(name, mode)] += timer.time_batch(comps[name], repeats)[1]
    return {(f"{name} [{mode}]" if mode else name): statistics.median(v) * 1e3
            for (name, mode), v in sorted(samples.items(), key=lambda kv: list(comps).index(kv[0][0]))}


def render(ms: dict[str, float], n: int, modes: list[str]) -> list[str]:
    half, quarter = n // 2, max(n // 4, 1)
    fours = [f"{quarter} {k}" for k in "ABCD"]
    mixes = [(f"{n - 1} A + 1 B", [f"{n - 1} A", "1 B"]), (f"{half} A + {half} B", [f"{half} A", f"{half} B"]),
             (" + ".join(fours), fours)]
    lines = ["| composition (A = 128x128, B = 96x128, C = 128x96, D = 128x64 (width x height), mask-aware CFG "
             "jobs) [calls per size] | CPU ms per step |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in ms.items()]
    lines.append("")
    for mixed, parts in mixes:
        apart = sum(ms[k] for k in parts)
        for mode in modes:
            one = ms[f"{mixed} [{mode}]"]
            lines.append(f"- {mixed} in one step, {mode}: {one:.1f} ms; the same jobs as {len(parts)} steps "
                         f"({', then '.join(parts)}): {apart:.1f} ms; mixing costs **{one - apart:+.1f} ms** "
                         f"({(one - apart) / apart * 100:+.1f}%).")
    for mode in modes:
        lines.append(f"- {mode}: one more job of the batch's size ({n - 1} A -> {n} A): "
                     f"{ms[f'{n} A'] - ms[f'{n - 1} A']:+.1f} ms; one job of another size beside them "
                     f"({n - 1} A -> {n - 1} A + 1 B): {ms[f'{n - 1} A + 1 B [{mode}]'] - ms[f'{n - 1} A']:+.1f} ms.")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/mixing_cost.md", seed=0)
    p.add_argument("--model", default="tiny", help="ops.bench.profile's model kind (tiny = the embedded default)")
    p.add_argument("--jobs", type=int, default=8, help="jobs per step (the service's max batch)")
    p.add_argument("--ratio", type=float, default=0.1, help="each job's mask ratio")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default=",".join(MIXED_SIZE_CALLS[1:]),
                   help="ways of making a mixed step's per-size calls to time (workers/engine/sd_runner.py)")
    run = cli.start(p, argv, __file__, quick=dict(jobs=4, rounds=1, repeats=1))
    args = run.args
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MIXED_SIZE_CALLS[1:]):
        p.error(f"--modes: a comma-separated subset of {MIXED_SIZE_CALLS[1:]}, got {args.modes!r}")
    t0, load_at_start = time.process_time(), cli.uptime()
    timer = RunnerTimer(load_model(args.model, None, args.seed), steps=(args.repeats + 1) * args.rounds + 1,
                        sizes=list(SIZES))
    ms = measure(timer, compositions(args.jobs, args.ratio), modes, args.rounds, args.repeats, args.seed)
    lines = ["# Mixing image sizes in one step: the cost of a call per size", "",
             f"Command: `{run.command}`. Load at start: {load_at_start}.", "",
             f"`SDRunner.step` on the embedded `{args.model}` model, mask ratio {args.ratio:g}, "
             f"{args.rounds} rounds x {args.repeats} steps per composition (after a warm step), CPU time of "
             "the process, 1 torch thread; medians.", "", *render(ms, args.jobs, modes), "",
             f"Total {time.process_time() - t0:.0f} CPU s; load at end: {cli.uptime()}."]
    run.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
