"""Temporal reuse (``turbo``): what a reused patch receives, when reuse is allowed, that a rule
never reusing changes nothing, that steady steps stay free of host syncs, and the served rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from app.jobs import JobParams
from tests.test_host_syncs import counted_steps
from tests.test_plan_engine import _job, _runner_setup, _warm
from workers.maskaware import TemplateCacheKey
from workers.maskaware.reuse import FEATURES, MAX_RUN, PATCH, TemporalReuse
from workers.maskaware.reuse_rule import ForestRule, ThresholdRule, Tree, default_rule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Never:
    name = "never"

    def reuse(self, features: np.ndarray) -> np.ndarray:
        return np.zeros(len(features), bool)


class Alternate:
    """Every other patch of a job's decision (one call per job and step: the same for a job batched or alone)."""

    name = "alternate"

    def reuse(self, features: np.ndarray) -> np.ndarray:
        return np.arange(len(features)) % 2 == 0


class Always:
    name = "always"

    def __init__(self) -> None:
        self.asked: list[float] = []

    def reuse(self, features: np.ndarray) -> np.ndarray:
        self.asked.append(float(features[0, FEATURES.index("progress")]))
        return np.ones(len(features), bool)


def test_a_reused_patch_takes_the_cache_plus_its_last_offset_and_computed_ones_update_it() -> None:
    g = torch.Generator().manual_seed(0)
    rows, n, c = 2, 40, 3
    idx = torch.tensor(sorted(np.random.default_rng(0).choice(n, 20, replace=False).tolist()))  # 2 patches: 16 + 4
    r = TemporalReuse(Always(), steps=10, refresh=frozenset({0}), guidance=7.5, units=["u"])
    # step 1: everything computed, the offset recorded
    u = r.begin(1).plan("u", idx, len(idx), n)
    assert u.sub is None and u.k == 20 and u.patches == 2
    cache1, fresh1 = torch.randn(rows, n, c, generator=g), torch.randn(rows, 20, c, generator=g)
    out1 = u.merge("b.y", True, cache1.clone(), fresh1)
    assert torch.equal(out1[:, idx], fresh1)
    rel1 = fresh1 - cache1[:, idx]
    assert torch.allclose(u.rel["b.y"], rel1)
    # step 2: patch 0 (positions 0-15) reused, patch 1 computed
    r.allowed, u.reuse_next = True, np.array([True, False])
    u = r.begin(2).plan("u", idx, len(idx), n)
    assert u.k == PATCH and torch.equal(u.idx, idx[torch.tensor([16, 17, 18, 19, 19, 19, 19, 19, 19, 19, 19, 19, 19,
                                                                 19, 19, 19])])
    cache2, fresh2 = torch.randn(rows, n, c, generator=g), torch.randn(rows, PATCH, c, generator=g)
    fresh2[:, 4:] = fresh2[:, 3:4]  # a padded position repeats the last token: the same values
    out2 = u.merge("b.y", True, cache2.clone(), fresh2)
    assert torch.allclose(out2[:, idx[:16]], cache2[:, idx[:16]] + rel1[:, :16])  # reused: cache + last offset
    assert torch.equal(out2[:, idx[16:]], fresh2[:, :4])  # computed: fresh
    unmasked = torch.ones(n, dtype=torch.bool)
    unmasked[idx] = False
    assert torch.equal(out2[:, unmasked], cache2[:, unmasked])  # the rest: the cache
    assert torch.allclose(u.rel["b.y"][:, :16], rel1[:, :16])  # a reused patch keeps its offset
    assert torch.allclose(u.rel["b.y"][:, 16:], fresh2[:, :4] - cache2[:, idx[16:]])
    pred = cache2[:, idx[16:]] + rel1[:, 16:]
    want = float((fresh2[:, :4] - pred).norm() / fresh2[:, :4].norm())
    assert float(u.err[1]) == pytest.approx(want, rel=1e-5)


def _masked(runner, key, steps: int, seed: int, refresh: list[int], reuse: bool):  # type: ignore[no-untyped-def]
    """A masked job of the plan-engine tests with refresh steps, as ``turbo`` (the runner's rule) or ``fast``."""
    job = _job(runner, "masked", key, steps, seed=seed)
    job.state.refresh = frozenset(refresh)
    if reuse:
        job.state.reuse = TemporalReuse(runner.reuse_rule, steps, job.state.refresh, 5.0, list(runner.maskaware.units),
                                        max_tokens=runner._full_tokens(job.state))
    return job


def _run(runner, job) -> dict:  # type: ignore[no-untyped-def]
    while not job.finished:
        runner.step([job])
        job.steps_done += 1
    return runner.result(job)


def test_turbo_never_reusing_equals_fast_and_always_reusing_skips_only_where_allowed(tmp_path: Path) -> None:
    steps, refresh = 12, [0, 9]
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "resident", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        fast = _run(runner, _masked(runner, key, steps, 7, refresh, reuse=False))
        runner.reuse_rule = Never()
        never = _run(runner, _masked(runner, key, steps, 7, refresh, reuse=True))
        assert torch.equal(never["latents"], fast["latents"]) and never["reused_share"] == 0
        always = Always()
        runner.reuse_rule = always
        tokens: list[int] = []
        job = _masked(runner, key, steps, 7, refresh, reuse=True)
        while not job.finished:
            runner.step([job])
            tokens.append(sum(runner.last_ctx.unit_tokens.values()) if runner.last_ctx is not None else -1)
            job.steps_done += 1
        out = runner.result(job)
        # At most MAX_RUN (2) steps in a row, never a refresh (0, 9), the step after one (1, 10) or the last (11).
        assert MAX_RUN == 2
        reused_steps = [2, 3, 5, 6, 8]
        masked_steps = [s for s in range(steps) if s not in refresh]
        assert out["reused_share"] == pytest.approx(len(reused_steps) / len(masked_steps))
        computed = [tokens[s] for s in masked_steps if s not in reused_steps]
        assert all(tokens[s] < min(computed) for s in reused_steps), tokens
        assert min(always.asked) * (steps - 1) == pytest.approx(2) and max(always.asked) * (steps - 1) <= 8 + 1e-9
        diff = float((out["latents"] - fast["latents"]).abs().max())
        assert 0 < diff < float(fast["latents"].abs().max()), diff  # it changed something, not everything
    finally:
        caches.close(wait=True)


def test_steady_turbo_steps_read_the_device_once(tmp_path: Path) -> None:
    """Four turbo jobs stepped together: every engine step, reusing or not, has the one host read of
    a steady step (the reuse errors ride on it), and the batch equals the jobs stepped alone."""
    steps = 8
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        runner.reuse_rule = ThresholdRule(10.0)  # every measured patch reused, MAX_RUN steps in a row
        batch = [_masked(runner, key, steps, 20 + i, [], reuse=True) for i in range(4)]
        alone = [_masked(runner, key, steps, 20 + i, [], reuse=True) for i in range(4)]
        counts = counted_steps(runner, batch, steps)
        for job in alone:
            _run(runner, job)
        assert all(c.syncs == {"aten._local_scalar_dense.default": 1} for c in counts), [c.syncs for c in counts]
        for a, b in zip(batch, alone):
            assert runner.result(a)["reused_share"] > 0
            assert runner.result(a)["reused_share"] == runner.result(b)["reused_share"]
            assert float((a.state.latents - b.state.latents).abs().max()) <= 1e-4 * float(b.state.latents.abs().max())
    finally:
        caches.close(wait=True)


def test_the_forest_served_with_numpy_votes_as_scikit_learn() -> None:
    from sklearn.ensemble import RandomForestClassifier

    from ops.train.reuse_rule import to_trees

    rng = np.random.default_rng(0)
    x = rng.random((600, len(FEATURES)))
    y = x[:, 1] + 0.3 * x[:, 0] < 0.6
    forest = RandomForestClassifier(n_estimators=5, max_depth=4, random_state=0).fit(x, y)
    rule = ForestRule(to_trees(forest), cut=0.5, tau=0.1)
    probe = rng.random((200, len(FEATURES)))
    safe = list(forest.classes_).index(True)
    assert np.allclose(rule.safe_probability(probe), forest.predict_proba(probe)[:, safe])
    again = ForestRule.from_json(rule.to_json())
    assert np.allclose(again.safe_probability(probe), rule.safe_probability(probe), atol=1e-3)
    with pytest.raises(ValueError, match="features"):
        ForestRule([], 0.5, 0.1, features=("err",))


@pytest.mark.parametrize("family", ["sd", "flux"])
def test_the_shipped_rule_loads_and_decides_per_patch(family: str) -> None:
    rule = default_rule(family)
    about = rule.about
    assert about["command"].startswith("python -m ops.train.reuse_rule")
    assert ("--family flux" in about["command"]) == (family == "flux")
    assert about["forest"]["accuracy"] > about["threshold_rule"]["accuracy"]  # it beats its baseline
    x = np.tile(np.array([[0.5, 0.04, 1, 0.04, 0.1, 1.0, 0.5, 7.5, 0]]), (3, 1))  # FEATURES, a typical patch
    x[1, 1] = x[1, 3] = x[1, 4] = 10.0  # a patch whose last reuse would have been far off
    decided = rule.reuse(x)
    assert decided.shape == (3,) and decided.dtype == bool
    assert decided[0] and not decided[1]


def test_a_forest_does_not_reuse_beyond_the_errors_it_was_trained_on() -> None:
    always = Tree(np.array([-1]), np.array([0.0]), np.array([-1]), np.array([-1]), np.array([1.0]))
    x = np.zeros((3, len(FEATURES)))
    x[:, FEATURES.index("err")] = [0.1, 0.5, 0.51]
    assert ForestRule([always], 0.5, 0.1).reuse(x).all()
    bounded = ForestRule.from_json(ForestRule([always], 0.5, 0.1, err_limit=0.5).to_json())
    assert bounded.reuse(x).tolist() == [True, True, False]


def test_a_reused_residual_is_the_units_input_plus_its_last_residual_measured_against_the_residual() -> None:
    """Flux's blocks (``flux_reuse``): a reused position gets this step's input plus the block's
    residual from its last computed step; the error is relative to the residual; bucket padding
    (repeating the last real position) stays equal to it."""
    g = torch.Generator().manual_seed(1)
    m, real, c = 24, 20, 5  # 2 patches; positions 20-23 pad (copies of position 19)
    idx = torch.arange(m).clamp(max=real - 1)
    r = TemporalReuse(Always(), steps=10, refresh=frozenset({0}), guidance=30.0, units=["b"])
    u = r.begin(1).plan("b", idx, m, 64, real)
    x1, y1 = torch.randn(1, m, c, generator=g), torch.randn(1, m, c, generator=g)
    assert torch.equal(u.combine("y", True, x1, y1, residual=True), y1)
    r.allowed, u.reuse_next = True, np.array([False, True])  # patch 1 (the last real tokens, the padding) reused
    u = r.begin(2).plan("b", idx, m, 64, real)
    assert u.k == PATCH and torch.equal(u.sub, torch.arange(PATCH))
    x2, y2 = torch.randn(1, m, c, generator=g), torch.randn(1, PATCH, c, generator=g)
    out = u.combine("y", True, x2, y2, residual=True)
    assert torch.equal(out[:, :PATCH], y2)
    assert torch.allclose(out[:, PATCH:real], x2[:, PATCH:real] + (y1 - x1)[:, PATCH:real])
    assert torch.equal(out[:, real:], out[:, real - 1:real].expand(-1, m - real, -1))
    pred = x2[:, :PATCH] + (y1 - x1)[:, :PATCH]
    want = float((y2 - pred).norm() / (y2 - x2[:, :PATCH]).norm())
    assert float(u.err[0]) == pytest.approx(want, rel=1e-5)


def _flux_turbo(world, runner, seed: int, refresh: list[int], reuse: bool):  # type: ignore[no-untyped-def]
    job = world.job(runner, seed, ratio=0.45, **world.warm_meta("masked"))
    job.state.refresh = frozenset(refresh)
    if reuse:
        job.state.reuse = TemporalReuse(runner.reuse_rule, world.steps, job.state.refresh, 30.0,
                                        world.ctrl.reuse_units, max_tokens=runner._full_tokens(job.state))
    return job


def test_flux_turbo_never_reusing_equals_fast_and_batches_equal_jobs_alone(tmp_path: Path) -> None:
    """Flux (``flux_reuse``): a rule that never reuses is ``fast`` bit for bit; reusing jobs batched
    together (each on its own sub-pack of patches) equal the same jobs stepped alone, reuse where
    allowed and read the device once per engine step."""
    from tests.support.flux_world import FluxWorld

    world = FluxWorld(tmp_path, steps=8, size=(128, 128))
    runner, steps = world.runner(), world.steps
    try:
        _warm(runner, world.caches, world.key, steps, rec=world.job(runner, 9, **world.warm_meta("record")))
        fast = _run(runner, _flux_turbo(world, runner, 30, [0], reuse=False))
        runner.reuse_rule = Never()
        never = _run(runner, _flux_turbo(world, runner, 30, [0], reuse=True))
        assert torch.equal(never["latents"], fast["latents"]) and never["reused_share"] == 0
        runner.reuse_rule = Alternate()  # some patches of every unit reused, some computed
        batch = [_flux_turbo(world, runner, 30 + i, [0], reuse=True) for i in range(3)]
        assert all(j.state.token_masks.m > PATCH for j in batch)  # several patches per job
        counts = counted_steps(runner, batch, steps)
        assert all(c.syncs == {"aten._local_scalar_dense.default": 1} for c in counts), [c.syncs for c in counts]
        alone = [_run(runner, _flux_turbo(world, runner, 30 + i, [0], reuse=True)) for i in range(3)]
        # steps 0 (refresh), 1 (after it) and 7 (last) compute everything, the others some patches
        for job, one in zip(batch, alone):
            got = runner.result(job)
            assert got["reused_share"] == one["reused_share"] and 0.2 < got["reused_share"] < 4 / 7
            assert float((got["latents"] - one["latents"]).abs().max()) <= 1e-4 * float(one["latents"].abs().max())
        diff = float((alone[0]["latents"] - fast["latents"]).abs().max())
        assert 0 < diff < float(fast["latents"].abs().max()), diff  # it changed something, not everything
    finally:
        world.caches.close(wait=True)


def test_flux_turbo_jobs_on_a_larger_grid_equal_each_job_alone(tmp_path: Path) -> None:
    """Flux jobs of different sizes share a step on the union grid (``RowGroup.positions``): reusing
    jobs of the smaller size, batched with full jobs of other sizes, equal each job alone."""
    from tests.support.flux_world import FluxWorld
    from tests.test_lora_engine import run_engine
    from tests.test_mixed_sizes import _image, _mask
    from workers.flux_inputs import prepare_flux_job_tensors

    world = FluxWorld(tmp_path, steps=8, size=(96, 128))
    runner = world.runner()

    def prepare(seed: int, size: tuple[int, int], **meta):  # type: ignore[no-untyped-def]
        params = JobParams(prompt="a cat", steps=world.steps, guidance=30.0, seed=seed)
        prep = prepare_flux_job_tensors(world.pipe, runner.scheduler_config, _image(seed, size),
                                        _mask(seed, size, 0.5), params, size[1], size[0])
        return prep.tensors, {**prep.meta, "cache_mode": "full", **meta}

    try:
        _warm(runner, world.caches, world.key, world.steps, rec=world.job(runner, 9, **world.warm_meta("record")))
        runner.reuse_rule = Alternate()
        turbo = dict(world.warm_meta("masked"), temporal_reuse=True, refresh_steps=[0])
        jobs = [prepare(0, (128, 128)), prepare(1, (128, 96)), prepare(9, (96, 128), **turbo),
                prepare(8, (96, 128), **turbo)]
        alone = [run_engine(runner, [job])[0][0] for job in jobs]
        together, engine = run_engine(runner, jobs, max_batch=4)
        assert any(len(r.job_ids) == 4 for r in engine.stats.history), "the sizes never shared a step"
        for a, b in zip(alone, together):
            assert a.get("reused_share") == b.get("reused_share")
            assert float((a["latents"] - b["latents"]).abs().max()) <= 1e-4
        assert all(r["reused_share"] > 0 for r in together[2:])
    finally:
        world.caches.close(wait=True)
