"""What a job costs on a worker that does not hold its template cache yet (a cold start).

A worker without the job's template fetches the cache when the job arrives and never waits for it:
until the cache lands the job computes in full (``UnitCache`` / ``SDRunner``'s fallback), then
masked. So a cold start does not cost the job the fetch time; it costs the extra device work of its
full-compute steps, and that work lengthens every step it is in, for every job in those steps:

- the job itself (its own full steps, in its predicted finish),
- its batch-mates in those steps (known: the jobs alive when it is admitted),
- the jobs that will reach that worker while those steps run (not there yet; they wait behind or
  share the lengthened steps), which is where load enters (``ColdStart.later_arrivals``).

``cold_start`` integrates the steps exactly as ``app.costmodel.finish_after_admission`` does, with
each step before the cache lands priced at full compute. The router (``app.routing.MaskAwareRouter.cold_start_cost``)
adds the three, the last with the cluster's load (``ClusterLoad``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.costmodel import finish_after_admission


@dataclass(frozen=True)
class ColdStart:
    """A cold start on one worker, predicted (seconds from the routing decision)."""

    finish: float  # when the job would finish there, computing in full until its cache lands
    extra_work: float  # device seconds its full-compute steps add over masked ones (summed over steps)
    mates_delay: float  # seconds those steps add to the jobs sharing them (summed over the jobs)
    exposure: float  # sum over its full steps of (seconds the step adds) x (when that step ends)

    def later_arrivals(self, load: "ClusterLoad") -> float:
        """Seconds the full steps add to jobs that reach this worker later. A job arriving before a
        lengthened step ends waits for it (queued) or shares it (admitted), so each step delays the
        ``rate x its end time`` jobs expected by then; they pass it on to the jobs behind them as
        long as the cluster has no room to absorb it, as extra work ``x`` extends an M/G/1 busy period
        by ``x / (1 - rho)``: hence the division by the share of batch slots free (``1 - rho``)."""
        return load.arrivals_per_s * self.exposure / load.free_share


@dataclass(frozen=True)
class ClusterLoad:
    """How loaded the cluster is, as the dispatcher sees it (``MaskAwareRouter.cluster_load``)."""

    arrivals_per_s: float = 0.0  # jobs reaching one worker per second (0: none expected)
    free_share: float = 1.0  # share of the cluster's batch slots free (1 - rho; > 0)


def cold_start(t_admit: float, alive: Sequence[tuple[float, int]], warm_s: float, cold_s: float, lands: float,
               steps: int, intercept: float, step: Callable[[float], float] | None = None) -> ColdStart:
    """The job's finish and the extra work of its full steps when admitted at ``t_admit`` next to
    ``alive`` ((step seconds, remaining steps) of the jobs then in the batch, ``admission_profile``).

    ``warm_s`` / ``cold_s``: its marginal step seconds with / without the cache; ``lands``: seconds until
    the cache is usable. A step that starts before then is computed in full (the simulator and the
    engine check at each step). ``step``: a curved step from the sum of job seconds; None = the linear
    ``intercept + sum``."""

    def seconds(work: float) -> float:
        return intercept + work if step is None else step(work)

    if t_admit >= lands:  # the cache lands while the job waits for a slot: a warm start
        return ColdStart(finish_after_admission(t_admit, alive, warm_s, steps, intercept, step), 0.0, 0.0, 0.0)
    t, done = t_admit, 0
    in_step = sum(g for g, _ in alive)
    mates = len(alive)
    extra = delay = exposure = 0.0
    for g, r in [*sorted(alive, key=lambda a: a[1]), (0.0, steps)]:
        end = min(r, steps)
        if end > done:
            run = end - done
            warm = seconds(in_step + warm_s)
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
