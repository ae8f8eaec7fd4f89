"""The caller's own account: who the key is, its limits and load, and the webhook secret."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from app.gateway.deps import Admin, AnyKey, GatewayDep
from app.gateway.jobs_api import ERRORS

router = APIRouter(prefix="/v1", tags=["account"], responses=ERRORS)


class Me(BaseModel):
    tenant: str
    key_id: str
    scopes: list[str]
    rate_per_s: float
    burst: int
    max_jobs: int
    jobs_in_flight: int


class WebhookSecret(BaseModel):
    webhook_secret: str


@router.get("/me", response_model=Me, summary="The key's tenant, scopes, limits and jobs in flight")
def me(caller: AnyKey, gw: GatewayDep) -> dict[str, Any]:
    return {"tenant": caller.tenant, "key_id": caller.principal.key_id, "scopes": sorted(caller.principal.scopes),
            "rate_per_s": caller.limits.rate_per_s, "burst": caller.limits.burst, "max_jobs": caller.limits.max_jobs,
            "jobs_in_flight": gw.quota.prune(caller.tenant)}


@router.post("/webhook-secret", response_model=WebhookSecret,
             summary="Rotate the secret your webhooks are signed with (returns the new one)")
def rotate_webhook_secret(caller: Admin, gw: GatewayDep) -> dict[str, Any]:
    return {"webhook_secret": gw.tenants.rotate_webhook_secret(caller.tenant)}
