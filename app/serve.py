"""``stencil serve``: a supervised local stack in the foreground, for one GPU box without Docker.

Starts what a deployment runs (redis-server with an append-only file unless ``STENCIL_REDIS_URL``
is given, the dispatcher, a CPU worker, one GPU worker per device, optionally Flower) through the
embedded stack's process starters, with the configured model and settings. A child that exits is
restarted after a backoff (1 s, doubling to 30 s, reset after a minute of uptime), as compose's
restart policy would. SIGINT/SIGTERM stop every child (SIGTERM, then SIGKILL after a timeout) and
the Redis it started, so nothing is left behind. ``<workdir>/stencil.env`` holds the settings a
client needs (``set -a; . stencil.env``) and ``<workdir>/children.json`` the children's pids.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from app.embedded import EmbeddedStack

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0


class Supervisor:
    """Restarts the stack's children when they exit; ``run`` returns when ``stop`` is set."""

    def __init__(self, stack: EmbeddedStack, starters: dict[str, Callable[[], object]],
                 children_file: Path | None = None) -> None:
        self.stack = stack
        self.starters = starters
        self.children_file = children_file
        self.backoff: dict[str, float] = {}
        self.started: dict[str, float] = {name: time.monotonic() for name in stack.procs}
        self.restarts: dict[str, int] = {}

    def run(self, stop: threading.Event, poll_s: float = 0.5) -> None:
        self._write_children()
        due: dict[str, float] = {}
        while not stop.wait(poll_s):
            now = time.monotonic()
            for name, proc in list(self.stack.procs.items()):
                if proc.poll() is None or name in due:
                    continue
                up = now - self.started.get(name, now)
                wait = 1.0 if up > HEALTHY_AFTER_S else min(MAX_BACKOFF_S, 2 * self.backoff.get(name, 0.5))
                self.backoff[name] = wait
                due[name] = now + wait
                log.warning("%s exited with %s after %.0f s; restarting in %.0f s", name, proc.returncode, up, wait)
            for name, when in list(due.items()):
                if now >= when:
                    del due[name]
                    self.stack.procs.pop(name, None)
                    self.starters[name]()
                    self.started[name] = time.monotonic()
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self._write_children()

    def _write_children(self) -> None:
        if self.children_file is not None:
            pids = {name: proc.pid for name, proc in self.stack.procs.items()}
            self.children_file.write_text(json.dumps({"pids": pids, "restarts": self.restarts}))


def serve(workdir: Path, *, gpu_workers: int, cpu_concurrency: int, flower_port: int = 0,
          flower_auth: str = "", redis_url: str = "", stop: threading.Event | None = None) -> int:
    """Run the supervised stack until SIGINT/SIGTERM (or ``stop``)."""
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workdir.mkdir(parents=True, exist_ok=True)
    overrides: dict[str, object] = {"redis_url": redis_url} if redis_url else {}
    stack = EmbeddedStack.start(workdir, gpu_workers=gpu_workers, cpu_concurrency=cpu_concurrency,
                                redis_appendonly=True, **overrides)
    try:
        starters: dict[str, Callable[[], object]] = {
            "cpu": lambda: stack.start_cpu_worker(concurrency=cpu_concurrency),
            "dispatcher": stack.start_dispatcher}
        for worker_id in stack.settings.gpu_worker_ids:
            starters[f"gpu{worker_id}"] = lambda w=worker_id: stack.start_gpu_worker(w)
            if stack.settings.stage_placement == "gpu_host":  # the host's stage pool, supervised too
                starters[f"stage{worker_id}"] = lambda w=worker_id: stack.start_stage_worker(w)
        if flower_port:
            args = ["flower", "--port", str(flower_port), "--db", str(workdir / "flower.db")]
            args += ["--basic-auth", flower_auth] if flower_auth else ["--no-auth"]
            starters["flower"] = lambda: stack._spawn("flower", args)
            starters["flower"]()
        env = {k: v for k, v in stack.settings.to_env().items()
               if k in ("STENCIL_REDIS_URL", "STENCIL_STORE_BACKEND", "STENCIL_STORE_DIR", "STENCIL_HOME",
                        "STENCIL_MODEL_ID", "STENCIL_MODEL_DIR", "STENCIL_GPU_WORKERS")}
        (workdir / "stencil.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        log.info("stencil is serving: %s; client settings in %s (logs in %s)",
                 ", ".join(sorted(stack.procs)), workdir / "stencil.env", workdir / "logs")
        Supervisor(stack, starters, workdir / "children.json").run(stop)
    finally:
        log.info("stopping: %s", ", ".join(sorted(stack.procs)))
        stack.stop()
    return 0
