"""The work after the model in an engine step, launched once for the batch: classifier-free guidance
equals the stock pipeline's per-job expression bit for bit, and the finiteness read names every job
whose latents are not finite."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workers.engine.sd_runner import SDRunner
from workers.engine.settle import LaunchedStep, finite_flags, read_failures


def _job(job_id: str, do_cfg: bool = True, guidance: float = 7.5, steps_done: int = 3) -> SimpleNamespace:
    state = SimpleNamespace(do_cfg=do_cfg, guidance=guidance, rows=2 if do_cfg else 1)
    return SimpleNamespace(job_id=job_id, state=state, steps_done=steps_done)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_guidance_equals_each_jobs_expression(dtype: torch.dtype) -> None:
    batch = [_job("a", guidance=7.5), _job("b", do_cfg=False), _job("c", guidance=3.3), _job("d", guidance=11.0)]
    g = torch.Generator().manual_seed(0)
    output = torch.randn(7, 4, 8, 8, generator=g).to(dtype)
    want, row = [], 0
    for job in batch:
        rows = output[row:row + job.state.rows]
        row += job.state.rows
        if job.state.do_cfg:
            uncond, cond = rows.chunk(2)
            rows = uncond + job.state.guidance * (cond - uncond)  # StableDiffusionInpaintPipeline's guidance
        want.append(rows)
    got = SDRunner._guided_batch(None, batch, output)  # type: ignore[arg-type]
    per_job = SDRunner._guided_batch(None, batch, [output[0:2], output[2:3], output[3:5], output[5:7]])  # type: ignore[arg-type]
    assert len(got) == len(per_job) == 4
    for a, b, c in zip(got, per_job, want):
        assert a.dtype == c.dtype and torch.equal(a, c) and torch.equal(b, c)


def _failures(batch: list[SimpleNamespace], news: list[torch.Tensor]) -> list[tuple[str, str]]:
    step = LaunchedStep(batch, [job.steps_done for job in batch], finite_flags(news), 0.0)  # type: ignore[arg-type]
    return [(job.job_id, str(exc)) for job, exc in read_failures([step])]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finiteness_read_names_each_job_whose_latents_are_not_finite(bad: float) -> None:
    batch = [_job("a"), _job("b"), _job("c")]
    news = [torch.randn(1, 4, 8, 8) for _ in batch]
    assert _failures(batch, news) == []
    news[1][0, 2, 3, 4] = bad
    assert _failures(batch, news) == [("b", "job b: non-finite latents at step 3")]
    news[2] = news[2].to(torch.bfloat16)
    news[2][0, 0, 0, 0] = bad
    assert [job for job, _ in _failures(batch, news)] == ["b", "c"]
    news[1][0, 2, 3, 4] = 0.0
    assert [job for job, _ in _failures(batch, news)] == ["c"]


def test_steps_read_together_name_each_failing_job_with_its_own_step() -> None:
    first, second = [_job("a", steps_done=2), _job("b", steps_done=2)], [_job("c", steps_done=5)]
    news = [torch.randn(1, 4, 8, 8) for _ in range(3)]
    news[1][0, 0, 0, 0] = float("nan")
    news[2][0, 1, 1, 1] = float("inf")
    steps = [LaunchedStep(jobs, [job.steps_done for job in jobs], finite_flags(part), 0.0)  # type: ignore[arg-type]
             for jobs, part in ((first, news[:2]), (second, news[2:]))]
    assert [str(exc) for _, exc in read_failures(steps)] == ["job b: non-finite latents at step 2",
                                                             "job c: non-finite latents at step 5"]
