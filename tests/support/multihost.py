"""Several "hosts" of one deployment on this machine: each a set of Stencil processes with
directories of its own, all sharing one Redis and one S3 server (the suite's).

Why this shape: a deployment across machines shares exactly two things, Redis and the object
store. Each host here gets its own root folder holding its working directory, ``STENCIL_HOME``,
``TMPDIR`` and the process logs, plus a model folder of its own (a copy under a host-specific name:
nothing may depend on where a host keeps its model). No folder is shared between hosts and none
names another host's, so a code path that hands a local path to another process shows up as a
failed job; ``Host.delete_directories`` removes a host's folders under its running processes
(the model folder, read when a process loads the model, is kept: it is the host's install).

The processes are ``EmbeddedStack``'s (the same ``stencil`` subcommands a deployment runs).
"""

from __future__ import annotations

import logging
import shutil
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from app.client import StencilClient
from app.embedded import EmbeddedStack
from app.settings import Settings
from tests.support.s3server import S3ServerInfo

log = logging.getLogger(__name__)


@dataclass
class Host:
    """One machine's processes and folders."""

    name: str
    root: Path
    model_dir: Path
    stack: EmbeddedStack
    gpu_ids: list[str] = field(default_factory=list)

    @property
    def settings(self) -> Settings:
        return self.stack.settings

    def client(self) -> StencilClient:
        """A client as a program on this host would make it (its settings, no shared folder)."""
        return StencilClient(self.settings)

    def start_dispatcher(self) -> None:
        self.stack.start_dispatcher()
        self.stack.wait_ready()

    def kill(self) -> None:
        """SIGKILL every process of the host (their process groups: prefork children too)."""
        for name in list(self.stack.procs):
            self.stack.kill(name, signal.SIGKILL)

    def delete_directories(self) -> None:
        """Remove the host's folders (working directory, home, TMPDIR, logs) under its processes."""
        shutil.rmtree(self.root)

    def stop(self) -> None:
        self.stack.stop()


class Deployment:
    """Hosts joined to one Redis (``redis_url``) and one S3 bucket; ``gpu_workers`` is the
    dispatcher's ``STENCIL_GPU_WORKERS`` (every GPU worker id of the deployment)."""

    def __init__(self, root: Path, *, redis_url: str, s3: S3ServerInfo, bucket: str, model_dir: Path,
                 gpu_workers: Sequence[str], **overrides: object) -> None:
        self.root = root
        self.model_dir = model_dir
        self.hosts: dict[str, Host] = {}
        self.common: dict[str, object] = {
            "redis_url": redis_url, "store_backend": "s3", "s3_endpoint_url": s3.endpoint_url, "s3_bucket": bucket,
            "s3_region": s3.region, "s3_access_key": s3.access_key, "s3_secret_key": s3.secret_key,
            "gpu_workers": ",".join(gpu_workers), "torch_threads": 1, **overrides}

    def start_host(self, name: str, *, dispatcher: bool = False, gpu: Sequence[str] = (), cpu: bool = False,
                   wait: bool = True) -> Host:
        """A host with its own folders (a fresh root: a restarted host does not find its old files)."""
        generation = sum(1 for h in self.root.glob(f"{name}-*"))
        root = self.root / f"{name}-{generation}"
        model_dir = self.root / "installs" / f"{name}-{generation}" / f"model-on-{name}"
        shutil.copytree(self.model_dir, model_dir)
        home, tmp = root / "home", root / "tmp"
        tmp.mkdir(parents=True)
        settings = Settings.from_env(**self.common, home=home, store_dir=home / "store", model_dir=str(model_dir))
        stack = EmbeddedStack(settings=settings, redis_server=None, workdir=root, cwd=root,
                              extra_env={"TMPDIR": str(tmp)})
        host = Host(name, root, model_dir, stack, list(gpu))
        self.hosts[name] = host
        try:
            if cpu:
                stack.start_cpu_worker(name=f"cpu{name}")
            for worker_id in gpu:
                stack.start_gpu_worker(worker_id)
            if dispatcher:
                stack.start_dispatcher()
            if wait:
                stack.wait_ready()
        except BaseException:
            host.stop()
            raise
        log.info("host %s started: %s", name, sorted(stack.procs))
        return host

    def stop(self) -> None:
        for host in self.hosts.values():
            host.stop()
        self.hosts.clear()


@contextmanager
def deployment(root: Path, **kwargs: object) -> Iterator[Deployment]:
    dep = Deployment(root, **kwargs)  # type: ignore[arg-type]
    try:
        yield dep
    finally:
        dep.stop()


__all__ = ["Deployment", "Host", "deployment"]
