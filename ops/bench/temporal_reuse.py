"""Temporal reuse (``turbo``) on the fidelity/speed frontier beside ``fast``, ``balanced`` and the
step-reuse baselines, side by side in one run.

Options (every one from the template's warm-up, 2 refresh steps unless named otherwise):
- ``fast``, ``balanced``: the policies of ``app/fidelity.py`` (every masked token every step);
- ``turbo``: masked patches reused from the job's last step where the shipped forest says so
  (``workers/maskaware/reuse_rule.py``);
- ``turbo-threshold``: the same mechanism with the plain threshold rule (last measured error < tau);
- ``fixed-interval``: FORA/DeepCache-style, every masked patch of every unit reused every other step;
- ``step-skip``: TeaCache-style, a whole denoiser call skipped (the last output reused) while the
  latents' accumulated relative L1 change since the last computed step stays below ``delta``.

Per model family (``--families``: the trained SD and Flux Fill models, each with its own rule):
part 1, fidelity (128 px, the traces' masks, guidance 1 / 3 / 7.5, 20 and 50 steps): whole-image
and in-mask SSIM against the edit's full compute, the share of (step, unit, patch) computations
reused (skipped steps count every unit), and the thread CPU time of the masked steps. Part 2,
speed at scale (the benchmark-size models of ``policy_speed``: a (320, 640) UNet at 4096 tokens
with CFG; Flux with 2 + 4 blocks, inner 512, 1024 tokens; a real warm-up, resident): a masked
step's thread CPU time, whole step and masked work, at reused shares from 0 to everything; each
option's speed-up over ``fast`` at the share it reached in part 1 (interpolated between measured
shares; on models this small part 1's own times are mostly per-call overhead). The masked work
is the UNet's transformer units (the step's CPU time times their share of its wall time: ResNets
run on the full map) and Flux's whole transformer call (its text tokens included, never reused).

    python -m ops.bench.temporal_reuse --edits 3 --out docs/bench/temporal_reuse.md
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.jobs import JobParams
from ops.bench.harness import cli
from ops.bench.harness.dispatch import DispatchCounter
from ops.bench.harness.edits import OPTIONS, TRACE_NAMES, Family, edit, metrics, trace_edits
from ops.bench.harness.step_bench import Bench
from workers.maskaware.reuse_rule import ThresholdRule, default_rule

log = logging.getLogger(__name__)


class AlwaysReuse:
    """Fixed interval (FORA / DeepCache): every patch reused whenever allowed (every other step)."""

    name = "fixed-interval"

    def reuse(self, features: np.ndarray) -> np.ndarray:
        return np.ones(len(features), bool)


class ShareRule:
    """Reuses a fixed share of the patches allowed (deterministic): part 2's cost points."""

    name = "share"

    def __init__(self, share: float, seed: int = 0) -> None:
        self.share, self.rng = share, np.random.default_rng(seed)

    def reuse(self, features: np.ndarray) -> np.ndarray:
        return self.rng.random(len(features)) < self.share


class StepSkip:
    """TeaCache-style whole-step reuse around a runner's denoiser call (one job at a time)."""

    def __init__(self, runner: Any, delta: float) -> None:
        self.runner, self.inner, self.delta = runner, runner._forward, delta
        self.prev: tuple[torch.Tensor, Any] | None = None
        self.acc, self.skipped, self.calls = 0.0, 0, 0

    def __call__(self, batch: list, groups: list | None) -> Any:
        job = batch[0]
        st, step = job.state, job.steps_done
        x = st.latents
        masked = groups is not None and getattr(groups[0], "mode", "") == "masked"
        self.calls += 1
        if masked and self.prev is not None and step < job.total_steps - 1:
            px, out = self.prev
            self.acc += float((x - px).abs().mean() / px.abs().mean().clamp_min(1e-12))
            if self.acc < self.delta:
                self.skipped += 1
                return out, [None]
        out, recorded = self.inner(batch, groups)
        self.prev, self.acc = ((x.clone(), out.clone()) if masked or recorded else None), 0.0
        return out, recorded


class StepClock:
    """Thread CPU seconds of each runner step, by step index (wraps ``runner.step``)."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.inner = runner, runner.step
        self.seconds: dict[int, float] = {}
        runner.step = self

    def __call__(self, batch: list) -> None:
        t0 = time.thread_time()
        self.inner(batch)
        self.seconds[batch[0].steps_done] = time.thread_time() - t0

    def remove(self) -> None:
        self.runner.step = self.inner


class CallClock:
    """Thread CPU seconds of a runner's denoiser calls (wraps ``runner._forward``)."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.inner = runner, runner._forward
        self.seconds = 0.0
        runner._forward = self

    def __call__(self, batch: list, groups: list | None) -> Any:
        t0 = time.thread_time()
        try:
            return self.inner(batch, groups)
        finally:
            self.seconds += time.thread_time() - t0

    def remove(self) -> None:
        self.runner._forward = self.inner


def options(family: str, tau: float, delta: float) -> dict[str, dict[str, Any]]:
    return {"fast": {"option": "fast"}, "balanced": {"option": "balanced"},
            "turbo": {"option": "turbo", "rule": default_rule(family)},
            "turbo-threshold": {"option": "turbo", "rule": ThresholdRule(tau)},
            "fixed-interval": {"option": "turbo", "rule": AlwaysReuse()},
            "step-skip": {"option": "fast", "skip": delta}}


def run_option(fam: Family, spec: dict[str, Any], img: Any, mask: np.ndarray, params: JobParams,
               key: Any) -> dict[str, Any]:
    runner = fam.runner_ma
    runner.reuse_rule = spec.get("rule")
    skip = StepSkip(runner, spec["skip"]) if "skip" in spec else None
    if skip is not None:
        runner._forward = skip
    clock = StepClock(runner)
    try:
        out = edit(fam, OPTIONS[spec["option"]], img, mask, params, key)
    finally:
        clock.remove()
        if skip is not None:
            runner._forward = skip.inner
        runner.reuse_rule = None
    refresh = set(OPTIONS[spec["option"]].schedule(params.steps))
    masked_s = sum(s for k, s in clock.seconds.items() if k not in refresh)
    if skip is not None:
        share = skip.skipped / max(1, params.steps - len(refresh))
    else:
        share = out["reused_share"] or 0.0
    return {"latents": out["latents"], "share": float(share), "masked_s": masked_s}


def fidelity_part(args: Any, family: str) -> list[dict[str, Any]]:
    fam = Family(family)
    rng = np.random.default_rng(args.seed)
    specs = options(family, args.tau, args.delta)
    rows = []
    for steps in [int(s) for s in args.steps.split(",")]:
        n_edits = args.edits if steps <= 20 else max(1, args.edits - 1)
        for g in [float(x) for x in args.guidance.split(",")]:
            templates, keys = fam.warmed_templates(steps, g)
            for trace in args.traces.split(","):
                for _k, mask, t, params in trace_edits(rng, trace, n_edits, fam.size, len(templates), steps, g):
                    tensors, meta = fam.prepare(templates[t], mask, params)
                    full = fam.full(tensors, meta)
                    pixel = tensors["pixel_mask"].bool().numpy()
                    for name, spec in specs.items():
                        got = run_option(fam, spec, templates[t], mask, params, keys[t])
                        m = metrics(full, fam.decode(got["latents"]), pixel)
                        rows.append({"family": family, "option": name, "steps": steps, "guidance": g, "trace": trace,
                                     "ratio": float(pixel.mean()), "ssim": m["ssim"],
                                     "ssim_masked": m.get("ssim_masked", float("nan")),
                                     "share": got["share"], "masked_s": got["masked_s"]})
            log.info("fidelity %s: %d steps, guidance %g done (%d rows)", family, steps, g, len(rows))
    return rows


def speed_part(args: Any, family: str) -> list[dict[str, Any]]:
    """Masked-step CPU seconds on the family's benchmark-size model at reused shares (module doc)."""
    bench = Bench(family, args.speed_steps)
    bench.warm()
    out = []
    for q in [float(x) for x in args.shares.split(",")]:
        whole, walls, units, shares, kernels = [], [], [], [], []
        clock = CallClock(bench.runner)
        for rnd in range(args.rounds + 1):  # the last round untimed: operators per masked step
            bench.runner.reuse_rule = ShareRule(q)
            job = bench.job(args.ratio, "masked", [0])  # anchored at step 0; as turbo where q > 0:
            meta = dict(bench.meta, cache_mode="masked", cache_key=bench.key.to_dict(), refresh_steps=[0],
                        temporal_reuse=q > 0)
            job.state = bench.runner.init_state(bench.tensors(args.ratio), meta)
            bench.step(job)  # the refresh
            if rnd == args.rounds:
                for _ in range(args.speed_steps - 2):
                    with DispatchCounter() as counter:
                        bench.step(job)
                    kernels.append(counter.kernels)
                continue
            for _ in range(args.speed_steps - 2):
                t0, call0 = time.perf_counter(), clock.seconds
                whole.append(bench.step(job))
                walls.append(time.perf_counter() - t0)
                if family == "sd":  # unit times are wall clock: scaled to the step's CPU time
                    ctx = bench.runner.last_ctx
                    units.append(whole[-1] * sum(ctx.unit_seconds.values()) / walls[-1] if ctx is not None
                                 else float("nan"))
                else:  # Flux: the whole transformer call
                    units.append(clock.seconds - call0)
            shares.append(job.state.reuse.share if job.state.reuse is not None else 0.0)
        clock.remove()
        bench.runner.reuse_rule = None
        out.append({"family": family, "q": q, "share": statistics.mean(shares), "step_s": statistics.mean(whole),
                    "units_s": statistics.mean(units), "kernels": statistics.mean(kernels)})
        log.info("speed %s: rule share %.2f -> reused %.3f, step %.4f s, masked work %.4f s, %.0f operators", family,
                 q, out[-1]["share"], out[-1]["step_s"], out[-1]["units_s"], out[-1]["kernels"])
    return out


def at_share(points: list[dict[str, Any]], share: float, key: str) -> float:
    xs = [p["share"] for p in points]
    ys = [p[key] for p in points]
    order = np.argsort(xs)
    return float(np.interp(share, np.asarray(xs)[order], np.asarray(ys)[order]))


FAMILY_NAMES = {"sd": "SD (trained tiny SD inpainting)", "flux": "Flux Fill (trained tiny Flux Fill)"}
MASKED_WORK = {"sd": "transformer units", "flux": "transformer call"}


def render(rows: list[dict[str, Any]], speed: list[dict[str, Any]], args: Any, command: str, elapsed: float) -> str:
    lines = ["# Temporal reuse: the fidelity/speed frontier\n",
             f"Command: `{command}`; {time.strftime('%Y-%m-%d')}, CPU, 1 torch thread, {elapsed:.0f} s. "
             f"Threshold rule tau {args.tau}, step-skip delta {args.delta}.\n",
             "SSIM: whole image (and in the mask) against the same edit's full compute; reused: share of the "
             "(step, unit, patch) computations of the masked steps taken from the last step (step-skip: share "
             "of masked steps skipped); speed-up over `fast`: masked steps at the benchmark-size model's measured "
             "cost at that share, whole step and the masked work (SD: the transformer units, whose share of a "
             "step the ResNets' full-map work bounds; Flux: the transformer call, text tokens included).\n"]
    for family in dict.fromkeys(r["family"] for r in rows):
        lines += [f"\n# {FAMILY_NAMES.get(family, family)}\n",
                  f"Shipped rule: `{default_rule(family).about.get('command', '')}`.\n"]
        lines += _family_tables([r for r in rows if r["family"] == family],
                                [p for p in speed if p["family"] == family], args, family)
    return "\n".join(lines) + "\n"


def _family_tables(rows: list[dict[str, Any]], speed: list[dict[str, Any]], args: Any, family: str) -> list[str]:
    lines: list[str] = []
    fast_points = speed[0] if speed else None
    for steps in sorted({r["steps"] for r in rows}):
        lines += [f"\n## {steps} steps\n",
                  "| option | guidance | SSIM | SSIM in mask | SSIM vs fast | reused | speed-up, step | "
                  "speed-up, masked work |", "|---|---|---|---|---|---|---|---|"]
        for g in sorted({r["guidance"] for r in rows}):
            sel = [r for r in rows if r["steps"] == steps and r["guidance"] == g]
            fast_ssim = statistics.mean(r["ssim"] for r in sel if r["option"] == "fast")
            for name in dict.fromkeys(r["option"] for r in sel):
                rs = [r for r in sel if r["option"] == name]
                ssim = statistics.mean(r["ssim"] for r in rs)
                share = statistics.mean(r["share"] for r in rs)
                speed_step = speed_units = "-"
                if fast_points is not None and name != "balanced":
                    if name == "step-skip":  # a skipped step costs nothing
                        speed_step = speed_units = f"{1 / max(1e-9, 1 - share):.2f}x"
                    else:
                        speed_step = f"{fast_points['step_s'] / at_share(speed, share, 'step_s'):.2f}x"
                        speed_units = f"{fast_points['units_s'] / at_share(speed, share, 'units_s'):.2f}x"
                lines.append(f"| {name} | {g:g} | {ssim:.4f} | {statistics.mean(r['ssim_masked'] for r in rs):.4f} | "
                             f"{ssim - fast_ssim:+.4f} | {share:.3f} | {speed_step} | {speed_units} |")
    if speed:
        shape = Bench.SHAPES[family]
        lines += ["\n## Masked step cost at scale by reused share\n",
                  f"{shape}, mask ratio {args.ratio}, {args.rounds} rounds of {args.speed_steps - 2} masked steps; "
                  "thread CPU seconds per step; kernel-launching operators per masked step (one more round, "
                  "untimed: on a GPU each is a launch the host pays for while steps run eagerly).\n",
                  f"| reused share | step (s) | {MASKED_WORK[family]} (s) | operators per step | vs `fast` |",
                  "|---|---|---|---|---|"]
        lines += [f"| {p['share']:.3f} | {p['step_s']:.4f} | {p['units_s']:.4f} | {p['kernels']:.0f} | "
                  f"{p['kernels'] / speed[0]['kernels']:.2f}x |" for p in speed]
    rule = default_rule(family)
    about = rule.about
    lines += ["\n## The shipped rule on held-out edits\n",
              f"{about.get('runs', '?')} recorded runs, {about.get('train_samples', '?')} training and "
              f"{about.get('held_out_samples', '?')} held-out decisions (tau {rule.tau}, cut {rule.cut}).\n",
              "| rule | accuracy | reuse share | unsafe share of reuses |", "|---|---|---|---|"]
    for name, key in (("forest (shipped)", "forest"), ("threshold (err < tau)", "threshold_rule")):
        st = about.get(key, {})
        lines.append(f"| {name} | {st.get('accuracy', '?')} | {st.get('reuse_share', '?')} | "
                     f"{st.get('unsafe_share_of_reuses', '?')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/temporal_reuse.md")
    p.add_argument("--families", default="sd,flux", help="model families, each with its trained model and rule")
    p.add_argument("--edits", type=int, default=3, help="edits per trace and guidance (50 steps: one fewer)")
    p.add_argument("--guidance", default="1.0,3.0,7.5")
    p.add_argument("--traces", default=",".join(TRACE_NAMES))
    p.add_argument("--steps", default="20,50")
    p.add_argument("--tau", type=float, default=0.15, help="the threshold rule's error bound")
    p.add_argument("--delta", type=float, default=0.3, help="step-skip's accumulated relative change bound")
    p.add_argument("--shares", default="0,0.25,0.5,1.0", help="part 2's rule shares (0: fast)")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--speed-steps", type=int, default=20)
    p.add_argument("--json", default="", help="also write the rows here")
    run = cli.start(p, argv, __file__, quick=dict(edits=1, guidance="7.5", steps="8", traces="spring", shares=""))
    args = run.args
    rows: list[dict[str, Any]] = []
    speed: list[dict[str, Any]] = []
    for family in args.families.split(","):
        rows += fidelity_part(args, family)
        if args.shares:  # --quick: no benchmark-size model
            speed += speed_part(args, family)
    text = render(rows, speed, args, run.command, run.elapsed())
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "speed": speed}, indent=1))
    run.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
