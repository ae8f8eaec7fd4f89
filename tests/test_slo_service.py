"""SLO satisfaction as a number every deployment reports: the dispatcher's default deadlines
(STENCIL_SLO_FACTOR x the job's standalone time at its own size), ``slo_deadline`` and ``slo_met``
on the job record, the Prometheus counter and gauge."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from app.blobs import BlobStore
from app.jobs import JobParams, JobStatus, JobStore
from app.metrics import StencilMetrics
from app.steptime import JobShape
from tests.test_steptime import _cost_model


def _png(mask: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8) * 255).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture()
def make_dispatcher(redis_server):  # type: ignore[no-untyped-def]
    from app.celery_app import make_celery
    from app.dispatcher import Dispatcher
    from app.settings import Settings

    def make(cost_model=None, **overrides: object) -> Dispatcher:  # type: ignore[no-untyped-def]
        settings = Settings.from_env(**{"redis_url": redis_server.url, "gpu_workers": "0", **overrides})
        return Dispatcher(settings, make_celery(settings), consumer="t", cost_model=cost_model)

    return make


def test_default_deadline_is_the_slo_factor_times_the_standalone_time_at_the_jobs_size(
        redis_client, make_dispatcher) -> None:  # type: ignore[no-untyped-def]
    model = _cost_model()
    d = make_dispatcher(model, slo_factor=4.0, routing_policy="least_requests")
    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    blobs = BlobStore(redis_client, 60)
    mask = np.zeros((64, 128), bool)  # a 128x64 banner: latent grid 8 x 16
    mask[10:30, 20:60] = True
    job, _ = store.create(JobParams(steps=10, template_id="tpl"))
    blobs.put(job, "mask", _png(mask))
    assert d.route(job) == "routed to gpu.0"
    rec = store.get(job)
    from app.costmodel import token_counts_from_mask

    alone = model.batch.alone_seconds(JobShape((8, 16), token_counts_from_mask(mask, (8, 16), 2), 2), 10)  # type: ignore[union-attr]
    assert float(rec.fields["slo_alone_s"]) == pytest.approx(alone, rel=1e-3)
    assert float(rec.fields["slo_deadline"]) == pytest.approx(rec.ts("queued") + 4.0 * alone, rel=1e-6)
    # A bigger image of the same mask share gets a longer standalone time.
    big = np.zeros((128, 128), bool)
    big[20:60, 20:60] = True
    job2, _ = store.create(JobParams(steps=10, template_id="tpl"))
    blobs.put(job2, "mask", _png(big))
    d.route(job2)
    assert float(store.get(job2).fields["slo_alone_s"]) > alone
    # The user's own deadline is the SLO deadline.
    own = time.time() + 600
    job3, _ = store.create(JobParams(steps=10, deadline=own))
    d.route(job3)
    assert float(store.get(job3).fields["slo_deadline"]) == pytest.approx(own)


def test_deadlines_use_the_engines_calibrated_pace(redis_client, make_dispatcher) -> None:  # type: ignore[no-untyped-def]
    """The engines publish their measured / predicted step time (``step_time_factor``); the
    dispatcher's standalone time, default deadline and expiry check use the fastest live worker's."""
    from app.dispatcher import WORKER_STATE_PREFIX

    model = _cost_model()
    d = make_dispatcher(model, slo_factor=4.0, routing_policy="least_requests", gpu_workers="0,1")
    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    for worker, factor in (("0", "1.5"), ("1", "1.8")):
        redis_client.hset(WORKER_STATE_PREFIX + worker, mapping={
            "updated": repr(time.time()), "running": "[]", "waiting": "[]", "step_time_factor": factor})
    job, _ = store.create(JobParams(steps=10))
    fit = d.min_latency(d.demand(store.get(job)))  # the fit alone (factor 1)
    assert fit is not None and fit > 0
    d.route(job)
    assert float(store.get(job).fields["slo_alone_s"]) == pytest.approx(1.5 * fit, rel=1e-3)
    # A deadline the fit could meet but the measured pace cannot: expired at routing, not sent.
    late, _ = store.create(JobParams(steps=10, deadline=time.time() + 1.25 * fit))
    assert d.route(late) == "expired"
    assert "needs at least" in store.get(late).error
    # Garbage in a worker hash is not trusted: the fit is used as is.
    redis_client.hset(WORKER_STATE_PREFIX + "0", mapping={"updated": repr(time.time()), "step_time_factor": "nan"})
    d.view.refresh(force=True)
    ok, _ = store.create(JobParams(steps=10))
    d.route(ok)
    assert float(store.get(ok).fields["slo_alone_s"]) == pytest.approx(fit, rel=1e-3)


def test_without_a_fitted_model_or_with_factor_0_no_default_deadline(redis_client, make_dispatcher) -> None:  # type: ignore[no-untyped-def]
    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    for d in (make_dispatcher(None, routing_policy="least_requests"), make_dispatcher(_cost_model(), slo_factor=0.0)):
        job, _ = store.create(JobParams(steps=10))
        d.route(job)
        assert "slo_deadline" not in store.get(job).fields


def test_records_say_whether_the_slo_was_met_and_the_metric_counts_it(redis_client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from app import metrics

    fresh = StencilMetrics(CollectorRegistry())
    monkeypatch.setattr(metrics, "METRICS", fresh)
    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    ids = {}
    for name, deadline in (("met", time.time() + 60), ("late", time.time() - 1), ("expired", time.time() + 60),
                           ("failed", time.time() + 60), ("cancelled", time.time() + 60)):
        ids[name], _ = store.create(JobParams(steps=5))
        store.update(ids[name], slo_deadline=repr(deadline))
    plain, _ = store.create(JobParams(steps=5))  # no SLO deadline: no field, not counted
    store.transition(ids["met"], JobStatus.DONE)
    store.transition(ids["late"], JobStatus.DONE)
    store.transition(ids["expired"], JobStatus.EXPIRED, error="deadline unreachable")
    store.fail(ids["failed"], "denoising failed: boom")
    store.cancel(ids["cancelled"])
    store.transition(plain, JobStatus.DONE)
    met = {name: store.get(j).fields.get("slo_met") for name, j in ids.items()}
    assert met == {"met": "1", "late": "0", "expired": "0", "failed": "0", "cancelled": None}
    assert store.get(plain).fields.get("slo_met") is None
    reg = fresh.registry
    assert reg.get_sample_value("stencil_slo_jobs_total", {"outcome": "met"}) == 1
    assert reg.get_sample_value("stencil_slo_jobs_total", {"outcome": "missed"}) == 3
    assert reg.get_sample_value("stencil_slo_satisfaction") == pytest.approx(0.25)


def test_warm_ups_get_no_default_deadline(redis_client, make_dispatcher) -> None:  # type: ignore[no-untyped-def]
    d = make_dispatcher(_cost_model(), routing_policy="least_requests")
    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    job, _ = store.create(JobParams(steps=10, kind="warm", template_id="tpl"))
    d.route(job)
    assert "slo_deadline" not in store.get(job).fields
