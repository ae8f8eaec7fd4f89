"""On a GPU (``gpu`` marker: skipped where CUDA is not available; run them on a GPU machine with
``pytest -m gpu -p no:xdist tests/test_gpu.py``): graph-replayed steps equal eager steps, a steady
mask-aware step makes no host synchronisation and an engine step none either, its one wait being for
the event after the step before's flags (so a step returns while its device work runs), and results
on the GPU equal the stock diffusers
pipeline on the same GPU (bfloat16: full compute within 1/255 for a job alone, 2/255 batched; the
exact mask-aware path within 2/255); ``stencil serve --device cuda`` serves an edit with its engine
and stages on the GPU."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

CUDA = "cuda"


def _sd_world(tmp_path: Path, graphs: bool | None, resnets: str = "full"):  # type: ignore[no-untyped-def]
    """The SDXL-layout test UNet in bfloat16 on the GPU with a provider staging onto it
    (``resnets="masked"``: its ResNets mask-aware too, ``workers/maskaware/resnets.py``)."""
    from app.storage.local import LocalStore
    from tests.test_maskaware_unet import sdxl_style_unet
    from tests.test_plan_engine import _job
    from workers.engine.sd_runner import SDRunner
    from workers.engine.template_cache import CacheRecorder, StepCacheProvider
    from workers.maskaware import ActivationStore, MaskAwareUNet
    from workers.models.tiny_sd import build_scheduler

    unet = sdxl_style_unet().to(CUDA, torch.bfloat16)
    ctrl = MaskAwareUNet(unet, resnets=resnets)
    acts = ActivationStore(LocalStore(tmp_path / "store"))
    caches = StepCacheProvider(acts, 1 << 30, device=CUDA)
    caches.dtype = torch.bfloat16
    cfg = dict(build_scheduler().config) | {"_class_name": "DDIMScheduler"}
    runner = SDRunner(unet, cfg, CUDA, maskaware=ctrl, caches=caches, recorder=CacheRecorder(acts), prefetch_steps=0,
                      graphs=graphs)
    return unet, ctrl, runner, caches, cfg, _job


@pytest.fixture()
def warmed(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The SD world on the GPU (graphs off) with a bfloat16 template warmed and resident."""
    from tests.test_plan_engine import _warm
    from workers.maskaware import TemplateCacheKey

    steps = 6
    unet, ctrl, runner, caches, cfg, job = _sd_world(tmp_path, graphs=False)
    key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout + "@bfloat16")
    try:
        _warm(runner, caches, key, steps)
        yield unet, ctrl, runner, caches, cfg, job, key, steps
    finally:
        caches.close(wait=True)


@pytest.mark.parametrize("burst", [True, False], ids=["one-step", "two-steps"])
def test_packed_pinned_steps_stage_on_cuda_as_decoding_each_tensor_does(burst: bool) -> None:
    """A GPU host's tier keeps a step in one pinned buffer: staging two jobs' steps (one copy per
    buffer, then one kernel per tensor for both jobs through a strided view, shared rows broadcast
    on the device, offsets in one multi-tensor add) gives what decoding each tensor on the GPU
    gives, bit for bit; both jobs at one template step (``burst``) or at two steps."""
    from workers.engine import cache_codec
    from workers.engine.staging import CacheStager, pack

    g = torch.Generator().manual_seed(0)
    stored: list[dict[str, torch.Tensor]] = [{}, {}]
    for step in stored:
        for b in range(4):
            for kind in ("k", "v", "y"):
                rows = 1 if b % 2 else 2  # shared and per-row tensors
                step[f"b{b}.{kind}"] = cache_codec.encode_tensor(f"b{b}.{kind}",
                                                                 torch.randn(rows, 64, 32, generator=g), "int8")
    if burst:
        stored[1] = stored[0]
    packed = [pack(step, pin=True) for step in stored]
    assert all(p.buffer.is_pinned() for p in packed)
    delta = {k: torch.randn(2, 64, 32, generator=g).to(CUDA, torch.bfloat16) for k in stored[0]}
    steps = [cache_codec.DecodedStep(packed[0], torch.bfloat16, None, 2),
             cache_codec.DecodedStep(packed[0] if burst else packed[1], torch.bfloat16, None, 2)]
    staged = CacheStager(CUDA).take_batch([("a", 0, steps[0], None), ("b", 0, steps[1], delta)])
    torch.cuda.synchronize()
    for name in stored[0]:
        want = [cache_codec.decode_tensor(step[name], torch.bfloat16, CUDA, 2) for step in stored]
        assert torch.equal(staged[0][name], want[0]), name
        assert torch.equal(staged[1][name], delta[name] + want[1]), name


@pytest.mark.parametrize("kind", ["offset", "mapping"])
def test_staging_adds_an_offset_only_once_the_compute_stream_has_written_it(kind: str) -> None:
    """A job's offset is made on the compute stream (after a refresh step) and added to its staged
    cache on the stager's side stream: the side stream waits for it. The offset is made behind a
    long kernel here, so a side stream that did not wait would add memory not yet written."""
    from workers.engine.staging import CacheStager, Offset

    base = torch.zeros(2, 256, 64).pin_memory()
    own = torch.ones(2, 256, 64, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of the compute stream before the offset is written
    tensors = {"b.k": own * 3}
    delta = Offset.made_now(tensors) if kind == "offset" else tensors
    staged = CacheStager(CUDA).take_batch([("a", 0, {"b.k": base}, delta)])
    torch.cuda.synchronize()
    assert torch.equal(staged[0]["b.k"], torch.full_like(own, 3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_guidance_on_cuda_equals_each_jobs_expression(dtype: torch.dtype) -> None:
    """The multi-tensor guidance kernels compute what the pipeline's per-job expression computes on
    the GPU too (scalars in the kernels' float arithmetic), bit for bit."""
    from tests.test_step_epilogue import _job
    from workers.engine.sd_runner import SDRunner

    batch = [_job("a", guidance=7.5), _job("b", do_cfg=False), _job("c", guidance=3.3), _job("d", guidance=11.0)]
    output = torch.randn(7, 4, 64, 64, generator=torch.Generator().manual_seed(0)).to(CUDA, dtype)
    got, row = SDRunner._guided_batch(None, batch, output), 0  # type: ignore[arg-type]
    for job, pred in zip(batch, got):
        rows = output[row:row + job.state.rows]
        row += job.state.rows
        if job.state.do_cfg:
            uncond, cond = rows.chunk(2)
            rows = uncond + job.state.guidance * (cond - uncond)
        assert torch.equal(pred, rows), job.job_id


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prediction,clip", [("epsilon", False), ("sample", False), ("v_prediction", False),
                                             ("epsilon", True)])
def test_a_batch_of_ddim_updates_on_cuda_equals_each_jobs_own_step(prediction: str, clip: bool,
                                                                    dtype: torch.dtype) -> None:
    """The multi-tensor DDIM update reproduces CUDA's host-scalar arithmetic (a multiplication by
    the scalar as it is, a division as a multiplication by its float32 reciprocal), bit for bit."""
    from tests.test_stepper import _jobs
    from workers.engine.stepper import step_batch

    jobs = [(stepper, i, output.to(CUDA), sample.to(CUDA))
            for stepper, i, output, sample in _jobs(prediction, clip, dtype)]
    for (stepper, i, output, sample), new in zip(jobs, step_batch(jobs)):
        assert new.device.type == CUDA and new.dtype == dtype
        assert torch.equal(new, stepper.step(i, output, sample)), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_flow_matching_updates_on_cuda_equals_each_jobs_own_step(dtype: torch.dtype) -> None:
    """Flux's Euler update batched: the scalar as it is (no cast on CUDA), the 16-bit sum, bit for bit."""
    from tests.test_stepper import _flow_jobs
    from workers.engine.stepper import step_batch

    jobs = [(stepper, i, output.to(CUDA), sample.to(CUDA)) for stepper, i, output, sample in _flow_jobs(dtype)]
    for (stepper, i, output, sample), new in zip(jobs, step_batch(jobs)):
        assert new.device.type == CUDA and new.dtype == dtype
        assert torch.equal(new, stepper.step(i, output, sample)), i


def test_graph_replayed_steps_equal_eager_steps_on_cuda(warmed) -> None:  # type: ignore[no-untyped-def]
    from workers.engine.graphs import CudaGraphCall
    from workers.engine.sd_runner import SDRunner

    unet, ctrl, runner, caches, cfg, job, key, steps = warmed
    graphed = SDRunner(unet, cfg, CUDA, maskaware=ctrl, caches=caches, prefetch_steps=0)
    assert graphed.graphs is not None and graphed.graphs.capture is CudaGraphCall  # on by default on CUDA
    assert ctrl.ragged_on(CUDA) and not graphed.bucket_tokens  # ragged indices: no per-job token buckets
    runner.bucket_tokens = graphed.bucket_tokens  # the graphed runner's computation, eagerly
    latents = {}
    for name, r in (("eager", runner), ("graphed", graphed)):
        batch = [job(r, "masked", key, steps, seed=10 + i) for i in range(3)] + [job(r, "full", None, steps, seed=20)]
        while not batch[0].finished:
            r.step(batch)
            for j in batch:
                j.steps_done += 1
        latents[name] = [j.state.latents for j in batch]
    assert graphed.graphs.captures >= 1 and graphed.graphs.replays >= steps - 2
    for a, b in zip(latents["eager"], latents["graphed"]):
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())


def test_a_capture_keeps_the_cached_device_memory_and_replays_its_call() -> None:
    """A capture while serving neither synchronizes nor empties the caching allocator (the
    ``torch.cuda.graph`` context would give its freed blocks back to the driver), and its replay
    computes the call on the current inputs."""
    from workers.engine.graphs import CudaGraphCall

    big = torch.empty(256 << 20, dtype=torch.uint8, device=CUDA)
    del big  # freed into the cache
    reserved = torch.cuda.memory_reserved()
    x = torch.randn(64, 64, device=CUDA)
    call = CudaGraphCall(lambda static: static[0] @ static[0] + 1, [x], torch.cuda.graph_pool_handle())
    assert torch.cuda.memory_reserved() >= reserved
    x.copy_(torch.randn(64, 64, device=CUDA))
    call.replay()
    torch.testing.assert_close(call.output, x @ x + 1)


def test_refresh_steps_replay_cuda_graphs_and_equal_eager_steps(warmed) -> None:  # type: ignore[no-untyped-def]
    """Refresh steps (jobs recording their activations) captured and replayed as CUDA graphs: three
    identical batches, two jobs refreshing at step 2; the third replays every step and every batch
    equals the eager runner's."""
    from workers.engine.sd_runner import SDRunner

    unet, ctrl, runner, caches, cfg, job, key, steps = warmed
    graphed = SDRunner(unet, cfg, CUDA, maskaware=ctrl, caches=caches, prefetch_steps=0)
    graphed.graphs.min_horizon = 1  # type: ignore[union-attr]
    runner.bucket_tokens = graphed.bucket_tokens
    latents: dict[str, list[torch.Tensor]] = {}
    ran: list[str] = []
    for name, r in (("eager", runner), ("graphed", graphed)):
        latents[name] = []
        for _ in range(3):
            batch = [job(r, "masked", key, steps, seed=10 + i) for i in range(3)]
            for j in batch[1:]:
                j.state.refresh = frozenset({2})
            ran = []
            while not batch[0].finished:
                r.step(batch)
                ran.append(r.last_step_graph)
                for j in batch:
                    j.steps_done += 1
            latents[name] += [j.state.latents for j in batch]
    assert ran == ["replayed"] * steps, ran
    for a, b in zip(latents["eager"], latents["graphed"]):
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ragged_attention_takes_queries_as_columns_of_one_fused_projection(dtype: torch.dtype) -> None:
    """The fused projections (``workers/fused_projections.py``) hand attention its queries as the
    first columns of one [T, 3C] GEMM output, row stride 3C: the variable-length kernels take them
    as they are and give what they give for the same queries made contiguous."""
    from workers.maskaware import varlen

    torch.manual_seed(0)
    rows, length, heads, hd = 3, 64, 4, 64
    width = heads * hd
    cu_q = torch.tensor([0, 10, 15, 52], device="cuda")
    qkv = torch.randn(52, 3 * width, device="cuda", dtype=dtype)
    k = torch.randn(rows, length, width, device="cuda", dtype=dtype)
    v = torch.randn(rows, length, width, device="cuda", dtype=dtype)
    columns = qkv.split(width, dim=-1)[0]
    assert not columns.is_contiguous()
    out = varlen.attend(columns, k, v, cu_q, heads, length)
    assert torch.equal(out, varlen.attend(columns.contiguous(), k, v, cu_q, heads, length))


def test_a_ragged_graph_replays_other_counts_on_cuda_and_equals_the_per_group_path() -> None:
    """Ragged batch indices on CUDA (the variable-length attention kernel): steps whose jobs' counts
    differ but whose totals share a bucket replay one CUDA graph, and each replay equals the eager
    ragged step bit for bit and the per-group path (SDPA per job) to bfloat16 rounding; a step of
    fewer tokens (within ``WIDEN_LIMIT``) replays it with its indices padded up to it."""
    from tests.test_maskaware_unet import LATENT, tiny_unet
    from workers.engine.graph_calls import unet_call
    from workers.engine.graphs import CudaGraphCall, StepGraphs
    from workers.engine.staging import CacheStager
    from workers.maskaware import MaskAwareUNet, RowGroup

    unet = tiny_unet(0).to(CUDA, torch.bfloat16)
    ctrl = MaskAwareUNet(unet)
    assert ctrl.ragged_on(CUDA)

    def blocks(spans: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
        latent = torch.zeros(LATENT, dtype=torch.bool)
        for by, bx in spans:
            latent[4 * by:4 * by + 4, 4 * bx:4 * bx + 4] = True
        return ctrl.token_masks(latent, LATENT).prepare(CUDA)

    def strip():  # type: ignore[no-untyped-def]
        latent = torch.zeros(LATENT, dtype=torch.bool)
        latent[0:4, 0:6] = True
        return ctrl.token_masks(latent, LATENT).prepare(CUDA)

    layouts = [[blocks([(0, 0), (0, 1)]), blocks([(2, 2)])], [blocks([(3, 3)]), blocks([(1, 0), (1, 1)])],
               [blocks([(2, 0)]), blocks([(0, 3), (3, 0)])],
               [strip(), blocks([(2, 2)])]]  # fewer tokens (80 against 112 at the finest level): padded up
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 9, *LATENT, generator=g) + 0.1 * torch.arange(4).view(-1, 1, 1, 1)).to(CUDA, torch.bfloat16)
    t = torch.tensor([981, 501, 981, 501], device=CUDA)
    e = torch.randn(4, 6, 32, generator=g).to(CUDA, torch.bfloat16)
    with torch.no_grad(), ctrl.batch([RowGroup(2, "record") for _ in range(2)]) as ctx:
        unet(x, t, encoder_hidden_states=e)
    recorded = [dict(r) for r in ctx.recorded]
    stager = CacheStager(CUDA)
    graphs = StepGraphs(CUDA, repeats=2)
    assert graphs.capture is CudaGraphCall
    for step, masks in enumerate(layouts):
        outs = {}
        for name in ("graph", "eager", "per group"):
            staged = stager.take_batch([(f"{name}{i}", step, r, None) for i, r in enumerate(recorded)])
            groups = [RowGroup(2, "masked", token_mask=m, cache=s) for m, s in zip(masks, staged)]
            with torch.no_grad():
                if name == "graph":
                    out, _ = unet_call(graphs, unet, ctrl, (x, t), {"encoder_hidden_states": e}, groups,
                                       torch.device(CUDA))
                else:
                    with ctrl.batch(groups, build_index=name == "eager"):
                        out = unet(x, t, encoder_hidden_states=e).sample
            outs[name] = out.float().clone()
        assert graphs.last == ("eager", "captured", "replayed", "replayed")[step]
        assert graphs.widened == (step == 3)
        if step < 3:  # the same shapes: bit for bit (a widened step's GEMMs have more rows)
            assert torch.equal(outs["graph"], outs["eager"]), (step, float((outs["graph"] - outs["eager"]).abs().max()))
        assert torch.allclose(outs["graph"], outs["eager"], atol=3e-2, rtol=3e-2)
        assert torch.allclose(outs["graph"], outs["per group"], atol=3e-2, rtol=3e-2), \
            (step, float((outs["graph"] - outs["per group"]).abs().max()))


def test_a_steady_masked_forward_never_synchronises_and_a_step_once(warmed) -> None:  # type: ignore[no-untyped-def]
    from workers.maskaware import RowGroup
    from workers.maskaware.tokens import blob_mask

    unet, ctrl, runner, caches, cfg, job, key, steps = warmed
    # The model forward of a staged masked job: not one synchronising operation.
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 9, 16, 16, generator=g).to(CUDA, torch.bfloat16), torch.tensor([500, 500], device=CUDA),
            torch.randn(2, 7, unet.config.cross_attention_dim, generator=g).to(CUDA, torch.bfloat16))
    masks = ctrl.token_masks(blob_mask(128, 128, 0.2, seed=3), (16, 16)).prepare(CUDA)
    staged = runner.stager.take("x", 0, caches.ready(key, 0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad(), ctrl.batch([RowGroup(2, "masked", token_mask=masks, cache=staged)]):
            unet(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # A steady engine step of three masked jobs: no synchronising operation, one wait (for the event
    # after the step before's finiteness flags reached pinned memory).
    batch = [job(runner, "masked", key, steps, seed=10 + i) for i in range(3)]
    runner.step(batch)
    for j in batch:
        j.steps_done += 1
    assert _step_syncs(runner, batch) == ([], 1)


def test_masked_resnets_replay_cuda_graphs_equal_to_eager_steps_and_never_synchronise(tmp_path: Path) -> None:
    """Mask-aware ResNets on the GPU: a steady masked forward has no synchronising operation, and
    graph-replayed steps of two masks (their gathers among the graph's inputs) equal eager ones."""
    from tests.test_masked_resnets import RUNNER_LATENT, _resnet_twins
    from tests.test_plan_engine import _warm
    from workers.engine.sd_runner import SDRunner
    from workers.maskaware import RowGroup, TemplateCacheKey

    steps, lat = 6, RUNNER_LATENT
    unet, ctrl, runner, caches, cfg, job = _sd_world(tmp_path, graphs=False, resnets="masked")
    key = TemplateCacheKey("t", "tpl", lat[0] * 8, lat[1] * 8, "ddim", steps, 1.0, "cfg2",
                           ctrl.cache_layout + "@bfloat16")
    try:
        _warm(runner, caches, key, steps, latent=lat)
        first, twin = _resnet_twins(ctrl, lat)
        steady = job(runner, "masked", key, steps, seed=first, ratio=0.05, latent=lat).state
        g = torch.Generator().manual_seed(0)
        args = (torch.randn(2, 9, *lat, generator=g).to(CUDA, torch.bfloat16), torch.tensor([500, 500], device=CUDA),
                torch.randn(2, 6, unet.config.cross_attention_dim, generator=g).to(CUDA, torch.bfloat16))
        staged = runner.stager.take("x", 0, caches.ready(key, 0))
        groups = [RowGroup(2, "masked", token_mask=steady.token_masks, cache=staged)]
        with torch.no_grad(), ctrl.batch(groups):
            unet(*args)  # the first call of a composition builds its gathers on the host
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad(), ctrl.batch(groups):
                unet(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graphed = SDRunner(unet, cfg, CUDA, maskaware=ctrl, caches=caches, prefetch_steps=0)
        graphed.graphs.min_horizon = 1
        runner.bucket_tokens = graphed.bucket_tokens
        assert ctrl.resnets.bucketed  # eager steps now pad the ResNets' columns as graphed ones do
        latents = {}
        for name, r in (("eager", runner), ("graphed", graphed)):
            latents[name] = []
            for seed in (first, twin):
                j = job(r, "masked", key, steps, seed=seed, ratio=0.05, latent=lat)
                while not j.finished:
                    r.step([j])
                    j.steps_done += 1
                latents[name].append(r.result(j)["latents"])
        assert graphed.graphs.replays >= steps
        for a, b in zip(latents["eager"], latents["graphed"]):
            assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
    finally:
        caches.close(wait=True)


def test_an_engine_step_returns_while_its_device_work_runs(warmed) -> None:  # type: ignore[no-untyped-def]
    """A step's one read is of the step before it (``workers/engine/settle.py``): with the device kept
    busy ahead of a step, the step returns while its work is still queued, and reading it (``settle``)
    waits for that work."""
    unet, ctrl, runner, caches, cfg, job, key, steps = warmed
    batch = [job(runner, "masked", key, steps, seed=30 + i) for i in range(2)]
    runner.step(batch)
    for j in batch:
        j.steps_done += 1
    runner.settle()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(500_000_000)  # a quarter of a second or more of device work ahead of the step
    runner.step(batch)
    assert not stream.query()  # the step returned, its work (behind the sleep) not done
    runner.settle()  # waits for it
    assert runner.failures() == [] and not runner.unread(batch[0])


def test_admitting_a_job_does_not_wait_for_the_step_in_flight(warmed) -> None:  # type: ignore[no-untyped-def]
    """A job's tensors and token indices go up from pinned memory on a copy stream
    (``app.storage.hostcache.to_device``): building its state while the device is busy makes no
    synchronising operation and does not wait."""
    from tests.test_plan_engine import _job_inputs

    unet, ctrl, runner, caches, cfg, job, key, steps = warmed
    runner.init_state(*_job_inputs("masked", key, steps, seed=41))  # first use: one-time set-up
    tensors, meta = _job_inputs("masked", key, steps, seed=40)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda._sleep(200_000_000)  # the step in flight
            state = runner.init_state(tensors, meta)
            busy = not torch.cuda.current_stream().query()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if "synchroniz" in str(w.message)] == []
    assert busy
    assert torch.equal(state.latents.cpu(), tensors["latents"].to(torch.bfloat16))


def _step_syncs(runner, batch) -> tuple[list[str], int]:  # type: ignore[no-untyped-def]
    """What one engine step of ``batch`` waits on: its synchronising operations (CUDA's sync debug
    mode warnings) and its waits for events."""
    waits = []
    wait = torch.cuda.Event.synchronize

    def counted(event: torch.cuda.Event) -> None:
        waits.append(event)
        wait(event)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    torch.cuda.Event.synchronize = counted  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.step(batch)
    finally:
        torch.cuda.Event.synchronize = wait  # type: ignore[method-assign]
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)], len(waits)


def test_steady_turbo_steps_synchronise_once(warmed) -> None:  # type: ignore[no-untyped-def]
    """Temporal reuse adds no synchronisation: its per-patch errors ride on the step's one wait
    (a pinned, non-blocking copy) and its patch indices go up without waiting."""
    from workers.maskaware.reuse_rule import ThresholdRule

    unet, ctrl, runner, caches, cfg, job, key, steps = warmed
    assert steps >= 4
    runner.reuse_rule = ThresholdRule(10.0)  # every measured patch reused (at most twice in a row)
    try:
        batch = [job(runner, "masked", key, steps, seed=20 + i) for i in range(3)]
        _assert_turbo_steps_synchronise_once(runner, batch, steps, 5.0, list(ctrl.units))
    finally:
        runner.reuse_rule = None


def _assert_turbo_steps_synchronise_once(runner, batch, steps: int, guidance: float,  # type: ignore[no-untyped-def]
                                         units: list[str]) -> None:
    """The jobs as ``turbo`` under the runner's rule: step 0 computes and measures every patch,
    steps 1 and 2 reuse some, each with no synchronising operation and one wait (temporal reuse
    reads its own step at once)."""
    from workers.maskaware.reuse import TemporalReuse

    for j in batch:
        j.state.reuse = TemporalReuse(runner.reuse_rule, steps, frozenset(), guidance, units,
                                      max_tokens=runner._full_tokens(j.state))
    runner.step(batch)
    for j in batch:
        j.steps_done += 1
    for _ in range(2):
        assert _step_syncs(runner, batch) == ([], 1)
        for j in batch:
            j.steps_done += 1
    assert all(j.state.reuse.reused > 0 for j in batch)


@pytest.mark.parametrize("family", ["sd", "flux"])
def test_results_on_cuda_equal_the_stock_pipeline_on_cuda(family: str, tmp_path: Path) -> None:
    from tests.test_bf16_exactness import _jobs, _world
    from tests.test_lora_engine import run_engine
    from workers.maskaware.activation_store import TemplateCacheKey
    from workers.models.loader import scheduler_config

    svc = _world(family, tmp_path, Path("unused"), device=CUDA)
    jobs = _jobs(family)
    prepared = [svc.prepare(p) for p in jobs]
    alone = run_engine(svc.runner, prepared[:1])[0][0]
    together, _ = run_engine(svc.runner, prepared)
    stock = [svc.stock(p) for p in jobs]  # deterministic: one stock run per job serves every check of it
    for i, out, tol in ((0, alone, 1), (0, together[0], 2), (1, together[1], 2)):
        params = jobs[i]
        diff = int(np.abs(svc.decode(out["latents"]) - stock[i]).max())
        assert diff <= tol, f"{family} seed {params.seed}: {diff}/255 from the stock pipeline on CUDA"
    params = jobs[0]
    layout = ("flux-kv-roped" if family == "flux" else "kv+y") + "@bfloat16/exact-x"
    key = TemplateCacheKey("m", "t", 128, 128, str(scheduler_config(svc.folder)["_class_name"]), params.steps, 1.0,
                           "single" if family == "flux" else "cfg2", layout)
    rec, _ = run_engine(svc.runner, [svc.prepare(params, cache_mode="record", cache_key=key.to_dict())])
    rec[0]["commit"].result(60)
    for step in range(params.steps):
        assert svc.runner.caches.wait(key, step, 30) is not None
    out, _ = run_engine(svc.runner, [svc.prepare(params, cache_mode="masked", cache_key=key.to_dict())])
    assert out[0]["masked_steps"] == params.steps
    diff = int(np.abs(svc.decode(out[0]["latents"]) - stock[0]).max())
    assert diff <= 2, f"{family}: exact mask-aware path {diff}/255 from the stock pipeline on CUDA"


def test_steady_flux_turbo_steps_synchronise_once(tmp_path: Path) -> None:
    """Flux's temporal reuse (``flux_reuse``) adds no synchronisation either: three bfloat16 jobs
    reusing part of their patches, one read per engine step."""
    from tests.support.flux_world import FluxWorld
    from tests.test_plan_engine import _warm
    from tests.test_temporal_reuse import Alternate

    world = FluxWorld(tmp_path, steps=6, size=(128, 128), device=CUDA, dtype=torch.bfloat16)
    runner = world.runner(graphs=False)
    try:
        _warm(runner, world.caches, world.key, world.steps, rec=world.job(runner, 9, **world.warm_meta("record")))
        runner.reuse_rule = Alternate()
        batch = [world.job(runner, 30 + i, ratio=0.45, **world.warm_meta("masked")) for i in range(3)]
        _assert_turbo_steps_synchronise_once(runner, batch, world.steps, 30.0, world.ctrl.reuse_units)
    finally:
        world.caches.close(wait=True)


def test_profile_on_cuda_fits_a_cost_model_the_dispatcher_picks_for_cuda(tmp_path: Path) -> None:
    """``stencil profile --device cuda`` times the runner's steps on the GPU (synchronised wall time,
    bfloat16) and its host tier is the pinned copy to the device; the file it writes is the one a
    CUDA worker's routing picks, never a CPU fit."""
    from app.costmodel import CostModel, shipped_model
    from ops.bench import profile

    out = tmp_path / "costmodels" / "sd15-inpaint--cuda.json"  # named as shipped cost models are
    assert profile.main(["--quick", "--model", "sd15-inpaint", "--device", CUDA, "--points", "8", "--max-jobs", "3",
                         "--repeats", "3", "--out", str(out)]) == 0
    model = CostModel.load(out)
    assert model.device_kind.startswith("cuda-") and model.device_kind.endswith("-bfloat16")
    assert model.meta["clock"] == "wall" and model.meta["dtype"] == "bfloat16"
    assert model.meta["graph_replays"] >= 8 * 3  # the timed steps are the engine's steady graph replays
    assert torch.cuda.get_device_name() in model.meta["hardware"]
    assert model.step_seconds([model.job_seconds(mask_ratio=0.2)]) > 0
    found = shipped_model("sd15-inpaint", CUDA, folder=out.parent)
    assert found is not None and found[1] == out
    assert shipped_model("sd15-inpaint", "cpu", folder=out.parent) is None


def test_serve_with_device_cuda_finishes_an_edit_on_the_gpu(tmp_path: Path, model_home: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented GPU path (docs/deployment.md): ``stencil serve --device cuda`` with its own
    Redis; one edit submitted as a client does, done, its result an edit of the template, the
    engine and the stages (prepare, finalize) on the GPU, in processes forked from the launcher.
    Last in this file, with waits that leave its log's tail inside the GPU run's test stage (100 s):
    the stack starts in seconds there, and a 6-step edit takes well under one."""
    from app.client import StencilClient
    from app.demo import demo_templates
    from tests.test_service import wait_until

    workdir = tmp_path / "serve"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STENCIL_")}
    env.update(STENCIL_HOME=str(model_home), HF_HUB_OFFLINE="1")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--device", "cuda", "--workdir", str(workdir),
                             "--cpu-concurrency", "1"], env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_until(lambda: (workdir / "children.json").is_file() or proc.poll() is not None, timeout=75)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        for line in (workdir / "stencil.env").read_text().splitlines():
            key, _, value = line.partition("=")
            monkeypatch.setenv(key, value)
        template = demo_templates(128)[0][1]
        mask = np.zeros((128, 128), bool)
        mask[32:96, 40:100] = True
        handle = StencilClient().submit(template=template, mask=mask, prompt="a red scarf", steps=6, seed=3)
        rec = handle.wait(45)
        assert rec.status.value == "done", (rec.error, (tmp_path / "serve.log").read_text()[-3000:])
        assert rec.worker == "gpu.0"
        assert rec.fields["prepare_device"].startswith("cuda") and rec.fields["finalize_device"].startswith("cuda")
        result = np.asarray(handle.result().convert("RGB"), dtype=np.int16)
        assert result.shape == (128, 128, 3)
        assert np.abs(result[mask] - np.asarray(template, dtype=np.int16)[mask]).max() > 0  # the region was edited
        # ... by a GPU worker forked from the preloaded launcher (which must not have touched CUDA)
        assert re.search(r"started gpu0 \(pid \d+, forked by the preloaded launcher\)",
                         (tmp_path / "serve.log").read_text()), (tmp_path / "serve.log").read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
