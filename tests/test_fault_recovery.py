"""Fault tolerance on the real stack (real redis-server, Celery workers, dispatcher): after a
process is SIGKILLed or Redis restarts, every job reaches a terminal state within the stated
bound, with exactly one result per done job and nothing left in flight (at-least-once without
duplicates). The bound comes from the settings the stack runs with (``STENCIL_STALL_TIMEOUT_S`` +
lease + sweep interval), not the broker's visibility timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.client import StencilClient
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask
from tests.test_service import SIZE, template, wait_until

pytestmark = pytest.mark.integration
RECOVERY: dict = dict(stall_timeout_s=8.0, sweep_interval_s=1.0, lease_seconds=4.0, max_batch=2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_home: Path) -> Iterator[EmbeddedStack]:
    """One stack for the module's faults (each test restarts what it killed; the Redis restart,
    which needs the append-only file, comes last): a stack start each test would add is the same
    processes starting again."""
    with EmbeddedStack.start(tmp_path_factory.mktemp("recovery"), home=model_home, redis_appendonly=True,
                             **RECOVERY) as s:
        yield s


@pytest.fixture()
def client(stack: EmbeddedStack) -> StencilClient:
    """A client of the module's stack, once every process of it (restarted ones too) is ready."""
    stack.wait_ready()
    return StencilClient(stack.settings)


def _bound(stack: EmbeddedStack) -> float:
    s = stack.settings
    return s.stall_timeout_s + s.lease_seconds + s.sweep_interval_s + 60.0  # + the jobs' own work


def _results(client: StencilClient) -> set[str]:
    return set(client.store.list("results/"))


def _results_once(client: StencilClient, handles: list, before: set[str]) -> None:  # type: ignore[type-arg]
    """Each job done with its result, and no other result written since ``before`` (the store's
    results when the test started: the module's stack keeps those of earlier tests)."""
    for h in handles:
        rec = h.record()
        assert rec.status == JobStatus.DONE, (h.id, rec.status, rec.error)
        assert rec.result_key and client.store.exists(rec.result_key)
        assert h.result().size == (SIZE, SIZE)
    results = _results(client) - before
    assert sorted(results) == sorted(f"results/{h.id}.png" for h in handles), results


def _nothing_in_flight(stack: EmbeddedStack, handles: list) -> None:  # type: ignore[type-arg]
    r = stack.redis()
    assert not any(r.exists(f"stencil:lease:{h.id}") for h in handles)


def test_gpu_worker_killed_mid_denoise_every_job_finishes_within_the_bound(stack: EmbeddedStack,
                                                                          client: StencilClient) -> None:
    before = _results(client)
    mask = make_mask(0.2, (SIZE, SIZE), seed=2)
    handles = [client.submit(template=template(120 + i), mask=mask, prompt="x", steps=30, seed=i)
               for i in range(5)]
    wait_until(lambda: sum(h.progress()[0] >= 3 for h in handles) >= 2, timeout=120)
    killed_at = time.monotonic()
    stack.kill("gpu0")  # SIGKILL, mid-batch: two jobs were denoising
    assert sum(0 < h.progress()[0] < 30 for h in handles) >= 2
    time.sleep(1.0)
    stack.start_gpu_worker("0")  # what compose's restart policy does
    for h in handles:
        left = _bound(stack) - (time.monotonic() - killed_at)
        assert h.wait(max(1.0, left)).status.terminal, f"{h.id} not terminal within the bound"
    _results_once(client, handles, before)
    _nothing_in_flight(stack, handles)
    assert any(int(h.record().fields.get("redrives") or 0) > 0 for h in handles), "nothing was re-driven"


@pytest.mark.parametrize("victim", ["cpu", "dispatcher"])
def test_cpu_worker_or_dispatcher_killed_every_job_finishes_within_the_bound(victim: str, stack: EmbeddedStack,
                                                                            client: StencilClient) -> None:
    """Killed while jobs are in prepare/finalize (CPU worker) or being routed (dispatcher): the
    restarted process and the sweeper finish every job without waiting for broker redelivery."""
    before = _results(client)
    mask = make_mask(0.2, (SIZE, SIZE), seed=4)
    first = {"cpu": 140, "dispatcher": 150}[victim]  # templates of its own: none cached by the other case
    handles = [client.submit(template=template(first + i), mask=mask, prompt="x", steps=8, seed=i)
               for i in range(6)]
    wait_until(lambda: any(h.status() != JobStatus.QUEUED for h in handles), timeout=120)
    killed_at = time.monotonic()
    stack.kill(victim)
    time.sleep(1.0)
    {"cpu": stack.start_cpu_worker, "dispatcher": stack.start_dispatcher}[victim]()
    for h in handles:
        left = _bound(stack) - (time.monotonic() - killed_at)
        assert h.wait(max(1.0, left)).status.terminal, f"{h.id} not terminal within the bound"
    _results_once(client, handles, before)
    _nothing_in_flight(stack, handles)


def test_the_dispatcher_survives_a_redis_restart(stack: EmbeddedStack, client: StencilClient) -> None:
    mask = make_mask(0.2, (SIZE, SIZE), seed=3)
    first = client.submit(template=template(130), mask=mask, steps=4)
    assert first.wait(120).status == JobStatus.DONE
    stack.redis_server.restart(pause_s=3.0)
    time.sleep(2.0)
    assert stack.procs["dispatcher"].poll() is None, "the dispatcher exited on the Redis restart"
    after = StencilClient(stack.settings).submit(template=template(131), mask=mask, steps=4)
    assert after.wait(180).status == JobStatus.DONE


def test_a_gpu_worker_whose_engine_cannot_start_exits_and_the_start_says_why(
        tmp_path: Path, model_home: Path, saved_model: Path) -> None:
    """An engine that fails to build (here: the UNet's weights file is not safetensors) ends the GPU
    worker at once, instead of leaving a worker that never serves: the stack's start fails within
    seconds, with the reason from the worker's log, not after its readiness timeout."""
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(saved_model, broken)
    weights = next((broken / "unet").glob("*.safetensors"))
    weights.write_bytes(b"not a safetensors file")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited during start-up: \['gpu0'\]") as err:
        with EmbeddedStack.start(tmp_path / "stack", home=model_home, model_dir=str(broken)):
            pass
    assert time.monotonic() - t0 < 90, "the start waited for the readiness timeout"
    assert "the GPU worker exits: the engine could not start" in str(err.value), str(err.value)
