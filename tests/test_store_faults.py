"""Activation caches on a real S3 server (SeaweedFS) that dies in the middle of a run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from app.client import StencilClient
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask
from app.storage.s3 import S3Store
from tests.support.s3server import running_s3_server
from tests.test_service import SIZE, template, wait_until

pytestmark = pytest.mark.integration


def test_jobs_complete_and_fall_back_to_full_compute(tmp_path: Path, model_home: Path) -> None:
    server_ctx = running_s3_server(tmp_path / "s3")
    s3 = server_ctx.__enter__()
    stopped = False
    try:
        S3Store("acts", endpoint_url=s3.endpoint_url, region=s3.region, access_key=s3.access_key,
                secret_key=s3.secret_key).ensure_bucket()
        overrides = dict(activations_backend="s3", s3_endpoint_url=s3.endpoint_url, s3_bucket="acts",
                         s3_access_key=s3.access_key, s3_secret_key=s3.secret_key, s3_region=s3.region,
                         prefetch_steps=2, max_batch=4, cache_steps="0")  # every step read from the store
        with EmbeddedStack.start(tmp_path / "stack", home=model_home, **overrides) as stack:
            client = StencilClient(stack.settings)
            tid = client.add_template(template(71))
            warm = client.warm_template(tid, steps=40).wait(120)
            assert warm.status == JobStatus.DONE, warm.error
            handles = [client.submit(template=tid, mask=make_mask(0.1 + 0.1 * i, (SIZE, SIZE), seed=i),
                                     prompt="a hat", steps=40, seed=i) for i in range(3)]
            wait_until(lambda: all(h.progress()[0] >= 4 for h in handles), timeout=120)
            # The object store dies mid-run. A graceful stop takes seconds, during which it still
            # answers and the jobs (40 fast CPU steps) could fetch every step they need.
            os.killpg(s3.pid, signal.SIGKILL)
            server_ctx.__exit__(None, None, None)
            stopped = True
            recs = [h.wait(300) for h in handles]
            assert [r.status for r in recs] == [JobStatus.DONE] * 3, [r.error for r in recs]
            for rec in recs:
                assert rec.fields["cache_mode"] == "masked"
                steps = [int(rec.fields[k]) for k in ("masked_steps", "fallback_steps", "refresh_steps")]
                assert sum(steps) == 40, rec.fields  # refresh steps: full compute by policy
            assert sum(int(r.fields["fallback_steps"]) for r in recs) > 0, "no step fell back to full compute"
            assert all(h.result().size == (SIZE, SIZE) for h in handles)
    finally:
        if not stopped:
            server_ctx.__exit__(None, None, None)
