"""The cluster simulator: production policy and scheduler code, deterministic with a seed, and
mask-aware routing beating least-requests on a small deterministic cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.costmodel import BlockSpec, CostModel, TierFit, UNetArch
from app.routing import make_policy
from ops.sim.cluster import Cluster, ClusterConfig
from ops.sim.report import summarize
from ops.sim.workload import WorkloadSpec, capacity, generate
from workers.engine.scheduler import BatchScheduler


def model() -> CostModel:
    arch = UNetArch(latent_hw=(32, 32), num_levels=2,
                    blocks=(BlockSpec("down_blocks.0.attentions.0.transformer_blocks.0", 0, 64, 64, 256, True),
                            BlockSpec("mid_block.attentions.0.transformer_blocks.0", 1, 128, 64, 512, True)),
                    fullmap_macs_per_row=1e7)
    return CostModel("sim", "test", arch, 0.02, (0.5, 2.0, 2.0, 0.001, 0.002), tiers={"local": TierFit(0.001, 2e9)})


def run(policy: str, *, seed: int = 0, load: float = 0.85, workers: int = 4, jobs: int = 400,
        trace: str = "controlnet", slo: bool = False) -> tuple[list, Cluster]:
    m = model()
    spec = WorkloadSpec(trace=trace, load=load, workers=workers, jobs=jobs, steps=20, max_batch=4, seed=seed)
    js = generate(m, spec)
    cluster = Cluster(m, ClusterConfig(workers=workers, max_batch=4, slo_admission=slo, noise=0.05, seed=seed),
                      make_policy(policy, m))
    cluster.run(js)
    return js, cluster


def test_simulation_is_deterministic_for_a_seed() -> None:
    a, ca = run("mask_aware", seed=3)
    b, _ = run("mask_aware", seed=3)
    c, _ = run("mask_aware", seed=4)
    assert [(j.worker, j.finish) for j in a] == [(j.worker, j.finish) for j in b]
    assert [j.finish for j in a] != [j.finish for j in c]
    assert all(j.finish is not None for j in a)
    assert all(type(w.sched) is BatchScheduler for w in ca.workers)  # the engine's own scheduler


def test_mask_aware_beats_least_requests_at_high_load() -> None:
    p95 = {}
    for policy in ("least_requests", "mask_aware"):
        stats = [summarize(run(policy, seed=s)[0]) for s in range(2)]
        p95[policy] = sum(x["p95_s"] for x in stats) / len(stats)
    assert p95["mask_aware"] < 0.9 * p95["least_requests"], p95


def test_capacity_and_load_scale_arrivals() -> None:
    m = model()
    spec = WorkloadSpec(trace="adetailer", load=0.5, workers=8, jobs=2000, steps=20, max_batch=4, seed=0)
    jobs = generate(m, spec)
    rate = len(jobs) / jobs[-1].arrival
    assert rate == pytest.approx(0.5 * capacity(m, spec), rel=0.1)
    assert all(j.deadline > j.arrival for j in jobs)


def test_slo_admission_in_the_simulated_cluster() -> None:
    jobs, _ = run("mask_aware", load=0.95, slo=True, jobs=300)
    stats = summarize(jobs)
    assert stats["completed"] + stats["expired"] == stats["jobs"]
    done = [j for j in jobs if j.finish is not None]
    assert done and all(j.expired == "" for j in done)


def test_simulate_cli_writes_report_and_plots(tmp_path: Path) -> None:
    from ops.bench import simulate

    path = model().save(tmp_path / "m.json")
    out = tmp_path / "dispatch.md"
    out.write_text("# Dispatch\n\nhand-written intro stays\n")
    assert simulate.main(["--cost-model", str(path), "--workers", "4", "--loads", "0.5", "--traces", "adetailer",
                          "--jobs-per-worker", "40", "--processes", "1", "--steps", "10", "--out", str(out)]) == 0
    text = out.read_text()
    assert "hand-written intro stays" in text and "<!-- sim:begin -->" in text and "| 50% |" in text
    assert (tmp_path / "dispatch_p95_4w.png").stat().st_size > 1000


def test_reference_clusters_on_hand_made_jobs() -> None:
    from ops.sim.bounds import central_fcfs, pooled_ps
    from ops.sim.workload import SimJob

    def sim_job(i: int, arrival: float, alone: float, ratio: float = 0.5) -> SimJob:
        return SimJob(index=i, arrival=arrival, ratio=ratio, steps=10, cached=True, template_id="t",
                      masked_tokens=(1,), deadline=arrival + 100.0, alone_s=alone)

    jobs = [sim_job(0, 0.0, 4.0), sim_job(1, 0.0, 4.0), sim_job(2, 1.0, 2.0), sim_job(3, 1.0, 0.0, ratio=0.0)]
    # One worker shared by every present job: 0 and 1 at rate 1/2 until t=1, then three at 1/3.
    fin = pooled_ps(jobs, workers=1, max_batch=8)
    assert fin[3] == 1.0  # empty mask: never reaches a worker
    assert fin[2] == pytest.approx(7.0) and fin[0] == pytest.approx(fin[1]) == pytest.approx(10.0)
    # Two workers: each of the first two alone at rate 1; the third shares with them.
    fin2 = pooled_ps(jobs, workers=2, max_batch=8)
    assert fin2[0] == pytest.approx(fin2[1]) and fin2[2] == pytest.approx(4.0)
    assert max(fin2.values()) == pytest.approx(5.0)  # work conserving: 10 s of work on 2 workers
    # At most max_batch per worker run at once, the rest waits in order.
    fin3 = pooled_ps(jobs, workers=1, max_batch=1)
    assert (fin3[0], fin3[1], fin3[2]) == pytest.approx((4.0, 8.0, 10.0))
    assert central_fcfs(jobs, workers=1) == {0: 4.0, 1: 8.0, 2: 10.0, 3: 1.0}
    assert central_fcfs(jobs, workers=2) == {0: 4.0, 1: 4.0, 2: 6.0, 3: 1.0}


def test_dispatcher_view_lags_but_counts_its_own_decisions() -> None:
    """With a refresh interval the dispatcher does not see publishes in between reads, yet a burst
    routed within one interval still spreads (its own decisions are in flight in the snapshot)."""
    m = model()
    spec = WorkloadSpec(trace="adetailer", load=0.5, workers=4, jobs=8, steps=10, max_batch=4, seed=0)
    js = generate(m, spec)
    for j in js:  # a burst: eight jobs within 8 ms, two per worker expected
        j.arrival = 0.001 * j.index
        j.ratio = max(j.ratio, 0.05)
    cluster = Cluster(m, ClusterConfig(workers=4, max_batch=4, noise=0.0, view_refresh_s=10.0, prepare_s=0.5),
                      make_policy("least_requests", m))
    cluster.run(js)
    assert sorted(sum(1 for j in js if j.worker == w.wid) for w in cluster.workers) == [2, 2, 2, 2]
    assert all(j.finish is not None for j in js)
    snap = cluster._snap
    assert snap is not None and cluster._snap_at == 0.0  # the snapshot read once at t=0 ...
    assert sum(w.n_jobs for w in snap.workers.values()) == 8  # ... still shows the burst in flight
    assert sum(w.n_jobs for w in cluster.view.workers.values()) == 0  # the engines finished it all


def test_lagged_view_and_prepare_stage_keep_the_policy_ordering() -> None:
    p95 = {}
    for policy in ("least_requests", "mask_aware"):
        stats = []
        for s in range(2):
            m = model()
            spec = WorkloadSpec(trace="controlnet", load=0.85, workers=4, jobs=400, steps=20, max_batch=4,
                                prepare_s=0.2, seed=s)
            js = generate(m, spec)
            Cluster(m, ClusterConfig(workers=4, max_batch=4, noise=0.05, prepare_s=0.2, view_refresh_s=0.05, seed=s),
                    make_policy(policy, m)).run(js)
            stats.append(summarize(js)["p95_s"])
        p95[policy] = sum(stats) / len(stats)
    assert p95["mask_aware"] < 0.9 * p95["least_requests"], p95


def test_static_batching_and_sublinear_step_cost_on_hand_made_jobs() -> None:
    """Static batching admits a job only once the running batch drained; the batch exponent makes a
    step of B jobs cost B ** exponent job steps (exponent 0: as cheap as one)."""
    from ops.sim.workload import SimJob

    m = model()
    g = m.job_seconds(cached=False)

    def finishes(batching: str, exponent: float) -> list[float]:
        jobs = [SimJob(index=i, arrival=a, ratio=0.5, steps=10, cached=False, template_id="t",
                       masked_tokens=(1, 1), deadline=1e9, alone_s=1.0) for i, a in enumerate((0.0, 1e-6, 1e-6))]
        cfg = ClusterConfig(workers=1, max_batch=4, noise=0.0, batching=batching, batch_exponent=exponent)
        Cluster(m, cfg, make_policy("round_robin", m)).run(jobs)
        return [j.finish for j in jobs]  # type: ignore[misc]

    i = m.intercept
    # Continuous, linear: jobs 1 and 2 join after job 0's first step; the three share 9 steps.
    cont = finishes("continuous", 1.0)
    assert cont[0] == pytest.approx((i + g) + 9 * (i + 3 * g))
    assert cont[1] == pytest.approx(cont[0] + (i + 2 * g))
    # Static: jobs 1 and 2 wait for job 0's 10 steps, then run as a pair.
    stat = finishes("static", 1.0)
    assert stat[0] == pytest.approx(10 * (i + g)) and stat[1] == pytest.approx(stat[0] + 10 * (i + 2 * g))
    # Exponent 0: a step of the pair costs one job's step.
    assert finishes("static", 0.0)[2] == pytest.approx(20 * (i + g))
