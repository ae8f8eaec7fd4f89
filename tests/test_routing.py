"""Routing policies on constructed worker views; the dispatcher's live view on a real Redis;
XAUTOCLAIM takeover of a dead dispatcher's entries; decision latency with 64 workers."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from app.costmodel import BlockSpec, CostModel, TierFit, UNetArch
from app.routing import (
    JobDemand,
    JobLoad,
    MaskAwareRouter,
    WorkerState,
    WorkerView,
    make_policy,
    make_router,
)
from tests.support.dispatch import run_until_routed


def small_model(intercept: float = 0.01, fetch_bw: float = 1e9) -> CostModel:
    """A cost model whose step time grows with masked tokens (attention- and linear-heavy)."""
    arch = UNetArch(latent_hw=(32, 32), num_levels=2,
                    blocks=(BlockSpec("down_blocks.0.attentions.0.transformer_blocks.0", 0, 64, 64, 256, True),
                            BlockSpec("up_blocks.1.attentions.0.transformer_blocks.0", 0, 64, 64, 256, True)),
                    fullmap_macs_per_row=2e7)
    return CostModel("m", "test", arch, intercept, (0.1, 2.0, 2.0, 0.001, 0.001),
                     tiers={"local": TierFit(0.0, fetch_bw)})


def job(job_id: str, ratio: float, remaining: int = 20, cached: bool = True, template: str = "") -> JobLoad:
    return JobLoad(job_id, remaining, ratio, cached=cached, template_id=template)


def demand(ratio: float = 0.1, steps: int = 20, template: str = "") -> JobDemand:
    return JobDemand("new", steps, ratio, template_id=template)


def view(*workers: WorkerState) -> WorkerView:
    return WorkerView(workers)


def test_round_robin_cycles_and_skips_dead_workers() -> None:
    rr = make_policy("round_robin")
    v = view(WorkerState("0"), WorkerState("1"), WorkerState("2", alive=False))
    assert [rr.choose(demand(), v) for _ in range(4)] == ["0", "1", "0", "1"]
    everyone_dead = view(WorkerState("0", alive=False), WorkerState("1", alive=False))
    assert rr.choose(demand(), everyone_dead) in {"0", "1"}  # better late than never routed


def test_least_requests_counts_running_waiting_and_in_flight() -> None:
    lr = make_policy("least_requests")
    a = WorkerState("a", running=[job("1", 0.1)], waiting=[job("2", 0.1)])
    b = WorkerState("b", running=[job("3", 0.9)], inflight=[job("4", 0.9)], templates=frozenset())
    c = WorkerState("c", running=[job("5", 0.5)])
    assert lr.choose(demand(), view(a, b, c)) == "c"
    v = view(a, b, c)
    v.assign("c", demand())
    assert v.workers["c"].n_jobs == 2
    assert lr.choose(demand(), v) in {"a", "b", "c"}


def test_least_masked_tokens_prefers_fewer_tokens_over_fewer_requests() -> None:
    model = small_model()
    big = WorkerState("big", running=[job("1", 0.8), job("2", 0.7)])
    many_small = WorkerState("small", running=[job(str(i), 0.02) for i in range(3, 7)])
    assert make_policy("least_requests").choose(demand(), view(big, many_small)) == "big"
    assert make_policy("least_masked_tokens", model).choose(demand(), view(big, many_small)) == "small"
    assert make_policy("least_masked_tokens").choose(demand(), view(big, many_small)) == "small"  # ratios only
    # An uncached job computes every token, whatever its mask.
    uncached = WorkerState("u", running=[job("7", 0.01, cached=False)])
    tiny = WorkerState("t", running=[job("8", 0.05), job("9", 0.05)])
    assert make_policy("least_masked_tokens", model).choose(demand(), view(uncached, tiny)) == "t"


def test_mask_aware_weighs_mask_sizes() -> None:
    model = small_model()
    ma = make_policy("mask_aware", model)
    big = WorkerState("big", running=[job("1", 0.8), job("2", 0.7)])
    many_small = WorkerState("small", running=[job(str(i), 0.02) for i in range(3, 7)])
    assert ma.choose(demand(), view(big, many_small)) == "small"


def test_mask_aware_integrates_over_remaining_steps() -> None:
    """Four jobs about to finish cost less than two that just started: least-requests gets it wrong."""
    model = small_model()
    ending = WorkerState("ending", running=[job(str(i), 0.3, remaining=1) for i in range(4)])
    fresh = WorkerState("fresh", running=[job("a", 0.3, remaining=20), job("b", 0.3, remaining=20)])
    assert make_policy("least_requests").choose(demand(0.3), view(ending, fresh)) == "fresh"
    assert make_policy("least_masked_tokens", model).choose(demand(0.3), view(ending, fresh)) == "fresh"
    assert make_policy("mask_aware", model).choose(demand(0.3), view(ending, fresh)) == "ending"


def test_mask_aware_routes_by_each_workers_measured_pace() -> None:
    """A worker whose engine measured its steps 2x slower than the fit (its published calibration
    factor) costs 2x: the job goes to the emptier-looking worker only while the pace is equal."""
    model = small_model()
    ma = make_policy("mask_aware", model)
    light_but_slow = WorkerState("slow", running=[job("1", 0.2)], step_time_factor=2.0)
    busier = WorkerState("fast", running=[job("2", 0.2), job("3", 0.2)])
    light = WorkerState("slow", running=[job("1", 0.2)])
    assert ma.choose(demand(0.2), view(light, busier)) == "slow"
    assert ma.choose(demand(0.2), view(light_but_slow, busier)) == "fast"
    # The pruned choice still equals the exact costs with the factor applied.
    mar = MaskAwareRouter(model)
    d = JobLoad.from_demand(demand(0.2))
    assert mar.cost(d, light_but_slow, 0.0) == pytest.approx(2.0 * mar.cost(d, light, 0.0))
    assert mar.lower_bound(light_but_slow, mar.job_seconds(d), 20) <= mar.cost(d, light_but_slow, 0.0)


def test_mask_aware_accounts_for_a_full_batch_queue() -> None:
    """A worker with a full batch makes the job wait for a slot; an emptier one does not."""
    model = small_model()
    full = WorkerState("full", running=[job(str(i), 0.05, remaining=15) for i in range(2)], max_batch=2)
    busy = WorkerState("busy", running=[job("x", 0.05, remaining=15)], max_batch=2)
    router = make_policy("mask_aware", model)
    assert isinstance(router, MaskAwareRouter)
    mine = JobLoad("n", 20, 0.1)
    assert router.cost(mine, full, 0.0) > router.cost(mine, busy, 0.0)
    assert router.choose(demand(0.1), view(full, busy)) == "busy"


def test_marginal_variant_charges_the_delay_inflicted_on_co_batched_jobs() -> None:
    """Both workers finish the new job at the same predicted time, but on ``long`` it shares 10
    steps with the running job (slowing it by 10 x its step seconds) and on ``short`` only 5:
    the paper's cost ties, the marginal cost (``mask_aware_marginal``) prefers ``short``."""
    model = small_model(intercept=0.0)
    plain, marginal = make_policy("mask_aware", model), make_policy("mask_aware_marginal", model)
    assert isinstance(plain, MaskAwareRouter) and isinstance(marginal, MaskAwareRouter)
    assert marginal.name == "mask_aware_marginal"

    def state(wid: str, g: float, rem: int) -> WorkerState:
        return WorkerState(wid, running=[JobLoad(f"{wid}.r", rem, 0.5, step_seconds=g)])

    mine = JobLoad("n", 10, 0.5, step_seconds=1.0)
    long, short = state("long", 1.0, 10), state("short", 2.0, 5)
    assert plain.cost(mine, long, 0.0) == pytest.approx(20.0)
    assert plain.cost(mine, short, 0.0) == pytest.approx(20.0)
    assert marginal.cost(mine, long, 0.0) == pytest.approx(30.0)
    assert marginal.cost(mine, short, 0.0) == pytest.approx(25.0)


@pytest.mark.parametrize("policy", ["mask_aware", "mask_aware_marginal", "mask_aware_fetch", "mask_aware_unloaded"])
def test_mask_aware_pruned_choice_equals_evaluating_every_worker(policy: str) -> None:
    """``choose`` skips workers by a lower bound; it must pick exactly what evaluating ``cost`` on
    every worker in the rotating order picks (ties included), on random views with idle, busy and
    queueing workers, templates, and partly warm per-state caches."""
    import random

    rnd = random.Random(5)
    model = small_model(fetch_bw=1e6)
    router, brute = make_policy(policy, model), make_policy(policy, model)
    assert isinstance(router, MaskAwareRouter) and isinstance(brute, MaskAwareRouter)
    n = 0

    def jobs(k: int, prefix: str) -> list[JobLoad]:
        nonlocal n
        out = []
        for _ in range(k):
            n += 1
            out.append(JobLoad(f"{prefix}{n}", rnd.choice([1, 2, 5, 10, 20]), rnd.choice([0.02, 0.1, 0.3, 0.9]),
                               cached=rnd.random() > 0.2, template_id=f"t{rnd.randrange(4)}"))
        return out

    def worker(wid: str) -> WorkerState:
        mb = rnd.choice([2, 4, 8])
        if rnd.random() < 0.3:
            return WorkerState(wid, max_batch=mb, templates=frozenset({"t0"}) if rnd.random() < 0.5 else frozenset())
        return WorkerState(wid, running=jobs(rnd.randrange(mb + 1), "r"), waiting=jobs(rnd.randrange(3), "w"),
                           inflight=jobs(rnd.randrange(2), "i"), max_batch=mb,
                           templates=frozenset(f"t{rnd.randrange(4)}" for _ in range(2)))

    v = view(*(worker(str(k)) for k in range(12)))
    for step in range(300):
        if step % 7 == 0:  # a refresh: some workers change (new state objects), others keep theirs
            v = view(*(worker(w.worker_id) if rnd.random() < 0.5 else w for w in v.workers.values()))
        d = JobDemand(f"new{step}", rnd.choice([10, 20]), rnd.choice([0.02, 0.1, 0.3]),
                      template_id=rnd.choice(["", "t0", "t1"]))
        mine = JobLoad.from_demand(d)
        fetch_s = brute.template_fetch_s(d)
        order = brute._rot.order(v.candidates())
        load = brute.cluster_load(v.candidates(), d.steps)
        expected = min(order, key=lambda w: (brute.cost(mine, w, fetch_s, load=load), w.n_jobs)).worker_id
        got = router.choose(d, v)
        assert got == expected, step
        v.assign(got, d)


def test_mask_aware_cache_affinity() -> None:
    """Identical load: the worker that holds the template (or has a job of it coming) wins, the other
    would compute the job in full until the cache lands; without a template both tie and rotation
    spreads the choice."""
    model = small_model(fetch_bw=1e5)  # a slow link: the fetch dominates whatever steps a cache stores
    a = WorkerState("a", running=[job("1", 0.2)])
    b = WorkerState("b", running=[job("2", 0.2)], templates=frozenset({"tpl"}))
    router = make_policy("mask_aware", model)
    assert router.choose(demand(0.2, template="tpl"), view(a, b)) == "b"
    c = WorkerState("c", running=[job("3", 0.2)], inflight=[job("4", 0.2, template="tpl")])
    d = WorkerState("d", running=[job("5", 0.2), job("6", 0.0001)])
    assert router.choose(demand(0.2, template="tpl"), view(d, c)) == "c"
    picks = {router.choose(demand(0.2), view(WorkerState("a", running=[job("1", 0.2)]),
                                               WorkerState("b", running=[job("2", 0.2)]))) for _ in range(4)}
    assert picks == {"a", "b"}


def test_mask_aware_charges_a_cold_template_the_steps_its_cache_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A template cache of n stored steps (STENCIL_CACHE_STEPS) moves n steps of bytes, not the job's
    20: a worker with two more jobs but the template resident wins against a 20-step fetch, and
    loses against a 2-step one."""
    model = small_model(fetch_bw=1e6)
    warm = WorkerState("warm", running=[job(str(i), 0.2) for i in range(3)], templates=frozenset({"tpl"}))
    cold = WorkerState("cold", running=[job("c", 0.2)], templates=frozenset())
    picks = {}
    for setting in ("0", "2"):
        monkeypatch.setenv("STENCIL_CACHE_STEPS", setting)
        picks[setting] = make_policy("mask_aware", model).choose(demand(0.2, template="tpl"), view(warm, cold))
    assert picks == {"0": "warm", "2": "cold"}


def test_mask_aware_cache_is_invalidated_by_state_changes() -> None:
    model = small_model()
    router = make_policy("mask_aware", model)
    a, b = WorkerState("a"), WorkerState("b")
    v = view(a, b)
    first = router.choose(demand(0.5), v)
    v.assign(first, JobDemand("j1", 20, 0.5))
    assert router.choose(demand(0.5), v) != first  # the in-flight job counts at once


def test_unknown_policy_and_missing_model() -> None:
    with pytest.raises(ValueError):
        make_policy("random")
    with pytest.raises(ValueError):
        make_policy("mask_aware")
    with pytest.raises(ValueError):
        make_router("round_robin", [])


# -- the dispatcher's live view, on a real Redis ----------------------------------------------


def publish(r, worker_id: str, running: list[dict], waiting: list[dict] | None = None,  # type: ignore[no-untyped-def]
            updated: float | None = None, **extra: str) -> None:
    """Write a worker hash the way ``RedisEngineHooks._state`` does."""
    mapping = {"running": json.dumps(running), "waiting": json.dumps(waiting or []),
               "updated": repr(time.time() if updated is None else updated), "last_step_seconds": "0.25",
               "holder": "test:1"}
    mapping.update(extra)
    r.hset(f"stencil:worker:{worker_id}", mapping=mapping)


def test_live_view_parses_worker_state_and_tracks_in_flight(redis_client) -> None:  # type: ignore[no-untyped-def]
    from app.dispatcher import LiveWorkerView
    from app.jobs import JobParams, JobStatus, JobStore

    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    publish(redis_client, "0", [{"job_id": "a", "mask_ratio": 0.2, "remaining": 5},
                                {"job_id": "done", "mask_ratio": 0.2, "remaining": 0}],
            [{"job_id": "b", "mask_ratio": 0.5, "remaining": 20}], max_batch="4", templates='["t1"]')
    publish(redis_client, "1", [], updated=time.time() - 1000)  # stale: presumed dead
    live = LiveWorkerView(redis_client, ["0", "1", "2"], max_batch=8, refresh_s=0.0, stale_s=60, jobs=store,
                          status_check_s=0.0)
    v = live.refresh()
    w0 = v.workers["0"]
    assert [j.job_id for j in w0.running] == ["a"] and [j.job_id for j in w0.waiting] == ["b"]
    assert w0.max_batch == 4 and w0.templates == {"t1"} and w0.last_step_seconds == 0.25 and w0.alive
    # Never published: not joined yet (its host may not run; jobs routed there would wait for the sweeper).
    assert not v.workers["1"].alive and not v.workers["2"].alive
    assert {w.worker_id for w in v.candidates()} == {"0"}
    # A routed job counts at its worker until the engine shows it, then only once.
    job_id, _ = store.create(JobParams(steps=20))
    store.transition(job_id, JobStatus.ROUTED)
    live.assign("2", JobDemand(job_id, 20, 0.3, template_id="t9"))
    assert [j.job_id for j in live.refresh().workers["2"].inflight] == [job_id]
    publish(redis_client, "2", [{"job_id": job_id, "mask_ratio": 0.3, "remaining": 19}])
    w2 = live.refresh().workers["2"]
    assert w2.inflight == [] and [j.job_id for j in w2.running] == [job_id]
    assert w2.running[0].template_id == "t9"  # enriched from what the dispatcher knew
    # An in-flight job that ended without ever being seen (e.g. cancelled) is dropped.
    other, _ = store.create(JobParams(steps=20))
    live.assign("0", JobDemand(other, 20, 0.3))
    store.cancel(other)
    assert live.refresh().workers["0"].inflight == []


@pytest.fixture()
def dispatcher_factory(redis_server):  # type: ignore[no-untyped-def]
    from app.celery_app import make_celery
    from app.dispatcher import Dispatcher
    from app.settings import Settings

    def make(**overrides: object) -> Dispatcher:
        cost_model = overrides.pop("cost_model", None)
        consumer = str(overrides.pop("consumer", "t"))
        options = {k: overrides.pop(k) for k in ("view_refresh_s", "claim_idle_ms") if k in overrides}
        settings = Settings.from_env(redis_url=redis_server.url, **overrides)
        return Dispatcher(settings, make_celery(settings), consumer=consumer, cost_model=cost_model, **options)

    return make


def test_dispatcher_routes_by_published_state(redis_client, dispatcher_factory) -> None:  # type: ignore[no-untyped-def]
    from app.jobs import JobParams, JobStore

    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    publish(redis_client, "0", [{"job_id": f"x{i}", "mask_ratio": 0.1, "remaining": 10} for i in range(3)])
    publish(redis_client, "1", [{"job_id": "y", "mask_ratio": 0.1, "remaining": 10}])
    d = dispatcher_factory(gpu_workers="0,1", routing_policy="least_requests", view_refresh_s=0.0)
    ids = [store.create(JobParams(steps=5))[0] for _ in range(3)]
    # Worker 1 has 1 job, worker 0 has 3: the first two go to 1 (its in-flight count grows), then tie.
    outcomes = [d.route(j) for j in ids]
    assert outcomes[:2] == ["routed to gpu.1", "routed to gpu.1"]
    assert d.decisions.samples and d.decisions.quantile(0.99) < 0.05


def test_dispatcher_expires_unreachable_deadlines_with_a_reason(redis_client, dispatcher_factory) -> None:  # type: ignore[no-untyped-def]
    from app.jobs import JobParams, JobStatus, JobStore

    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    model = small_model(intercept=0.5)  # >= 10 s for 20 steps
    d = dispatcher_factory(gpu_workers="0", cost_model=model)
    hopeless, _ = store.create(JobParams(steps=20, deadline=time.time() + 2.0))
    fine, _ = store.create(JobParams(steps=20, deadline=time.time() + 600.0))
    assert d.route(hopeless) == "expired"
    rec = store.get(hopeless)
    assert rec.status == JobStatus.EXPIRED and "deadline unreachable" in (rec.error or "")
    assert d.route(fine) == "routed to gpu.0"


def test_xautoclaim_takes_over_a_dead_dispatchers_entries(redis_server, redis_client,  # type: ignore[no-untyped-def]
                                                          dispatcher_factory) -> None:
    """A dispatcher with ANOTHER name claims entries a dead one read but never acknowledged."""
    from app.jobs import JobParams, JobStatus, JobStore

    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    alive = dispatcher_factory(gpu_workers="0", claim_idle_ms=200, consumer="alive")
    alive.ensure_group()
    job_id, _ = store.create(JobParams(steps=5))
    got = redis_client.xreadgroup("dispatchers", "dead", {"stencil:jobs": ">"}, count=10)
    assert got and store.status(job_id) == JobStatus.QUEUED
    time.sleep(0.3)  # idle longer than the claim threshold
    assert run_until_routed(alive, store, job_id) == JobStatus.ROUTED
    assert redis_client.xpending("stencil:jobs", "dispatchers")["pending"] == 0
    consumers = {c["name"].decode(): c["pending"] for c in redis_client.xinfo_consumers("stencil:jobs", "dispatchers")}
    assert consumers.get("dead", 0) == 0


def test_decision_latency_with_64_workers(redis_client) -> None:  # type: ignore[no-untyped-def]
    """p99 of a mask-aware decision over 64 busy workers (target < 1 ms; asserted loosely because
    the test machine is shared) and of a view refresh from 64 real Redis hashes."""
    from ops.sim.decision import policy_latency, refresh_latency

    lat = policy_latency(small_model(), "mask_aware", workers=64, decisions=400)
    assert lat["cpu_p50_ms"] < 1.0 and lat["cpu_p99_ms"] < 5.0, lat
    ref = refresh_latency(redis_client, workers=64, rounds=30)
    assert ref["p50_ms"] < 50.0, ref


def test_dispatcher_finds_the_fitted_model_or_falls_back(redis_server, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """mask_aware loads ``<home>/costmodels/<model id>--*.json``; with no fitted model and none
    shipped for the model, it routes with least_requests instead of refusing to start."""
    from app.celery_app import make_celery
    from app.costmodel import default_path
    from app.dispatcher import Dispatcher
    from app.routing import LeastRequestsRouter
    from app.settings import Settings

    monkeypatch.delenv("STENCIL_COST_MODEL", raising=False)
    empty = Settings.from_env(redis_url=redis_server.url, home=tmp_path / "empty", routing_policy="mask_aware",
                              model_id="no-such-model")
    assert isinstance(Dispatcher(empty, make_celery(empty), consumer="t").router, LeastRequestsRouter)
    home = tmp_path / "home"
    small_model().save(default_path(home, "tiny-sd-inpaint", "cpu-test"))
    s = Settings.from_env(redis_url=redis_server.url, home=home, routing_policy="mask_aware",
                          model_id="tiny-sd-inpaint")
    d = Dispatcher(s, make_celery(s), consumer="t")
    assert isinstance(d.router, MaskAwareRouter) and d.cost_model is not None
    assert d.cost_model.device_kind == "test"


def test_default_policy_is_mask_aware_with_the_shipped_model(redis_server, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """By default (no routing setting, nothing fitted in the home) the dispatcher routes mask-aware
    with the cost model shipped for the configured model, on its device type."""
    from app.celery_app import make_celery
    from app.costmodel import SHIPPED_DIR, CostModel
    from app.dispatcher import Dispatcher
    from app.settings import Settings

    monkeypatch.delenv("STENCIL_COST_MODEL", raising=False)
    monkeypatch.delenv("STENCIL_ROUTING_POLICY", raising=False)
    assert Settings().routing_policy == "mask_aware"
    for model_id, shipped in (("tiny-sd-inpaint", "tiny-sd-inpaint--cpu-1t.json"),
                              ("tiny-sd-inpaint-trained", "tiny-sd-inpaint-trained--cpu-1t-mixed.json")):
        s = Settings.from_env(redis_url=redis_server.url, home=tmp_path / "empty", model_id=model_id, device="cpu")
        with caplog.at_level(logging.INFO, logger="app.dispatcher"):
            d = Dispatcher(s, make_celery(s), consumer="t")
        assert isinstance(d.router, MaskAwareRouter)
        expected = CostModel.load(SHIPPED_DIR / shipped)
        assert d.router.model.model_id == model_id and d.router.model.coef == expected.coef
        assert d.cost_model is None  # routing only: deadlines wait for a model fitted on this host
        assert shipped in caplog.text


def test_a_model_folder_of_a_shipped_architecture_routes_with_its_cost_model(  # type: ignore[no-untyped-def]
        redis_server, tmp_path, monkeypatch) -> None:
    """A checkpoint folder under another name whose UNet is a shipped model's architecture: that model."""
    import shutil

    from app.celery_app import make_celery
    from app.dispatcher import Dispatcher
    from app.settings import Settings

    monkeypatch.delenv("STENCIL_COST_MODEL", raising=False)
    monkeypatch.delenv("STENCIL_ROUTING_POLICY", raising=False)
    folder = tmp_path / "my-checkpoint"
    (folder / "unet").mkdir(parents=True)
    trained = Path(__file__).resolve().parents[1] / "workers" / "models" / "trained" / "tiny-sd-inpaint-trained"
    shutil.copy(trained / "unet" / "config.json", folder / "unet" / "config.json")
    s = Settings.from_env(redis_url=redis_server.url, home=tmp_path / "empty", model_dir=str(folder))
    d = Dispatcher(s, make_celery(s), consumer="t")
    assert isinstance(d.router, MaskAwareRouter) and d.router.model.model_id.startswith("tiny-sd-inpaint")


def test_default_policy_falls_back_to_least_requests_when_no_shipped_model_fits(  # type: ignore[no-untyped-def]
        redis_server, tmp_path, monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    """A model with no shipped cost model (a custom folder), or a shipped CPU model on a GPU
    device: least_requests, with a log line naming why."""
    from app.celery_app import make_celery
    from app.dispatcher import Dispatcher
    from app.routing import LeastRequestsRouter
    from app.settings import Settings

    monkeypatch.delenv("STENCIL_COST_MODEL", raising=False)
    monkeypatch.delenv("STENCIL_ROUTING_POLICY", raising=False)
    folder = tmp_path / "my-checkpoint"
    for overrides in ({"model_dir": str(folder)}, {"model_id": "tiny-sd-inpaint", "device": "cuda"}):
        s = Settings.from_env(redis_url=redis_server.url, home=tmp_path / "empty", **overrides)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="app.dispatcher"):
            d = Dispatcher(s, make_celery(s), consumer="t")
        assert isinstance(d.router, LeastRequestsRouter), overrides
        assert "routing with least_requests instead" in caplog.text


def test_refresh_steps_are_costed_at_full_compute() -> None:
    """A cached job under a fidelity policy with refresh steps computes that share of its steps
    fully: the router's per-step cost is the blend, not the masked cost alone."""
    model = small_model()
    router = make_policy("mask_aware", model)
    masked = router.job_seconds(JobLoad("a", 20, 0.1, cached=True))
    full = router.job_seconds(JobLoad("b", 20, 0.1, cached=False))
    blended = router.job_seconds(JobLoad("c", 20, 0.1, cached=True, refresh_share=0.1))
    assert masked < blended < full
    assert blended == pytest.approx(0.9 * masked + 0.1 * full)
    assert JobLoad.from_demand(JobDemand("d", 20, 0.1, refresh_share=0.15)).refresh_share == 0.15
