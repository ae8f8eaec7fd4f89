"""``ops.bench.gpu_step --parts compiled``'s steps (``CompiledSteps``) compute what the engine's steps
compute: the compiled variants replay from a graph pool of their own, swap the controller's kernels
only for their call, and give the eager kernels' outputs. Inductor itself is replaced by the
identity here (a real compilation takes minutes on this CPU: the benchmark runs it on a GPU,
``GPU_CHECKS=compiled bash ops/gpu_checks.sh``); what the compiled kernels compute is
``tests/test_compiled.py``'s."""

from __future__ import annotations

import argparse

import pytest
import torch

from ops.bench import gpu_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("model", ["sd15", "flux"])
def test_compiled_steps_run_in_their_own_graphs_and_equal_the_eager_kernels(
        model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "compile", lambda fn, **_kwargs: fn)
    args = argparse.Namespace(quick=True, dtype="float32", seed=0, results={}, models=[model])
    cpu = torch.device("cpu")
    case = (gpu_step.flux_case(args, cpu, [0.2], compiled=True) if model == "flux"
            else gpu_step.unet_case(model, args, cpu, ratios=[0.2], compiled=True))
    steps = case.compiled
    assert steps is not None and steps.graphs in case.graphs and len(case.graphs) == 2  # a pool of its own
    kernels = steps.ctrl.kernels
    with torch.no_grad():
        for step in ("full", "masked 0.2"):
            want = case.calls[f"{step} graph"]()
            for variant in gpu_step.COMPILE_VARIANTS:
                got = case.calls[f"{step} {variant}"]()
                assert steps.ctrl.kernels is kernels, variant  # swapped for the call only
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{step} {variant}")
    assert steps.graphs.captures > 0  # the compiled variants' graph calls captured (replayed) here
    assert steps.fallbacks() == []


def test_a_variant_that_fails_is_reported_and_the_others_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The part runs to its report when a variant's first call raises (on a GPU: a capture or a
    compilation that fails), naming the error; the other variants are timed."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_kwargs: fn)
    add_masked = gpu_step.CompiledSteps.add_masked

    def failing_reduce_overhead(self: gpu_step.CompiledSteps, case: gpu_step.Case, ratio: float,
                                *calls: object) -> None:
        add_masked(self, case, ratio, *calls)  # type: ignore[arg-type]

        def fail() -> None:
            raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")
        case.calls[f"masked {ratio:g} reduce-overhead"] = fail

    monkeypatch.setattr(gpu_step.CompiledSteps, "add_masked", failing_reduce_overhead)
    args = argparse.Namespace(quick=True, dtype="float32", seed=0, results={}, models=["sd15"], ratios=[0.2],
                              rounds=1, reps=1)
    lines = gpu_step.part_compiled(args, torch.device("cpu"))
    result = args.results["compiled"]["sd15"]
    assert set(result["errors"]) == {"masked 0.2 reduce-overhead"}
    assert set(result["ms"]) == {"full graph", "full graph compiled", "full reduce-overhead", "masked 0.2 graph",
                                 "masked 0.2 graph compiled"}
    report = "\n".join(lines)
    assert "| failed |" in report and "overwritten" in report
