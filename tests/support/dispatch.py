"""Run a real dispatcher loop on a thread until a job is routed (shared by dispatcher tests)."""

from __future__ import annotations

import threading
import time

from app.jobs import JobStatus, JobStore


def run_until_routed(dispatcher, store: JobStore, job_id: str, timeout: float = 10.0) -> JobStatus | None:  # type: ignore[no-untyped-def]
    """Start ``dispatcher.run`` on a thread, wait for ``job_id`` to be routed, stop; its status."""
    stop = threading.Event()
    thread = threading.Thread(target=dispatcher.run, args=(stop, 100))
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while store.status(job_id) != JobStatus.ROUTED and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(5)
    return store.status(job_id)
