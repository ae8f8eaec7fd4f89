"""A step's one read from the device, taken one step late so the device never waits for the host.

An engine step launches its device work (the model, guidance, each job's scheduler update), a
per-job finiteness flag and the flags' copy to pinned host memory, and on a GPU returns without
waiting (``BaseRunner.read_late``). The flags of step s are read while step s + 1 is queued behind
it (``BaseRunner.settle``), by waiting for the event recorded after their copy: the host then waits
only for work the device has already finished or is about to, and builds step s + 2 while step
s + 1 runs. Reading step s's flags at the end of step s instead leaves the device idle for all the
host work between two steps (scheduling, planning, staging, the engine's bookkeeping). On the CPU
the work is done when a step returns, so it is read at once (the same code, read sooner).

What depends on a step's result waits for its read: a job whose latents are not finite fails then
(named with the step that produced them; it may have taken one more step meanwhile, which only its
own rows saw), a warm-up's cache is committed only after its last step read finite, a job's result
is handed over only after its last step was read, and device-timed unit costs are learnt then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers.engine.job import EngineJob


@dataclass
class LaunchedStep:
    """A step whose device work may still be running, and what its read decides."""

    batch: list[EngineJob]
    steps: list[int]  # each job's step index in it
    flags: torch.Tensor  # per job: its new latents are finite (host memory; see ``ready``)
    started: float  # monotonic time the step began on the host
    ready: Any = None  # a CUDA event after which ``flags`` hold their values (None: they do already)
    ctx: Any = None  # the mask-aware call's context: unit times the cost model learns once read
    commits: list[EngineJob] = field(default_factory=list)  # warm-ups whose last step this was
    decide: list[tuple[EngineJob, int]] = field(default_factory=list)  # temporal reuse: (job, step) to decide


def finite_flags(news: list[torch.Tensor]) -> torch.Tensor:
    """Per job, whether its new latents are finite: one fused reduction over every job's tensor
    (the L1 norm: NaN and infinity carry through a sum, and latents are far from overflowing it),
    left on the device."""
    return torch.stack(torch._foreach_norm(news, 1)).isfinite()


def to_host(flags: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``flags`` on their way to host memory, and the CUDA event after which they are there. From
    a GPU the copy is queued behind the step (pinned memory, no wait): reading them later waits for
    that step only, where a reduction launched then would queue behind every step launched since."""
    if flags.device.type != "cuda":
        return flags, None
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(flags.device))
    return host, ready


def read_failures(steps: list[LaunchedStep]) -> list[tuple[EngineJob, FloatingPointError]]:
    """The jobs of ``steps`` whose latents are not finite, each with the error it fails with. One
    wait, for the last of them (a step's copy is queued behind the one before)."""
    if steps[-1].ready is not None:
        steps[-1].ready.synchronize()
    flags = steps[0].flags if len(steps) == 1 else torch.cat([step.flags for step in steps])
    if bool(flags.all()):
        return []
    ok = iter(flags.tolist())
    return [(job, FloatingPointError(f"job {job.job_id}: non-finite latents at step {index}"))
            for step in steps for job, index in zip(step.batch, step.steps) if not next(ok)]
