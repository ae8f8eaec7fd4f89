"""A mixed-size trace as the simulator and the step-time predictor see it (shared by the benchmarks).

Sizes are given as ``WxH:weight``; each arrival becomes a ``JobShape`` (latent grid, masked tokens
per level, rows) for the resolution-aware batch predictor (``app/steptime.py``) and a ``SimJob`` for
``ops/sim/cluster.py``. ``ops.bench.mixed_sizes`` and ``ops.bench.scheduler_cost`` both build their
traces here, so the two measure the same jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.costmodel import CostModel, token_counts_from_mask
from app.steptime import BatchPredictor, JobShape
from ops.sim.workload import MixedArrival, SimJob


def parse_sizes(text: str) -> tuple[list[tuple[int, int]], list[float]]:
    """``"128x128:0.4,96x128:0.25"`` -> ([(width, height), ...], [weight, ...])."""
    sizes, weights = [], []
    for part in filter(None, (p.strip() for p in text.split(","))):
        dims, _, weight = part.partition(":")
        w, _, h = dims.lower().partition("x")
        sizes.append((int(w), int(h)))
        weights.append(float(weight or 1.0))
    return sizes, weights


def job_shape(arrival: MixedArrival, mask: np.ndarray | None, predictor: BatchPredictor, cost: CostModel) -> JobShape:
    """Latent grid, masked tokens per level (from the mask, or estimated from the ratio) and rows."""
    w, h = arrival.size
    grid = predictor.latent_hw(h, w)
    if arrival.ratio >= 0.999:
        return JobShape(grid, None, 2)
    if mask is not None:
        tokens = token_counts_from_mask(mask, grid, predictor.spec.levels)
    else:
        tokens = dataclasses.replace(cost.arch, latent_hw=grid).tokens_from_ratio(arrival.ratio)[:predictor.spec.levels]
    return JobShape(grid, tuple(int(t) for t in tokens), 2)


def capacity(step_seconds: Any, shapes: list[JobShape], max_batch: int, steps: int, seed: int,
             samples: int = 400) -> float:
    """Jobs/s of one worker kept full (batches of ``max_batch`` jobs drawn from ``shapes``)."""
    rng = np.random.default_rng(seed + 99)
    mean = float(np.mean([step_seconds([shapes[i] for i in rng.integers(0, len(shapes), max_batch)])
                          for _ in range(samples)]))
    return max_batch / (steps * mean)


@dataclass
class ShapeJob:
    """A ``JobShape`` in the attributes ``engine_job_shape`` reads (capacity estimates)."""

    shape: JobShape

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.shape.latent_hw

    @property
    def masked_tokens(self) -> tuple[int, ...] | None:
        return self.shape.tokens

    @property
    def cached(self) -> bool:
        return self.shape.tokens is not None

    @property
    def rows(self) -> int:
        return self.shape.rows


def sim_jobs(arrivals: list[MixedArrival], predictor: BatchPredictor, cost: CostModel, args: argparse.Namespace,
             step_cost: Any) -> list[SimJob]:
    """Simulator jobs of the trace (``args``: ``steps``, ``slo_factor``): soft deadlines at ``slo_factor``
    x their standalone time under ``step_cost``, as the dispatcher assigns the service's default."""
    out = []
    for a in arrivals:
        shape = job_shape(a, None, predictor, cost)
        alone = args.steps * step_cost([ShapeJob(shape)])
        out.append(SimJob(index=a.index, arrival=a.arrival, ratio=a.ratio, steps=args.steps,
                          cached=shape.tokens is not None, template_id=f"t{a.size[0]}x{a.size[1]}",
                          masked_tokens=shape.tokens or (), deadline=a.arrival + args.slo_factor * alone,
                          alone_s=alone, latent_hw=shape.latent_hw, hard_deadline=False))
    return out
