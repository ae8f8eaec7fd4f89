"""At-least-once without duplicates: a GPU worker killed mid-batch loses no job."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from app.client import StencilClient
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask
from tests.test_service import SIZE, template, wait_until

pytestmark = pytest.mark.integration


def test_gpu_worker_sigkill_mid_batch_loses_no_job(tmp_path: Path, model_home: Path) -> None:
    # Short broker visibility timeout and lease so redelivery happens within the test.
    with EmbeddedStack.start(tmp_path, home=model_home, max_batch=4, visibility_timeout=6,
                             lease_seconds=2.0) as stack:
        client = StencilClient(stack.settings)
        handles = [client.submit(template=template(40 + i), mask=make_mask(0.2, (SIZE, SIZE), seed=i),
                                 prompt="a hat", steps=150, seed=i) for i in range(3)]
        wait_until(lambda: all(h.progress()[0] >= 5 for h in handles), timeout=120)
        assert all(h.status() == JobStatus.DENOISING for h in handles)
        stack.kill("gpu0", signal.SIGKILL)
        progress_at_kill = [h.progress()[0] for h in handles]
        assert all(0 < p < 150 for p in progress_at_kill)
        time.sleep(0.5)
        stack.start_gpu_worker("0")
        recs = [h.wait(300) for h in handles]
        assert [r.status for r in recs] == [JobStatus.DONE] * 3, [r.error for r in recs]
        results = list(client.store.list("results/"))
        assert sorted(results) == sorted(f"results/{h.id}.png" for h in handles), results
        for h in handles:
            assert h.result().size == (SIZE, SIZE)
        # Nothing left in flight: no lease, no stray blobs of these jobs.
        r = stack.redis()
        assert not any(r.exists(f"stencil:lease:{h.id}") for h in handles)
