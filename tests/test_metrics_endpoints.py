"""Each process of a running stack serves the Prometheus metrics operators need (issue: ops)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from app.client import StencilClient
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask
from tests.test_service import SIZE, template

pytestmark = pytest.mark.integration


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


COST_MODEL = Path(__file__).resolve().parents[1] / "ops/sim/costmodels/tiny-sd-inpaint-trained--cpu-1t-mixed.json"


def test_metrics_endpoints_during_a_run(tmp_path: Path, model_home: Path) -> None:
    # With a fitted batch predictor: default SLO deadlines, SLO admission (auto), SLO fields and metric.
    with EmbeddedStack.start(tmp_path, home=model_home, metrics=True, max_batch=4, cost_model=str(COST_MODEL)) as stack:
        client = StencilClient(stack.settings)
        tid = client.add_template(template(90))
        assert client.warm_template(tid, steps=6).wait(120).status == JobStatus.DONE
        jobs = [client.submit(template=tid, mask=make_mask(0.2, (SIZE, SIZE), seed=i), steps=6, seed=i)
                for i in range(3)]
        bad = client.submit(template=b"not an image", mask=make_mask(0.2, (SIZE, SIZE)), steps=6)
        assert [j.wait(120).status for j in jobs] == [JobStatus.DONE] * 3
        assert bad.wait(60).status == JobStatus.FAILED
        records = [client.jobs.get(j.id) for j in [*jobs, bad]]
        gpu, cpu, disp = (scrape(stack.metrics_ports[n]) for n in ("gpu0", "cpu", "dispatcher"))
        gpu_log = (tmp_path / "logs" / "gpu0.log").read_text()
    for rec in records:  # each edit: its default deadline (from its predicted standalone time) and the outcome
        assert float(rec.fields["slo_deadline"]) > rec.ts("queued") and float(rec.fields["slo_alone_s"]) > 0
        assert rec.fields["slo_met"] in ("0", "1")
    assert records[-1].fields["slo_met"] == "0"  # a failed job missed its SLO
    assert 'stencil_slo_jobs_total{outcome="missed"}' in cpu and "stencil_slo_satisfaction" in cpu
    assert "SLO admission on" in gpu_log
    for name in ("stencil_engine_step_seconds_count", "stencil_engine_batch_size_bucket",
                 "stencil_engine_masked_tokens_bucket", 'stencil_cache_hits_total{tier="host"}'):
        assert name in gpu, name
    assert 'stencil_queue_length{queue="cpu"}' in disp and 'stencil_queue_length{queue="gpu.0"}' in disp
    assert "stencil_job_phase_seconds_bucket" in cpu and 'phase="denoising"' in cpu
    assert 'stencil_job_failures_total{reason=' in cpu
    steps = [line for line in gpu.splitlines() if line.startswith("stencil_engine_step_seconds_count")]
    assert float(steps[0].split()[-1]) >= 6, steps
