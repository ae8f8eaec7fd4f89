"""The launcher process (``python -m app.preloaded STATUS_DIR``): imports the heavy third-party
packages every Stencil worker needs once, then forks each ``stencil`` process it is asked for.

Why: a worker process spends most of its start importing torch, diffusers, transformers, PEFT and
Celery (about 12 s of CPU on a 2-core machine), and an embedded stack starts several and restarts
the ones that die. A fork of a process that has imported them starts in well under a second
(``app.launcher`` is the other end and says when a process is started this way).

The protocol, one JSON line each way on standard input and output (the launcher's own output,
whatever its imports print, goes to standard error): ``{"argv", "env", "cwd", "log"}`` in, ``{"pid"}``
(or ``{"error"}``) out, sent once the child leads a session of its own, so that
signalling its process group reaches it. When a child ends, its exit code (negative: the signal
that ended it, as ``subprocess`` reports it) is written to ``STATUS_DIR/<pid>``. End of input
ends the launcher; its children go on.

Fork safety: nothing here runs torch (no thread pool or CUDA context exists when it forks: the
launcher checks that CUDA is not initialized and has a single thread), and nothing of the project
is imported (its settings read the environment when their modules load: each child imports them
itself, with its own environment).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path

# What the worker processes import (third-party only). prometheus_client is left out: it reads
# PROMETHEUS_MULTIPROC_DIR, which differs per process, when it is imported.
PRELOAD = (
    "numpy", "PIL.Image", "torch", "safetensors.torch", "redis", "boto3", "botocore.session",
    "celery", "celery.apps.worker", "celery.worker.consumer", "celery.concurrency.prefork",
    "kombu.transport.redis", "transformers", "peft", "accelerate", "diffusers",
)
PROJECT = {"app", "workers", "ops", "tests"}
PRELOAD_NAMES = {  # classes that diffusers and transformers import lazily on first access
    "diffusers": ("AutoencoderKL", "UNet2DConditionModel", "FluxTransformer2DModel", "ControlNetModel",
                  "StableDiffusionInpaintPipeline", "StableDiffusionXLInpaintPipeline", "FluxFillPipeline"),
    "transformers": ("CLIPTextModel", "CLIPTextModelWithProjection", "CLIPTokenizer", "T5EncoderModel"),
}


def preload() -> None:
    """Import what the workers import; a package this host lacks (a GPU host without the S3
    client, say) is skipped: a process that needs it imports it, or fails, as it would anyway."""
    for name in PRELOAD:
        try:
            module = importlib.import_module(name)
            for attr in PRELOAD_NAMES.get(name, ()):
                getattr(module, attr)
        except (ImportError, AttributeError) as exc:
            sys.stderr.write(f"preload: {name} skipped ({exc})\n")


def run_as_main(module: str, argv: list[str], env: dict[str, str], cwd: str) -> int:
    """Run ``python -m module *argv`` in this forked process as a fresh interpreter would, and
    return its exit code: its own environment, working directory, ``TMPDIR`` and random state; the
    project's modules imported now, with that environment; at the end, non-daemon threads joined
    and ``atexit`` handlers run. Output goes wherever file descriptors 1 and 2 point."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    tempfile.tempdir = None  # TMPDIR is this process's
    if "numpy" in sys.modules:  # its global generator was seeded once, in the process that forked
        sys.modules["numpy"].random.seed()
    sys.argv = [module, *argv]
    code = 1
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = int(exc.code or 0)
        else:
            sys.stderr.write(f"{exc.code}\n")
    except BaseException:  # noqa: BLE001 - the process ends here, as an uncaught error would end it
        traceback.print_exc()
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _child(request: dict, ready_w: int, closing: list[int]) -> None:
    """In the fork: become ``python -m app.cli *argv`` in a session of its own; never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # as a fresh Python process has them
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in closing:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(devnull)
        os.close(log_fd)
        os.write(ready_w, b"1")
        os.close(ready_w)
        code = run_as_main("app.cli", request["argv"], request["env"], request["cwd"])
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        os._exit(code)


def _reap(status_dir: Path) -> None:
    """Write the exit code of every child that has ended (``STATUS_DIR/<pid>``, atomically)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tmp = status_dir / f".{pid}"
        tmp.write_text(str(os.waitstatus_to_exitcode(status)))
        tmp.rename(status_dir / str(pid))


def _launch(request: dict, inherited: tuple[int, ...]) -> dict:
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _child(request, ready_w, [*inherited])
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        if ready.read(1) != b"1":  # it ended before leading its session: its status says how
            return {"pid": pid, "early_exit": True}
    return {"pid": pid}


def forks_can_use_cuda() -> bool:
    """Whether a fork of this process may still initialize CUDA. torch marks every later fork as
    unable to ("Cannot re-initialize CUDA in forked subprocess") once this process has asked the
    CUDA runtime for its devices, which ``torch.cuda.is_initialized()`` does not show: a fork says."""
    import torch

    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def serve(status_dir: Path) -> None:
    # The protocol gets standard output's pipe to itself; what the imports print goes to the log.
    proto = os.dup(1)
    os.dup2(2, 1)
    # Should an import ask whether CUDA is there, NVML answers: the CUDA runtime's own answer would
    # initialize the driver here, and a fork cannot use CUDA after that.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    preload()
    import torch

    if torch.cuda.is_initialized() or threading.active_count() != 1:
        raise SystemExit("the launcher cannot fork safely: CUDA initialized or threads running after preload")
    if not forks_can_use_cuda():
        raise SystemExit("the launcher cannot fork safely: the preload asked the CUDA runtime for its devices")
    read_env = sorted(m for m in sys.modules if (m.split(".")[0] in PROJECT or m == "prometheus_client")
                      and m not in ("app", "app.preloaded"))  # this module and its package
    if read_env:
        raise SystemExit(f"the preload imported modules that read the environment when imported: {read_env}")
    gc.freeze()  # the preloaded objects stay in the shared pages of every fork
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C for the stack is for its processes, not this one
    signal.set_wakeup_fd(wake_w)
    os.write(proto, (json.dumps({"ready": os.getpid()}) + "\n").encode())
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        _reap(status_dir)
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the stack's process has gone: so does the launcher, and its status files (its children stay)
            shutil.rmtree(status_dir, ignore_errors=True)
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                reply = _launch(json.loads(line), (wake_r, wake_w, proto))
            except Exception as exc:  # noqa: BLE001 - the caller starts that process another way
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(proto, (json.dumps(reply) + "\n").encode())

if __name__ == "__main__":
    serve(Path(sys.argv[1]))
