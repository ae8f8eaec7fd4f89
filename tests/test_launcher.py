"""The preloaded launcher (``app.launcher``, ``app.preloaded``): a process it forks is what
``subprocess.Popen`` would have started (environment, working directory, log, a session of its
own, exit codes, signals); a process whose environment differs where the preloaded imports read
it is not forked from it; the launcher ends with its input."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.embedded import RedisServer
from app.launcher import LaunchedProcess, PreloadedLauncher, import_environment
from tests.test_service import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def launcher() -> Iterator[PreloadedLauncher]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    launcher = PreloadedLauncher(env)
    yield launcher
    launcher.close()  # the end of its input ends it (a stack's process that has gone takes it along)
    assert launcher.proc.returncode == 0, launcher.log_tail()
    assert not launcher.status_dir.exists()  # nothing left in the temporary folder


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", **extra)


def _start(launcher: PreloadedLauncher, args: list[str], tmp_path: Path, **extra: str) -> LaunchedProcess:
    proc = launcher.start(args, _env(**extra), tmp_path, tmp_path / "process.log")
    assert proc is not None, launcher.log_tail()
    return proc


def test_a_forked_process_has_its_own_directory_log_and_session(launcher: PreloadedLauncher,
                                                                 redis_server: RedisServer, tmp_path: Path) -> None:
    proc = _start(launcher, ["dispatcher"], tmp_path, STENCIL_REDIS_URL=redis_server.url, STENCIL_GPU_WORKERS="0")
    try:
        wait_until(lambda: "dispatcher" in (tmp_path / "process.log").read_text(), timeout=60, poll=0.1)
        assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)
        assert os.getsid(proc.pid) == proc.pid and os.getpgid(proc.pid) == proc.pid
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # as the stack kills a process (and its pool)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()


def test_forked_processes_read_their_own_environments(launcher: PreloadedLauncher, tmp_path: Path) -> None:
    """(``/proc/<pid>/environ`` shows the launcher's: what the process was forked with.)"""
    for batch in ("7", "5"):
        (tmp_path / batch).mkdir()
        proc = _start(launcher, ["config"], tmp_path / batch, STENCIL_MAX_BATCH=batch, TMPDIR=str(tmp_path))
        assert proc.wait(60) == 0
        printed = (tmp_path / batch / "process.log").read_text()
        assert f"STENCIL_MAX_BATCH={batch}  # set" in printed, printed[-2000:]


def test_exit_codes_are_the_processes_own(launcher: PreloadedLauncher, tmp_path: Path) -> None:
    ok = _start(launcher, ["--help"], tmp_path)
    assert ok.wait(30) == 0
    assert "usage: stencil" in (tmp_path / "process.log").read_text()
    refused = _start(launcher, ["no-such-command"], tmp_path)
    assert refused.wait(30) == 2  # argparse's
    assert "invalid choice: 'no-such-command'" in (tmp_path / "process.log").read_text()


def test_a_process_with_another_import_environment_is_not_forked(launcher: PreloadedLauncher,
                                                                 tmp_path: Path) -> None:
    assert import_environment(_env(STENCIL_DEVICE="cpu", TMPDIR="/x")) == import_environment(_env())
    assert launcher.start(["--help"], _env(HF_HOME=str(tmp_path)), tmp_path, tmp_path / "log") is None
    assert launcher.start(["--help"], _env(OMP_NUM_THREADS="7"), tmp_path, tmp_path / "log") is None
    assert not (tmp_path / "log").exists()


def test_what_the_preloaded_imports_print_goes_to_the_log_not_the_protocol(tmp_path: Path) -> None:
    """What the interpreter's start-up prints (a ``sitecustomize``) and what a preloaded package
    prints on import (here ``boto3``, shadowed) cannot break the launcher's replies."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('a line on standard output at start-up')\n")
    (site / "boto3.py").write_text("print('a line on standard output on import')\n")
    env = _env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    printing = PreloadedLauncher(env)
    try:
        assert printing.wait_ready(), printing.log_tail()
        assert "a line on standard output on import" in printing.log_tail()
        proc = printing.start(["--help"], env, tmp_path, tmp_path / "process.log")
        assert proc is not None and proc.wait(30) == 0, printing.log_tail()
    finally:
        printing.close()
