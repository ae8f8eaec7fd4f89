"""Graph-replayed steps (``workers/engine/graphs.py``): the pool's policy, and on the CPU, with a
stand-in that replays by re-running the captured call on its static buffers, that a runner's
graphed steps compute exactly what its eager steps compute (the input plumbing: latents,
timesteps, text, staged caches and token indices copied in at every replay). Real CUDA graphs are
checked against eager steps by ``tests/test_gpu.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_plan_engine import _job, _runner_setup, _warm
from workers.engine.graphs import EagerReplay, StepGraphs
from workers.maskaware import TemplateCacheKey

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _double(ts):  # type: ignore[no-untyped-def]
    return ts[0] * 2 + ts[1]


def test_a_signature_is_captured_when_it_repeats_and_replayed_with_new_inputs() -> None:
    graphs = StepGraphs("cpu", repeats=2)
    a, b = torch.ones(3), torch.zeros(3)
    assert torch.equal(graphs.run("k", [a, b], _double), a * 2)
    assert graphs.captures == 0 and graphs.eager == 1
    out = graphs.run("k", [a, b], _double)  # second sighting: captured, then replayed
    assert graphs.captures == 1 and torch.equal(out, a * 2)
    out = graphs.run("k", [torch.full((3,), 5.0), torch.ones(3)], _double)
    assert graphs.replays == 2 and torch.equal(out, torch.full((3,), 11.0))


def test_the_pool_is_bounded_by_count_and_bytes_and_failed_captures_run_eagerly() -> None:
    graphs = StepGraphs("cpu", repeats=1, max_graphs=2, budget_bytes=10 * 4)
    for key in ("a", "b", "c"):
        graphs.run(key, [torch.ones(2), torch.ones(2)], _double)
    assert list(graphs._graphs) == ["b", "c"]  # least recently used evicted
    graphs.run("big", [torch.ones(8), torch.ones(8)], _double)  # 64 bytes > budget: never captured
    assert "big" not in graphs._graphs and graphs.static_bytes <= 40

    def broken(forward, static, pool):  # type: ignore[no-untyped-def]
        raise RuntimeError("operation not permitted when stream is capturing")

    failing = StepGraphs("cpu", repeats=1, capture=broken)
    for _ in range(3):
        assert torch.equal(failing.run("k", [torch.ones(2), torch.ones(2)], _double), torch.full((2,), 3.0))
    assert failing.captures == 0 and failing.eager == 3 and "k" in failing._failed


def test_after_a_few_failed_captures_no_other_signature_is_tried() -> None:
    """A model whose calls cannot be captured fails for every signature: each try costs an eager
    call and a capture, so after ``MAX_FAILED_CAPTURES`` signatures none is tried any more."""
    from workers.engine.graphs import MAX_FAILED_CAPTURES

    tried: list[int] = []

    def broken(forward, static, pool):  # type: ignore[no-untyped-def]
        tried.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = StepGraphs("cpu", repeats=1, capture=broken)
    for key in range(MAX_FAILED_CAPTURES + 3):
        out = graphs.run(key, [torch.ones(2), torch.ones(2)], _double)
        assert torch.equal(out, torch.full((2,), 3.0))
    assert len(tried) == MAX_FAILED_CAPTURES and graphs.eager == MAX_FAILED_CAPTURES + 3


def test_graphs_of_one_input_shape_share_their_buffers_and_replay_their_own_inputs() -> None:
    """Graphs whose inputs have the same shapes read the same static buffers (each replay copies
    its inputs in first), so interleaved replays of two graphs each compute from their own inputs;
    a buffer is freed with the last graph that reads it."""
    graphs = StepGraphs("cpu", repeats=1, max_graphs=2)

    def minus(ts):  # type: ignore[no-untyped-def]
        return ts[0] - ts[1]

    a, b, c = torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 5.0)
    graphs.run("double", [a, b], _double)
    graphs.run("minus", [a, b], minus)
    assert graphs.captures == 2 and graphs.static_bytes == 2 * 3 * 4  # two buffers, not four
    assert torch.equal(graphs.run("double", [c, a], _double), torch.full((3,), 11.0))
    assert torch.equal(graphs.run("minus", [b, c], minus), torch.full((3,), -3.0))
    assert torch.equal(graphs.run("double", [b, b], _double), torch.full((3,), 6.0))
    def head(ts):  # type: ignore[no-untyped-def]
        return ts[0][:3] * 2 + ts[1]

    graphs.run("wide", [torch.ones(5), torch.ones(3)], head)  # evicts "minus"; (3,)-buffers stay in use
    assert list(graphs._graphs) == ["double", "wide"] and graphs.static_bytes == 2 * 3 * 4 + 5 * 4
    graphs.run("wider", [torch.ones(7), torch.ones(3)], head)  # evicts "double": its second (3,) buffer freed
    assert list(graphs._graphs) == ["wide", "wider"] and graphs.static_bytes == (3 + 5 + 7) * 4
    assert torch.equal(graphs.run("wide", [torch.full((5,), 4.0), torch.ones(3)], head), torch.full((3,), 9.0))
    assert graphs.last == "replayed"


def test_graphed_runner_steps_equal_eager_steps(tmp_path: Path) -> None:
    """A template warm-up, then a batch of three masked edits and a full-compute job stepping
    together: the runner with graphs (captured at the second step, replayed after) gives the same
    latents as the runner without, bit for bit; a job joining mid-way changes the signature."""
    from workers.engine.sd_runner import SDRunner

    steps = 5
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        graphed = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, prefetch_steps=0, cache_plan="plan", graphs=True)
        assert graphed.graphs is not None and graphed.graphs.capture is EagerReplay
        graphed.graphs.min_horizon = 1  # these jobs are short: capture even near their end
        assert graphed.bucket_tokens and not runner.bucket_tokens
        runner.bucket_tokens = True  # the same computation eagerly (tests/test_token_buckets.py: against exact counts)
        results, replayed = {}, {}
        for name, r in (("eager", runner), ("graphed", graphed)):
            batch = [_job(r, "masked", key, steps, seed=10 + i) for i in range(3)]
            batch.append(_job(r, "full", None, steps, seed=20))
            late = _job(r, "masked", key, steps, seed=30)
            seen = replayed[name] = {id(j): 0 for j in batch + [late]}  # steps each job took from a replay
            for step in range(steps):
                r.step(batch)
                for job in batch:
                    job.steps_done += 1
                    seen[id(job)] += r.last_step_graph == "replayed"
                if step == 1:
                    batch.append(late)
            while not late.finished:
                r.step([late])
                late.steps_done += 1
                seen[id(late)] += r.last_step_graph == "replayed"
            results[name] = [j.state.latents for j in batch]
            assert all(r.result(j)["masked_steps"] == steps for j in batch if j.state.mode == "masked")
            assert [r.result(j)["graph_replayed_steps"] for j in batch] == [seen[id(j)] for j in batch]
        assert graphed.graphs.captures >= 2 and graphed.graphs.replays >= 4
        assert runner.last_step_graph == "off" and not any(replayed["eager"].values())
        assert 0 < min(replayed["graphed"].values()) and max(replayed["graphed"].values()) < steps
        for a, b in zip(results["eager"], results["graphed"]):
            assert torch.equal(a, b)
    finally:
        caches.close(wait=True)


def test_graphed_flux_steps_equal_eager_steps(tmp_path: Path) -> None:
    """Flux Fill: a warm-up, then three masked edits and a full-compute job; graphed steps (staged
    caches in one flat buffer, prepared token indices as inputs) equal eager ones bit for bit."""
    from tests.support.flux_world import FluxWorld

    world = FluxWorld(tmp_path)
    steps = world.steps
    runners = {g: world.runner(graphs=g) for g in (False, True)}
    runners[True].graphs.min_horizon = 1  # these jobs are short: capture even near their end
    runners[False].bucket_tokens = True  # the same computation eagerly
    try:
        _warm(runners[False], world.caches, world.key, steps,
              rec=world.job(runners[False], 9, **world.warm_meta("record")))
        latents = {}
        for g, runner in runners.items():
            batch = [world.job(runner, 20 + i, **world.warm_meta("masked")) for i in range(3)] + [world.job(runner, 5)]
            while not batch[0].finished:
                runner.step(batch)
                for j in batch:
                    j.steps_done += 1
            latents[g] = [j.state.latents for j in batch]
            assert all(runner.result(j)["masked_steps"] == steps for j in batch[:3])
        assert runners[True].graphs.captures >= 1 and runners[True].graphs.replays >= steps - 2
        for a, b in zip(latents[False], latents[True]):
            assert torch.equal(a, b)
    finally:
        world.caches.close(wait=True)


@pytest.mark.parametrize(("mode", "device", "expected"), [
    ("auto", "cuda", True), ("auto", "cuda:1", True), ("auto", "cpu", False), ("off", "cuda", False)])
def test_the_setting_turns_graphs_on_for_cuda_only(mode: str, device: str, expected: bool) -> None:
    from app.settings import Settings

    assert Settings(cuda_graphs=mode).cuda_graphs_for(device) is expected


def test_the_setting_rejects_unknown_values() -> None:
    from app.settings import Settings

    with pytest.raises(ValueError, match="STENCIL_CUDA_GRAPHS"):
        Settings(cuda_graphs="sometimes")


def test_a_signature_about_to_change_is_not_captured() -> None:
    graphs = StepGraphs("cpu", repeats=1, min_horizon=4)
    a, b = torch.ones(3), torch.zeros(3)
    for horizon in (3, 2, 1):  # the batch's first job finishes within three steps: stays eager
        assert torch.equal(graphs.run("k", [a, b], _double, horizon), a * 2)
    assert graphs.captures == 0 and graphs.eager == 3
    graphs.run("k", [a, b], _double, 4)
    assert graphs.captures == 1


def test_a_short_signature_that_comes_back_is_captured() -> None:
    """Under continuous batching a signature often recurs in short stretches (the step after a job
    joins a full batch): the first stretch is not captured (it may never come back), the second is,
    whatever its horizon, and later stretches replay."""
    graphs = StepGraphs("cpu", repeats=2, min_horizon=4)
    a, b = torch.ones(3), torch.zeros(3)
    for horizon in (3, 2):
        graphs.run("short", [a, b], _double, horizon)
    graphs.run("other", [a, b], _double, 9)
    assert graphs.captures == 0 and graphs.eager == 3
    assert torch.equal(graphs.run("short", [a, b], _double, 1), a * 2)  # back: captured though about to end
    assert graphs.captures == 1 and graphs.last == "captured"
    graphs.run("other", [a, b], _double, 9)
    out = graphs.run("short", [torch.full((3,), 2.0), b], _double, 1)
    assert graphs.last == "replayed" and torch.equal(out, torch.full((3,), 4.0))


def _graphed_runner(unet, ctrl, caches, cfg, **options):  # type: ignore[no-untyped-def]
    from workers.engine.sd_runner import SDRunner

    runner = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, prefetch_steps=0, cache_plan="plan", graphs=True,
                      **options)
    assert runner.graphs is not None and runner.graphs.capture is EagerReplay
    runner.graphs.min_horizon = 1  # these jobs are short: capture even near their end
    return runner


def test_refresh_steps_are_graphed_and_equal_eager_steps(tmp_path: Path) -> None:
    """A refresh step (the job records its activations to re-anchor its offset) replays a graph
    too: what it records is among the graph's outputs, copied out before the next replay. Three
    identical batches one after the other, two of three jobs refreshing at step 2: the third
    replays every step, its refresh step included, and every batch equals the eager runner's steps
    bit for bit."""
    steps = 5  # three batches: a signature is captured the second time it runs, replayed the third
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        graphed = _graphed_runner(unet, ctrl, caches, cfg)
        runner.bucket_tokens = True  # the same computation eagerly
        latents, outcomes = {}, {}
        for name, r in (("eager", runner), ("graphed", graphed)):
            latents[name], outcomes[name] = [], []
            for _ in range(3):
                batch = [_job(r, "masked", key, steps, seed=10 + i) for i in range(3)]
                for job in batch[1:]:
                    job.state.refresh = frozenset({2})
                ran = []
                for _step in range(steps):
                    r.step(batch)
                    ran.append(r.last_step_graph)
                    for job in batch:
                        job.steps_done += 1
                outcomes[name].append(ran)
                latents[name] += [j.state.latents for j in batch]
                assert [r.result(j)["refresh_steps"] for j in batch] == [0, 1, 1]
        assert outcomes["eager"] == [["off"] * steps] * 3
        assert outcomes["graphed"][1][2] == "captured" and outcomes["graphed"][2] == ["replayed"] * steps, outcomes
        for a, b in zip(latents["eager"], latents["graphed"]):
            assert torch.equal(a, b)
    finally:
        caches.close(wait=True)


def test_the_gpu_workers_runner_replays_graphs_for_steps_without_controlnets(tmp_path: Path) -> None:
    """The GPU worker's runner computes ControlNets concurrently with the UNet's down path; a step
    with no ControlNet input is graphed like any other (a step with one runs eagerly: its residuals
    arrive from another thread)."""
    from workers.controlnets.bank import ControlNetBank

    steps = 5
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        graphed = _graphed_runner(unet, ctrl, caches, cfg, controlnets=ControlNetBank(lambda i: None, 1 << 30),
                                  controlnet_parallel=True)
        assert graphed.concurrent is not None
        batch = [_job(graphed, "masked", key, steps, seed=10 + i) for i in range(2)]
        for _step in range(steps):
            graphed.step(batch)
            for job in batch:
                job.steps_done += 1
        assert graphed.graphs.captures == 1 and graphed.graphs.replays == steps - 1
    finally:
        caches.close(wait=True)


def test_a_graph_keeps_the_row_indices_its_call_read_past_the_memo() -> None:
    """A captured graph reads memoized row indices by address: its entry keeps each one it read
    alive, so clearing the memo cannot free memory a replay reads."""
    from workers.maskaware import tokens

    def select(ts):  # type: ignore[no-untyped-def]
        return ts[0].index_select(0, tokens.row_index((2, 0), ts[0].device))

    graphs = StepGraphs("cpu", repeats=1)
    graphs.run("k", [torch.arange(3.0)], select)
    read = tokens.row_index((2, 0), "cpu")
    tokens._ROW_INDEX.clear()
    assert any(t is read for t in graphs._graphs["k"].held)
    assert torch.equal(graphs.run("k", [torch.arange(3.0) + 1], select), torch.tensor([3.0, 1.0]))


def test_graph_outputs_count_against_the_pool_budget() -> None:
    """Each graph owns its output (a refresh step's recorded activations among it): the pool
    evicts least recently used graphs once inputs and outputs pass the budget."""
    def wide(ts):  # type: ignore[no-untyped-def]
        return ts[0].repeat(4)  # an output four times its input

    graphs = StepGraphs("cpu", repeats=1, budget_bytes=100)
    for key in ("a", "b", "c"):
        graphs.run(key, [torch.ones(4)], wide)  # 16 bytes of shared input, 64 bytes of output each
    assert list(graphs._graphs) == ["c"] and graphs.static_bytes + graphs.output_bytes <= 100


def test_no_step_graphs_under_a_compile_mode_with_graphs_of_its_own() -> None:
    """``reduce-overhead`` and ``max-autotune`` replay CUDA graphs themselves, which cannot be
    captured inside a step graph: the runner then steps eagerly, even where graphs were asked for
    (a CUDA worker asks for them by default)."""
    from workers.engine.graphs import step_graphs

    cpu = torch.device("cpu")
    assert step_graphs(cpu, True, "reduce-overhead") is None
    assert step_graphs(cpu, True, "Max-Autotune") is None
    assert isinstance(step_graphs(cpu, True, "default"), StepGraphs)
    assert step_graphs(cpu, None, "off") is None  # off CUDA by default
