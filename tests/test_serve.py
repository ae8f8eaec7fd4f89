"""``stencil serve``: one command starts a supervised local stack (``--device cpu`` reaching its
GPU worker); a catalog runs against it; a killed child is restarted; Ctrl-C (SIGINT) leaves no
process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_catalog import write_catalog
from tests.test_service import wait_until

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is as good as gone
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False


def test_serve_runs_a_catalog_restarts_a_killed_child_and_stops_cleanly(tmp_path: Path, model_home: Path) -> None:
    workdir = tmp_path / "serve"
    env = {k: v for k, v in os.environ.items() if k not in ("STENCIL_REDIS_URL",)}
    # --device must reach the processes serve starts, over what the environment says
    env.update(STENCIL_HOME=str(model_home), HF_HUB_OFFLINE="1", STENCIL_DEVICE="cpu:0")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--workdir", str(workdir),
                             "--cpu-concurrency", "1", "--device", "cpu"], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "serve.log", "wb"))
    children: dict[str, int] = {}
    try:
        wait_until(lambda: (workdir / "stencil.env").is_file() and (workdir / "children.json").is_file(),
                   timeout=180)
        children = json.loads((workdir / "children.json").read_text())["pids"]
        assert {"cpu", "gpu0", "dispatcher"} <= set(children)
        client_env = dict(env)
        for line in (workdir / "stencil.env").read_text().splitlines():
            key, _, value = line.partition("=")
            client_env[key] = value
        manifest = write_catalog(tmp_path / "cat", rows=3)
        out = subprocess.run([sys.executable, "-m", "app.cli", "catalog", "edit", str(manifest), "--out",
                              str(tmp_path / "report"), "--no-progress"], env=client_env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout)["status"]["done"] == 3
        # --device reached the GPU worker (it says where its engine runs), forked by the launcher
        assert "engine: sd model on cpu in" in (workdir / "logs" / "gpu0.log").read_text()
        assert re.search(r"started gpu0 \(pid \d+, forked by the preloaded launcher\)",
                         (tmp_path / "serve.log").read_text())
        os.killpg(children["gpu0"], signal.SIGKILL)
        wait_until(lambda: json.loads((workdir / "children.json").read_text())["pids"].get("gpu0")
                   not in (None, children["gpu0"]), timeout=60)
        state = json.loads((workdir / "children.json").read_text())
        assert state["restarts"]["gpu0"] == 1 and _alive(state["pids"]["gpu0"])
        children = state["pids"]
        port = client_env["STENCIL_REDIS_URL"].rsplit(":", 1)[1].split("/")[0]
        redis_pid = int(subprocess.run(["pgrep", "-f", f"redis-server 127.0.0.1:{port}"], capture_output=True,
                                       text=True).stdout.split()[0])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0, (tmp_path / "serve.log").read_text()[-2000:]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in [*children.values(), redis_pid]):
            time.sleep(0.2)
        left = {n: p for n, p in [*children.items(), ("redis", redis_pid)] if _alive(p)}
        assert not left, f"processes left behind: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children.values():
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)
