"""``stencil serve``: a supervised local stack in the foreground, for one GPU box without Docker.

Starts what a deployment runs (redis-server with an append-only file unless ``STENCIL_REDIS_URL``
is given, the dispatcher, a CPU worker, one GPU worker per device, optionally Flower) through the
embedded stack's process starters, with the configured model and settings. A child that exits is
restarted after a backoff (1 s, doubling to 30 s, reset after a minute of uptime), as compose's
restart policy would. SIGINT/SIGTERM stop every child (SIGTERM, then SIGKILL after a timeout) and
the Redis it started, so nothing is left behind. ``<workdir>/stencil.env`` holds the settings a
client needs (``set -a; . stencil.env``) and ``<workdir>/children.json`` the children's pids.
``--device`` places the engines (and, off the CPU, the stages) on a device: ``device_plan``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
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
            # Written aside and renamed: a reader polling the file never sees it half written.
            tmp = self.children_file.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({"pids": pids, "restarts": self.restarts}))
            os.replace(tmp, self.children_file)


def device_plan(device: str, gpu_workers: int,
                environ: Mapping[str, str] = os.environ) -> tuple[dict[str, object], dict[str, dict[str, str]]]:
    """Settings overrides and each GPU host's environment (by worker id) for ``--device``.

    ``cuda`` gives GPU worker k the GPU ``cuda:k`` (one worker per GPU); any other name (``cpu``,
    ``cuda:1``) is every worker's. Off the CPU the stages (text encoders, VAE) run in each host's
    stage pool on its worker's device, as the compose file's ``gpu`` profile runs them, unless
    ``STENCIL_STAGE_PLACEMENT`` or ``STENCIL_STAGE_DEVICE`` is set. Checked before anything starts:
    a device this host lacks raises ``DeviceUnavailable`` with the reason."""
    import torch

    from workers.models.loader import DeviceUnavailable, resolve_device

    name = device.strip()
    first = resolve_device(name, "--device")
    if name.lower() == "cuda" and gpu_workers > 1:
        visible = torch.cuda.device_count()
        if gpu_workers > visible:
            raise DeviceUnavailable(f"--device cuda runs one GPU worker per GPU: --gpu-workers {gpu_workers} "
                                    f"but {visible} GPUs are visible")
        devices = [f"cuda:{k}" for k in range(gpu_workers)]
    else:
        devices = [name] * gpu_workers
    overrides: dict[str, object] = {"device": devices[0]}
    off_cpu = first.type != "cpu"
    if off_cpu and "STENCIL_STAGE_PLACEMENT" not in environ:
        overrides["stage_placement"] = "gpu_host"
    stages_follow = off_cpu and "STENCIL_STAGE_DEVICE" not in environ
    hosts = {str(k): {"STENCIL_DEVICE": d, **({"STENCIL_STAGE_DEVICE": d} if stages_follow else {})}
             for k, d in enumerate(devices)}
    return overrides, hosts


def serve(workdir: Path, *, gpu_workers: int, cpu_concurrency: int, flower_port: int = 0,
          flower_auth: str = "", redis_url: str = "", device: str = "",
          stop: threading.Event | None = None) -> int:
    """Run the supervised stack until SIGINT/SIGTERM (or ``stop``); ``device``: ``device_plan``
    ('' = ``STENCIL_DEVICE`` as configured)."""
    overrides: dict[str, object] = {"redis_url": redis_url} if redis_url else {}
    hosts: dict[str, dict[str, str]] = {}
    if device:  # before anything starts: a device this host lacks stops serve with the reason
        placed, hosts = device_plan(device, gpu_workers)
        overrides.update(placed)
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workdir.mkdir(parents=True, exist_ok=True)
    stack = EmbeddedStack.start(workdir, gpu_workers=gpu_workers, cpu_concurrency=cpu_concurrency,
                                redis_appendonly=True, host_env=hosts, **overrides)
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
        log.info("stencil is serving: %s on %s; client settings in %s (logs in %s)",
                 ", ".join(sorted(stack.procs)), ", ".join(sorted({h["STENCIL_DEVICE"] for h in hosts.values()}))
                 or stack.settings.device, workdir / "stencil.env", workdir / "logs")
        Supervisor(stack, starters, workdir / "children.json").run(stop)
    finally:
        log.info("stopping: %s", ", ".join(sorted(stack.procs)))
        stack.stop()
    return 0
