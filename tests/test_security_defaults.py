"""Secure by default: no unauthenticated Flower beyond loopback, placeholder secrets refused at
start-up (the variable named, its value never printed), published ports and metrics on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from app.secrets import InsecureConfiguration, check_basic_auth, check_secrets
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STENCIL_", "FLOWER_"))}
    env.update(HF_HUB_OFFLINE="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of listening TCP sockets on ``port`` (from /proc/net/tcp, tcp6)."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        for line in open(name).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:
                out.add(addr)
    return out


@pytest.mark.parametrize("env, var", [
    ({"STENCIL_REDIS_URL": "redis://:change-me-redis@redis:6379/0"}, "STENCIL_REDIS_URL"),
    ({"STENCIL_BROKER_URL": "redis://:change-me-redis@redis:6379/1"}, "STENCIL_BROKER_URL"),
    ({"STENCIL_S3_SECRET_KEY": "change-me-s3-secret"}, "STENCIL_S3_SECRET_KEY"),
    ({"STENCIL_S3_ACCESS_KEY": "changeme"}, "STENCIL_S3_ACCESS_KEY"),
])
def test_placeholder_secrets_are_refused_by_name(env: dict[str, str], var: str) -> None:
    with pytest.raises(InsecureConfiguration) as err:
        check_secrets(env)
    message = str(err.value)
    assert var in message and "change-me-" not in message and "changeme" not in message.replace(var, "")
    check_secrets({"STENCIL_REDIS_URL": "redis://:a-real-password@redis:6379/0", "STENCIL_S3_SECRET_KEY": "k3y"})


def test_flower_credentials_must_be_real() -> None:
    for bad in ("admin:change-me-flower", "admin", "admin:", ":pw"):
        with pytest.raises(InsecureConfiguration):
            check_basic_auth(bad)
    check_basic_auth("ops:s3cret,viewer:another-one")
    with pytest.raises(InsecureConfiguration, match="FLOWER_BASIC_AUTH"):
        check_secrets({"FLOWER_BASIC_AUTH": "admin:change-me-flower"}, flower=True)


@pytest.mark.parametrize("argv, says", [
    ([], "Flower needs credentials"),
    (["--no-auth", "--address", "0.0.0.0"], "loopback only"),
    (["--basic-auth", "admin:change-me-flower"], "placeholder password"),
])
def test_flower_refuses_to_start_insecurely(argv: list[str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "app.cli", "flower", "--port", str(_free_port()), *argv],
                         capture_output=True, text=True, env=_env(), timeout=60)
    assert out.returncode != 0 and says in out.stderr, out.stderr[-500:]
    assert "Traceback" not in out.stderr


@pytest.mark.integration
def test_flower_without_auth_listens_on_loopback_only(redis_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "flower", "--port", str(port), "--no-auth",
                             "--db", str(tmp_path / "flower.db")], env=_env(STENCIL_REDIS_URL=redis_server.url),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _listening_addresses(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _listening_addresses(port) == {"0100007F"}, _listening_addresses(port)  # 127.0.0.1
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGTERM, then SIGKILL: what this module checks is where a server listens, not how fast it
    stops (Flower's own SIGTERM exit joins its executor's threads and once took over 30 s on a
    loaded machine; deployments stop it with a grace period too)."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def test_flower_refuses_a_state_file_that_is_not_a_regular_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Flower moves an unreadable --db aside and replaces it on save: a device or folder must be refused."""
    out = subprocess.run([sys.executable, "-m", "app.cli", "flower", "--port", str(_free_port()), "--no-auth",
                          "--db", str(tmp_path)], capture_output=True, text=True, env=_env(), timeout=60)
    assert out.returncode != 0 and "not a regular file" in out.stderr, out.stderr[-500:]
    assert tmp_path.is_dir()


def test_long_running_processes_refuse_placeholder_secrets() -> None:
    for command in (["dispatcher"], ["cpu-worker"], ["gpu-worker", "--worker-id", "0"], ["api"], ["webhook-sender"]):
        out = subprocess.run([sys.executable, "-m", "app.cli", *command], capture_output=True, text=True, timeout=60,
                             env=_env(STENCIL_REDIS_URL="redis://:change-me-redis@127.0.0.1:1/0"))
        assert out.returncode != 0 and "STENCIL_REDIS_URL" in out.stderr, (command, out.stderr[-500:])
        assert "change-me-redis" not in out.stderr


def test_published_ports_and_metrics_default_to_loopback() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    published = [(name, p) for name, svc in compose["services"].items() for p in svc.get("ports", [])]
    assert published, "compose publishes no port?"
    for name, port in published:
        assert str(port).startswith("${STENCIL_BIND_ADDRESS:-127.0.0.1}:"), (name, port)
    assert Settings().metrics_address == "127.0.0.1"


def test_the_gateway_listens_on_loopback_unless_configured(redis_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``stencil api`` without --host binds STENCIL_BIND_ADDRESS, 127.0.0.1 by default."""
    assert Settings().bind_address == "127.0.0.1"
    port = _free_port()
    with open(tmp_path / "api.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "api", "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, env=_env(STENCIL_REDIS_URL=redis_server.url,
                                                                   STENCIL_HOME=str(tmp_path)))
    try:
        deadline = time.monotonic() + 60
        while not _listening_addresses(port):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "api.log").read_text()[-2000:]
            time.sleep(0.1)
        assert _listening_addresses(port) == {"0100007F"}
    finally:
        proc.terminate()
        proc.wait(15)


def test_the_metrics_server_binds_loopback_by_default() -> None:
    from prometheus_client import CollectorRegistry

    import app.metrics as metrics

    port = _free_port()
    saved, metrics._server = metrics._server, None
    try:
        assert metrics.start_metrics_server(port, registry=CollectorRegistry()) == port
        assert _listening_addresses(port) == {"0100007F"}
    finally:
        if metrics._server is not None:
            metrics._server.shutdown()
        metrics._server = saved
