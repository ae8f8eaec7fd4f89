"""Prometheus metrics (app/metrics.py) on a real prometheus_client registry, real Redis and Celery."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app import metrics
from app.embedded import RedisServer, free_port
from app.jobs import JobParams, JobStatus, JobStore
from app.metrics import QueueLengthCollector, StencilMetrics, failure_class, phase_durations

ROOT = Path(__file__).resolve().parents[1]


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's exposition text, keyed by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture()
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def test_observe_step_fills_the_three_engine_histograms(reg: CollectorRegistry) -> None:
    m = StencilMetrics(reg)
    m.observe_step(batch_size=3, masked_tokens=120, seconds=0.04)
    m.observe_step(batch_size=8, masked_tokens=5000, seconds=0.3)
    s = scrape(reg)
    assert s[("stencil_engine_step_seconds_count", ())] == 2
    assert s[("stencil_engine_step_seconds_sum", ())] == pytest.approx(0.34)
    assert s[("stencil_engine_step_seconds_bucket", (("le", "0.05"),))] == 1
    assert s[("stencil_engine_batch_size_sum", ())] == 11
    assert s[("stencil_engine_batch_size_bucket", (("le", "4.0"),))] == 1
    assert s[("stencil_engine_masked_tokens_sum", ())] == 5120
    assert s[("stencil_engine_masked_tokens_bucket", (("le", "256.0"),))] == 1


def test_steps_are_counted_by_how_their_denoiser_call_ran(reg: CollectorRegistry) -> None:
    """``stencil_engine_steps_total{graph}``: the share of steps a GPU worker replays from CUDA graphs
    (a batch whose jobs change every few steps cannot replay); an unknown outcome never becomes a label."""
    m = StencilMetrics(reg)
    for graph in ("replayed", "replayed", "captured", "eager", "off", "bogus"):
        m.observe_step(batch_size=2, masked_tokens=10, seconds=0.01, graph=graph)
    s = scrape(reg)
    assert {g: s[("stencil_engine_steps_total", (("graph", g),))] for g in ("replayed", "captured", "eager", "off",
                                                                           "other")} == {
        "replayed": 2, "captured": 1, "eager": 1, "off": 1, "other": 1}
    assert ("stencil_engine_steps_total", (("graph", "bogus"),)) not in s


def test_cache_hits_misses_and_bytes_are_per_tier(reg: CollectorRegistry) -> None:
    m = StencilMetrics(reg)
    m.observe_cache("host", True, 1000)
    m.observe_cache("host", True, 24)
    m.observe_cache("store", False, 0)
    m.observe_cache("store", True, 4096)
    s = scrape(reg)
    assert s[("stencil_cache_hits_total", (("tier", "host"),))] == 2
    assert s[("stencil_cache_hits_total", (("tier", "store"),))] == 1
    assert s[("stencil_cache_misses_total", (("tier", "store"),))] == 1
    assert ("stencil_cache_misses_total", (("tier", "host"),)) not in s
    assert s[("stencil_cache_fetched_bytes_total", (("tier", "host"),))] == 1024
    assert s[("stencil_cache_fetched_bytes_total", (("tier", "store"),))] == 4096


@pytest.mark.parametrize("reason, cls", [
    ("steps must be > 0 (got 0)", "invalid_params"),
    ("steps: must be an integer, got 'ten'", "invalid_params"),
    ("template: must be at most 128 characters, got 5000", "invalid_params"),
    ("image is 9000x9000 = 81000000 pixels, over STENCIL_MAX_IMAGE_PIXELS = 16777216", "invalid_image"),
    ("strength must be in (0, 1] (got 2.0)", "invalid_params"),
    ("template image could not be decoded (UnidentifiedImageError: x)", "invalid_image"),
    ("mask size 64x64 does not match image size 128x128", "invalid_image"),
    ("image is too large: 9000x9000", "invalid_image"),
    ("unknown template 'nope'", "unknown_template"),
    ("the mask is missing (expired or never uploaded)", "missing_input"),
    ("prepared inputs are missing (expired?)", "missing_input"),
    ("denoising failed: FloatingPointError: non-finite latents", "denoise_error"),
    ("finalize failed: OSError: disk full", "finalize_error"),
    ("prepare failed: RuntimeError: boom", "prepare_error"),
    ("dispatch failed repeatedly (dead-lettered)", "dead_letter"),
    ("deadline passed before routing", "deadline"),
    ("something nobody expected", "other"),
    ("", "other"),
])
def test_failure_reasons_map_to_bounded_classes(reason: str, cls: str) -> None:
    assert failure_class(reason) == cls


def test_observe_failure_counts_by_class_on_the_default_registry() -> None:
    def value(cls: str) -> float:
        return REGISTRY.get_sample_value("stencil_job_failures_total", {"reason": cls}) or 0.0

    before = value("invalid_params"), value("other")
    metrics.observe_failure("steps must be > 0 (got 0)")
    metrics.observe_failure("steps must be <= 200 (got 500)")
    metrics.observe_failure("a reason with a unique id 1f3a9 that must not become a label")
    assert value("invalid_params") == before[0] + 2
    assert value("other") == before[1] + 1
    labels = [s.labels for f in REGISTRY.collect() if f.name == "stencil_job_failures" for s in f.samples]
    assert all("1f3a9" not in str(lbl) for lbl in labels)


def test_phase_durations_from_timestamps_skip_missing_phases() -> None:
    fields = {"status": "done", "ts_queued": "100.0", "ts_routed": "100.5", "ts_preparing": "101.0",
              "ts_waiting": "102.0", "ts_finalizing": "102.25", "ts_done": "103.0", "ts_denoised": "x"}
    assert phase_durations(fields) == {"queued": 0.5, "routed": 0.5, "preparing": 1.0, "waiting": 0.25,
                                       "finalizing": 0.75, "total": 3.0}
    raw = {k.encode(): v.encode() for k, v in fields.items()}  # HGETALL gives bytes
    assert phase_durations(raw) == phase_durations(fields)
    assert phase_durations({"status": "queued", "ts_queued": "1"}) == {}


def test_job_end_latency_from_a_real_job_record(redis_client, reg: CollectorRegistry) -> None:  # type: ignore[no-untyped-def]
    jobs = JobStore(redis_client, ttl_seconds=60, intake_stream="test:metrics:jobs")
    job_id, _ = jobs.create(JobParams(steps=4))
    for status in (JobStatus.ROUTED, JobStatus.PREPARING, JobStatus.WAITING, JobStatus.DENOISING,
                   JobStatus.FINALIZING):
        time.sleep(0.02)
        assert jobs.transition(job_id, status)
    time.sleep(0.02)
    assert jobs.transition(job_id, JobStatus.DONE, result_key="results/x.png")
    failed_id, _ = jobs.create(JobParams(steps=0))
    assert jobs.fail(failed_id, "steps must be > 0 (got 0)")

    m = StencilMetrics(reg)
    m.observe_job_end(redis_client.hgetall(jobs.key(job_id)))
    m.observe_job_end(redis_client.hgetall(jobs.key(failed_id)))
    s = scrape(reg)
    assert s[("stencil_jobs_ended_total", (("outcome", "done"),))] == 1
    assert s[("stencil_jobs_ended_total", (("outcome", "failed"),))] == 1
    phases = {p: s[("stencil_job_phase_seconds_sum", (("outcome", "done"), ("phase", p)))]
              for p in ("queued", "routed", "preparing", "waiting", "denoising", "finalizing")}
    assert all(v >= 0.015 for v in phases.values()), phases
    total = s[("stencil_job_phase_seconds_sum", (("outcome", "done"), ("phase", "total")))]
    assert total == pytest.approx(sum(phases.values()), abs=1e-6)
    assert s[("stencil_job_phase_seconds_count", (("outcome", "failed"), ("phase", "queued")))] == 1


def test_queue_length_collector_counts_real_celery_messages(redis_server: RedisServer,
                                                            redis_client, reg: CollectorRegistry) -> None:  # type: ignore[no-untyped-def]
    from app.celery_app import make_celery
    from app.settings import Settings

    celery = make_celery(Settings(redis_url=redis_server.url))
    for i in range(3):
        celery.send_task("stencil.nothing", args=(i,), queue="gpu.7")
    for prio in (2, 8):  # Celery's Redis transport puts these on priority sub-lists
        celery.send_task("stencil.nothing", queue="gpu.7", priority=prio)
    celery.send_task("stencil.nothing", queue="cpu")
    reg.register(QueueLengthCollector(redis_server.url, ["cpu", "gpu.7", "gpu.8"]))
    s = scrape(reg)
    assert s[("stencil_queue_length", (("queue", "gpu.7"),))] == 5
    assert s[("stencil_queue_length", (("queue", "cpu"),))] == 1
    assert s[("stencil_queue_length", (("queue", "gpu.8"),))] == 0
    assert s[("stencil_queue_collector_up", ())] == 1


def test_queue_length_collector_survives_redis_being_down(reg: CollectorRegistry) -> None:
    reg.register(QueueLengthCollector(f"redis://127.0.0.1:{free_port()}/0", ["cpu"]))
    s = scrape(reg)
    assert s[("stencil_queue_collector_up", ())] == 0
    assert ("stencil_queue_length", (("queue", "cpu"),)) not in s


def test_default_queues_follow_the_routed_gpu_workers() -> None:
    from app.settings import Settings

    assert metrics.default_queues(Settings(gpu_workers="0, 2")) == ["cpu", "gpu.0", "gpu.2"]


def test_metrics_server_serves_over_http() -> None:
    assert metrics.start_metrics_server(0) == 0  # disabled
    port = free_port()
    try:
        assert metrics.start_metrics_server(port, addr="127.0.0.1") == port
        assert metrics.start_metrics_server(free_port(), addr="127.0.0.1") == port  # once per process
        metrics.observe_step(batch_size=2, masked_tokens=77, seconds=0.123)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            body = resp.read().decode()
    finally:
        metrics.stop_metrics_server()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name in ("stencil_engine_step_seconds", "stencil_engine_batch_size", "stencil_engine_masked_tokens",
                 "stencil_cache_hits", "stencil_job_phase_seconds", "stencil_job_failures"):
        assert name in families, f"{name} missing from /metrics"
    count = [s.value for s in families["stencil_engine_step_seconds"].samples
             if s.name == "stencil_engine_step_seconds_count"][0]
    assert count >= 1


def test_prefork_children_are_served_by_the_parent(tmp_path: Path) -> None:
    """Celery prefork: samples recorded in forked children appear on the parent's /metrics."""
    port = free_port()
    script = textwrap.dedent(f"""
        import multiprocessing as mp, urllib.request
        from app import metrics

        def child(n):
            metrics.observe_step(batch_size=n, masked_tokens=10 * n, seconds=0.01)

        if __name__ == "__main__":
            ctx = mp.get_context("fork")
            procs = [ctx.Process(target=child, args=(n,)) for n in (1, 2, 3)]
            for p in procs: p.start()
            for p in procs: p.join()
            metrics.start_metrics_server({port}, addr="127.0.0.1")
            print(urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    """)
    mpdir = tmp_path / "mp"
    mpdir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mpdir), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    samples = {s.name: s.value for f in text_string_to_metric_families(proc.stdout) for s in f.samples
               if not s.labels or set(s.labels) == {"le"} and s.labels["le"] == "+Inf"}
    assert samples["stencil_engine_batch_size_count"] == 3
    assert samples["stencil_engine_batch_size_sum"] == 6
    assert samples["stencil_engine_masked_tokens_sum"] == 60
