"""Flower on the embedded stack, as an operator sees it: the Workers page in headless Chromium
(screenshot + DOM), its API behind basic auth, and its Prometheus endpoint."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.embedded import EmbeddedStack, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
USER, PASSWORD = "ops", "s3cret-flower"


def http_get(url: str, auth: bool = True, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if auth:
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for(predicate, timeout: float, what: str, poll: float = 0.25):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(poll)
    raise TimeoutError(f"{what} not reached after {timeout}s (last: {last!r})")


@pytest.fixture()
def flower(stack: EmbeddedStack, tmp_path: Path) -> Iterator[str]:
    """``stencil flower`` against the shared stack; yields its base URL."""
    port = free_port()
    log = open(tmp_path / "flower.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "flower", "--port", str(port), "--address", "127.0.0.1",
                             "--basic-auth", f"{USER}:{PASSWORD}", "--db", str(tmp_path / "flower.db")],
                            env=stack.env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is None and http_get(base + "/healthcheck", auth=False)[0] == 200, 60,
                 "Flower /healthcheck")
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def chromium() -> str:
    out = subprocess.run(["bash", str(ROOT / "ops" / "deploy" / "install_chromium.sh")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def run_chromium(binary: str, profile: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--window-size=1400,900", "--hide-scrollbars",
            "--virtual-time-budget=10000", *extra, url]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_workers_page_shows_the_gpu_worker_online(stack: EmbeddedStack, flower: str, tmp_path: Path) -> None:
    from app.client import StencilClient
    from app.maskgen import make_mask
    from tests.test_service import SIZE, template

    # A few jobs first, so the page shows processed tasks on both kinds of worker.
    client = StencilClient(stack.settings)
    handles = [client.submit(template=template(60 + i), mask=make_mask(0.2, (SIZE, SIZE), seed=i), steps=3, seed=i)
               for i in range(3)]
    assert all(h.wait(180).status.value == "done" for h in handles)

    # The API is protected, and with the credentials says gpu0@... is alive (heartbeat events).
    assert http_get(flower + "/api/workers", auth=False)[0] == 401
    status = wait_for(lambda: {k: v for k, v in json.loads(http_get(flower + "/api/workers?status=1")[1]).items()
                               if k.startswith("gpu0@") and v}, 60, "gpu0 online in /api/workers?status=1")
    gpu_name = next(iter(status))
    code, body = http_get(flower + "/api/workers?refresh=1", timeout=30)
    assert code == 200
    workers = json.loads(body)
    assert gpu_name in workers, sorted(workers)
    queues = [q["name"] for q in workers[gpu_name].get("active_queues", [])]
    assert queues == ["gpu.0"], queues
    assert workers[gpu_name]["stats"]["pool"]["implementation"] == "celery.concurrency.thread:TaskPool"
    wait_for(lambda: any(k.startswith("cpu@") for k in workers), 1, "a CPU worker listed")

    # The page itself, as a browser renders it (credentials in the URL, page JS run).
    binary = chromium()
    page = flower.replace("http://", f"http://{USER}:{PASSWORD}@") + "/workers"
    shot = tmp_path / "flower-workers.png"
    shot_run = run_chromium(binary, tmp_path / "profile1", page, f"--screenshot={shot}")
    assert shot.is_file() and shot.stat().st_size > 10_000, shot_run.stderr[-2000:]
    with Image.open(shot) as img:
        assert img.size == (1400, 900)
        small = np.asarray(img.convert("RGB").resize((140, 90))).reshape(-1, 3)
    colours = len(np.unique(small, axis=0))
    assert colours > 20, "the screenshot is blank"
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    shutil.copyfile(shot, docs / "flower-workers.png")

    dom_run = run_chromium(binary, tmp_path / "profile2", page, "--dump-dom")
    dom = dom_run.stdout
    assert "workers-table" in dom, dom_run.stderr[-2000:]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", dom, flags=re.S)
    gpu_rows = [r for r in rows if re.search(r">\s*" + re.escape(gpu_name) + r"\s*<", r)]
    assert gpu_rows, f"{gpu_name} not on the Workers page"
    assert "Online" in gpu_rows[0] and "Offline" not in gpu_rows[0], gpu_rows[0][:500]

    # Prometheus endpoint (open, like /healthcheck), with the worker's online gauge.
    code, metrics = http_get(flower + "/metrics", auth=False)
    assert code == 200
    text = metrics.decode()
    assert re.search(r'flower_worker_online\{worker="' + re.escape(gpu_name) + r'"\} 1\.0', text), \
        [line for line in text.splitlines() if "worker_online" in line]
    assert "flower_events_total" in text
