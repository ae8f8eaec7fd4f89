"""The measured GPU step costs (``ops/sim/gpucosts``) as the dispatch simulator's step times and cost model.

``ops.bench.simulate --gpu-costs NAME`` runs the 8-64-worker cluster on what one GPU measured instead
of a CPU-fitted linear model. Two things come from the measurement, kept apart on purpose:

- **What a step takes** (the simulated truth): the fitted batch curve ``t(W)`` of ``ops/sim/gpu_costs.py``
  at the batch's work ``W`` in jobs of the measured size, via ``gpu_costs.batch_step_cost`` (the same
  function the mixed-size simulator uses). A job's work is 1 in full compute; a masked job's is either
  its share of a full job's work on the base cost model's architecture (``tokens``: what a mask-aware
  step would cost if it paid as its tokens do) or a full job with the step stretched by the measured,
  host-bound mask-aware speed (``host-bound``; ``gpu_costs.host_bound_factor``). The two bracket a
  mask-aware GPU step that has not been measured with graphs and token buckets.
- **What the dispatcher and the engines believe** (routing, SLO admission, deadline checks): a
  ``CostModel`` whose job seconds are a linear fit by relative least squares to the truth on
  single-size batches of 1 to ``max_batch`` jobs, all full and (host-bound) all masked: what
  ``ops.bench.profile`` would fit on that GPU. ``router_step``: ``curve`` (tokens' default) also gives
  it the file's fitted curve (``app.costmodel.StepCurve``, a job's work = its seconds / a full
  job's), so routing and admission price a step as the curve of its work; ``linear`` leaves the
  step ``intercept + sum(job seconds)``, whose error against the curve is reported
  (``GpuDispatchCosts.router_mape``). The host-bound truth is not a function of work alone (the
  mask-aware speed depends on the job count), so it has the linear step only (its default).

Never stored in ``ops/sim/costmodels`` (the dispatcher loads every file there as a routing model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from app.costmodel import CostModel, FitReport, StepCurve
from ops.sim import gpu_costs
from ops.sim.traces import load_trace

MASKED_WORK = ("tokens", "host-bound")
ROUTER_STEPS = ("curve", "linear")
_TOKENS = ("g",)  # memo key prefix of GpuCostModel (the base model memoizes under "t" and "r")


def cost_file(name: str) -> Path:
    """``ops/sim/gpucosts/<name>.json``, or a clear error naming the files there."""
    path = gpu_costs.COSTMODELS / f"{name}.json"
    if not name or "/" in name or not path.is_file():
        known = sorted(p.stem for p in gpu_costs.COSTMODELS.glob("*.json"))
        raise ValueError(f"unknown GPU cost file {name!r}: expected one of {known} (in {gpu_costs.COSTMODELS})")
    return path


@dataclass
class GpuCostModel(CostModel):
    """A ``CostModel`` whose step is the linear fit to a measured GPU curve (module docstring).

    Job step seconds: ``full_job_s`` in full compute; a masked job ``masked_job_s`` (host-bound) or
    ``full_job_s`` x its share of a full job's work on the base architecture (tokens)."""

    full_job_s: float = 0.0
    masked_job_s: float | None = None

    def work(self, masked_tokens: Sequence[int] | None) -> float:
        """A job's work in full jobs of the measured size, by its tokens on the base architecture."""
        if masked_tokens is None:
            return 1.0
        return super().job_step_seconds(masked_tokens) / super().job_step_seconds(None)

    def job_step_seconds(self, masked_tokens: Sequence[int] | None) -> float:
        if masked_tokens is None:
            return self.full_job_s
        if self.masked_job_s is not None:
            return self.masked_job_s
        key = (*_TOKENS, tuple(masked_tokens))
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = self.full_job_s * self.work(masked_tokens)
        return value


def _job_tokens(job: Any, base: CostModel) -> tuple[Sequence[int] | None, bool]:
    """(masked tokens or None, runs masked) of an engine or simulated job, as the cost model sees it."""
    ratio = getattr(job, "mask_ratio", getattr(job, "ratio", 1.0))
    if not getattr(job, "cached", False) or ratio >= 1.0:
        return None, False
    tokens = getattr(job, "masked_tokens", None)
    if tokens is None or len(tokens) != base.arch.num_levels:
        tokens = base.arch.tokens_from_ratio(ratio)
    return tokens, True


@dataclass(frozen=True)
class Probe:
    """A job as ``gpu_costs.batch_step_cost`` reads it (one size: ``latent_hw`` None)."""

    mask_ratio: float
    masked_tokens: tuple[int, ...] | None
    cached: bool
    latent_hw: None = None


class GpuDispatchCosts:
    """Step times (truth) and the router's linear ``CostModel`` from one measured cost file."""

    def __init__(self, costs: gpu_costs.GpuCosts, base: CostModel, masked_work: str = "tokens",
                 max_batch: int = 8, router_step: str | None = None) -> None:
        if masked_work not in MASKED_WORK:
            raise ValueError(f"masked work must be one of {MASKED_WORK}, got {masked_work!r}")
        if router_step is None:  # the curve where it prices a step (tokens), else the linear fit
            router_step = "curve" if masked_work == "tokens" else "linear"
        if router_step not in ROUTER_STEPS:
            raise ValueError(f"router step must be one of {ROUTER_STEPS}, got {router_step!r}")
        if router_step == "curve" and masked_work != "tokens":
            raise ValueError("the host-bound step is not a function of work alone: use the linear router step")
        if masked_work == "host-bound" and "mask_aware_speed" not in costs.data:
            raise ValueError(f"{costs.path}: no mask-aware speed measured, so no host-bound variant")
        costs.full_points  # noqa: B018 -- raises a clear error for a file without a batch curve
        self.costs, self.base, self.masked_work, self.max_batch = costs, base, masked_work, max_batch
        self.router_step = router_step
        self.curve = costs.curve
        proto = GpuCostModel(**{f.name: getattr(base, f.name) for f in dataclasses.fields(CostModel)
                                if f.name != "_memo"})
        self._work = proto.work
        self.step_cost = gpu_costs.batch_step_cost(
            self.curve, self.job_work, 1.0,  # one image size per step: the packed share never applies
            full_work=lambda _job: 1.0, costs=costs if masked_work == "host-bound" else None)
        intercept, full_s, masked_s, report = self._fit_linear()
        self.model = dataclasses.replace(
            proto, model_id=f"{Path(costs.path).stem.split('--')[0]}", device_kind=Path(costs.path).stem.split("--")[1],
            intercept=intercept, full_job_s=full_s, masked_job_s=masked_s, step_report=report, batch=None, _memo={},
            curve=(StepCurve(self.curve.floor_s, self.curve.per_job_s, self.curve.knee)
                   if router_step == "curve" else None),
            meta={"gpu_costs": Path(costs.path).name, "masked_work": masked_work, "base": base.model_id})

    # -- the truth --------------------------------------------------------------------------
    def job_work(self, job: Any) -> float:
        """Work of a job in full jobs of the measured size (``tokens``: by its masked tokens)."""
        tokens, _ = _job_tokens(job, self.base)
        return self._work(tokens)

    def probe(self, ratio: float, cached: bool) -> Probe:
        tokens, masked = _job_tokens(Probe(ratio, None, cached), self.base)
        return Probe(ratio, tuple(tokens) if tokens is not None else None, masked)

    def alone_seconds(self, ratio: float, cached: bool, steps: int) -> float:
        """A job's time alone on an idle worker (deadlines, references)."""
        return steps * self.step_cost([self.probe(ratio, cached)])

    def pooled_step(self, jobs: Sequence[Any], workers: int) -> float:
        """Step seconds of a worker holding ``1/workers`` of ``jobs`` (fractional), as ``step_cost``
        prices a batch: the ideal pooled reference's pace (``ops/sim/bounds.pooled_batches``)."""
        per = len(jobs) / workers
        if self.masked_work == "tokens":
            return self.curve(sum(self.job_work(j) for j in jobs) / workers)
        masked = sum(1 for j in jobs if _job_tokens(j, self.base)[1])
        return self.curve(per) * gpu_costs.host_bound_factor(self.costs, per, masked / len(jobs))  # type: ignore[arg-type]

    def capacity(self, trace: str, workers: int, steps: int, uncached_fraction: float, seed: int,
                 batches: int = 2000) -> float:
        """Jobs per second of the cluster with every worker running full batches of the trace's jobs
        (the same definition as ``ops.sim.workload.capacity``, with the curve's step of such a batch)."""
        rng = np.random.default_rng(seed + 17)
        ratios = load_trace(trace)
        ratios = ratios[ratios > 0.0]  # empty masks never reach a GPU worker
        draws = ratios[rng.integers(0, len(ratios), (batches, self.max_batch))]
        cached = rng.random((batches, self.max_batch)) >= uncached_fraction
        probes = {(float(r), bool(c)): self.probe(float(r), bool(c)) for r, c in zip(draws.ravel(), cached.ravel())}
        mean_step = float(np.mean([self.step_cost([probes[(float(r), bool(c))] for r, c in zip(rs, cs)])
                                   for rs, cs in zip(draws, cached)]))
        return workers * self.max_batch / (steps * mean_step)

    # -- the router's belief ----------------------------------------------------------------
    def _fit_linear(self) -> tuple[float, float, float | None, FitReport]:
        """``intercept + n_full x a + n_masked x b`` by relative least squares on single-size batches
        of 1..max_batch jobs (all full; host-bound also all masked at the measured ratio)."""
        sizes = range(1, self.max_batch + 1)
        rows, ys = [], []
        for j in sizes:
            rows.append((1.0, float(j), 0.0))
            ys.append(self.step_cost([self.probe(1.0, False)] * j))
        host = self.masked_work == "host-bound"
        if host:
            ratio = float(self.costs.data["mask_aware_speed"].get("ratio", 0.2))
            for j in sizes:
                rows.append((1.0, 0.0, float(j)))
                ys.append(self.step_cost([self.probe(ratio, True)] * j))
        x, y = np.asarray(rows), np.asarray(ys)
        x = x if host else x[:, :2]
        coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
        pred = x @ coef
        rel = np.abs(pred - y) / y
        ss_res, ss_tot = float(np.sum((pred - y) ** 2)), float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
        report = FitReport(r2_train=r2, r2_test=r2, mape_test=float(rel.mean()), n_train=len(y), n_test=len(y),
                           residuals_test=tuple(float(v) for v in y - pred))
        if coef[0] <= 0 or coef[1] <= 0 or (host and coef[2] <= 0):
            raise ValueError(f"the linear fit to {self.costs.path} has a non-positive term: {coef}")
        return float(coef[0]), float(coef[1]), float(coef[2]) if host else None, report

    @property
    def router_mape(self) -> float:
        """Mean relative error of the router's linear step against the curve on the fitted batches."""
        assert self.model.step_report is not None
        return self.model.step_report.mape_test

    def describe(self) -> str:
        m = self.model
        masked = (f"a masked job {m.masked_job_s * 1e3:.2f} ms" if m.masked_job_s is not None
                  else f"a masked job {m.full_job_s * 1e3:.2f} ms x its share of a full job's work on "
                       f"`{self.base.model_id}`")
        if m.curve is not None:
            return (f"{gpu_costs.describe(self.costs)}. Masked work: `{self.masked_work}`. Router and SLO admission: "
                    f"that curve at the step's work (a job's work: {m.full_job_s * 1e3:.2f} ms x its share of a full "
                    f"job's work on `{self.base.model_id}`, / {m.full_job_s * 1e3:.2f} ms)")
        return (f"{gpu_costs.describe(self.costs)}. Masked work: `{self.masked_work}`. Router and SLO admission: "
                f"linear fit to the curve on batches of 1-{self.max_batch} jobs, intercept {m.intercept * 1e3:.2f} ms, "
                f"a full job {m.full_job_s * 1e3:.2f} ms, {masked}; its error on those batches "
                f"{self.router_mape * 100:.1f}% (MAPE)")


@cache
def load(name: str, base_path: str, masked_work: str = "tokens", max_batch: int = 8,
         router_step: str | None = None) -> GpuDispatchCosts:
    """The measured file ``name`` (``ops/sim/gpucosts/<name>.json``) over the base cost model's architecture."""
    return GpuDispatchCosts(gpu_costs.load(cost_file(name)), CostModel.load(base_path), masked_work, max_batch,
                            router_step)


__all__ = ["MASKED_WORK", "ROUTER_STEPS", "GpuCostModel", "GpuDispatchCosts", "Probe", "cost_file", "load"]
