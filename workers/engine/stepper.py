"""A job's scheduler step with every schedule scalar read once, before the job's first step.

Why: diffusers' schedulers look their scalars up in tensors at every step (``alphas_cumprod[t]``,
``prev_timestep >= 0``, ``sigmas[i]``). With the schedule on the host those lookups are host
reads; with it on the GPU each one is a device synchronisation, and a batched step runs one
scheduler per job. ``HostStepper`` computes, at admission, exactly the values the scheduler would
compute (the same tensor expressions on the same host tensors) and keeps them as 0-d host
tensors; a step then applies the scheduler's own arithmetic to the model output with them as
scalar operands, exactly as ``scheduler.step`` does, so results are bit-identical (tested) and a
step reads nothing: no lookup, no comparison, no device synchronisation.

``step_batch`` updates a step's DDIM jobs together, and its flow-matching jobs: each operation of
the update is one multi-tensor (``_foreach``) call over the jobs, with each job's scalars as a list
of numbers, so a batch of any size launches the same few kernels. It computes what each job's own step computes,
bit for bit: a ``_foreach`` operation with a scalar list computes each element in the operation's
math type (float32 for 16-bit tensors) with the number it is given, so the batch gives it the number
the single-tensor operation with a 0-d host tensor really uses. That differs by device: on the CPU
``scalar * x`` first casts the scalar to ``x``'s dtype while ``x / scalar`` divides by it as it is;
on CUDA ``scalar * x`` uses it as it is and ``x / scalar`` multiplies by its float32 reciprocal
(``div_true_kernel_cuda``). Other devices and dtypes step each job alone.

Covered: ``DDIMScheduler`` (eta 0; epsilon, sample and v prediction; clipping) and
``FlowMatchEulerDiscreteScheduler`` (deterministic, no per-token timesteps): the schedulers the
service's model families use. Any other scheduler, or options outside that set (thresholding,
stochastic sampling), runs its own ``step`` (``SchedulerStepper``), which may read host scalars.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


class Stepper(Protocol):
    """One job's denoising update: ``step(i, model_output, sample) -> next sample``."""

    stateless: bool  # a failed step needs no rollback of scheduler state
    scales_input: bool  # ``scale_input`` computes something (False: it returns the sample itself)

    def scale_input(self, sample: torch.Tensor, i: int) -> torch.Tensor: ...

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class _DDIMStep:
    """0-d host tensors: the operands diffusers multiplies by (a CPU scalar operand of a device
    kernel is passed by value, no synchronisation; a Python float would round differently in half
    precision, where a 0-d float32 tensor is first cast to the sample's dtype)."""

    sqrt_alpha: torch.Tensor
    sqrt_beta: torch.Tensor
    sqrt_alpha_prev: torch.Tensor
    direction: torch.Tensor


# The devices whose host-scalar arithmetic ``step_batch`` reproduces (elsewhere each job steps alone).
_DEVICES = ("cpu", "cuda")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _operands(values: torch.Tensor) -> dict[torch.dtype | str, list[float]]:
    """0-d host scalars (stacked, float32) as the numbers ``step_batch`` hands to multi-tensor
    operations (module doc), worked out at admission so that a step dispatches nothing for them:
    per dtype, what a leading scalar multiplies by on the CPU (cast to that dtype; float32: itself,
    also CUDA's for every dtype), and ``"reciprocal"``: CUDA's divisor, ``1 / scalar`` in float32."""
    numbers: dict[torch.dtype | str, list[float]] = {dtype: values.to(dtype).tolist() for dtype in _DTYPES}
    numbers["reciprocal"] = (np.float32(1.0) / values.numpy()).tolist()
    return numbers


def _multiplier(numbers: dict[torch.dtype | str, list[float]], i: int, x: torch.Tensor) -> float:
    """The number ``scalar * x`` multiplies by (step ``i``): on the CPU a leading 0-d operand is first
    cast to ``x``'s dtype (TensorIterator's temporaries); on CUDA the kernel reads it as it is."""
    return numbers[x.dtype if x.device.type == "cpu" else torch.float32][i]


class DDIMStepper:
    """``DDIMScheduler.step`` (eta = 0) with its per-step scalars precomputed (module doc)."""

    stateless = True
    scales_input = False

    def __init__(self, scheduler: Any, timesteps: list[int]) -> None:
        cfg = scheduler.config
        self.prediction = cfg.prediction_type
        self.clip = (cfg.clip_sample_range if cfg.clip_sample else None)
        stride = cfg.num_train_timesteps // scheduler.num_inference_steps
        self.steps: list[_DDIMStep] = []
        for t in timesteps:
            timestep = torch.tensor(t)  # as the pipeline passes it: a 0-d integer tensor
            prev_timestep = timestep - stride
            alpha_prod_t = scheduler.alphas_cumprod[timestep]
            alpha_prod_t_prev = (scheduler.alphas_cumprod[prev_timestep] if prev_timestep >= 0
                                 else scheduler.final_alpha_cumprod)
            beta_prod_t = 1 - alpha_prod_t
            variance = scheduler._get_variance(timestep, prev_timestep)
            std_dev_t = 0.0 * variance ** (0.5)
            self.steps.append(_DDIMStep(
                sqrt_alpha=alpha_prod_t ** (0.5), sqrt_beta=beta_prod_t ** (0.5),
                sqrt_alpha_prev=alpha_prod_t_prev ** (0.5),
                direction=(1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5)))
        self.numbers = {f.name: _operands(torch.stack([getattr(s, f.name) for s in self.steps]).float())
                        for f in dataclasses.fields(_DDIMStep)} if self.steps else {}

    @staticmethod
    def supports(scheduler: Any) -> bool:
        cfg = scheduler.config
        return (type(scheduler).__name__ == "DDIMScheduler" and not cfg.thresholding
                and cfg.prediction_type in ("epsilon", "sample", "v_prediction"))

    def scale_input(self, sample: torch.Tensor, i: int) -> torch.Tensor:
        return sample  # DDIMScheduler.scale_model_input is the identity

    def batch_key(self, output: torch.Tensor, sample: torch.Tensor) -> tuple[Any, ...] | None:
        """Jobs with equal keys step together (``step_batch``); None: this job steps alone."""
        if not _batchable(output, sample):
            return None
        return (DDIMStepper, self.prediction, self.clip, sample.device, sample.dtype, output.dtype)

    @staticmethod
    def step_many(key: tuple[Any, ...], group: list[tuple[Any, int, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        _, prediction, clip = key[:3]
        return _ddim_batch(prediction, clip, [(stepper.numbers, i) for stepper, i, _, _ in group],
                           [output for _, _, output, _ in group], [sample for _, _, _, sample in group])

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        s = self.steps[i]
        if self.prediction == "epsilon":
            pred_original_sample = (sample - s.sqrt_beta * model_output) / s.sqrt_alpha
            pred_epsilon = model_output
        elif self.prediction == "sample":
            pred_original_sample = model_output
            pred_epsilon = (sample - s.sqrt_alpha * pred_original_sample) / s.sqrt_beta
        else:  # v_prediction
            pred_original_sample = s.sqrt_alpha * sample - s.sqrt_beta * model_output
            pred_epsilon = s.sqrt_alpha * model_output + s.sqrt_beta * sample
        if self.clip is not None:
            pred_original_sample = pred_original_sample.clamp(-self.clip, self.clip)
        pred_sample_direction = s.direction * pred_epsilon
        return s.sqrt_alpha_prev * pred_original_sample + pred_sample_direction


def step_batch(updates: Sequence[tuple[Stepper, int, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Each job's next sample, ``(stepper, step index, model output, sample)`` in, in order: jobs whose
    steppers batch (``batch_key``: same kind, configuration, device and dtypes) in one multi-tensor
    call per operation (module doc), any other job through its own ``step``."""
    news: list[torch.Tensor | None] = [None] * len(updates)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for n, (stepper, i, output, sample) in enumerate(updates):
        batch_key = getattr(stepper, "batch_key", None)
        key = batch_key(output, sample) if batch_key is not None else None
        if key is None:
            news[n] = stepper.step(i, output, sample)
        else:
            groups.setdefault(key, []).append(n)
    for key, members in groups.items():
        group = [updates[n] for n in members]
        if len(group) == 1:
            stepper, i, output, sample = group[0]
            results = [stepper.step(i, output, sample)]
        else:
            results = key[0].step_many(key, group)
        for n, new in zip(members, results):
            news[n] = new
    return news  # type: ignore[return-value]


def _batchable(output: torch.Tensor, sample: torch.Tensor) -> bool:
    return sample.device.type in _DEVICES and sample.dtype in _DTYPES and output.dtype in _DTYPES


def _ddim_batch(prediction: str, clip: float | None, steps: list[tuple[dict[str, Any], int]],
                outputs: list[torch.Tensor], samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """``DDIMStepper.step``'s expressions, operation by operation, over the jobs (``steps``: each
    job's number tables and step index)."""
    def times(xs: list[torch.Tensor], name: str) -> list[torch.Tensor]:  # ``scalar * x``
        return list(torch._foreach_mul(xs, [_multiplier(t[name], i, x) for (t, i), x in zip(steps, xs)]))

    def over(xs: list[torch.Tensor], name: str) -> list[torch.Tensor]:  # ``x / scalar``
        if xs[0].device.type == "cpu":  # divides by the scalar as it is
            return list(torch._foreach_div(xs, [t[name][torch.float32][i] for t, i in steps]))
        return list(torch._foreach_mul(xs, [t[name]["reciprocal"][i] for t, i in steps]))  # div_true_kernel_cuda

    if prediction == "epsilon":
        original = over(list(torch._foreach_sub(samples, times(outputs, "sqrt_beta"))), "sqrt_alpha")
        epsilon = outputs
    elif prediction == "sample":
        original = outputs
        epsilon = over(list(torch._foreach_sub(samples, times(original, "sqrt_alpha"))), "sqrt_beta")
    else:  # v_prediction
        original = list(torch._foreach_sub(times(samples, "sqrt_alpha"), times(outputs, "sqrt_beta")))
        epsilon = list(torch._foreach_add(times(outputs, "sqrt_alpha"), times(samples, "sqrt_beta")))
    if clip is not None:
        original = [x.clamp(-clip, clip) for x in original]
    return list(torch._foreach_add(times(original, "sqrt_alpha_prev"), times(epsilon, "direction")))


class FlowMatchStepper:
    """``FlowMatchEulerDiscreteScheduler.step`` (deterministic) with ``sigma_next - sigma`` per
    step precomputed; ``begin`` is the scheduler's begin index (the job's first step)."""

    stateless = True
    scales_input = False

    def __init__(self, scheduler: Any, begin: int, count: int) -> None:
        sigmas = scheduler.sigmas
        self.dts = [sigmas[i + 1] - sigmas[i] for i in range(begin, begin + count)]  # 0-d host tensors
        self.numbers = _operands(torch.stack(self.dts).float() if self.dts else torch.zeros(0))

    @staticmethod
    def supports(scheduler: Any) -> bool:
        return (type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
                and not scheduler.config.get("stochastic_sampling", False))

    def scale_input(self, sample: torch.Tensor, i: int) -> torch.Tensor:
        return sample

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        prev_sample = sample.to(torch.float32) + self.dts[i] * model_output
        return prev_sample.to(model_output.dtype)

    def batch_key(self, output: torch.Tensor, sample: torch.Tensor) -> tuple[Any, ...] | None:
        """As ``DDIMStepper.batch_key``; a sample in the output's dtype only (then the float32 sum
        rounded to that dtype is what the 16-bit addition computes)."""
        if not _batchable(output, sample) or sample.dtype != output.dtype:
            return None
        return (FlowMatchStepper, sample.device, sample.dtype)

    @staticmethod
    def step_many(key: tuple[Any, ...], group: list[tuple[Any, int, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        outputs = [output for _, _, output, _ in group]
        dts = [_multiplier(stepper.numbers, i, output) for (stepper, i, _, _), output in zip(group, outputs)]
        products = torch._foreach_mul(outputs, dts)
        return list(torch._foreach_add([sample for _, _, _, sample in group], products))


class SchedulerStepper:
    """Any other scheduler through its own ``step`` (stateful: the runner rolls it back on failure)."""

    stateless = False
    scales_input = True

    def __init__(self, scheduler: Any, timesteps: torch.Tensor, generator: torch.Generator) -> None:
        self.scheduler = scheduler
        self.timesteps = timesteps
        params = set(inspect.signature(scheduler.step).parameters)
        # eta/generator as ``prepare_extra_step_kwargs`` passes them (eta = 0, the pipeline default)
        self.kwargs: dict[str, Any] = {}
        if "eta" in params:
            self.kwargs["eta"] = 0.0
        if "generator" in params:
            self.kwargs["generator"] = generator

    def scale_input(self, sample: torch.Tensor, i: int) -> torch.Tensor:
        scale = getattr(self.scheduler, "scale_model_input", None)  # flow matching has none
        return sample if scale is None else scale(sample, self.timesteps[i])

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return self.scheduler.step(model_output, self.timesteps[i], sample, **self.kwargs, return_dict=False)[0]


def make_stepper(scheduler: Any, timesteps: torch.Tensor, generator: torch.Generator) -> Stepper:
    """The job's stepper: precomputed scalars where the scheduler is covered, else its own step.
    ``timesteps``: the job's schedule, which starts at the scheduler's begin index (0 if unset)."""
    if DDIMStepper.supports(scheduler):
        return DDIMStepper(scheduler, [int(t) for t in timesteps.tolist()])
    if FlowMatchStepper.supports(scheduler):
        return FlowMatchStepper(scheduler, int(getattr(scheduler, "begin_index", None) or 0), len(timesteps))
    return SchedulerStepper(scheduler, timesteps, generator)


__all__ = ["DDIMStepper", "FlowMatchStepper", "SchedulerStepper", "Stepper", "make_stepper", "step_batch"]
