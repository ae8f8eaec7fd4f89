"""Job records and the dispatcher's routing decisions, against a real redis-server."""

from __future__ import annotations

import time

import pytest

from app.jobs import INTAKE_GROUP, INTAKE_STREAM, JobParams, JobStatus, JobStore
from tests.support.dispatch import run_until_routed

pytestmark = pytest.mark.integration


@pytest.fixture()
def store(redis_client) -> JobStore:  # type: ignore[no-untyped-def]
    return JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")


def test_create_announces_on_stream_and_reads_back(store: JobStore) -> None:
    job_id, created = store.create(JobParams(prompt="p", steps=7, seed=3, deadline=123.5))
    assert created
    rec = store.get(job_id)
    assert rec is not None and rec.status == JobStatus.QUEUED
    assert rec.params.steps == 7 and rec.params.seed == 3 and rec.params.deadline == 123.5
    assert rec.progress == (0, 7)
    entries = store.r.xrange("stencil:jobs")
    assert [e[1][b"job_id"].decode() for e in entries] == [job_id]


def test_idempotency_key(store: JobStore) -> None:
    a, created_a = store.create(JobParams(), idempotency_key="k1")
    b, created_b = store.create(JobParams(), idempotency_key="k1")
    c, _ = store.create(JobParams(), idempotency_key="k2")
    assert a == b and created_a and not created_b and c != a
    assert store.r.xlen("stencil:jobs") == 2


def test_terminal_status_never_changes_and_gets_a_ttl(store: JobStore) -> None:
    job_id, _ = store.create(JobParams())
    assert store.r.ttl(store.key(job_id)) > 0
    store.r.persist(store.key(job_id))
    assert store.transition(job_id, JobStatus.DENOISING)
    assert store.fail(job_id, "boom")
    assert 0 < store.r.ttl(store.key(job_id)) <= 60
    assert not store.transition(job_id, JobStatus.DONE)
    assert not store.cancel(job_id)
    rec = store.get(job_id)
    assert rec.status == JobStatus.FAILED and rec.error == "boom"
    assert rec.ts(JobStatus.FAILED) <= time.time()


def test_expect_guards_against_moving_backwards(store: JobStore) -> None:
    job_id, _ = store.create(JobParams())
    assert store.transition(job_id, JobStatus.PREPARING)
    assert not store.transition(job_id, JobStatus.ROUTED, expect=(JobStatus.QUEUED,))
    assert store.status(job_id) == JobStatus.PREPARING


@pytest.mark.parametrize("params, reason", [
    (JobParams(steps=0), "steps: must be between 1 and 200, got 0"),
    (JobParams(steps=500), "steps: must be between 1 and 200, got 500"),
    (JobParams(strength=0.0), "strength"),
    (JobParams(guidance=-1), "guidance"),
    (JobParams(width=100, height=64), "multiple of 8"),
])
def test_param_validation(params: JobParams, reason: str) -> None:
    assert reason in (params.validate(max_steps=200) or "")


def test_dispatcher_routes_round_robin_and_skips_cancelled(redis_server, store: JobStore) -> None:  # type: ignore[no-untyped-def]
    from app.celery_app import make_celery
    from app.dispatcher import Dispatcher
    from app.settings import Settings

    settings = Settings.from_env(redis_url=redis_server.url, gpu_workers="0,1", routing_policy="round_robin")
    dispatcher = Dispatcher(settings, make_celery(settings), consumer="t")
    ids = [store.create(JobParams(steps=5))[0] for _ in range(3)]
    cancelled, _ = store.create(JobParams(steps=5))
    store.cancel(cancelled)
    invalid, _ = store.create(JobParams(steps=-1))
    expired, _ = store.create(JobParams(steps=5, deadline=time.time() - 1))
    outcomes = [dispatcher.route(j) for j in ids + [cancelled, invalid, expired, "nope"]]
    assert outcomes[:3] == ["routed to gpu.0", "routed to gpu.1", "routed to gpu.0"]
    assert outcomes[3] == "skipped (cancelled)"
    assert outcomes[4] == "invalid" and store.status(invalid) == JobStatus.FAILED
    assert outcomes[5] == "expired" and store.status(expired) == JobStatus.EXPIRED
    assert outcomes[6] == "missing"
    assert [store.get(j).worker for j in ids] == ["gpu.0", "gpu.1", "gpu.0"]
    # Routed again (a redelivered stream entry): nothing is sent twice.
    assert dispatcher.route(ids[0]) == "skipped (routed)"
    # The chains really are in the broker: prepare messages on the cpu queue.
    assert store.r.llen("cpu") == 3


def test_dispatcher_restart_rereads_unacknowledged_entries(redis_server, store: JobStore) -> None:  # type: ignore[no-untyped-def]

    from app.celery_app import make_celery
    from app.dispatcher import Dispatcher
    from app.settings import Settings

    settings = Settings.from_env(redis_url=redis_server.url, gpu_workers="0")
    dispatcher = Dispatcher(settings, make_celery(settings), consumer="d1")
    dispatcher.ensure_group()
    job_id, _ = store.create(JobParams(steps=5))
    # A dispatcher read the entry and died before routing/acknowledging it.
    store.r.xreadgroup(INTAKE_GROUP, "d1", {INTAKE_STREAM: ">"}, count=10)
    assert store.status(job_id) == JobStatus.QUEUED
    assert run_until_routed(dispatcher, store, job_id) == JobStatus.ROUTED
    assert store.r.xpending(INTAKE_STREAM, INTAKE_GROUP)["pending"] == 0


def test_params_round_trip_through_record_fields() -> None:
    """Every parameter survives the Redis hash (strings only), including the booleans and Nones."""
    from app.jobs import JobParams

    params = JobParams(prompt="a hat", steps=7, guidance=3.0, strength=0.8, seed=9, priority=2, deadline=123.5,
                       template_id="t1", width=64, height=96, kind="edit", keep_unmasked=True)
    assert JobParams.from_fields(params.to_fields()) == params
    plain = JobParams(prompt="x")
    assert JobParams.from_fields(plain.to_fields()) == plain
    assert JobParams.from_fields(plain.to_fields()).keep_unmasked is False


def test_submission_is_atomic_a_key_without_its_record_does_not_swallow_the_retry(store: JobStore) -> None:
    """A connection that dropped after the idempotency key was stored but before the record was
    written (the old two-step submission) left the key pointing at nothing: the retry returned
    that id with created=False and the job was lost. Key, record and stream entry are now one
    script; a key pointing at no record is taken over by the retry."""
    from app.jobs import IDEMPOTENCY_PREFIX

    store.r.set(IDEMPOTENCY_PREFIX + "order-1", "ghost-job-id", ex=60)  # what the drop left
    job_id, created = store.create(JobParams(steps=5), idempotency_key="order-1")
    assert created and job_id != "ghost-job-id" and store.get(job_id) is not None
    again, created_again = store.create(JobParams(steps=5), idempotency_key="order-1")
    assert (again, created_again) == (job_id, False)
    entries = [e for _id, e in store.r.xrange(store.intake_stream)]
    assert sum(1 for e in entries if e[b"job_id"].decode() == job_id) == 1


def test_concurrent_submissions_with_one_key_create_one_job(store: JobStore) -> None:
    import threading

    results: list[tuple[str, bool]] = []
    barrier = threading.Barrier(8)

    def go() -> None:
        barrier.wait()
        results.append(store.create(JobParams(steps=5), idempotency_key="order-2"))

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(created for _id, created in results) == 1 and len({i for i, _c in results}) == 1
