"""The dispatcher: reads the intake stream and routes each job as a Celery chain.

At-least-once: entries are read with XREADGROUP and acknowledged only after the chain was sent
and the job marked routed; on restart the consumer first re-reads its own pending entries, and
XAUTOCLAIM takes over entries that another (dead) dispatcher left idle. Entries delivered too
many times are dead-lettered (the job fails with a reason). A resent chain is harmless: every
task is idempotent against the job record.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import redis
from celery import Celery, chain

from app.celery_app import CPU_QUEUE, gpu_queue
from app.jobs import JobStatus, JobStore
from app.routing import Router, make_router
from app.settings import Settings

log = logging.getLogger(__name__)

HEARTBEAT_KEY = "stencil:dispatcher:heartbeat"
DEAD_LETTER_STREAM = "stencil:jobs:dead"


class Dispatcher:
    def __init__(self, settings: Settings, celery: Celery, *, router: Router | None = None,
                 consumer: str | None = None) -> None:
        self.s = settings
        self.celery = celery
        self.r = redis.Redis.from_url(settings.redis_url)
        self.jobs = JobStore(self.r, ttl_seconds=settings.job_ttl_seconds, intake_stream=settings.intake_stream)
        self.router = router or make_router(settings.routing_policy, settings.gpu_worker_ids)
        # A stable name (per host) lets a restarted dispatcher re-read its own pending entries.
        self.consumer = consumer or socket.gethostname()
        self.stream = settings.intake_stream
        self.group = settings.intake_group

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def route(self, job_id: str) -> str:
        """Route one job; returns what happened (for logs and tests)."""
        rec = self.jobs.get(job_id)
        if rec is None:
            return "missing"
        if rec.status != JobStatus.QUEUED:
            return f"skipped ({rec.status.value})"
        reason = rec.params.validate(self.s.max_steps)
        if reason:
            self.jobs.fail(job_id, reason)
            return "invalid"
        if rec.params.deadline is not None and rec.params.deadline < time.time():
            self.jobs.transition(job_id, JobStatus.EXPIRED, error="deadline passed before routing")
            return "expired"
        worker = self.router.choose(rec)
        # Signatures by task name on this dispatcher's app: no worker code (or torch) is imported.
        signature = chain(
            self.celery.signature("stencil.prepare", args=(job_id,), immutable=True, queue=CPU_QUEUE),
            self.celery.signature("stencil.denoise", queue=gpu_queue(worker)),
            self.celery.signature("stencil.finalize", queue=CPU_QUEUE),
        )
        signature.apply_async()
        self.jobs.transition(job_id, JobStatus.ROUTED, expect=(JobStatus.QUEUED,), worker=gpu_queue(worker))
        return f"routed to {gpu_queue(worker)}"

    def _handle(self, entries: list) -> None:
        for entry_id, fields in entries:
            job_id = (fields.get(b"job_id") or b"").decode()
            try:
                outcome = self.route(job_id) if job_id else "malformed entry"
                log.info("job %s: %s", job_id, outcome)
            except Exception:
                log.exception("routing job %s failed; it stays pending for a retry", job_id)
                continue
            self.r.xack(self.stream, self.group, entry_id)

    def _reclaim(self) -> None:
        """Take over entries idle too long (dead consumer); dead-letter over-delivered ones."""
        _, claimed, _ = self.r.xautoclaim(self.stream, self.group, self.consumer,
                                          min_idle_time=self.s.intake_claim_idle_ms, start_id="0-0", count=100)
        if not claimed:
            return
        pending = {p["message_id"]: p["times_delivered"] for p in
                   self.r.xpending_range(self.stream, self.group, min="-", max="+", count=1000,
                                         consumername=self.consumer)}
        retry = []
        for entry_id, fields in claimed:
            if pending.get(entry_id, 0) > self.s.intake_max_deliveries:
                job_id = (fields.get(b"job_id") or b"").decode()
                self.jobs.fail(job_id, "dispatch failed repeatedly (dead-lettered)")
                self.r.xadd(DEAD_LETTER_STREAM, {"job_id": job_id, "entry": entry_id})
                self.r.xack(self.stream, self.group, entry_id)
            else:
                retry.append((entry_id, fields))
        self._handle(retry)

    def run(self, stop: threading.Event | None = None, block_ms: int = 1000) -> None:
        stop = stop or threading.Event()
        self.ensure_group()
        log.info("dispatcher %s routing %s with policy %s", self.consumer, self.s.gpu_worker_ids,
                 self.s.routing_policy)
        # Entries this consumer read but never acknowledged before a restart.
        for _stream, entries in self.r.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=1000) or []:
            self._handle(entries)
        last_claim = 0.0
        while not stop.is_set():
            self.r.set(HEARTBEAT_KEY, repr(time.time()), ex=30)
            if time.monotonic() - last_claim > 5.0:
                last_claim = time.monotonic()
                self._reclaim()
            resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=64, block=block_ms)
            for _stream, entries in resp or []:
                self._handle(entries)
