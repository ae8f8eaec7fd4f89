"""The sweeper (app/sweeper.py) on a real Redis: what counts as stalled, what is left alone, and
the bound on re-drives."""

from __future__ import annotations

import json
import time

import pytest

from app.jobs import LIVE_KEY, JobParams, JobStatus, JobStore
from app.keys import LEASE_PREFIX
from app.sweeper import Sweeper


@pytest.fixture()
def store(redis_client) -> JobStore:  # type: ignore[no-untyped-def]
    redis_client.flushdb()
    return JobStore(redis_client, ttl_seconds=600, intake_stream="stencil:jobs")


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _sweeper(store: JobStore, clock: Clock, sent: list) -> Sweeper:  # type: ignore[type-arg]
    return Sweeper(store.r, store, lambda job, worker: sent.append((job, worker)), worker_ids=["0", "1"],
                   stall_timeout_s=30, max_redrives=2, worker_stale_s=60, clock=clock)


def _job_in(store: JobStore, status: JobStatus, worker: str = "gpu.0") -> str:
    job_id, _ = store.create(JobParams(steps=5, template_id="t"))
    store.transition(job_id, status, worker=worker)
    return job_id


def _alive(store: JobStore, worker: str, clock: Clock) -> None:
    store.r.hset(f"stencil:worker:{worker}", "updated", repr(clock.now))


def test_a_job_whose_work_vanished_is_redriven_then_failed_after_the_bound(store: JobStore) -> None:
    clock, sent = Clock(), []
    sweeper = _sweeper(store, clock, sent)
    job = _job_in(store, JobStatus.DENOISING)
    assert sweeper.sweep("d1")["redriven"] == 0  # fresh: moving
    clock.now += 31
    _alive(store, "1", clock)  # worker 0 is dead (no state), worker 1 alive
    assert sweeper.sweep("d1")["redriven"] == 1 and sent == [(job, "1")]
    rec = store.get(job)
    assert rec.fields["redrives"] == "1" and rec.fields["worker"] == "gpu.1"
    assert sweeper.sweep("d1")["redriven"] == 0  # the re-drive itself is activity
    clock.now += 31
    _alive(store, "1", clock)
    sweeper.sweep("d1")
    clock.now += 31
    assert sweeper.sweep("d1")["failed"] == 1
    rec = store.get(job)
    assert rec.status == JobStatus.FAILED and "stalled in denoising" in rec.error and "2 re-drives" in rec.error
    assert store.r.zscore(LIVE_KEY, job) is None


def test_leases_backlogs_queued_and_terminal_jobs_are_left_alone(store: JobStore) -> None:
    clock, sent = Clock(), []
    sweeper = _sweeper(store, clock, sent)
    leased = _job_in(store, JobStatus.DENOISING)
    store.r.set(LEASE_PREFIX + leased, "engine", px=120_000)
    backlog = _job_in(store, JobStatus.WAITING)
    store.r.lpush("gpu.0", json.dumps({"headers": {"argsrepr": f"({{'job_id': '{backlog}'}},)"}}))
    routed = _job_in(store, JobStatus.ROUTED)
    store.r.lpush("cpu", json.dumps({"headers": {"argsrepr": f"('{routed}',)"}}))
    queued, _ = store.create(JobParams(steps=5))
    done = _job_in(store, JobStatus.DONE)
    clock.now += 100
    counts = sweeper.sweep("d1")
    assert sent == [] and counts["redriven"] == 0 and counts["failed"] == 0
    assert store.r.zscore(LIVE_KEY, done) is None and store.r.zscore(LIVE_KEY, queued) is not None
    store.r.delete("gpu.0")  # the message was lost after all: now it is re-driven
    assert sweeper.sweep("d1")["redriven"] == 1 and sent[0][0] == backlog


def test_one_dispatcher_sweeps_at_a_time(store: JobStore) -> None:
    clock, sent = Clock(), []
    a, b = _sweeper(store, clock, sent), _sweeper(store, clock, sent)
    _job_in(store, JobStatus.PREPARING)
    clock.now += 31
    assert a.sweep("d1")["redriven"] == 1
    clock.now += 31
    assert b.sweep("d2")["checked"] == 0  # d1 holds the lock


def test_a_backlog_in_a_dead_workers_queue_moves_to_a_live_worker(store: JobStore) -> None:
    clock, sent = Clock(), []
    sweeper = _sweeper(store, clock, sent)
    job = _job_in(store, JobStatus.WAITING)
    store.r.lpush("gpu.0", json.dumps({"headers": {"argsrepr": f"({{'job_id': '{job}'}},)"}}))
    clock.now += 31
    _alive(store, "0", clock)
    assert sweeper.sweep("d1")["redriven"] == 0  # worker 0 alive: a backlog
    clock.now += 120  # worker 0's state goes stale (it died), worker 1 is alive
    _alive(store, "1", clock)
    assert sweeper.sweep("d1")["redriven"] == 1 and sent == [(job, "1")]


def test_a_routed_job_waiting_in_its_hosts_stage_queue_is_backlog(store: JobStore) -> None:
    """STENCIL_STAGE_PLACEMENT=gpu_host: prepare waits in ``stage.<worker>``; while that host is alive
    the job is backlog, not stalled; its host dead (and another alive), the chain is re-sent."""
    clock, sent = Clock(), []
    sweeper = Sweeper(store.r, store, lambda job, worker: sent.append((job, worker)), worker_ids=["0", "1"],
                      stall_timeout_s=30, max_redrives=2, worker_stale_s=60, clock=clock, stage_placement="gpu_host")
    job = _job_in(store, JobStatus.ROUTED, worker="gpu.0")
    store.r.rpush("stage.0", json.dumps({"args": [job]}))
    clock.now += 31
    _alive(store, "0", clock)
    assert sweeper.sweep("d1")["redriven"] == 0 and sent == []
    store.r.delete("stencil:worker:0")
    _alive(store, "1", clock)
    assert sweeper.sweep("d1")["redriven"] == 1 and sent == [(job, "1")]


def test_a_redriven_job_queued_behind_a_live_workers_backlog_is_not_redriven_again(store: JobStore) -> None:
    """A job re-driven from a dead host keeps its status (``denoising``) while its new chain waits in
    the surviving worker's queues: backlog, not a stall (else a long backlog fails it after the bound)."""
    clock, sent = Clock(), []
    sweeper = _sweeper(store, clock, sent)
    job = _job_in(store, JobStatus.DENOISING, worker="gpu.1")
    clock.now += 31
    _alive(store, "0", clock)
    assert sweeper.sweep("d1")["redriven"] == 1 and sent == [(job, "0")]  # gpu.1 is dead
    store.r.lpush("cpu", json.dumps({"args": [job]}))  # its prepare waits in the CPU pool's queue
    clock.now += 31
    _alive(store, "0", clock)
    assert sweeper.sweep("d1")["redriven"] == 0
    store.r.delete("cpu")
    store.r.lpush("gpu.0", json.dumps({"headers": {"argsrepr": f"({{'job_id': '{job}'}},)"}}))  # then its denoise
    clock.now += 31
    _alive(store, "0", clock)
    assert sweeper.sweep("d1")["redriven"] == 0 and len(sent) == 1
    store.r.delete("gpu.0")  # the message vanished (its worker died holding it): re-driven again
    clock.now += 31
    assert sweeper.sweep("d1")["redriven"] == 1
