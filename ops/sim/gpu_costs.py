"""Step costs measured on a GPU, for the simulators: raw measurements as data, a fitted batch curve.

A cost file (``ops/sim/gpucosts/<model>-<px>--<gpu>-<dtype>.json``, format ``stencil-gpu-costs``)
holds what ``ops/bench/gpu_step.py`` measured on one card, with its provenance (GPU, dtype, torch,
diffusers, the harness command): the full step's time at J CFG jobs (``full_step``), the
mask-aware step's speed against it (``mask_aware_speed``, ``one_job``). Nothing derived is stored:
the curve is fitted from the points when the file is loaded, so the file stays the measurement.

Why the curve is a smooth roofline, ``t(J) = (h^p + (c J)^p)^(1/p)``: on the H200 the SD 1.5 step
costs about the same from 1 to 4 jobs (29.7 -> 33.3 ms: the host launching ~1,200 kernels bounds
it, issue 37's profile) and then grows by about one job's device time per job (49.7 -> 92.1 ms
from 8 to 16). ``h`` is that host-bound floor, ``c`` the device time of one more job once the device
is the bound, ``p`` how sharp the knee between the two is. Three parameters, each a physical
quantity, against five points; a power law ``a + b J^k`` cannot bend both ways (its exponent from
the 2-4-8 points is 3.0, from 8-16 1.4), and piecewise-linear interpolation, the sourced curve's
form, extrapolates the knee's slope past the last point (leave-one-out MAPE 6.3% against the
roofline's 2.8%, ``leave_one_out``), and a straight line (intercept + per-job seconds, the linear
cost model's form) misses the knee (17.5%). Fitted by relative least squares in
``app.costmodel.fit_step_curve``, the fit ``ops.bench.profile`` writes into a deployment's cost model:
for each ``p`` on a grid, ``t^p = h^p + c^p J^p`` is linear in ``h^p`` and ``c^p`` (weighted by
``1 / t^p``, i.e. relative error), and the ``p`` of least relative error wins; deterministic, numpy only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from app.costmodel import fit_step_curve

FORMAT = "stencil-gpu-costs"
COSTMODELS = Path(__file__).resolve().parent / "gpucosts"  # apart from costmodels/: another format
# The measured model the simulators use by default: SD 1.5 inpainting at 512 px (the size a full
# 128x128 job of the CPU-fitted trace stands for) on one H200 in bfloat16.
DEFAULT_FILE = COSTMODELS / "sd15-inpaint-512--h200-bf16.json"


@dataclass(frozen=True)
class Roofline:
    """``t(J) = (h^p + (c J)^p)^(1/p)`` seconds for J jobs (module docstring)."""

    floor_s: float  # h: the host-bound step
    per_job_s: float  # c: one more job's device time once the device bounds the step
    knee: float  # p

    def __call__(self, jobs: float) -> float:
        p = self.knee
        return float((self.floor_s ** p + (self.per_job_s * jobs) ** p) ** (1.0 / p))


def fit_roofline(jobs: Sequence[float], seconds: Sequence[float]) -> Roofline:
    """The roofline of least relative squared error through ``(jobs, seconds)`` (at least 3 points):
    ``app.costmodel.fit_step_curve``, the fit ``ops.bench.profile`` writes into a deployment's cost model."""
    curve = fit_step_curve(jobs, seconds)
    return Roofline(curve.floor_s, curve.per_job_s, curve.knee)


def straight_line(jobs: Sequence[float], seconds: Sequence[float]) -> Callable[[float], float]:
    """``intercept + per-job seconds x J`` by least squares: the linear step model's form
    (``app.costmodel``: intercept + the sum of the jobs' seconds), the one a cost model has without a curve."""
    slope, intercept = np.polyfit(np.asarray(jobs, dtype=np.float64), np.asarray(seconds, dtype=np.float64), 1)
    return lambda x: float(intercept + slope * x)


def piecewise_linear(jobs: Sequence[float], seconds: Sequence[float]) -> Callable[[float], float]:
    """Linear between the points, extended with the first and last slopes (the sourced curve's form)."""
    xs, ys = list(jobs), list(seconds)

    def curve(x: float) -> float:
        i = 1 if x <= xs[1] else next((k for k in range(1, len(xs)) if x <= xs[k]), len(xs) - 1)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])

    return curve


def leave_one_out(jobs: Sequence[float], seconds: Sequence[float],
                  fit: Callable[[Sequence[float], Sequence[float]], Callable[[float], float]] = fit_roofline
                  ) -> list[float]:
    """Relative error at each point of a curve fitted on all the others (held-out error)."""
    out = []
    for k in range(len(jobs)):
        rest = [i for i in range(len(jobs)) if i != k]
        curve = fit([jobs[i] for i in rest], [seconds[i] for i in rest])
        out.append(abs(curve(jobs[k]) - seconds[k]) / seconds[k])
    return out


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear between measured points, held at the end values outside them (no extrapolation)."""
    return float(np.interp(x, xs, ys))


@dataclass(frozen=True)
class GpuCosts:
    """One model on one device, as measured (``load``)."""

    path: str
    data: dict[str, Any] = field(repr=False)

    @property
    def label(self) -> str:
        d = self.data["device"]
        return f"{Path(self.path).name.split('--')[0]} on one {d['gpu']}, {d['dtype']}"

    @property
    def provenance(self) -> str:
        d, p = self.data["device"], self.data["provenance"]
        return (f"{d['gpu']}, {d['dtype']}, torch {d['torch']}, diffusers {d['diffusers']}; `{p['harness']}` "
                f"({p['timing']})")

    @property
    def full_points(self) -> tuple[list[float], list[float]]:
        """(jobs, seconds) of the full step as measured."""
        full = self.data.get("full_step")
        if not full:
            raise ValueError(f"{self.path}: no batch curve measured (one job only)")
        return [float(j) for j in full["jobs"]], [ms / 1e3 for ms in full["ms"]]

    @property
    def curve(self) -> Roofline:
        return _fitted(tuple(map(tuple, self.full_points)))  # type: ignore[arg-type]

    def step_seconds(self, work: float) -> float:
        """Seconds of a full step of ``work`` jobs (fractional work: jobs smaller than the measured size)."""
        return self.curve(max(work, 0.0))

    def mask_aware_speed(self, jobs: float) -> float:
        """Full step / mask-aware step at ``jobs`` jobs, as measured (host-bound step code; module
        docstring), interpolated between the measured job counts and held at the ends."""
        m = self.data["mask_aware_speed"]
        return interpolate(m["jobs"], m["speed"], jobs)

    def leave_one_out(self) -> list[float]:
        return leave_one_out(*self.full_points)

    def mape(self) -> float:
        """Held-out error of the curve: mean relative error, leave one point out."""
        return float(np.mean(self.leave_one_out()))


@cache
def _fitted(points: tuple[tuple[float, ...], tuple[float, ...]]) -> Roofline:
    return fit_roofline(*points)


def load(path: str | Path = DEFAULT_FILE) -> GpuCosts:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file")
    return GpuCosts(str(path), data)


def mixed_size_step(curve: Callable[[float], float], work_by_size: dict[Any, float], transformer_share: float) -> float:
    """A step of several sizes in one batch: the transformer blocks run once on every size's tokens
    (packed), the rest (convolutions) once per size, each paying the small-batch floor again."""
    packed = curve(sum(work_by_size.values()))
    if len(work_by_size) <= 1:
        return packed
    return transformer_share * packed + (1.0 - transformer_share) * sum(curve(w) for w in work_by_size.values())


def host_bound_factor(costs: GpuCosts, jobs: int, masked_share: float) -> float:
    """What the measured mask-aware step makes of a step with ``masked_share`` of its full work masked:
    1 + share x (1 / speed(J) - 1), exact at the measured points (all masked or none)."""
    if masked_share <= 0:
        return 1.0
    return 1.0 + masked_share * (1.0 / costs.mask_aware_speed(jobs) - 1.0)


def is_masked(job: Any) -> bool:
    """Whether a (simulated or engine) job runs mask-aware steps: cached, with masked tokens."""
    return bool(getattr(job, "cached", False) and getattr(job, "masked_tokens", None))


def batch_step_cost(curve: Callable[[float], float], work: Callable[[Any], float], transformer_share: float, *,
                    full_work: Callable[[Any], float] | None = None, costs: GpuCosts | None = None
                    ) -> Callable[[Sequence[Any]], float]:
    """Seconds of one step of a batch of jobs on a GPU curve (in jobs of the measured size).

    Without ``costs`` a job costs ``work(job)``: its masked work scaled by its share of tokens, what a
    mask-aware step would cost if it paid as its tokens do. With ``costs`` (the measured, host-bound
    mask-aware step) every job costs ``full_work(job)`` and the step is stretched by
    ``host_bound_factor`` for the share of that work that ran masked."""
    def cost(jobs: Sequence[Any]) -> float:
        by_size: dict[Any, float] = {}
        masked = 0.0
        for j in jobs:
            w = work(j) if costs is None or full_work is None else full_work(j)
            hw = getattr(j, "latent_hw", None)
            by_size[hw] = by_size.get(hw, 0.0) + w
            masked += w if is_masked(j) else 0.0
        step = mixed_size_step(curve, by_size, transformer_share)
        if costs is None:
            return step
        total = sum(by_size.values())
        return step * host_bound_factor(costs, len(jobs), masked / total if total > 0 else 0.0)

    return cost


def describe(costs: GpuCosts) -> str:
    """The fitted curve, its held-out error and where the points come from, for reports."""
    c = costs.curve
    jobs, secs = costs.full_points
    return (f"{costs.label} ({costs.provenance}): full step at J jobs "
            + ", ".join(f"{int(j)}: {s * 1e3:.1f} ms" for j, s in zip(jobs, secs))
            + f"; fitted t(J) = (h^p + (c J)^p)^(1/p), h = {c.floor_s * 1e3:.2f} ms, c = {c.per_job_s * 1e3:.2f} ms, "
            f"p = {c.knee:.2f}; leave-one-out MAPE {costs.mape() * 100:.1f}% over {len(jobs)} points")


def fit_report(costs: GpuCosts) -> dict[str, Any]:
    """The fitted curve and its held-out error, as ``docs/bench/gpu_measured_costs.json`` holds them."""
    jobs, secs = costs.full_points
    linear = leave_one_out(jobs, secs, fit=piecewise_linear)
    line = leave_one_out(jobs, secs, fit=straight_line)
    c = costs.curve
    return {"file": Path(costs.path).name, "device": costs.data["device"],
            "harness": costs.data["provenance"]["harness"], "jobs": jobs, "measured_s": [round(s, 6) for s in secs],
            "form": "t(J) = (h^p + (c J)^p)^(1/p)",
            "h_s": c.floor_s, "c_s": c.per_job_s, "p": c.knee, "fitted_s": [c(j) for j in jobs],
            "in_sample_errors": [abs(c(j) - s) / s for j, s in zip(jobs, secs)],
            "loo_errors": costs.leave_one_out(), "loo_mape": costs.mape(),
            "piecewise_linear_loo_errors": linear, "piecewise_linear_loo_mape": float(np.mean(linear)),
            "straight_line_loo_errors": line, "straight_line_loo_mape": float(np.mean(line)),
            "points": len(jobs)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ops.sim.gpu_costs [--costs FILE] [--json OUT]``: the fit and its held-out error."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", default=str(DEFAULT_FILE))
    p.add_argument("--json", default="", help="write the fit report here ('' = standard output)")
    args = p.parse_args(argv)
    text = json.dumps({"fit": fit_report(load(args.costs))}, indent=1) + "\n"
    if args.json:
        Path(args.json).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
