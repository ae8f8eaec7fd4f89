"""Run ``python -m <module> <argv>`` as a fork of a process that has already imported torch and
diffusers, for the quick-benchmark tests.

Importing torch, diffusers and PEFT takes about 9 s of CPU on the CI machine, and the quick
benchmarks are some thirty processes: that import was a quarter of their cost. A
``multiprocessing`` forkserver imports them once (``PRELOAD``) and forks one child per run; the
child then behaves as ``python -m`` would in a fresh process: its own environment, working
directory, ``sys.argv``, standard output and error in files, the project's modules imported anew
(the forkserver never imports ``app``, ``workers`` or ``ops``, whose settings read the environment
when they load), ``atexit`` handlers run, exit status from ``SystemExit``: the set-up of
``app.preloaded.run_as_main``, which the embedded stack's launcher runs its processes with.

Fork-safety: nothing in the forkserver runs torch, so no thread pool exists when it forks (the
server has one thread after the imports).
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

# Third-party only: their import-time reads of the environment (HF_HUB_OFFLINE, HOME, OMP_NUM_THREADS)
# see the forkserver's environment, which the caller sets to what every run gets.
PRELOAD = ["tests.support.bench_preload"]


def _run(module: str, argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """The child: ``python -m module *argv`` in ``cwd`` with ``env``, output to the two files."""
    from app.preloaded import run_as_main  # standard library only: nothing here reads the environment

    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    code = run_as_main(module, argv, env, cwd)
    if code:
        raise SystemExit(code)


class Launcher:
    """One forkserver, started with ``env`` (a fresh home and the runs' common settings)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def run(self, module: str, argv: list[str], env: dict[str, str], cwd: Path, out_dir: Path,
            timeout: float) -> tuple[int, str]:
        """Exit code and standard error of ``python -m module *argv``; a run past ``timeout`` is
        killed and reported as code -9."""
        stdout, stderr = out_dir / "stdout.txt", out_dir / "stderr.txt"
        proc = self.ctx.Process(target=_run, args=(module, argv, env, str(cwd), str(stdout), str(stderr)))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
        code = proc.exitcode if proc.exitcode is not None else -9
        return code, stderr.read_text() if stderr.exists() else ""
