"""Batch-wide token indices (``workers/maskaware/batched.py``): the masked jobs of a call staged
into one buffer are gathered, written and attended with a few kernels per block, and compute what
the per-group path computes; a graph replay reads the index of its own step."""

from __future__ import annotations

import pytest
import torch

from ops.bench.harness.dispatch import DispatchCounter
from tests.test_maskaware_unet import LATENT, _one_forward, sdxl_style_unet, tiny_unet
from workers.engine.graph_calls import unet_call
from workers.engine.graphs import StepGraphs
from workers.engine.staging import CacheStager
from workers.maskaware import MaskAwareUNet, RowGroup
from workers.maskaware.batched import FREE_PAD_ROWS, Member, build
from workers.maskaware.buckets import GROWTH
from workers.maskaware.tokens import TokenMasks, blob_mask, rect_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _member(g: int, start: int, m: int, adjacent: bool = True, rows: int = 2) -> Member:
    return Member(g, start, rows, torch.arange(m, dtype=torch.long) * 2, adjacent)


def test_runs_pad_within_growth_and_slabs_split_where_caches_or_rows_are_not_adjacent() -> None:
    n = 1024
    members = [_member(0, 0, 200), _member(1, 2, 180), _member(2, 4, 80), _member(3, 6, 80, adjacent=False),
               _member(4, 10, 80)]  # rows 8-9 belong to another group: not adjacent in the batch
    level, pieces = build(n, members, pad=True)
    assert [(s.first, s.count) for s in level.slabs] == [(0, 3), (3, 1), (4, 1)]
    assert [(r.first, r.count, r.m) for r in level.runs] == [(0, 2, 200), (2, 1, 80), (3, 1, 80), (4, 1, 80)]
    assert [m for *_, m in level.members] == [200, 200, 80, 80, 80]  # 180 padded to its run's 200 (80 would not fit)
    data = torch.cat(pieces)
    rows, tokens = data[:level.tokens], data[level.tokens:2 * level.tokens]
    assert level.tokens == 2 * (200 + 200 + 80 + 80 + 80)
    second = slice(400, 800)  # member 1: rows 2 and 3, its 180 tokens then its last one 20 times
    assert rows[second].tolist() == [2] * 200 + [3] * 200
    assert tokens[second].tolist() == 2 * ([2 * i for i in range(180)] + [358] * 20)
    first_slab = data[level.slabs[0].scatter:level.slabs[0].scatter + level.slabs[0].tokens]
    assert first_slab[400:600].tolist() == [2 * n + 2 * i for i in range(180)] + [2 * n + 358] * 20  # slab row 2
    # Without padding only equal counts share a run; the padded work of a run stays within GROWTH.
    exact, _ = build(n, members, pad=False)
    assert [(r.first, r.count) for r in exact.runs] == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]
    for run in level.runs:
        real = sum(2 * int(members[i].indices.numel()) for i in range(run.first, run.first + run.count))
        assert run.rows * run.m <= GROWTH * real or run.rows * run.m - real <= FREE_PAD_ROWS
    # A few padded rows are always worth a run: 2 x (10, 4) -> 2 x (10, 10) adds 12 rows.
    small, _ = build(16, [_member(0, 0, 10), _member(1, 2, 4)], pad=True)
    assert [(r.count, r.m) for r in small.runs] == [(2, 10)]


def _staged_jobs(unet: torch.nn.Module, ctrl: MaskAwareUNet, masks: list[TokenMasks]
                 ) -> tuple[tuple[torch.Tensor, ...], list[dict[str, torch.Tensor]], CacheStager]:
    jobs = len(masks)
    x, t, e = _one_forward(unet)
    rows = 0.1 * torch.arange(2 * jobs).view(-1, 1, 1, 1)  # every row its own input
    args = (x.repeat(jobs, 1, 1, 1) + rows, t.repeat(jobs), e.repeat(jobs, 1, 1))
    with torch.no_grad(), ctrl.batch([RowGroup(2, "record") for _ in range(jobs)]) as ctx:
        unet(*args)
    return args, [dict(r) for r in ctx.recorded], CacheStager("cpu")


def _masked_call(unet: torch.nn.Module, ctrl: MaskAwareUNet, args: tuple[torch.Tensor, ...],
                 recorded: list[dict[str, torch.Tensor]], stager: CacheStager, masks: list[TokenMasks], tag: str,
                 graphs: StepGraphs | None = None, build_index: bool = True) -> torch.Tensor:
    """One call of CFG jobs at ``masks``, their recorded caches staged afresh into one buffer:
    through ``graphs`` (``unet_call``) or eagerly (with the batch index, or the per-group path)."""
    staged = stager.take_batch([(f"{tag}-{i}", 0, r, None) for i, r in enumerate(recorded)])
    groups = [RowGroup(2, "masked", token_mask=m, cache=s) for m, s in zip(masks, staged)]
    with torch.no_grad():
        if graphs is not None:
            return unet_call(graphs, unet, ctrl, (args[0], args[1]), {"encoder_hidden_states": args[2]},
                             groups, torch.device("cpu"))[0].clone()
        with ctrl.batch(groups, build_index=build_index):
            return unet(*args).sample


@pytest.mark.parametrize("model", ["tiny", "sdxl_style"])
def test_batched_step_equals_the_per_group_path_and_leaves_its_inputs(model: str) -> None:
    """Four CFG jobs at different masks (a run padded across jobs, one job alone at some levels),
    their caches in one staged buffer: the batch-wide path computes what the per-group path
    computes, and records nothing into the template's caches."""
    unet = tiny_unet(0) if model == "tiny" else sdxl_style_unet(0)
    ctrl = MaskAwareUNet(unet)
    shapes = [blob_mask(128, 128, 0.3, seed=1), blob_mask(128, 128, 0.27, seed=2),
              rect_mask(128, 128, 0.1, seed=3), rect_mask(128, 128, 0.08, seed=4)]
    masks = sorted((ctrl.token_masks(m, LATENT) for m in shapes), key=lambda m: tuple(-c for c in m.counts()))
    args, recorded, stager = _staged_jobs(unet, ctrl, masks)
    snap = [{k: v.clone() for k, v in r.items()} for r in recorded]
    outs = {}
    for batched in (True, False):
        staged = stager.take_batch([(f"j{i}", 0, r, None) for i, r in enumerate(recorded)])
        groups = [RowGroup(2, "masked", token_mask=m, cache=s) for m, s in zip(masks, staged)]
        assert all(a.adjacent(b) for a, b in zip(staged, staged[1:]))
        with torch.no_grad(), ctrl.batch(groups, build_index=batched) as ctx:
            outs[batched] = unet(*args).sample
        assert (ctx.index is not None) == batched
        if batched:
            runs = [r for level in ctx.index.levels.values() for r in level.runs]
            assert any(r.count > 1 for r in runs)  # jobs shared attention calls
            padded = [(m, mem[3]) for level in ctx.index.levels.values()
                      for m, mem in zip((masks[mem[0]].count(level.n) for mem in level.members), level.members)]
            assert any(real < used for real, used in padded)  # and a job was padded to its run
    assert torch.allclose(outs[True], outs[False], rtol=1e-5, atol=1e-5), float((outs[True] - outs[False]).abs().max())
    for r, before in zip(recorded, snap):
        assert all(torch.equal(r[k], before[k]) for k in r)


def test_four_jobs_staged_together_dispatch_within_the_bound_of_full_compute() -> None:
    """The operator proxy of issue 37 at a batch: four masked CFG jobs staged together dispatch
    at most 1.1x the kernel-launching operators of the same call in full compute."""
    unet = sdxl_style_unet(0)
    ctrl = MaskAwareUNet(unet)
    masks = sorted((ctrl.token_masks(blob_mask(128, 128, 0.2, seed=s), LATENT) for s in range(4)),
                   key=lambda m: tuple(-c for c in m.counts()))
    args, recorded, stager = _staged_jobs(unet, ctrl, masks)
    staged = stager.take_batch([(f"j{i}", 0, r, None) for i, r in enumerate(recorded)])
    counts = {}
    for name, groups in (("full", [RowGroup(2, "full") for _ in masks]),
                         ("masked", [RowGroup(2, "masked", token_mask=m, cache=s) for m, s in zip(masks, staged)])):
        with torch.no_grad(), ctrl.batch(groups):  # a steady step: the batch index is built
            unet(*args)
        counts[name] = DispatchCounter()
        with torch.no_grad(), counts[name], ctrl.batch(groups):
            unet(*args)
    full, masked = counts["full"], counts["masked"]
    assert masked.syncs == {}, masked.syncs
    assert masked.kernels <= 1.1 * full.kernels, (masked.kernels, full.kernels)


def test_a_replayed_step_reads_the_batch_index_of_its_own_masks() -> None:
    """Two steps of one signature (equal token counts at every level) but masks at other places:
    the replay of the graph captured for the first computes the second's tokens (the batch index
    is a graph input, not a constant of the capture), equal to the eager call."""
    unet = tiny_unet(0)
    ctrl = MaskAwareUNet(unet)

    def at(x0: int) -> TokenMasks:
        latent = torch.zeros(LATENT, dtype=torch.bool)
        latent[4:8, x0:x0 + 4] = True  # aligned to the coarsest level: equal counts at every level
        return ctrl.token_masks(latent, LATENT).prepare("cpu")

    layouts = [[at(0), at(4)], [at(8), at(12)], [at(12), at(0)]]
    assert len({tuple(m.counts()) for pair in layouts for m in pair}) == 1
    args, recorded, stager = _staged_jobs(unet, ctrl, layouts[0])
    graphs = StepGraphs("cpu", repeats=2)
    for step, masks in enumerate(layouts):
        out = _masked_call(unet, ctrl, args, recorded, stager, masks, f"j{step}", graphs=graphs)
        eager = _masked_call(unet, ctrl, args, recorded, stager, masks, f"e{step}")
        assert graphs.last == ("eager", "captured", "replayed")[step]
        assert torch.equal(out, eager), (step, float((out - eager).abs().max()))
