"""The plan inside the engine: per-unit "compute fully" overrides, block-wise loading, wiring.

Exactness: a job whose cache was recorded from its own inputs must equal full compute whatever
mix of units computes fully and which use the cache (DESIGN.md pitfall 10: the plan is real).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from app.storage.local import LocalStore
from app.storage.throttle import ThrottledStore
from tests.test_maskaware_unet import LATENT, MODELS, TOL, Job, _masks, make_template, run_jobs
from workers.maskaware import ActivationStore, MaskAwareUNet, RowGroup, TemplateCacheKey


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class PartialCache(Mapping[str, torch.Tensor]):
    """A step cache whose units in ``missing`` are not resident: reading them is a bug."""

    def __init__(self, ctrl: MaskAwareUNet, tensors: dict[str, torch.Tensor], missing: set[str]) -> None:
        self.tensors = tensors
        self.missing = missing
        self.blocked = {n for u in missing for n in ctrl.unit_tensor_names(u)}
        self.asked: list[str] = []

    def acquire_unit(self, unit: str) -> bool:
        self.asked.append(unit)
        return unit not in self.missing

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.blocked:
            raise AssertionError(f"read {name} of a unit that computes fully")
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


@pytest.mark.parametrize(("model", "kv_source"), [
    ("default", "cache"), ("sdxl_style", "cache"), ("sdxl_style", "recompute"), ("tiny", "cache")])
def test_mixed_plan_equals_full_compute(model: str, kv_source: str) -> None:
    ref_unet, unet = MODELS[model](0), MODELS[model](0)
    ctrl = MaskAwareUNet(unet, kv_source=kv_source)
    units = ctrl.units
    assert len(units) >= 2 and all(".transformer_blocks." not in u for u in units)
    m = _masks()
    tpl = make_template(2, m["blob"])
    ref = run_jobs(ref_unet, None, [Job(tpl)])[0]
    rec = Job(tpl, "record")
    run_jobs(unet, ctrl, [rec])
    tm = ctrl.token_masks(tpl.mask, LATENT)
    # Every other unit not resident; step-dependent so that each unit is both at some step.
    per_step = [PartialCache(ctrl, c, set(units[s % 2::2])) for s, c in enumerate(rec.recorded)]
    out = run_jobs(unet, ctrl, [Job(tpl, "masked", 0, tm, per_step)])[0]  # type: ignore[arg-type]
    assert float((out - ref).abs().max()) <= TOL
    assert all(sorted(c.asked) == sorted(units) for c in per_step)  # once per unit and step


def test_full_units_do_not_read_the_cache_and_others_do() -> None:
    """Guard against vacuity: a wrong cache shows exactly in the units that use it."""
    unet = MODELS["sdxl_style"](0)
    ctrl = MaskAwareUNet(unet)
    m = _masks()
    a, b = make_template(1, m["blob"]), make_template(2, m["blob"])
    rec_a, rec_b = Job(a, "record"), Job(b, "record")
    ref_a = run_jobs(unet, ctrl, [rec_a, rec_b])[0]
    tm = ctrl.token_masks(a.mask, LATENT)
    everything = set(ctrl.units)
    # B's cache, but every unit computes fully: exact, and B's tensors are never read.
    wrong_all_full = [PartialCache(ctrl, c, everything) for c in rec_b.recorded]
    out = run_jobs(unet, ctrl, [Job(a, "masked", 0, tm, wrong_all_full)])[0]  # type: ignore[arg-type]
    assert float((out - ref_a).abs().max()) <= TOL
    # B's cache used by one unit only: the result changes.
    one = ctrl.units[0]
    wrong_one = [PartialCache(ctrl, c, everything - {one}) for c in rec_b.recorded]
    out = run_jobs(unet, ctrl, [Job(a, "masked", 0, tm, wrong_one)])[0]  # type: ignore[arg-type]
    assert float((out - ref_a).abs().max()) > 1e-3


def test_units_are_in_execution_order() -> None:
    unet = MODELS["sdxl_style"](0)
    ctrl = MaskAwareUNet(unet)
    seen: list[str] = []
    mods = dict(unet.named_modules())
    handles = [mods[u].register_forward_pre_hook(lambda m, a, u=u: seen.append(u)) for u in ctrl.units]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        unet(torch.randn(1, 9, *LATENT, generator=g), torch.tensor([10]), torch.randn(1, 6, 32, generator=g))
    for h in handles:
        h.remove()
    assert seen == ctrl.units and ctrl.units.index("mid_block.attentions.0") < ctrl.units.index(
        "up_blocks.0.attentions.0")


def test_full_units_field_and_unit_timings() -> None:
    unet = MODELS["sdxl_style"](0)
    ctrl = MaskAwareUNet(unet)
    g = torch.Generator().manual_seed(0)
    x, t, e = torch.randn(2, 9, *LATENT, generator=g), torch.tensor([981, 981]), torch.randn(2, 6, 32, generator=g)
    tm = ctrl.token_masks(_masks()["rect"], LATENT)
    with torch.no_grad():
        with ctrl.batch([RowGroup(2, "record")]) as ctx:
            ref = unet(x, t, e).sample
        cache = ctx.recorded[0]
        full = frozenset(ctrl.units[1:])
        partial = {n: v for n, v in cache.items() if n in set(ctrl.unit_tensor_names(ctrl.units[0]))}
        with ctrl.batch([RowGroup(2, "masked", token_mask=tm, cache=partial, full_units=full)]) as ctx2:
            out = unet(x, t, e).sample
    assert float((out - ref).abs().max()) <= 1e-5
    assert set(ctx.unit_seconds) == set(ctrl.units) and all(v > 0 for v in ctx.unit_seconds.values())
    u0 = ctrl.units[0]
    n0 = ctrl.unit_tokens(u0, LATENT)
    assert ctx.unit_tokens[u0] == 2 * n0
    assert ctx2.unit_tokens[u0] == 2 * tm.count(n0) < 2 * n0  # masked: fewer rows computed
    assert all(ctx2.unit_tokens[u] == 2 * ctrl.unit_tokens(u, LATENT) for u in full)
    assert sum(ctrl.unit_nbytes(u, LATENT, 2) for u in ctrl.units) == ctrl.cache_nbytes(*LATENT, rows=2)
    assert sorted(n for u in ctrl.units for n in ctrl.unit_tensor_names(u)) == sorted(ctrl.tensor_names())


# --- the plan's input and decisions (pure) --------------------------------------------------------

class _Ctrl:
    """Two units at one level; unit bytes as given."""

    units = ["u0", "u1"]

    def unit_tokens(self, unit: str, hw: tuple[int, int]) -> int:
        return 100

    def unit_nbytes(self, unit: str, hw: tuple[int, int], rows: int) -> int:
        return 1000 * rows


class _Mask:
    def count(self, n: int) -> int:
        return n // 10


def test_unit_costs_and_plan_decisions() -> None:
    from workers.engine.plan import RESIDENT, Tier, UnitCostModel, plan_optimal
    from workers.engine.runner_base import GAP, PlanJob, unit_costs

    cost = UnitCostModel()
    for u in _Ctrl.units:
        cost.observe(u, 20, 0.02)
        cost.observe(u, 400, 0.4)
    assert unit_costs(_Ctrl(), cost, [PlanJob(2)], (8, 8), None) is None  # gaps unmeasured: never guess
    for u in _Ctrl.units:
        cost.observe(GAP + u, 6, 0.01)
    assert cost.predict("u0", 210) == pytest.approx(0.21)
    jobs = [PlanJob(2),  # full job: 200 rows every unit
            PlanJob(2, _Mask(), ("d", 3), {"u0"}),  # pending: u0 resident, u1 to load
            PlanJob(2, _Mask(), ("d", 3), set())]  # same slot: bytes counted once
    fast, slow = Tier("fast", 1e9), Tier("slow", 1e3)  # 2 KB: 2 us vs 2 s

    def units_only(blocks):  # type: ignore[no-untyped-def]
        return [b for b in blocks if not b.name.startswith(GAP)]

    def decisions(blocks):  # type: ignore[no-untyped-def]
        plan = plan_optimal(blocks)
        return tuple(use for b, use in zip(blocks, plan.use_cache) if not b.name.startswith(GAP))

    blocks = unit_costs(_Ctrl(), cost, jobs, (8, 8), fast)
    assert blocks is not None and [b.name for b in blocks] == [GAP + "u0", "u0", GAP + "u1", "u1"]
    assert blocks[0].full_s == pytest.approx(0.01) and not blocks[0].available  # always computed
    u0, u1 = units_only(blocks)
    assert u0.load_bytes == 2000  # job 3 has u0 non-resident
    assert u1.load_bytes == 2000 and u1.tier == fast
    assert u1.cached_s == pytest.approx(cost.predict("u1", 200 + 20 + 20))
    assert u1.full_s == pytest.approx(cost.predict("u1", 200 + 200 + 200))
    assert decisions(blocks) == (True, True)
    assert decisions(unit_costs(_Ctrl(), cost, jobs, (8, 8), slow)) == (False, False)
    # 0.5 s per load: waiting for u0 (0.5 + 0.24) loses to computing it (0.61), but u1's load
    # hides behind that compute: the plan is neither all nor nothing (Algorithm 1's point).
    mid = Tier("mid", 2000 / 0.5)
    assert decisions(unit_costs(_Ctrl(), cost, jobs, (8, 8), mid)) == (False, True)
    only_resident = [PlanJob(2, _Mask(), ("d", 3), {"u0", "u1"})]
    blocks = unit_costs(_Ctrl(), cost, only_resident, (8, 8), slow)
    # Nothing to decide (resident units are used whatever the plan says: ``UnitCache``).
    assert [(b.tier, b.load_bytes) for b in units_only(blocks)] == [(RESIDENT, 0), (RESIDENT, 0)]


# --- block-wise loading and the runner ----------------------------------------------------------


def _runner_setup(tmp_path: Path, cache_plan: str, bandwidth: float = 20e6,  # type: ignore[no-untyped-def]
                  resnets: str = "full"):
    from workers.engine.sd_runner import SDRunner
    from workers.engine.template_cache import CacheRecorder, StepCacheProvider
    from workers.models.tiny_sd import build_scheduler

    unet = MODELS["sdxl_style"](0)
    ctrl = MaskAwareUNet(unet, resnets=resnets)
    store = ThrottledStore(LocalStore(tmp_path / "store"), bandwidth, latency_s=0.002)
    acts = ActivationStore(store)
    caches = StepCacheProvider(acts, 1 << 30)
    cfg = dict(build_scheduler().config) | {"_class_name": "DDIMScheduler"}
    runner = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, recorder=CacheRecorder(acts),
                      prefetch_steps=0, cache_plan=cache_plan)
    return unet, ctrl, runner, caches, store, cfg


def _job(runner, mode: str, key: TemplateCacheKey | None, steps: int, seed: int = 3,  # type: ignore[no-untyped-def]
         ratio: float = 0.15, latent: tuple[int, int] = LATENT):
    from workers.engine.job import EngineJob

    tensors, meta = _job_inputs(mode, key, steps, seed, ratio, latent)
    job = EngineJob(job_id=f"{mode}-{seed}", total_steps=steps)
    job.state = runner.init_state(tensors, meta)
    return job


def _job_inputs(mode: str, key: TemplateCacheKey | None, steps: int, seed: int = 3, ratio: float = 0.15,
                latent: tuple[int, int] = LATENT) -> tuple[dict, dict]:
    """A CFG job's prepared tensors and meta at ``latent`` (a blob mask of ``ratio``)."""
    from workers.maskaware.tokens import blob_mask

    h, w = latent
    g = torch.Generator().manual_seed(seed)
    pix = blob_mask(h * 8, w * 8, ratio, seed=seed)
    lat = torch.nn.functional.adaptive_max_pool2d(pix.float()[None, None], (h, w))
    tensors = {"latents": torch.randn(1, 4, h, w, generator=g),
               "mask": lat.expand(2, 1, h, w).contiguous(),
               "masked_image_latents": torch.randn(2, 4, h, w, generator=g),
               "prompt_embeds": torch.randn(2, 6, 32, generator=g),
               "generator_state": g.get_state(), "pixel_mask": pix.to(torch.uint8)}
    meta = {"t_start": 0, "num_steps": steps, "do_cfg": True, "guidance": 5.0, "cache_mode": mode}
    if key is not None:
        meta["cache_key"] = key.to_dict()
    return tensors, meta


def _warm(runner, caches, key: TemplateCacheKey, steps: int, rec=None,  # type: ignore[no-untyped-def]
          latent: tuple[int, int] = LATENT) -> None:
    """The template's warm-up (``rec``, else an SD one) recorded and committed, every step then
    resident (a steady state)."""
    rec = rec if rec is not None else _job(runner, "record", key, steps, latent=latent)
    while not rec.finished:
        runner.step([rec])
        rec.steps_done += 1
    runner.result(rec)["commit"].result(timeout=60)
    for s in range(steps):
        assert caches.wait(key, s, timeout=30) is not None


def _run(runner, job) -> torch.Tensor:  # type: ignore[no-untyped-def]
    while not job.finished:
        runner.step([job])
        job.steps_done += 1
    return runner.result(job)


@pytest.mark.parametrize("cache_plan", ["all", "plan", "resident"])
def test_runner_block_wise_loading_is_exact(tmp_path: Path, cache_plan: str) -> None:
    from workers.engine.sd_runner import SDRunner

    steps = 6
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, cache_plan)
    key = TemplateCacheKey("t", "tpl", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
    rec = _run(runner, _job(runner, "record", key, steps))
    rec["commit"].result(timeout=60)
    ref = _run(SDRunner(unet, cfg), _job(SDRunner(unet, cfg), "full", None, steps))["latents"]
    assert float((rec["latents"] - ref).abs().max()) <= TOL
    read_before = store.stats().bytes_read
    out = _run(runner, _job(runner, "masked", key, steps))
    assert float((out["latents"] - ref).abs().max()) <= TOL
    assert out["masked_steps"] + out["fallback_steps"] == steps
    share = out["cached_unit_share"]
    if cache_plan == "all":  # every unit waited for and used, loaded unit by unit
        assert share == 1.0 and out["fallback_steps"] == 0
        assert any(entry[1] == ctrl.units[0] for entry in caches.load_log)
    else:
        assert share is not None and 0.0 <= share <= 1.0
    assert caches.store_tier() is not None and caches.store_tier().bandwidth_bytes_per_s > 0
    # Loads deduplicated: at most the cache's bytes (plus headers/manifests) crossed the link.
    assert store.stats().bytes_read - read_before <= ctrl.cache_nbytes(*LATENT, rows=2, steps=steps) * 1.2 + 10**6
    caches.close(wait=True)


def test_plan_waits_for_fast_loads_and_skips_slow_ones(tmp_path: Path) -> None:
    """The store's link fast or slow (a unit's load >> its compute): the plan uses the cache
    where its load pays off and, once it has measured the slow link, stops waiting for it."""
    from workers.engine.sd_runner import SDRunner
    from workers.engine.template_cache import StepCacheProvider

    steps = 8
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    key = TemplateCacheKey("t", "tpl", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
    rec = _run(runner, _job(runner, "record", key, steps))
    rec["commit"].result(timeout=60)
    fast = _run(runner, _job(runner, "masked", key, steps))
    assert runner.last_plan is not None and fast["cached_unit_share"] > 0.5
    caches.close(wait=True)
    # Slow link, fresh provider (nothing resident, nothing measured yet).
    store.bandwidth_bytes_per_s = 1e6  # ~20-60 ms per unit vs ~1 ms to compute it
    slow_caches = StepCacheProvider(runner.caches.activations, 1 << 30)
    slow_runner = SDRunner(unet, cfg, maskaware=ctrl, caches=slow_caches, prefetch_steps=0, cache_plan="plan")
    slow_runner.unit_cost = runner.unit_cost  # same model, same measured compute times
    _run(slow_runner, _job(slow_runner, "masked", key, steps))  # first contact: measures the link
    deadline = time.monotonic() + 30
    while len(slow_caches.host.keys()) < steps and time.monotonic() < deadline:
        time.sleep(0.05)  # background prefetch of the whole cache finishes
    tier = slow_caches.store_tier()
    assert tier is not None and tier.bandwidth_bytes_per_s < 3e6
    for s in range(steps):
        slow_caches.forget(key, s)  # cold again, link now known to be slow
    slow = _run(slow_runner, _job(slow_runner, "masked", key, steps, seed=3))
    assert slow["cached_unit_share"] < fast["cached_unit_share"]
    assert slow["load_wait_s"] < 0.5  # never stalled for the slow transfers
    store.bandwidth_bytes_per_s = 1e9
    slow_caches.close(wait=True)


def test_runner_plans_the_next_step_while_this_one_computes(tmp_path: Path) -> None:
    """With nothing prefetched ahead, step s+1's chosen units are queued before step s+1 starts
    (behind step s's loads), so they are in flight or resident when it does; the result is exact."""
    from workers.engine.sd_runner import SDRunner

    steps = 6
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    key = TemplateCacheKey("t", "tpl", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
    _run(runner, _job(runner, "record", key, steps))["commit"].result(timeout=60)
    _run(runner, _job(runner, "masked", key, steps))  # trains the cost model, measures the link
    caches.drain()
    for s in range(steps):
        caches.forget(key, s)
    ref = _run(SDRunner(unet, cfg), _job(SDRunner(unet, cfg), "full", None, steps))["latents"]
    job = _job(runner, "masked", key, steps)
    starts: dict[int, float] = {}
    while not job.finished:
        starts[job.steps_done] = time.perf_counter()
        runner.step([job])
        job.steps_done += 1
    out = runner.result(job)
    assert float((out["latents"] - ref).abs().max()) <= TOL
    assert runner.last_ahead is not None
    ahead = [(slot[1], t0) for slot, unit, t0, _t1, _n in caches.load_log
             if slot[0] == key.digest() and unit in ctrl.units and slot[1] >= 1]
    early = [s for s, t0 in ahead if t0 < starts[s]]
    assert early, f"no unit of a later step was loaded before its step started: {ahead}"
    caches.close(wait=True)


def test_runner_without_the_plan_does_not_load_ahead(tmp_path: Path) -> None:
    steps = 4
    _unet, ctrl, runner, caches, _store, _cfg = _runner_setup(tmp_path, "resident", bandwidth=1e9)
    key = TemplateCacheKey("t", "tpl", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
    _run(runner, _job(runner, "record", key, steps))["commit"].result(timeout=60)
    _run(runner, _job(runner, "masked", key, steps))
    assert runner.last_ahead is None
    caches.close(wait=True)


def test_on_a_link_slower_than_compute_running_jobs_leave_whole_steps_to_the_plan(tmp_path: Path) -> None:
    """Measured: a step's cache loads slower than the step computes -> ``link_bound``; running
    jobs then queue no whole-step background fetches (the plan loads chosen units one step ahead);
    on a fast link they do."""
    from workers.engine.template_cache import StepCacheProvider

    steps = 6
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    key = TemplateCacheKey("t", "tpl", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
    _run(runner, _job(runner, "record", key, steps))["commit"].result(timeout=60)
    _run(runner, _job(runner, "masked", key, steps))  # trains the cost model on the fast link
    caches.close(wait=True)
    for bandwidth, bound in ((1e9, False), (2e5, True)):
        store.bandwidth_bytes_per_s = bandwidth
        fresh = StepCacheProvider(runner.caches.activations, 1 << 30, fetch_threads=1)
        r = type(runner)(unet, cfg, maskaware=ctrl, caches=fresh, prefetch_steps=3, cache_plan="plan")
        r.unit_cost = runner.unit_cost
        fresh.wait(key, 0, 30)  # measures the link
        job = _job(r, "masked", key, steps)
        for _ in range(3):
            r.step([job])
            job.steps_done += 1
        assert r.link_bound is bound
        for s in range(steps):
            fresh.forget(key, s)
        before = len(fresh.queued())
        r.prefetch(job)
        assert (len(fresh.queued()) > before) is not bound
        fresh.close()
    store.bandwidth_bytes_per_s = 1e9
