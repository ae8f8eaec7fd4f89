"""Start ``stencil`` processes as forks of a process that has already imported torch, diffusers,
transformers, PEFT and Celery (``app.preloaded``), for the embedded stack (``stencil demo``,
``stencil serve``, the tests): a worker then starts in under a second instead of importing them
anew, which is most of its start, and a restarted worker is back as fast.

A process started so is in a session of its own, has the environment, working directory and log
file it would have had from ``subprocess.Popen``, and its handle (``LaunchedProcess``) answers
``pid``, ``poll``, ``wait``, ``send_signal`` and ``returncode`` as a ``Popen`` does. One launcher
serves every stack of a process whose environment matches what the preloaded packages read when
they were imported (everything but Stencil's own settings and a few variables read at run time);
an environment that differs there gets a launcher of its own, and a process the launcher cannot
start is started with ``subprocess.Popen``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

# Read when a process uses them, never by the preloaded packages' imports: they may differ per
# process. PYTEST_CURRENT_TEST: pytest renames it for every test of a process that starts stacks;
# KMP_* below and _TORCHINDUCTOR_*: torch sets them in its own process once it has compiled a
# function (for its compile workers): a stack started after that would need a launcher of its own.
RUNTIME_VARIABLES = frozenset({"TMPDIR", "PROMETHEUS_MULTIPROC_DIR", "CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST",
                               "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"})
RUNTIME_PREFIXES = ("STENCIL_", "_TORCHINDUCTOR_")  # Stencil's settings: its modules are never preloaded
MAX_LAUNCHERS = 3  # per process, the least recently used closed first (each holds the imports' memory)
START_TIMEOUT_S = 300.0  # importing the preloaded packages on a loaded 2-core machine


def import_environment(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    """What of ``env`` the preloaded packages could have read when they were imported."""
    return frozenset((k, v) for k, v in env.items()
                     if not k.startswith(RUNTIME_PREFIXES) and k not in RUNTIME_VARIABLES)


def _parsed(line: str | None) -> dict | None:
    """A protocol line as its object, or None where it is none (no line, or not a JSON object)."""
    try:
        reply = json.loads(line) if line else None
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


class LaunchedProcess:
    """A ``subprocess.Popen``-like handle of a process the launcher forked (not our child: its
    exit code comes from the launcher's status file)."""

    def __init__(self, args: list[str], pid: int, launcher: PreloadedLauncher) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._launcher = launcher

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreloadedLauncher:
    """One ``app.preloaded`` process and the handles of what it started."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env_key = import_environment(env)
        self.status_dir = Path(tempfile.mkdtemp(prefix="stencil-launcher-"))
        self._lock = threading.Lock()
        self._log = open(self.status_dir / "launcher.log", "ab")  # noqa: SIM115 - kept open with the process
        self.proc = subprocess.Popen([sys.executable, "-m", "app.preloaded", str(self.status_dir)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     cwd=str(Path(__file__).resolve().parents[1]), start_new_session=True)
        self._ready: bool | None = None

    def wait_ready(self) -> bool:
        """Whether the launcher has imported the packages and can fork (the first call waits)."""
        if self._ready is None:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:  # what the interpreter's start-up printed (a sitecustomize, say) comes before it
                line = self._readline(max(deadline - time.monotonic(), 0.0))
                reply = _parsed(line)
                if line is None or reply is not None:
                    break
                log.info("the preloaded launcher printed at start-up: %s", line.rstrip()[:200])
            self._ready = reply is not None and "ready" in reply
            if not self._ready:
                log.warning("the preloaded launcher did not start; processes start with Popen (%s)",
                            self.log_tail())
                self.close()
        return self._ready

    def _readline(self, timeout: float) -> str | None:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return line.decode() if line else None

    def log_tail(self) -> str:
        try:
            return (self.status_dir / "launcher.log").read_text()[-1000:].strip() or "no output"
        except OSError:
            return "no output"

    def start(self, args: list[str], env: dict[str, str], cwd: Path | None, log_path: Path) -> LaunchedProcess | None:
        """``python -m app.cli *args`` forked by the launcher, or None where it cannot be (the
        caller starts it another way)."""
        if import_environment(env) != self.env_key:
            return None
        with self._lock:
            if not self.wait_ready() or self.proc.poll() is not None:
                return None
            request = {"argv": args, "env": env, "cwd": str(cwd or os.getcwd()), "log": str(log_path)}
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                return None
            line = self._readline(30.0)
        reply = _parsed(line) or {"error": f"no reply ({line!r})" if line else "no reply"}
        if "pid" not in reply:
            log.warning("the preloaded launcher could not start %s: %s", args[0], reply.get("error"))
            return None
        return LaunchedProcess([sys.executable, "-m", "app.cli", *args], int(reply["pid"]), self)

    def exit_code(self, pid: int) -> int | None:
        """The exit code of a process it started, or None while it runs."""
        try:
            return int((self.status_dir / str(pid)).read_text())
        except FileNotFoundError:
            pass
        if self.proc.poll() is None:
            return None
        try:  # the launcher has gone, so nobody reaps the process: it is gone once it cannot be signalled
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return -1

    def close(self) -> None:
        """End the launcher (what it started goes on)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()


_launchers: dict[frozenset[tuple[str, str]], PreloadedLauncher] = {}  # least recently used first
_retired: list[PreloadedLauncher] = []  # closed for room: their status files are read until exit
_registry_lock = threading.Lock()


def launcher_for(env: dict[str, str]) -> PreloadedLauncher:
    """The launcher of processes with this environment (started now, importing in the background)."""
    key = import_environment(env)
    with _registry_lock:
        launcher = _launchers.pop(key, None)
        if launcher is None or launcher.proc.poll() is not None:
            if _launchers:  # another environment: say where it differs (each launcher imports anew)
                other = dict(next(reversed(_launchers.values())).env_key)
                mine = dict(key)
                differ = sorted(k for k in other.keys() | mine.keys() if other.get(k) != mine.get(k))
                log.info("a preloaded launcher for another environment (differs in %s)", ", ".join(differ))
            launcher = PreloadedLauncher(env)
        _launchers[key] = launcher
        while len(_launchers) > MAX_LAUNCHERS:
            oldest = _launchers.pop(next(iter(_launchers)))
            oldest.close()
            _retired.append(oldest)
        return launcher


@atexit.register
def _close_all() -> None:
    with _registry_lock:
        for launcher in [*_launchers.values(), *_retired]:
            launcher.close()
            shutil.rmtree(launcher.status_dir, ignore_errors=True)
        _launchers.clear()
        _retired.clear()


__all__ = ["LaunchedProcess", "PreloadedLauncher", "import_environment", "launcher_for"]
