"""An uploaded template is warmed when its bytes come back in a second job, not when one job's
prepare runs again (a redelivered task, a job re-driven after its CPU worker died): the jobs that
used it are counted, against the real Redis of the test session."""

from __future__ import annotations

from typing import Any

import pytest

from app.jobs import JobParams, JobStore
from app.settings import Settings
from workers import context as ctx
from workers import cpu_tasks


@pytest.fixture()
def warm_jobs(redis_client: Any, monkeypatch: pytest.MonkeyPatch) -> JobStore:
    jobs = JobStore(redis_client, ttl_seconds=3600)
    monkeypatch.setattr(ctx, "settings", lambda: Settings())
    monkeypatch.setattr(ctx, "redis_client", lambda: redis_client)
    monkeypatch.setattr(ctx, "jobs", lambda: jobs)
    return jobs


def _warm_ups(redis_client: Any) -> int:
    return sum(1 for _ in redis_client.scan_iter("stencil:warming:*"))


def test_a_prepare_run_again_does_not_warm_a_one_off_upload_and_a_second_job_does(redis_client: Any,
                                                                                  warm_jobs: JobStore) -> None:
    params = JobParams(prompt="a hat", steps=8, template_id="upload-" + "ab" * 32)
    meta = {"width": 64, "height": 64}
    for _ in range(3):  # the first job's prepare, then twice again after faults
        cpu_tasks._trigger_warm("job-1", params, meta, "digest-1")
    assert _warm_ups(redis_client) == 0
    cpu_tasks._trigger_warm("job-2", params, meta, "digest-1")
    assert _warm_ups(redis_client) == 1
    cpu_tasks._trigger_warm("job-3", params, meta, "digest-1")  # already under way: not twice
    assert _warm_ups(redis_client) == 1


def test_a_stored_template_is_warmed_at_its_first_job(redis_client: Any, warm_jobs: JobStore) -> None:
    params = JobParams(prompt="a hat", steps=8, template_id="stored-template-7")
    cpu_tasks._trigger_warm("job-1", params, {"width": 64, "height": 64}, "digest-2")
    assert _warm_ups(redis_client) == 1
