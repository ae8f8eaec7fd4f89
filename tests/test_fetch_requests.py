"""Requests per cached step: prefetch on S3 is latency-bound, so each request counts.

A step read costs one GET once the template's manifest is known (the manifest is cached, step
objects are still verified on every read), background prefetch of an untouched step reads the
whole object in one GET, and a deleted or re-recorded cache is never served from a stale manifest.
Counted with ``ThrottledStore.stats()`` over a local folder (no throttling).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from app.storage.local import LocalStore
from app.storage.throttle import ThrottledStore
from workers.engine.template_cache import StepCacheProvider
from workers.maskaware.activation_store import ActivationStore, CacheNotFound, TemplateCacheKey

UNITS = {"u0": ["u0.k", "u0.v"], "u1": ["u1.k", "u1.v"]}


def _key(name: str = "tpl", steps: int = 4) -> TemplateCacheKey:
    return TemplateCacheKey("m", name, 64, 64, "ddim", steps, 1.0, "cfg2", "kv+y")


def _record(acts: ActivationStore, key: TemplateCacheKey, fill: float) -> None:
    for step in range(key.steps):
        acts.put_step(key, step, {n: torch.full((8, 16), fill + step) for names in UNITS.values() for n in names})
    acts.commit(key)


def _store(tmp_path: Path) -> tuple[ThrottledStore, ActivationStore]:
    link = ThrottledStore(LocalStore(tmp_path))
    return link, ActivationStore(link)


def _unit_provider(acts: ActivationStore) -> StepCacheProvider:
    provider = StepCacheProvider(acts, 1 << 30, fetch_threads=1)
    provider.set_units(UNITS)
    return provider


def _wait_resident(provider: StepCacheProvider, key: TemplateCacheKey, steps: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(provider.ready(key, s, fetch=False) is None for s in steps) and time.monotonic() < deadline:
        time.sleep(0.005)


def test_step_reads_after_the_first_cost_one_request(tmp_path: Path) -> None:
    link, acts = _store(tmp_path)
    key = _key()
    _record(acts, key, 0.0)
    acts.read_step(key, 0)  # manifest + object
    before = link.stats().requests
    for step in (1, 2, 3):
        assert float(acts.read_step(key, step)["u0.k"][0, 0]) == step
    assert link.stats().requests - before == 3


def test_deleted_cache_is_not_served_from_a_cached_manifest(tmp_path: Path) -> None:
    _link, acts = _store(tmp_path)
    key = _key()
    _record(acts, key, 0.0)
    acts.read_step(key, 0)
    acts.delete(key)
    with pytest.raises(CacheNotFound):
        acts.read_step(key, 1)
    assert not acts.has(key)


def test_cache_deleted_by_another_process_fails_the_read_then_rereads_the_manifest(tmp_path: Path) -> None:
    _link, acts = _store(tmp_path)
    other = ActivationStore(LocalStore(tmp_path))  # e.g. `stencil cache delete` elsewhere
    key = _key()
    _record(acts, key, 0.0)
    acts.read_step(key, 0)
    other.delete(key)
    with pytest.raises(KeyError):  # ObjectNotFound: this step computes fully, never stale data
        acts.read_step(key, 1)
    _record(other, key, 100.0)  # re-recorded elsewhere: the next read sees the new cache
    assert float(acts.read_step(key, 1)["u1.v"][0, 0]) == 101.0


def test_background_prefetch_of_an_untouched_step_is_one_request(tmp_path: Path) -> None:
    link, acts = _store(tmp_path)
    key = _key()
    _record(acts, key, 0.0)
    provider = _unit_provider(acts)
    try:
        assert provider.wait(key, 0, 10) is not None  # manifest + step 0
        before = link.stats().requests
        provider.prefetch(key, [1, 2, 3])
        _wait_resident(provider, key, [1, 2, 3])
        got = provider.ready(key, 3, fetch=False)
        assert got is not None and float(got["u1.k"][0, 0]) == 3.0
        assert link.stats().requests - before == 3
    finally:
        provider.close(wait=True)


def test_a_unit_claimed_by_the_plan_is_still_read_on_its_own(tmp_path: Path) -> None:
    """The copy stream's unit is not swallowed into a whole-object GET (it is needed first)."""
    _link, acts = _store(tmp_path)
    key = _key()
    _record(acts, key, 0.0)
    provider = _unit_provider(acts)
    try:
        provider.load_units(key, 2, ["u0"])  # the plan wants u0 of step 2 now, the rest follows
        assert provider.drain(10)
        _wait_resident(provider, key, [2])
        assert provider.ready(key, 2, fetch=False) is not None
        loads = [unit for slot, unit, *_ in provider.load_log if slot[1] == 2]
        assert sorted(loads) == ["u0", "u1"]  # the rest ranged around it, not one whole GET
    finally:
        provider.close(wait=True)


def test_a_unit_past_its_own_deadline_is_computed_fully_not_waited_for(tmp_path: Path) -> None:
    """Per-unit deadlines (the plan's break-even wait): a late unit gives up at its own deadline,
    while a step-wide deadline would have waited for it."""
    from workers.engine.template_cache import UnitCache

    link = ThrottledStore(LocalStore(tmp_path), bandwidth_bytes_per_s=4096.0)  # ~1 s per unit
    acts = ActivationStore(link)
    key = _key()
    link.bandwidth_bytes_per_s = float("inf")
    _record(acts, key, 0.0)
    acts.step_header(key, 1)  # manifest cached before the link slows down
    link.bandwidth_bytes_per_s = 4096.0
    provider = _unit_provider(acts)
    names = [n for ns in UNITS.values() for n in ns]
    try:
        provider.load_units(key, 1, ["u0"], complete=False)
        t0 = time.monotonic()
        per_unit = UnitCache(provider, key, 1, names, ["u0"], {"u0": t0 + 0.05})
        assert per_unit.acquire_unit("u0") is False and per_unit.missed == ["u0"]
        assert time.monotonic() - t0 < 0.5
        step_wide = UnitCache(provider, key, 1, names, ["u0"], time.monotonic() + 10)
        assert step_wide.acquire_unit("u0") is True  # waited for the slow load
    finally:
        provider.close(wait=True)
