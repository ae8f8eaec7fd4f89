"""An embedded stack on one machine: its own redis-server on a free loopback port, the local
object store, CPU and GPU Celery workers and the dispatcher, as child processes (and on request
the HTTP gateway and the webhook sender).

Used by ``stencil demo`` and by the integration tests, so both exercise the same processes a
deployment runs (the same ``stencil`` subcommands docker-compose starts).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from app.launcher import LaunchedProcess, launcher_for
from app.settings import Settings

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private ``redis-server`` for one stack or test session (``appendonly``: with an
    append-only file, so a restart keeps every job, as a deployment's Redis does)."""

    def __init__(self, workdir: Path, port: int | None = None, appendonly: bool = False) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not found: install it (Debian: apt-get install -y redis-server)")
        self.port = port or free_port()
        self.workdir = workdir
        self.appendonly = appendonly
        workdir.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.workdir),
             "--logfile", str(self.workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except (redis.ConnectionError, redis.BusyLoadingError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def restart(self, pause_s: float = 0.0) -> None:
        """Stop (flushing the append-only file), stay down ``pause_s``, start on the same port."""
        self.stop()
        time.sleep(pause_s)
        self._start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class EmbeddedStack:
    """Processes of a one-machine Stencil; ``stop()`` (or the context manager) ends them all."""

    settings: Settings
    redis_server: RedisServer | None  # None: an external Redis (``redis_url`` given)
    workdir: Path
    procs: dict[str, subprocess.Popen | LaunchedProcess] = field(default_factory=dict)
    owns_workdir: bool = False
    metrics: bool = False
    metrics_ports: dict[str, int] = field(default_factory=dict)
    spawned: dict[str, float] = field(default_factory=dict)  # process name -> when it was started (epoch s)
    # Where the processes run and what they get on top of the settings (a host of several, tests/support/multihost.py).
    cwd: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # Per GPU host (worker id): what its GPU worker and stage pool get on top, e.g. its device.
    host_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # Start processes as forks of the preloaded launcher (``app.launcher``) where it can: a worker
    # starts in about a second instead of importing torch and diffusers anew.
    preload: bool = True

    @classmethod
    def start(cls, workdir: Path | None = None, *, gpu_workers: int = 1, cpu_concurrency: int = 1,
              dispatcher: bool = True, stock: bool = False, worker_env: dict[str, str] | None = None,
              metrics: bool = False, redis_appendonly: bool = False,
              host_env: dict[str, dict[str, str]] | None = None, preload: bool = True,
              **overrides: object) -> "EmbeddedStack":
        """Start the stack. ``stock=True`` starts the stock-diffusers baseline instead of Stencil
        (round-robin router + plain pipeline workers), for side-by-side benchmarks. ``host_env``:
        environment of each GPU host's processes by worker id (``stencil serve --device``).
        ``preload=False``: each process a new interpreter (the ``stack_start`` benchmark's ablation)."""
        owns = workdir is None
        workdir = Path(workdir or tempfile.mkdtemp(prefix="stencil-"))
        workdir.mkdir(parents=True, exist_ok=True)
        external = str(overrides.pop("redis_url", "") or "")
        server = None if external else RedisServer(workdir / "redis", appendonly=redis_appendonly)
        ids = ",".join(str(i) for i in range(gpu_workers))
        values: dict[str, object] = {"home": Path(os.environ.get("STENCIL_HOME", workdir / "home")),
                                     "store_dir": workdir / "store", "gpu_workers": ids,
                                     # Several worker processes share this machine's cores.
                                     "torch_threads": int(os.environ.get("STENCIL_TORCH_THREADS", "1"))}
        values.update(overrides)
        values["redis_url"] = external or server.url  # type: ignore[union-attr]
        settings = Settings.from_env(**values)
        stack = cls(settings=settings, redis_server=server, workdir=workdir, owns_workdir=owns, metrics=metrics,
                    host_env=dict(host_env or {}), preload=preload)
        try:
            if stack.preload:  # its imports overlap with saving the model
                launcher_for(stack.env())
            # Save the embedded model once, before several processes race to do it.
            from workers.models.loader import ensure_model_dir

            ensure_model_dir(settings)
            if stock:
                for worker_id in settings.gpu_worker_ids:
                    stack._spawn(f"gpu{worker_id}", ["stock-worker", "--worker-id", worker_id],
                                 **stack.host_env.get(worker_id, {}), **(worker_env or {}))
                stack._spawn("dispatcher", ["stock-router"])
            else:
                stack.start_cpu_worker(concurrency=cpu_concurrency)
                for worker_id in settings.gpu_worker_ids:
                    stack.start_gpu_worker(worker_id, **(worker_env or {}))
                    if settings.stage_placement == "gpu_host":  # the host's stage pool beside it
                        stack.start_stage_worker(worker_id)
                if dispatcher:
                    stack.start_dispatcher()
            stack.wait_ready()
        except BaseException:
            stack.stop()
            raise
        return stack

    def __enter__(self) -> "EmbeddedStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.settings.to_env())
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.extra_env)
        env.update(extra)
        return env

    def _spawn(self, name: str, args: list[str], **extra_env: str) -> subprocess.Popen | LaunchedProcess:
        logdir = self.workdir / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        if self.metrics:  # one Prometheus endpoint per process
            port = self.metrics_ports.setdefault(name, free_port())
            extra_env = dict(extra_env, STENCIL_METRICS_PORT=str(port))
            if name.startswith("cpu"):  # prefork children write to files the parent serves
                multiproc = self.workdir / "prometheus" / name
                shutil.rmtree(multiproc, ignore_errors=True)
                multiproc.mkdir(parents=True)
                extra_env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)
        spawned = time.time()
        env = self.env(**extra_env)
        proc: subprocess.Popen | LaunchedProcess | None = None
        if self.preload:
            proc = launcher_for(env).start(args, env, self.cwd, logdir / f"{name}.log")
        if proc is None:
            with open(logdir / f"{name}.log", "ab") as logfile:
                proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=env, cwd=self.cwd,
                                        stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        self.spawned[name] = spawned
        how = "forked by the preloaded launcher" if isinstance(proc, LaunchedProcess) else "a new interpreter"
        log.info("started %s (pid %d, %s)", name, proc.pid, how)
        return proc

    def start_cpu_worker(self, concurrency: int = 1, name: str = "cpu") -> subprocess.Popen | LaunchedProcess:
        return self._spawn(name, ["cpu-worker", "--concurrency", str(concurrency), "--name", name])

    def start_gpu_worker(self, worker_id: str, **extra_env: str) -> subprocess.Popen | LaunchedProcess:
        env = {**self.host_env.get(worker_id, {}), **extra_env}
        return self._spawn(f"gpu{worker_id}", ["gpu-worker", "--worker-id", worker_id], **env)

    def start_stage_worker(self, worker_id: str, **extra_env: str) -> subprocess.Popen | LaunchedProcess:
        env = {**self.host_env.get(worker_id, {}), **extra_env}
        return self._spawn(f"stage{worker_id}", ["stage-worker", "--worker-id", worker_id], **env)

    def start_dispatcher(self) -> subprocess.Popen | LaunchedProcess:
        return self._spawn("dispatcher", ["dispatcher"])

    def start_api(self, port: int | None = None, timeout: float = 60.0, **extra_env: str) -> str:
        """The HTTP gateway (``stencil api``) on a loopback port; returns its URL once it answers."""
        import urllib.request

        port = port or free_port()
        proc = self._spawn("api", ["api", "--port", str(port)], **extra_env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:  # noqa: S310 (loopback)
                    if resp.status == 200:
                        return url
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start; see {self.workdir / 'logs' / 'api.log'}")
            time.sleep(0.1)

    def start_webhook_sender(self, **extra_env: str) -> subprocess.Popen | LaunchedProcess:
        return self._spawn("webhook-sender", ["webhook-sender"], **extra_env)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill a process (and its children, e.g. prefork pool processes)."""
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(10)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.settings.redis_url)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every GPU engine published its state and the dispatcher its heartbeat (these
        processes': a restarted one finds what its killed predecessor left in Redis)."""
        r = self.redis()
        deadline = time.monotonic() + timeout
        need = {f"stencil:worker:{w}": self.spawned[f"gpu{w}"]
                for w in self.settings.gpu_worker_ids if f"gpu{w}" in self.procs}
        if "dispatcher" in self.procs:
            need["stencil:dispatcher:heartbeat"] = self.spawned["dispatcher"]
        while True:
            missing = [k for k, since in need.items() if not self._published(r, k, since)]
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                tails = "".join(f"\n--- {n}.log (end) ---\n{self.log_tail(n)}" for n in dead)
                raise RuntimeError(f"processes exited during start-up: {dead}; see {self.workdir / 'logs'}{tails}")
            if not missing and self._cpu_ready():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"stack not ready after {timeout}s: waiting for {missing}")
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The last lines of a process's log (what a start-up error needs to say why)."""
        try:
            text = (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:])

    @staticmethod
    def _published(r: redis.Redis, key: str, since: float) -> bool:
        """A GPU worker's state or the dispatcher's heartbeat written since ``since`` (its start)."""
        raw = r.hget(key, "updated") if key.startswith("stencil:worker:") else r.get(key)
        return raw is not None and float(raw) >= since

    def _cpu_ready(self) -> bool:
        from app.celery_app import make_celery

        pools = {n.rstrip("0123456789") for n in self.procs if n.startswith(("cpu", "stage"))}
        if not pools:
            return True
        replies = make_celery(self.settings).control.ping(timeout=0.5) or []
        answered = {name.split("@")[0].rstrip("0123456789") for reply in replies for name in reply}
        return pools <= answered

    def stop(self) -> None:
        for name in list(self.procs):
            proc = self.procs[name]
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for name, proc in list(self.procs.items()):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self.procs.clear()
        if self.redis_server is not None:
            self.redis_server.stop()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
