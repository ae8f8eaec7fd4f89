"""The docker-compose deployment: valid for compose (ops/compose_check.sh, which must also reject
broken copies), wired as documented (each service runs a `stencil ...` command the CLI parser
accepts and the README documents), and its healthchecks work against real processes."""

from __future__ import annotations

import logging
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cli import build_parser
from ops.deploy import healthcheck, lint

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "ops" / "compose_check.sh"
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"


log = logging.getLogger(__name__)

def compose_check(file: Path = COMPOSE, env_file: Path = ENV_EXAMPLE) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK), "-p", str(file), str(env_file)], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """The configuration as compose resolves it (interpolated from .env.example, anchors merged)."""
    proc = compose_check()
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def services(resolved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return resolved["services"]


def stencil_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if s.get("image") == services["dispatcher"]["image"]}


def command(svc: dict[str, Any]) -> list[str]:
    cmd = svc["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def port_binding(port: Any) -> tuple[str, str, int]:
    """(host address, published port, container port) of a resolved port (compose v2: a mapping;
    docker-compose 1.x: ``host:published:target/proto``)."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), str(port["published"]), int(port["target"])
    host, published, target = str(port).split("/")[0].rsplit(":", 2)
    return host, published, int(target)


def documented_commands() -> set[str]:
    """Subcommands the README's CLI block shows (``stencil <sub>``, two words for groups)."""
    block = re.search(r"## CLI\s+```(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert block, "README has no CLI block"
    found = set()
    for m in re.finditer(r"stencil ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", block.group(1)):
        found.add(m.group(1))
        if m.group(2):
            found.add(f"{m.group(1)} {m.group(2)}")
    return found


def test_compose_file_is_valid(resolved: dict[str, Any]) -> None:
    assert set(resolved["services"]) >= {"redis", "minio", "minio-init", "dispatcher", "gpu-worker-0",
                                         "gpu-worker-cpu", "cpu-worker", "flower", "api", "webhook-sender"}
    assert lint.problems(resolved) == []


BROKEN = {
    "unknown service option": (r'    command: \["stencil", "dispatcher"\]', '    commandd: ["stencil", "dispatcher"]'),
    "dependency on an undefined service": (r"      dispatcher:\n        condition: service_started",
                                           "      dispatch:\n        condition: service_started"),
    "unknown depends_on condition": (r"condition: service_completed_successfully", "condition: service_finished"),
    "waits for a service without a healthcheck": (
        r'    healthcheck:\n      test: \["CMD-SHELL", "redis-cli ping \| grep -q PONG"\]\n(      .*\n)*?    restart',
        "    restart"),
    "device reservation with count and device_ids": (r'              device_ids: \["0"\]',
                                                     '              device_ids: ["0"]\n              count: 1'),
    "YAML syntax error": (r"services:\n", "services:\n  oops: [\n"),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_broken_copies_are_rejected(what: str, tmp_path: Path) -> None:
    pattern, replacement = BROKEN[what]
    text, n = re.subn(pattern, replacement, COMPOSE.read_text(), count=1)
    assert n == 1, f"the mutation for {what!r} no longer applies to docker-compose.yml"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text)
    proc = compose_check(broken)
    assert proc.returncode != 0, f"{what}: accepted\n{proc.stderr}"


def test_dockerfile_is_linted_and_a_broken_one_rejected(tmp_path: Path) -> None:
    (tmp_path / "docker-compose.yml").write_text(COMPOSE.read_text())
    good = (ROOT / "Dockerfile").read_text()
    (tmp_path / "Dockerfile").write_text(good)
    ok = compose_check(tmp_path / "docker-compose.yml")
    assert ok.returncode == 0 and "hadolint" in ok.stderr, ok.stderr
    (tmp_path / "Dockerfile").write_text(good.replace("WORKDIR /opt/stencil", "WORKDIR opt/stencil"))
    bad = compose_check(tmp_path / "docker-compose.yml")
    assert bad.returncode != 0 and "DL3000" in bad.stderr, bad.stderr


def test_missing_secret_in_the_env_file_is_rejected(tmp_path: Path) -> None:
    env = tmp_path / "env"
    env.write_text("".join(line + "\n" for line in ENV_EXAMPLE.read_text().splitlines()
                           if not line.startswith("REDIS_PASSWORD=")))
    proc = compose_check(env_file=env)
    assert proc.returncode != 0 and "REDIS_PASSWORD" in proc.stderr


def test_every_stencil_service_runs_a_documented_cli_command(services: dict[str, dict[str, Any]]) -> None:
    parser = build_parser()
    documented = documented_commands()
    ours = stencil_services(services)
    assert set(ours) >= {"dispatcher", "gpu-worker-0", "gpu-worker-cpu", "cpu-worker", "flower"}
    seen = set()
    for name, svc in ours.items():
        argv = command(svc)
        assert argv[0] == "stencil", f"{name}: {argv}"
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{name}: `{' '.join(argv)}` is not accepted by app.cli's parser")
        sub = " ".join(a for a in argv[1:3] if not a.startswith("-"))
        assert sub in documented or argv[1] in documented, f"{name}: `{sub}` is not in the README's CLI block"
        seen.add(argv[1])
        if argv[1] == "gpu-worker":
            worker_id = args.worker_id
            assert worker_id in svc["environment"]["STENCIL_GPU_WORKERS"].split(",") or name == "gpu-worker-1"
            assert svc["healthcheck"]["test"][-1] == worker_id, f"{name} checks another worker's health"
        if argv[1] == "stage-worker":  # the stage pool beside a GPU worker: same id, its own health name
            assert svc["healthcheck"]["test"][-1] == f"stage{args.worker_id}", f"{name} checks another pool"
        if argv[1] == "api":  # all interfaces inside the network; the host side binds STENCIL_BIND_ADDRESS
            assert args.host == "0.0.0.0" and args.port == 8080
        if argv[1] == "flower":
            assert args.basic_auth and ":" in args.basic_auth, "Flower must run with --basic-auth"
            assert args.port == 5555
    assert seen >= {"dispatcher", "gpu-worker", "cpu-worker", "stage-worker", "flower", "api", "webhook-sender"}


def test_healthcheck_commands_parse(services: dict[str, dict[str, Any]]) -> None:
    parser = healthcheck.build_parser()
    for name, svc in stencil_services(services).items():
        test = svc.get("healthcheck", {}).get("test")
        if not test:
            continue
        assert test[:4] == ["CMD", "python", "-m", "ops.deploy.healthcheck"], f"{name}: {test}"
        parser.parse_args(test[4:])


def test_deployment_wiring(services: dict[str, dict[str, Any]]) -> None:
    redis_cmd = " ".join(command(services["redis"]))
    assert "--requirepass change-me-redis" in redis_cmd and "--appendonly yes" in redis_cmd
    assert any(v.endswith(":/data") or v.endswith(":/data:rw") for v in services["redis"]["volumes"])
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] == "change-me-minio-root"
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"

    for name, svc in stencil_services(services).items():
        env = svc["environment"]
        assert env["STENCIL_REDIS_URL"] == "redis://:change-me-redis@redis:6379/0", name
        assert env["STENCIL_STORE_BACKEND"] == "s3" and env["STENCIL_S3_ENDPOINT_URL"] == "http://minio:9000"
        assert env["STENCIL_S3_BUCKET"] and env["STENCIL_S3_ACCESS_KEY"] and env["STENCIL_S3_SECRET_KEY"]
        assert "STENCIL_MODEL_DIR" in env and "STENCIL_GPU_WORKERS" in env
        if name in ("model-save",):
            continue
        assert svc["restart"] == "unless-stopped", name
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
    for name in ("gpu-worker-0", "gpu-worker-1", "gpu-worker-cpu", "cpu-worker", "stage-worker-0", "stage-worker-1",
                 "stage-worker-cpu"):
        cond = services[name]["depends_on"]["minio-init"]["condition"]
        assert cond == "service_completed_successfully", name

    gpu = services["gpu-worker-0"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert gpu["profiles"] == ["gpu"] and gpu["environment"]["STENCIL_DEVICE"] == "cuda"
    cpu_variant = services["gpu-worker-cpu"]
    assert "deploy" not in cpu_variant and cpu_variant["profiles"] == ["cpu"]
    assert cpu_variant["environment"]["STENCIL_DEVICE"] == "cpu"
    assert command(cpu_variant) == command(gpu)
    # Stage placement: by default every GPU host's stage pool runs prepare/finalize, on the GPU in
    # profile gpu (on the same device as its engine), on the CPU in profile cpu.
    assert {svc["environment"]["STENCIL_STAGE_PLACEMENT"] for svc in stencil_services(services).values()} == \
        {"gpu_host"}
    for engine, pool in (("gpu-worker-0", "stage-worker-0"), ("gpu-worker-1", "stage-worker-1"),
                         ("gpu-worker-cpu", "stage-worker-cpu")):
        e, p = services[engine], services[pool]
        assert p["profiles"] == e["profiles"] and command(p)[-1] == command(e)[-1], pool
        assert p["environment"]["STENCIL_STAGE_DEVICE"] == e["environment"]["STENCIL_DEVICE"], pool
        assert p.get("deploy") == e.get("deploy"), pool
    # Clients reach the gateway, published on the bind address; Redis is not published at all.
    assert "ports" not in services["redis"]
    published = {name: [port_binding(p) for p in svc["ports"]] for name, svc in services.items() if svc.get("ports")}
    assert all(host == "127.0.0.1" for ports in published.values() for host, _, _ in ports), published
    assert published["api"] == [("127.0.0.1", "8080", 8080)]
    assert services["api"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    # Scalable: no fixed container name or host port on the CPU workers.
    assert "container_name" not in services["cpu-worker"] and "ports" not in services["cpu-worker"]
    assert all("container_name" not in s for s in services.values())


def test_image_contains_what_the_services_run() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for part in ("app", "workers", "ops"):
        assert re.search(rf"^COPY {part} \./{part}$", dockerfile, flags=re.M), part
    assert re.search(r"^RUN pip install \.", dockerfile, flags=re.M)
    assert "torch==${TORCH_VERSION}" in dockerfile
    pinned = re.search(r'"torch==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and f"ARG TORCH_VERSION={pinned.group(1)}" in dockerfile, "torch pin differs from pyproject"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


# -- the healthchecks, run against real processes ----------------------------------------------

def run_health(stack, *args: str) -> int:  # type: ignore[no-untyped-def]
    proc = subprocess.run([sys.executable, "-m", "ops.deploy.healthcheck", *args], env=stack.env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    log.info("healthcheck %s -> %d %s", args, proc.returncode, proc.stderr[-500:])
    return proc.returncode


@pytest.mark.integration
def test_healthchecks_against_the_embedded_stack(stack) -> None:  # type: ignore[no-untyped-def]
    from app.embedded import free_port

    assert run_health(stack, "dispatcher") == 0
    assert run_health(stack, "gpu-worker", "--worker-id", "0") == 0
    assert run_health(stack, "gpu-worker", "--worker-id", "9") == 1  # no such engine
    assert run_health(stack, "celery", "--name", "cpu") == 0
    assert run_health(stack, "celery", "--name", "nobody") == 1
    assert run_health(stack, "http", f"http://127.0.0.1:{free_port()}/healthcheck") == 1
    assert socket.gethostname()  # the GPU check compares the engine's holder with this host name
