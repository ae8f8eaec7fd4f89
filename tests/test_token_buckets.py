"""Token-count buckets (``workers/maskaware/buckets.py``): padded counts serve every mask of a
bucket, what the real tokens compute does not change, and a graph captured for one job is
replayed for the next job whose counts fall in the same buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ops.bench.graph_churn import padding
from ops.bench.harness.ablations import bucket_growth
from tests.test_plan_engine import LATENT, _job, _run, _runner_setup, _warm
from workers.maskaware import TemplateCacheKey, buckets
from workers.maskaware.buckets import ALIGN, GROWTH, bucket_range, token_bucket
from workers.maskaware.tokens import blob_mask, build_token_masks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("total", [36, 256, 4096, 16384])
def test_buckets_cover_every_count_with_bounded_padding(total: int) -> None:
    seen = set()
    previous = 0
    for count in range(total + 1):
        lowest, bucket = bucket_range(count, total)
        assert lowest <= count <= bucket <= total and bucket >= previous
        assert bucket <= max(ALIGN, count * GROWTH + ALIGN), (count, bucket)
        assert bucket_range(lowest, total) == (lowest, bucket)  # every count of the bucket shares it
        if lowest > 1:
            assert token_bucket(lowest - 1, total) < bucket
        previous = bucket
        seen.add(bucket)
    assert token_bucket(0, total) == 0 and token_bucket(total, total) == total
    assert len(seen) <= 40  # a few shapes serve every mask (about 30 at 4096 tokens)


def test_the_growth_ablation_pads_more_with_coarser_buckets_and_restores_the_engines() -> None:
    fine, coarse = padding(GROWTH, samples=2000), padding(2.0, samples=2000)
    assert 0.0 < fine[0] <= GROWTH - 1 and fine[0] < coarse[0] <= 1.0 and fine[1] < coarse[1]
    engines = token_bucket(600, 4096)
    with bucket_growth(2.0):
        assert token_bucket(600, 4096) == 1024 > engines
    assert buckets.GROWTH == GROWTH  # the ablation leaves the engine's buckets as they were


def test_bucketed_indices_hold_the_mask_padded_with_its_last_token() -> None:
    masks = build_token_masks(blob_mask(128, 128, 0.15, seed=4), LATENT, 3)
    buckets = masks.with_buckets().prepare("cpu")
    for level in masks.levels:
        n = level.numel()
        exact, padded = masks.indices(n), buckets.indices(n) if 0 < masks.count(n) < n else None
        assert buckets.masked(n) == masks.count(n) == int(level.sum())
        assert buckets.count(n) == token_bucket(masks.count(n), n)
        if padded is None:
            continue
        assert padded.numel() == buckets.count(n)
        assert torch.equal(padded[:exact.numel()], exact) and bool((padded[exact.numel():] == exact[-1]).all())


def _bucket_twin(ctrl, seed: int) -> int:  # type: ignore[no-untyped-def]
    """A mask seed whose token counts differ from ``seed``'s at some level but fall in the same
    buckets at every level (the jobs' masks are ``_job``'s blobs)."""
    h, w = LATENT

    def counts(s: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        masks = ctrl.token_masks(blob_mask(h * 8, w * 8, 0.15, seed=s).bool(), LATENT)
        return masks.counts(), masks.with_buckets().counts()

    exact, buckets = counts(seed)
    for other in range(seed + 1, seed + 400):
        e, b = counts(other)
        if b == buckets and e != exact:
            return other
    raise AssertionError("no mask of the same buckets among 400 seeds")


def test_a_job_in_a_finished_jobs_buckets_replays_its_graph(tmp_path: Path) -> None:
    """One masked edit, then another whose token counts differ but share its buckets: with buckets
    the second replays the first's graph at every step (no capture), with exact counts it needs
    its own. Bucketed results equal the eager bucketed step bit for bit and the exact step to
    float rounding."""
    from workers.engine.sd_runner import SDRunner

    steps = 5
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        twin = _bucket_twin(ctrl, 10)
        captures, latents = {}, {}
        for buckets in (True, False):
            graphed = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, prefetch_steps=0, graphs=True)
            graphed.graphs.min_horizon = 1  # these jobs are short: capture even near their end
            graphed.bucket_tokens = buckets
            _run(graphed, _job(graphed, "masked", key, steps, seed=10))
            assert graphed.graphs.captures == 1
            second = _run(graphed, _job(graphed, "masked", key, steps, seed=twin))
            assert second["masked_steps"] == steps
            captures[buckets], latents[buckets] = graphed.graphs.captures, second["latents"]
        assert captures == {True: 1, False: 2}
        eager = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, prefetch_steps=0)
        eager.bucket_tokens = True
        assert torch.equal(_run(eager, _job(eager, "masked", key, steps, seed=twin))["latents"], latents[True])
        # float rounding of other GEMM shapes (latents ~10; a wrong token is off by ~1)
        torch.testing.assert_close(latents[True], latents[False], rtol=1e-5, atol=1e-4)
    finally:
        caches.close(wait=True)


def test_bucketed_flux_steps_equal_exact_ones(tmp_path: Path) -> None:
    """Flux Fill: masked edits whose computed and cached token lists are padded to their buckets
    give the exact steps' latents to float rounding, with every step masked."""
    from tests.support.flux_world import FluxWorld

    world = FluxWorld(tmp_path)
    runners = {b: world.runner() for b in (False, True)}
    runners[True].bucket_tokens = True
    try:
        _warm(runners[False], world.caches, world.key, world.steps,
              rec=world.job(runners[False], 9, **world.warm_meta("record")))
        latents = {}
        for b, runner in runners.items():
            batch = [world.job(runner, 20 + i, **world.warm_meta("masked")) for i in range(3)]
            padded = [j.state.token_masks for j in batch]
            assert all(t.sel is None or t.sel.numel() == t.m for t in padded)
            while not batch[0].finished:
                runner.step(batch)
                for j in batch:
                    j.steps_done += 1
            assert all(runner.result(j)["masked_steps"] == world.steps for j in batch)
            latents[b] = torch.cat([j.state.latents for j in batch])
        bucketed = [j for j in (world.job(runners[True], 20 + i, **world.warm_meta("masked")) for i in range(3))]
        assert any(j.state.token_masks.m > int(j.state.token_masks.mask.sum()) for j in bucketed)  # padding happened
        torch.testing.assert_close(latents[True], latents[False], rtol=1e-5, atol=1e-4)
    finally:
        world.caches.close(wait=True)


def test_jobs_of_one_bucket_attend_to_their_text_in_one_call_as_they_would_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Masked jobs whose counts share buckets are adjacent runs of one token count: their
    attention is one call per level (the step's batch index, ``workers/maskaware/batched.py``).
    Stepped together they give what each gives alone."""
    from workers.engine.sd_runner import SDRunner

    steps = 4
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        bucketed = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, prefetch_steps=0)
        bucketed.bucket_tokens = True
        seeds = (10, _bucket_twin(ctrl, 10), 11)
        batch = [_job(bucketed, "masked", key, steps, seed=s) for s in seeds]
        counts = [j.state.token_masks.counts() for j in batch]
        assert counts[0] == counts[1]  # the twin: one run per level
        indices, original = [], ctrl.batch_index

        def recorded(groups, device):  # type: ignore[no-untyped-def]
            indices.append(original(groups, device))
            return indices[-1]

        monkeypatch.setattr(ctrl, "batch_index", recorded)
        while not batch[0].finished:
            bucketed.step(batch)
            for j in batch:
                j.steps_done += 1
        monkeypatch.undo()
        runs = [(len(level.members), len(level.runs)) for index in indices if index is not None
                for level in index.levels.values()]
        assert runs and any(n_runs < members for members, n_runs in runs)
        for s, together in zip(seeds, batch):
            alone = _run(bucketed, _job(bucketed, "masked", key, steps, seed=s))["latents"]
            torch.testing.assert_close(together.state.latents, alone, rtol=1e-5, atol=1e-4)
    finally:
        caches.close(wait=True)
