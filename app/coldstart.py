"""What a job costs on a worker without its template cache (a cold start).

The worker fetches the cache when the job arrives and never waits for it: the job computes in full
until it lands (``UnitCache`` / ``SDRunner``'s fallback), then masked. So a cold start costs the
extra device work of those full steps, which lengthens each of them for every job in it: the job,
its batch-mates, and the jobs that reach the worker while they run (where load enters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.costmodel import finish_after_admission


@dataclass(frozen=True)
class ClusterLoad:
    """How loaded the cluster is, as the dispatcher sees it (``MaskAwareRouter.cluster_load``)."""

    arrivals_per_s: float = 0.0  # jobs reaching one worker per second
    free_share: float = 1.0  # share of batch slots free, read as 1 - rho (> 0)


@dataclass(frozen=True)
class ColdStart:
    """A cold start on one worker, predicted in seconds from the routing decision."""

    finish: float  # the job's finish, computing in full until its cache lands
    extra_work: float  # seconds its full steps add over masked ones, summed over those steps
    mates_delay: float  # the same, times the jobs sharing each step
    exposure: float  # the same, times when each step ends

    def later_arrivals(self, load: ClusterLoad) -> float:
        """Delay to jobs that reach the worker later: one arriving before a lengthened step ends waits
        for it or shares it (``rate x end``), and passes it on while the cluster has no room, as extra
        work extends an M/G/1 busy period by ``1 / (1 - rho)``."""
        return load.arrivals_per_s * self.exposure / load.free_share


def cold_start(t_admit: float, alive: Sequence[tuple[float, int]], warm_s: float, cold_s: float, lands: float,
               steps: int, intercept: float, step: Callable[[float], float] | None = None) -> ColdStart:
    """``finish_after_admission`` with each step that starts before ``lands`` priced at ``cold_s``
    (full compute) instead of ``warm_s``; ``alive``: (step seconds, remaining steps) of the jobs in
    the batch at admission; ``step``: a curved step (None: ``intercept + sum``)."""

    def seconds(work: float) -> float:
        return intercept + work if step is None else step(work)

    if t_admit >= lands:  # the cache lands while the job waits for a slot
        return ColdStart(finish_after_admission(t_admit, alive, warm_s, steps, intercept, step), 0.0, 0.0, 0.0)
    t, done, mates = t_admit, 0, len(alive)
    in_step = sum(g for g, _ in alive)
    extra = delay = exposure = 0.0
    for g, r in [*sorted(alive, key=lambda a: a[1]), (0.0, steps)]:
        end = min(r, steps)
        if end > done:
            run, warm = end - done, seconds(in_step + warm_s)
            if t < lands:
                cold = seconds(in_step + cold_s)
                full = min(run, math.ceil((lands - t) / cold))
                added = cold - warm
                extra += added * full
                delay += added * full * mates
                exposure += added * (full * t + cold * full * (full + 1) / 2)  # step i ends at t + i * cold
                t += full * cold + (run - full) * warm
            else:
                t += run * warm
            done = end
        if done >= steps:
            break
        in_step -= g
        mates -= 1
    return ColdStart(t, extra, delay, exposure)


__all__ = ["ClusterLoad", "ColdStart", "cold_start"]
