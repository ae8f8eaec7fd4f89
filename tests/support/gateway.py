"""The HTTP gateway of a test stack (``EmbeddedStack.start_api``: a real ``stencil api`` process) and
API keys for tests."""

from __future__ import annotations

from pathlib import Path

from app.embedded import EmbeddedStack
from app.gateway.apikeys import ApiKeys
from app.gateway.tenants import Tenants

ROOT = Path(__file__).resolve().parents[2]


class Gateway:
    def __init__(self, stack: EmbeddedStack, **env: str) -> None:
        self.stack = stack
        self.url = stack.start_api(**env)
        self.port = int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        return (self.stack.workdir / "logs" / "api.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if "api" in self.stack.procs:
            self.stack.kill("api", 15)


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
