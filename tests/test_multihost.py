"""One deployment over several hosts (``tests/support/multihost.py``): hosts share only Redis and
the object store, GPU hosts leave and join mid-run, the dispatcher moves to another host."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.client import JobHandle
from app.embedded import RedisServer
from app.jobs import JobRecord, JobStatus
from app.maskgen import make_mask
from app.storage.s3 import S3Store
from tests.support.controlnets import save_controlnet
from tests.support.loras import save_sd_lora
from tests.support.multihost import Deployment, deployment
from tests.support.pipes import sd_pipe
from tests.support.s3server import S3ServerInfo, running_s3_server
from tests.test_controlnet_service import control_image
from tests.test_service import SIZE, template, wait_until

pytestmark = pytest.mark.integration

STEPS = 6
BUCKET = "stencil"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3ServerInfo]:
    with running_s3_server(tmp_path_factory.mktemp("weed")) as info:
        S3Store(BUCKET, endpoint_url=info.endpoint_url, region=info.region, access_key=info.access_key,
                secret_key=info.secret_key).ensure_bucket()
        yield info


@pytest.fixture(scope="module")
def addons(saved_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("addons")
    pipe = sd_pipe(saved_model)
    controlnet = save_controlnet(pipe.unet, root / "edges", seed=3, std=0.05)  # before the LoRA wraps the UNet
    return {"controlnet": controlnet, "lora": save_sd_lora(pipe, root / "lora", rank=4, seed=5, std=0.1)}


def _deployment(tmp_path: Path, saved_model: Path, s3: S3ServerInfo, **overrides: object):  # type: ignore[no-untyped-def]
    redis_server = RedisServer(tmp_path / "redis")
    dep = deployment(tmp_path / "hosts", redis_url=redis_server.url, s3=s3, bucket=BUCKET, model_dir=saved_model,
                     gpu_workers=["0", "1"], max_batch=4, **overrides)
    return redis_server, dep


def _edit(client, templates: list[str], i: int, **kw) -> JobHandle:  # type: ignore[no-untyped-def]
    return client.submit(template=templates[i % len(templates)], mask=make_mask(0.1 + 0.02 * (i % 5), (SIZE, SIZE),
                                                                                "blob", seed=i),
                         prompt="a hat", steps=STEPS, seed=i, **kw)


def _records(handles: list[JobHandle], timeout: float) -> list[JobRecord]:
    return [h.wait(timeout) for h in handles]


def test_three_hosts_share_only_redis_and_the_store(tmp_path: Path, saved_model: Path, s3: S3ServerInfo,
                                                   addons: dict[str, Path]) -> None:
    """Hosts A (dispatcher, CPU pool), B (GPU 0, CPU pool), C (GPU 1), their folders deleted under
    their running processes: 40 edits of 4 templates, LoRA and ControlNet jobs among them, each
    denoised once, results read by clients on every host, templates warmed on B serving masked
    edits on C from the store."""
    redis_server, dep_ctx = _deployment(tmp_path, saved_model, s3)
    try:
        with dep_ctx as dep:
            a = dep.start_host("a", dispatcher=True, cpu=True)
            b = dep.start_host("b", gpu=["0"], cpu=True)
            on_a = a.client()
            assert on_a.add_lora(addons["lora"], "style")["id"] == "style"
            assert b.client().add_controlnet(addons["controlnet"], "edges")["id"] == "edges"
            templates = [on_a.add_template(template(70 + k), f"tpl-{k}") for k in range(4)]
            warms = _records([on_a.warm_template(t, steps=STEPS) for t in templates], 300)
            assert [w.status for w in warms] == [JobStatus.DONE] * 4, [w.error for w in warms]
            assert {w.fields["worker"] for w in warms} == {"gpu.0"}  # host C has not joined yet
            c = dep.start_host("c", gpu=["1"])
            for host in (a, b, c):
                host.delete_directories()
            clients = [h.client() for h in (a, b, c)]
            handles = []
            for i in range(40):
                extra: dict[str, object] = {}
                if i % 10 == 3:
                    extra["loras"] = [("style", 0.8)]
                elif i % 10 == 7:
                    extra["controls"] = [("edges", control_image(i), 0.8)]
                handles.append(_edit(clients[i % 3], templates, i, **extra))
            recs = _records(handles, 600)
            assert [r.status for r in recs] == [JobStatus.DONE] * 40, [r.error for r in recs if r.error]
            assert all(r.fields.get("denoise_runs") == "1" and not r.fields.get("redrives") for r in recs), \
                [(r.fields.get("denoise_runs"), r.fields.get("redrives")) for r in recs]
            for k, h in enumerate(handles):  # read on another host than the one that submitted
                data = clients[(k + 1) % 3].job(h.id).result_bytes()
                assert data == clients[(k + 2) % 3].job(h.id).result_bytes() and data[:4] == b"\x89PNG"
            on_c = [r for r in recs if r.fields["worker"] == "gpu.1"]
            assert on_c and len(on_c) < 40, "routing used one GPU host only"
            masked_on_c = [r for r in on_c if r.fields["cache_mode"] == "masked"]
            assert masked_on_c, [r.fields.get("cache_mode") for r in on_c]
            assert all(int(r.fields["cache_store_bytes"]) > 0 for r in masked_on_c)
            with_lora = [r for r in recs if r.fields.get("lora_applied_step") is not None]
            assert len(with_lora) == 4 and all(r.fields["lora_applied_step"] == "0" for r in with_lora)
    finally:
        redis_server.stop()


def _sweep_bound(dep: Deployment) -> float:
    """How long after a GPU host dies the sweeper has re-sent each of its jobs at the latest."""
    s = next(iter(dep.hosts.values())).settings
    return s.lease_seconds + s.stall_timeout_s + max(s.worker_stale_seconds - s.stall_timeout_s, 0) \
        + 2 * s.sweep_interval_s + 2.0


def test_gpu_host_killed_mid_run_rejoins_and_the_dispatcher_moves(tmp_path: Path, saved_model: Path,
                                                                  s3: S3ServerInfo) -> None:
    """GPU host C is killed (SIGKILL, every process) while it denoises: its jobs finish on B within
    the sweeper's bound, none lost or denoised twice; C restarted receives jobs again; the
    dispatcher killed on A, one started on B routes the next jobs."""
    redis_server, dep_ctx = _deployment(tmp_path, saved_model, s3, lease_seconds=2.0, stall_timeout_s=4.0,
                                        worker_stale_seconds=4.0, sweep_interval_s=0.5)
    try:
        with dep_ctx as dep:
            a = dep.start_host("a", dispatcher=True, cpu=True)
            b = dep.start_host("b", gpu=["0"])
            c = dep.start_host("c", gpu=["1"])
            client = a.client()
            templates = [client.add_template(template(80 + k), f"tpl-{k}") for k in range(2)]
            handles = [client.submit(template=templates[i % 2], mask=make_mask(0.2, (SIZE, SIZE), "blob", seed=i),
                                     prompt="a hat", steps=30, seed=i) for i in range(8)]
            handles += [_edit(client, templates, i) for i in range(8)]
            wait_until(lambda: any(h.record().fields.get("worker") == "gpu.1" and h.progress()[0] >= 2
                                   for h in handles), timeout=180, poll=0.1)
            c.kill()
            killed_at = time.time()
            recs = _records(handles, 300)
            assert [r.status for r in recs] == [JobStatus.DONE] * len(recs), [r.error for r in recs if r.error]
            assert all(r.fields.get("denoise_runs") == "1" for r in recs), [r.fields.get("denoise_runs") for r in recs]
            moved = [r for r in recs if r.fields.get("redrives")]
            assert moved, "no job was re-sent after its host died"
            assert all(r.fields["worker"] == "gpu.0" for r in moved)
            bound = _sweep_bound(dep)
            assert all(float(r.fields["ts_redriven"]) - killed_at <= bound for r in moved), \
                ([float(r.fields["ts_redriven"]) - killed_at for r in moved], bound)

            dep.start_host("c", gpu=["1"])  # rejoins with fresh folders
            later = [_edit(client, templates, 100 + i) for i in range(6)]
            recs = _records(later, 300)
            assert [r.status for r in recs] == [JobStatus.DONE] * 6, [r.error for r in recs if r.error]
            assert "gpu.1" in {r.fields["worker"] for r in recs}, "the restarted host received no job"

            a.stack.kill("dispatcher")  # the dispatcher moves to host B
            b.start_dispatcher()
            last = [_edit(b.client(), templates, 200 + i) for i in range(2)]
            recs = _records(last, 300)
            assert [r.status for r in recs] == [JobStatus.DONE] * 2, [r.error for r in recs if r.error]
    finally:
        redis_server.stop()


def test_a_model_copy_has_the_same_identity_wherever_a_host_keeps_it(saved_model: Path, tmp_path: Path) -> None:
    """Cache keys and add-on descriptions name the model by its contents, not by its folder."""
    import shutil

    from workers.models.loader import model_identity

    copy = shutil.copytree(saved_model, tmp_path / "elsewhere" / "another-name")
    assert model_identity(copy) == model_identity(saved_model)
