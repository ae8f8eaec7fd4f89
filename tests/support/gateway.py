"""The HTTP gateway (``stencil api``) and the webhook sender as real processes beside a stack, and
API keys for tests (shared with the load benchmark)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from app.embedded import EmbeddedStack, free_port
from app.gateway.apikeys import ApiKeys
from app.gateway.tenants import Tenants

ROOT = Path(__file__).resolve().parents[2]


class Process:
    """A ``stencil <command>`` child of the stack's environment, stopped with SIGTERM."""

    def __init__(self, stack: EmbeddedStack, name: str, args: list[str], env: dict[str, str]) -> None:
        self.log_path = stack.workdir / "logs" / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=stack.env(**env), cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Gateway(Process):
    def __init__(self, stack: EmbeddedStack, **env: str) -> None:
        self.port = free_port()
        super().__init__(stack, f"api-{self.port}", ["api", "--port", str(self.port)], env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(self.url + "/healthz", timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start:\n{self.log()}")
            time.sleep(0.1)


def make_key(stack: EmbeddedStack, tenant: str, scopes: str = "submit,read", **limits: float) -> str:
    """A key for ``tenant`` (created as ``stencil api-key create`` does), with the tenant's own limits."""
    r = stack.redis()
    token, _ = ApiKeys(r).create(tenant, scopes.split(","))
    tenants = Tenants(r, stack.settings)
    tenants.ensure(tenant)
    if limits:
        tenants.set_limits(tenant, **limits)  # type: ignore[arg-type]
    return token


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
