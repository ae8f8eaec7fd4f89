"""The host-scalar scheduler steps equal diffusers' ``scheduler.step`` bit for bit."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from ops.bench.harness.dispatch import DispatchCounter
from workers.engine.stepper import DDIMStepper, FlowMatchStepper, SchedulerStepper, make_stepper, step_batch


def _ddim(prediction: str, clip: bool) -> DDIMScheduler:
    return DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=clip,
                         set_alpha_to_one=False, steps_offset=1, prediction_type=prediction)


def _run_both(scheduler_factory, steps: int, t_start: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """(diffusers' samples, the stepper's samples) over a job's schedule from ``t_start``."""
    stock, ours = scheduler_factory(), scheduler_factory()
    for s in (stock, ours):
        if isinstance(s, FlowMatchEulerDiscreteScheduler):
            s.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=0.7)
        else:
            s.set_timesteps(steps)
        if hasattr(s, "set_begin_index"):
            s.set_begin_index(t_start * s.order)
    timesteps = ours.timesteps[t_start * ours.order:]
    stepper = make_stepper(ours, timesteps, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(2, 4, 8, 8, generator=g).to(dtype)
    a = b = sample
    outs_a, outs_b = [], []
    for i, t in enumerate(stock.timesteps[t_start * stock.order:]):
        eps = torch.randn(2, 4, 8, 8, generator=g).to(dtype)
        a = stock.step(eps, t, a, return_dict=False)[0]
        if hasattr(ours, "scale_model_input"):  # flow matching has no input scaling
            assert torch.equal(stepper.scale_input(b, i), ours.scale_model_input(b, t))
        else:
            assert stepper.scale_input(b, i) is b
        b = stepper.step(i, eps, b)
        outs_a.append(a)
        outs_b.append(b)
    return outs_a, outs_b, stepper


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prediction,clip", [("epsilon", False), ("sample", False), ("v_prediction", False),
                                             ("epsilon", True)])
def test_ddim_stepper_is_bit_identical(prediction: str, clip: bool, dtype: torch.dtype) -> None:
    stock, ours, stepper = _run_both(lambda: _ddim(prediction, clip), 12, 3, dtype)
    assert isinstance(stepper, DDIMStepper)
    for a, b in zip(stock, ours):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flow_match_stepper_is_bit_identical(dtype: torch.dtype) -> None:
    stock, ours, stepper = _run_both(lambda: FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
                                     10, 2, dtype)
    assert isinstance(stepper, FlowMatchStepper)
    for a, b in zip(stock, ours):
        assert torch.equal(a, b)


def test_other_schedulers_run_their_own_step() -> None:
    stock, ours, stepper = _run_both(EulerDiscreteScheduler, 8, 0, torch.float32)
    assert isinstance(stepper, SchedulerStepper) and not stepper.stateless
    for a, b in zip(stock, ours):
        assert torch.equal(a, b)


def _jobs(prediction: str, clip: bool, dtype: torch.dtype, output_dtype: torch.dtype | None = None,
          count: int = 5) -> list:  # type: ignore[type-arg]
    """``count`` DDIM jobs at different steps of a 12-step schedule, with outputs and samples."""
    scheduler = _ddim(prediction, clip)
    scheduler.set_timesteps(12)
    g = torch.Generator().manual_seed(2)
    jobs = []
    for n in range(count):
        stepper = make_stepper(scheduler, scheduler.timesteps, torch.Generator().manual_seed(0))
        output = torch.randn(2, 4, 8, 8, generator=g).to(output_dtype or dtype)
        jobs.append((stepper, (3 * n + 1) % 12, output, torch.randn(2, 4, 8, 8, generator=g).to(dtype)))
    return jobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prediction,clip", [("epsilon", False), ("sample", False), ("v_prediction", False),
                                             ("epsilon", True)])
def test_a_batch_of_ddim_updates_equals_each_jobs_own_step(prediction: str, clip: bool, dtype: torch.dtype) -> None:
    jobs = _jobs(prediction, clip, dtype)
    batched = step_batch(jobs)
    for (stepper, i, output, sample), new in zip(jobs, batched):
        assert new.dtype == dtype
        assert torch.equal(new, stepper.step(i, output, sample))


def _euler_job(sample: torch.Tensor, output: torch.Tensor) -> tuple:  # type: ignore[type-arg]
    euler = EulerDiscreteScheduler()
    euler.set_timesteps(8)
    return make_stepper(euler, euler.timesteps, torch.Generator().manual_seed(0)), 0, output, sample


def test_a_batch_mixing_schedulers_and_dtypes_steps_each_job_as_its_own() -> None:
    sample, output = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    jobs = (_jobs("epsilon", False, torch.bfloat16, count=3) + [_euler_job(sample, output)]
            + _jobs("v_prediction", False, torch.float32, count=2)
            + _jobs("epsilon", False, torch.float32, torch.bfloat16, count=2))
    batched = step_batch(jobs)
    own = [stepper.step(i, out, x) for stepper, i, out, x in jobs[:3] + [_euler_job(sample, output)] + jobs[4:]]
    for new, expected in zip(batched, own, strict=True):
        assert new.dtype == expected.dtype and torch.equal(new, expected)
    assert [b.dtype for b in batched] == [torch.bfloat16] * 3 + [torch.float32] * 5


def test_a_batch_of_ddim_updates_launches_the_same_operators_at_any_size() -> None:
    counts = {}
    for count in (2, 8):
        jobs = _jobs("epsilon", False, torch.bfloat16, count=count)
        with DispatchCounter() as counter:
            step_batch(jobs)
        counts[count] = counter.kernels
    assert counts[8] == counts[2] <= 6, counts


def _flow_jobs(dtype: torch.dtype, count: int = 4) -> list:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(3)
    jobs = []
    for n in range(count):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
        scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / 10, 10).tolist(), mu=0.7)
        scheduler.set_begin_index(n % 3)
        stepper = make_stepper(scheduler, scheduler.timesteps[n % 3:], torch.Generator().manual_seed(0))
        jobs.append((stepper, (2 * n + 1) % 7, torch.randn(1, 64, 16, generator=g).to(dtype),
                     torch.randn(1, 64, 16, generator=g).to(dtype)))
    return jobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_batch_of_flow_matching_updates_equals_each_jobs_own_step(dtype: torch.dtype) -> None:
    jobs = _flow_jobs(dtype)
    with DispatchCounter() as counter:
        batched = step_batch(jobs)
    assert counter.kernels == 2  # one multiplication and one addition for every job
    for (stepper, i, output, sample), new in zip(jobs, batched, strict=True):
        assert isinstance(stepper, FlowMatchStepper) and new.dtype == dtype
        assert torch.equal(new, stepper.step(i, output, sample))


def test_a_flow_matching_sample_in_another_dtype_steps_alone() -> None:
    jobs = _flow_jobs(torch.bfloat16)
    stepper, i, output, sample = jobs[1]
    jobs[1] = (stepper, i, output, sample.float())  # the stock step returns the output's dtype
    batched = step_batch(jobs)
    assert batched[1].dtype == torch.bfloat16
    assert torch.equal(batched[1], stepper.step(i, output, sample.float()))
