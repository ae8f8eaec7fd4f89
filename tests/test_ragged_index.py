"""Ragged batch indices (``workers/maskaware/batched.py``, ``varlen.py``): a slab's rows attended in
one variable-length call, its token rows padded to a bucket of their total, so that a graph's
shapes name the batch's rows and that bucket, not each job's count. On the CPU the attention runs
row by row over extents read from the index (the CUDA kernels: ``tests/test_gpu.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_batched_index import _masked_call, _member, _staged_jobs
from tests.test_maskaware_unet import LATENT, sdxl_style_unet, tiny_unet
from tests.test_plan_engine import _job, _runner_setup, _warm
from workers.engine.graphs import StepGraphs
from workers.maskaware import MaskAwareUNet, RowGroup, TemplateCacheKey
from workers.maskaware.batched import build, row_lengths
from workers.maskaware.buckets import token_bucket
from workers.maskaware.tokens import TokenMasks, blob_mask, rect_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_ragged_slab_pads_its_total_to_a_bucket_row_by_row_and_names_no_count() -> None:
    n = 1024
    level, pieces = build(n, [_member(0, 0, 200), _member(1, 2, 180), _member(2, 4, 80)], pad=True, ragged=True)
    data = torch.cat(pieces)
    real = [200, 200, 180, 180, 80, 80]
    assert level.ragged and len(level.slabs) == 1 and len(level.runs) == 1
    slab = level.slabs[0]
    assert slab.tokens == level.tokens == token_bucket(sum(real), 6 * n) > sum(real)
    cu = data[slab.cu:slab.cu + slab.rows + 1].tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert cu[0] == 0 and cu[-1] == slab.tokens and lengths == row_lengths(real, n)
    assert all(r <= length <= n for r, length in zip(real, lengths))
    rows, tokens = data[:level.tokens], data[level.tokens:2 * level.tokens]
    scatter = data[slab.scatter:slab.scatter + slab.tokens]
    for r, (lo, hi) in enumerate(zip(cu, cu[1:])):
        assert rows[lo:hi].tolist() == [r] * (hi - lo)  # batch rows 0-5: the slab starts at row 0
        own = [2 * i for i in range(real[r])]
        assert tokens[lo:hi].tolist() == own + [own[-1]] * (hi - lo - real[r])  # pads repeat the row's last
        assert scatter[lo:hi].tolist() == [r * n + t for t in tokens[lo:hi].tolist()]
    # Another composition of the same rows whose total falls in the same bucket: the same structure.
    other, _ = build(n, [_member(0, 0, 120), _member(1, 2, 240), _member(2, 4, 100)], pad=True, ragged=True)
    assert token_bucket(2 * (120 + 240 + 100), 6 * n) == slab.tokens
    assert other.structure == level.structure
    assert build(n, [_member(0, 0, 120), _member(1, 2, 240), _member(2, 4, 100)], pad=True)[0].structure \
        != build(n, [_member(0, 0, 200), _member(1, 2, 180), _member(2, 4, 80)], pad=True)[0].structure
    with pytest.raises(ValueError, match="pad=True"):
        build(n, [_member(0, 0, 10)], pad=False, ragged=True)


def test_row_lengths_never_pass_a_row_and_fill_from_the_last() -> None:
    for real, n in (([10, 10], 16), ([3, 900, 7], 1024), ([15, 15, 15], 16), ([40, 1, 1, 40], 64)):
        lengths = row_lengths(real, n)
        assert sum(lengths) == token_bucket(sum(real), len(real) * n)
        assert all(r <= x <= n for r, x in zip(real, lengths)), (real, lengths)
        padded_rows = [i for i, (r, x) in enumerate(zip(real, lengths)) if x > r]
        assert all(lengths[i] == n for i in padded_rows[1:]), (real, lengths)  # later rows filled first
    assert row_lengths([10, 10], 16) == [15, 16]
    assert row_lengths([0, 0], 64) == [0, 0]


@pytest.mark.parametrize("model", ["tiny", "sdxl_style"])
def test_a_ragged_step_equals_the_per_group_path(model: str) -> None:
    """Four CFG jobs at different masks in one staged buffer: one variable-length attention call
    per block and slab computes what the per-group path computes, and leaves the caches alone."""
    unet = tiny_unet(0) if model == "tiny" else sdxl_style_unet(0)
    ctrl = MaskAwareUNet(unet)
    ctrl.ragged = True
    shapes = [blob_mask(128, 128, 0.3, seed=1), rect_mask(128, 128, 0.1, seed=3),
              blob_mask(128, 128, 0.27, seed=2), rect_mask(128, 128, 0.08, seed=4)]
    masks = [ctrl.token_masks(m, LATENT) for m in shapes]  # not ordered by count: rows of any length
    args, recorded, stager = _staged_jobs(unet, ctrl, masks)
    snap = [{k: v.clone() for k, v in r.items()} for r in recorded]
    outs = {batched: _masked_call(unet, ctrl, args, recorded, stager, masks, f"b{batched}", build_index=batched)
            for batched in (True, False)}
    staged = stager.take_batch([(f"i{i}", 0, r, None) for i, r in enumerate(recorded)])
    index = ctrl.batch_index([RowGroup(2, "masked", token_mask=m, cache=s) for m, s in zip(masks, staged)],
                             torch.device("cpu"))
    assert index is not None and index.ragged
    assert all(len(level.runs) == len(level.slabs) == 1 for level in index.levels.values())
    assert any(level.tokens > sum(2 * m.count(level.n) for m in masks)
               for level in index.levels.values())  # a level was padded
    assert torch.allclose(outs[True], outs[False], rtol=1e-5, atol=1e-5), float((outs[True] - outs[False]).abs().max())
    for r, before in zip(recorded, snap):
        assert all(torch.equal(r[k], before[k]) for k in r)


def _blocks(ctrl: MaskAwareUNet, spans: list[tuple[int, int]]) -> TokenMasks:
    """Latent 4x4 blocks (aligned to the coarsest level) at (row, column) block positions."""
    latent = torch.zeros(LATENT, dtype=torch.bool)
    for by, bx in spans:
        latent[4 * by:4 * by + 4, 4 * bx:4 * bx + 4] = True
    return ctrl.token_masks(latent, LATENT).prepare("cpu")


def test_a_ragged_graph_replays_for_jobs_of_other_counts() -> None:
    """Three steps whose jobs' counts differ (two blocks and one, then one and two, then three
    blocks split otherwise) but whose totals per level fall in one bucket: one signature. The
    graph captured at the second replays the third, and each equals the eager step; exact counts
    (not ragged) would give three signatures."""
    unet = tiny_unet(0)
    ctrl = MaskAwareUNet(unet)
    ctrl.ragged = True
    layouts = [[_blocks(ctrl, [(0, 0), (0, 1)]), _blocks(ctrl, [(2, 2)])],
               [_blocks(ctrl, [(3, 3)]), _blocks(ctrl, [(1, 0), (1, 1)])],
               [_blocks(ctrl, [(2, 0)]), _blocks(ctrl, [(0, 3), (3, 0)])]]
    assert len({tuple(m.counts() for m in pair) for pair in layouts}) == 2  # counts differ per job
    args, recorded, stager = _staged_jobs(unet, ctrl, layouts[0])
    graphs = StepGraphs("cpu", repeats=2)
    for step, masks in enumerate(layouts):
        out = _masked_call(unet, ctrl, args, recorded, stager, masks, f"j{step}", graphs=graphs)
        assert graphs.last == ("eager", "captured", "replayed")[step]
        eager = _masked_call(unet, ctrl, args, recorded, stager, masks, f"e{step}")
        per_group = _masked_call(unet, ctrl, args, recorded, stager, masks, f"p{step}", build_index=False)
        assert torch.equal(out, eager), (step, float((out - eager).abs().max()))
        assert torch.allclose(out, per_group, rtol=1e-5, atol=1e-5), (step, float((out - per_group).abs().max()))
    assert graphs.captures == 1


def test_a_ragged_engine_needs_no_token_buckets_and_its_graphed_steps_equal_eager_ones(tmp_path: Path) -> None:
    """The runner with ragged indices: masked jobs compute their own counts (no per-job buckets),
    and graphed steps (the CPU stand-in) equal eager ones bit for bit, a job joining mid-way."""
    from workers.engine.sd_runner import SDRunner

    steps = 5
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        ctrl.ragged = True
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        graphed = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, prefetch_steps=0, cache_plan="plan", graphs=True)
        graphed.graphs.min_horizon = 1
        assert not graphed.bucket_tokens and not runner.bucket_tokens
        results = {}
        for name, r in (("eager", runner), ("graphed", graphed)):
            batch = [_job(r, "masked", key, steps, seed=10 + i) for i in range(3)]
            late = _job(r, "masked", key, steps, seed=30)
            for step in range(steps):
                r.step(batch)
                for job in batch:
                    job.steps_done += 1
                if step == 1:
                    batch.append(late)
            while not late.finished:
                r.step([late])
                late.steps_done += 1
            results[name] = [j.state.latents for j in batch]
            assert all(r.result(j)["masked_steps"] == steps for j in batch)
        assert graphed.graphs.replays >= 2
        for a, b in zip(results["eager"], results["graphed"]):
            assert torch.equal(a, b)
    finally:
        caches.close(wait=True)


@pytest.mark.parametrize(("dtype", "flash"), [(torch.bfloat16, True), (torch.float32, False)])
def test_the_device_kernels_are_called_as_their_schemas_say(dtype: torch.dtype, flash: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's calls (FlashAttention-2's variable-length forward for 16-bit inputs, the
    memory-efficient kernel's otherwise) on the meta device, which checks the arguments' number,
    types and shapes against the operators' schemas: a mistake there would otherwise show only on a
    GPU."""
    from workers.maskaware import varlen

    monkeypatch.setattr(varlen, "device_kernel", lambda device: True)
    monkeypatch.setattr(varlen, "_flash_capable", lambda device: flash)
    called = []
    for name in ("_flash_attention_forward", "_efficient_attention_forward"):
        op = getattr(torch.ops.aten, name)
        monkeypatch.setattr(torch.ops.aten, name,
                            lambda *a, _op=op, _name=name, **k: called.append(_name) or _op(*a, **k))
    rows, length, heads, width, total = 3, 64, 4, 128, 50
    q = torch.empty(total, width, device="meta", dtype=dtype)
    k = torch.empty(rows, length, width, device="meta", dtype=dtype)
    cu_q = torch.empty(rows + 1, device="meta", dtype=torch.int64)
    memo: dict = {}
    out = varlen.attend(q, k, k, cu_q, heads, length, memo)
    assert out.shape == (total, width) and out.dtype == dtype and out.device.type == "meta"
    assert called == ["_flash_attention_forward" if flash else "_efficient_attention_forward"]
    assert len(memo) == 1 and all(t.dtype == torch.int32 for t in next(iter(memo.values())))


def test_a_step_without_a_graph_replays_a_wider_batchs_graph_padded_up_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs of three latent blocks each are captured; then two jobs of two blocks (token totals
    1.33x and 1.5x under the graph's per level) replay that graph with their indices padded up to
    it, and compute what they compute alone; a step whose totals would need more padding than
    ``WIDEN_LIMIT`` runs eagerly, as the narrow step does with widening off."""
    from workers.engine import graph_calls

    unet = tiny_unet(0)
    ctrl = MaskAwareUNet(unet)
    ctrl.ragged = True
    wide = [_blocks(ctrl, [(0, 0), (0, 1), (0, 2)]), _blocks(ctrl, [(2, 2), (2, 3), (3, 3)])]
    narrow = [_blocks(ctrl, [(0, 0), (0, 1)]), _blocks(ctrl, [(2, 2), (2, 3)])]
    narrower = [_blocks(ctrl, [(0, 0)]), _blocks(ctrl, [(2, 2), (2, 3)])]
    args, recorded, stager = _staged_jobs(unet, ctrl, wide)
    graphs = StepGraphs("cpu", repeats=2)
    for step in range(2):
        _masked_call(unet, ctrl, args, recorded, stager, wide, f"w{step}", graphs=graphs)
    assert graphs.last == "captured" and graphs.captures == 1
    out = _masked_call(unet, ctrl, args, recorded, stager, narrow, "n", graphs=graphs)
    assert graphs.last == "replayed" and graphs.widened == 1 and graphs.captures == 1
    padded, own = graphs.widened_rows
    assert padded == (192 - 144) + (48 - 32) and own == 144 + 32 + 16  # two CFG rows per job, per level
    eager = _masked_call(unet, ctrl, args, recorded, stager, narrow, "ne")
    per_group = _masked_call(unet, ctrl, args, recorded, stager, narrow, "np", build_index=False)
    assert torch.allclose(out, eager, rtol=1e-5, atol=1e-5), float((out - eager).abs().max())
    assert torch.allclose(out, per_group, rtol=1e-5, atol=1e-5), float((out - per_group).abs().max())
    _masked_call(unet, ctrl, args, recorded, stager, narrower, "m", graphs=graphs)  # 192 / 112 > WIDEN_LIMIT
    assert graphs.last == "eager" and graphs.widened == 1
    monkeypatch.setattr(graph_calls, "WIDEN_LIMIT", 1.0)
    _masked_call(unet, ctrl, args, recorded, stager, narrow, "off", graphs=graphs)
    assert graphs.last == "eager" and graphs.widened == 1


def test_under_poisson_arrivals_widening_replays_more_steps_and_the_ablation_restores_the_engines() -> None:
    """``ops.bench.graph_churn``'s engine at load 0.9 (its quick settings): with widening some steps
    replay a wider batch's graph, each padded by at most ``WIDEN_LIMIT``, and more steps replay
    than with it off; the ablation leaves the engine's limit as it was."""
    from types import SimpleNamespace

    from ops.bench.graph_churn import run
    from ops.bench.harness.runner_timing import load_model
    from workers.engine import graph_calls
    from workers.maskaware.buckets import GROWTH

    limit = graph_calls.WIDEN_LIMIT
    mut = load_model("tiny", 8, 0)
    args = SimpleNamespace(jobs=8, max_batch=4, steps=8, trace="spring", seed=0)
    off, on = (run(mut, "0.9", 1, "ragged", GROWTH, widen, args) for widen in (1.0, limit))
    assert off["widened"] == 0 < on["widened"] and off["replayed"] < on["replayed"]
    assert 0 < on["widened_padding"] <= limit - 1
    assert graph_calls.WIDEN_LIMIT == limit
