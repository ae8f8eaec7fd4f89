"""Reference clusters that no immediate-dispatch router can be compared against unfairly.

They answer "how much could *any* routing policy cut?" on the very same jobs (arrivals, sizes):

- ``pooled_ps``: the cluster as one perfectly balanced pool. Every job that is present runs at
  once (up to ``max_batch`` per worker), the total rate of ``workers`` workers is shared equally,
  and no job runs faster than alone on one worker. This is what a router would get if it could
  move jobs between workers at every instant; with linear step times and no intercept (the CPU
  fits here) each worker is a processor-sharing server, so this is the ideal of balancing.
- ``central_fcfs``: one central first-come-first-served queue, each worker runs one job at a time
  (``M/G/c``). Different discipline (no co-batching), shown because with step times linear in
  the batch and no intercept, batching buys no throughput and FCFS has a shorter tail.

- ``pooled_batches`` (``ideal_pooled`` when the step cost is a batch curve, e.g. a GPU's): the same
  pool, but a worker's step costs what the curve says for its share of the present jobs (1/workers
  of them, fractional) and every job advances one step per step, no faster than alone: on a GPU a
  batch of 8 costs far less than 8 single steps, so processor sharing would understate the pool.

All use each job's time alone (``SimJob.alone_s``, no step noise, caches resident), so they are
references, not strict bounds of the simulated cluster.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from ops.sim.workload import SimJob


def _pool(jobs: Sequence[SimJob], workers: int, max_batch: int,
          step_times: Callable[[list[SimJob]], list[float]]) -> dict[int, float]:
    """Finish time per job index in a pool of ``workers`` x ``max_batch`` slots (FCFS beyond them), where
    ``step_times(active)`` gives each active job's seconds per step while that set is active."""
    arrivals = sorted((j for j in jobs if j.ratio > 0.0), key=lambda j: j.arrival)
    slots = workers * max_batch
    active: dict[int, float] = {}  # job index -> remaining steps
    by_index = {j.index: j for j in arrivals}
    queue: deque[SimJob] = deque()
    finish: dict[int, float] = {}
    t, i = 0.0, 0
    while i < len(arrivals) or active or queue:
        while queue and len(active) < slots:
            j = queue.popleft()
            active[j.index] = float(j.steps)
        step = dict(zip(active, step_times([by_index[k] for k in active])))
        t_arr = arrivals[i].arrival if i < len(arrivals) else float("inf")
        t_fin = t + min(left * step[k] for k, left in active.items()) if active else float("inf")
        t_next = min(t_arr, t_fin)
        for k in active:
            active[k] -= (t_next - t) / step[k]
        t = t_next
        for k in [k for k, left in active.items() if left <= 1e-9]:
            del active[k]
            finish[k] = t
        if t_arr <= t_fin and i < len(arrivals):
            queue.append(arrivals[i])
            i += 1
    for j in jobs:
        if j.ratio <= 0.0:  # empty mask: never reaches a GPU worker (as in the cluster)
            finish[j.index] = j.arrival
    return finish


def pooled_ps(jobs: Sequence[SimJob], workers: int, max_batch: int) -> dict[int, float]:
    """Finish time per job index in the pooled processor-sharing reference (module docstring): every
    active job runs at ``min(1, workers / active)`` of its speed alone."""
    def step_times(active: list[SimJob]) -> list[float]:
        slow = max(1.0, len(active) / workers)
        return [j.alone_s / j.steps * slow for j in active]

    return _pool(jobs, workers, max_batch, step_times)


def pooled_batches(jobs: Sequence[SimJob], workers: int, max_batch: int,
                   pooled_step: Callable[[Sequence[SimJob], int], float]) -> dict[int, float]:
    """Finish time per job index in the pooled reference with a batch step curve (module docstring):
    ``pooled_step(active, workers)`` = step seconds of a worker holding ``1/workers`` of ``active``."""
    def step_times(active: list[SimJob]) -> list[float]:
        shared = pooled_step(active, workers) if len(active) > workers else 0.0
        return [max(shared, j.alone_s / j.steps) for j in active]

    return _pool(jobs, workers, max_batch, step_times)


def central_fcfs(jobs: Sequence[SimJob], workers: int) -> dict[int, float]:
    """Finish time per job index with one central FCFS queue and one job per worker."""
    free = [0.0] * workers
    finish: dict[int, float] = {}
    for j in sorted(jobs, key=lambda j: j.arrival):
        if j.ratio <= 0.0:
            finish[j.index] = j.arrival
            continue
        start = max(heapq.heappop(free), j.arrival)
        finish[j.index] = start + j.alone_s
        heapq.heappush(free, finish[j.index])
    return finish


REFERENCES = {"ideal_pooled": "pooled_ps", "central_fcfs": "central_fcfs"}


def apply_reference(name: str, jobs: Sequence[SimJob], workers: int, max_batch: int,
                    pooled_step: Callable[[Sequence[SimJob], int], float] | None = None) -> None:
    """Fill ``finish`` of every job as the reference cluster ``name`` would (``pooled_step``: the
    step curve of ``pooled_batches``; None: processor sharing, for linear step costs)."""
    if name == "ideal_pooled":
        fin = (pooled_ps(jobs, workers, max_batch) if pooled_step is None
               else pooled_batches(jobs, workers, max_batch, pooled_step))
    elif name == "central_fcfs":
        fin = central_fcfs(jobs, workers)
    else:
        raise ValueError(f"unknown reference {name!r}; known: {sorted(REFERENCES)}")
    for j in jobs:
        j.finish = fin[j.index]
        j.worker = ""


__all__ = ["REFERENCES", "apply_reference", "central_fcfs", "pooled_batches", "pooled_ps"]
