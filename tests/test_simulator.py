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
    from ops import simulate

    path = model().save(tmp_path / "m.json")
    out = tmp_path / "dispatch.md"
    out.write_text("# Dispatch\n\nhand-written intro stays\n")
    assert simulate.main(["--cost-model", str(path), "--workers", "4", "--loads", "0.5", "--traces", "adetailer",
                          "--jobs-per-worker", "40", "--processes", "1", "--steps", "10", "--out", str(out)]) == 0
    text = out.read_text()
    assert "hand-written intro stays" in text and "<!-- sim:begin -->" in text and "| 50% |" in text
    assert (tmp_path / "dispatch_p95_4w.png").stat().st_size > 1000
