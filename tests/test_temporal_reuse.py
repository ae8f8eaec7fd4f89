"""Temporal reuse (``turbo``): what a reused patch receives, when reuse is allowed, that a rule
never reusing changes nothing, that steady steps stay free of host syncs, and the served rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_host_syncs import counted_steps
from tests.test_plan_engine import _job, _runner_setup, _warm
from workers.maskaware import TemplateCacheKey
from workers.maskaware.reuse import FEATURES, MAX_RUN, PATCH, TemporalReuse
from workers.maskaware.reuse_rule import ForestRule, ThresholdRule, default_rule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Never:
    name = "never"

    def reuse(self, features: np.ndarray) -> np.ndarray:
        return np.zeros(len(features), bool)


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


def test_the_shipped_rule_loads_and_decides_per_patch() -> None:
    rule = default_rule()
    about = rule.about
    assert about["command"].startswith("python -m ops.train.reuse_rule")
    x = np.tile(np.array([[0.5, 0.04, 1, 0.04, 0.1, 1.0, 0.5, 7.5, 0]]), (3, 1))  # FEATURES, a typical patch
    x[1, 1] = x[1, 3] = x[1, 4] = 10.0  # a patch whose last reuse would have been far off
    decided = rule.reuse(x)
    assert decided.shape == (3,) and decided.dtype == bool
    assert decided[0] and not decided[1]
