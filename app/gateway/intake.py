"""A tenant's submissions into the shared Redis intake (``StencilClient.enqueue``).

In order: an idempotency key already used returns its job (nothing stored again); the job is
counted against the tenant's quota; an uploaded template is stored under the tenant's content id;
then the uploads and the record (with its ``tenant``), the tenant's job index and the webhook
watch. A submission that fails or turns out to be a duplicate gives its quota place back.
"""

from __future__ import annotations

import dataclasses

from app.client_base import content_id
from app.gateway.errors import ApiProblem
from app.gateway.limits import QuotaExceeded
from app.gateway.state import Gateway
from app.gateway.tenants import new_owned_id, scoped
from app.jobs import JobParams
from app.keys import UPLOAD_PREFIX, template_key
from app.validation import text
from app.webhooks import check_url, watch

MAX_IDEMPOTENCY_KEY_CHARS = 200


def idempotency_key(tenant: str, key: str | None) -> str | None:
    """The stored key: the tenant's own namespace (two tenants may use the same key)."""
    if not key:
        return None
    return f"{tenant}:{text('Idempotency-Key', key, MAX_IDEMPOTENCY_KEY_CHARS)}"


def require_template(gw: Gateway, template_id: str, public_id: str) -> None:
    if not gw.client.store.exists(template_key(template_id)):
        raise ApiProblem(404, f"template {public_id!r} not found", parameter="template_id")


def submit(gw: Gateway, tenant: str, max_jobs: int, params: JobParams, blobs: dict[str, bytes], *,
           template_data: bytes | None = None, idempotency: str | None = None,
           webhook_url: str = "") -> tuple[str, bool, dict[str, str] | None]:
    """Create the job; returns ``(job id, created, its record)`` (created False: the idempotency key's
    earlier job, whose record is not read here)."""
    if idempotency:
        existing = gw.client.existing_job(idempotency)
        if existing is not None:
            return existing, False, None
    if webhook_url:
        webhook_url = check_url(webhook_url, allow_private=gw.settings.webhook_allow_private)
    job_id = new_owned_id(tenant)
    try:
        gw.quota.admit(tenant, job_id, max_jobs)
    except QuotaExceeded as exc:
        raise ApiProblem(429, str(exc), code="quota_exceeded", headers={"Retry-After": "1"}) from None
    created = False
    try:
        if template_data is not None:
            stored = gw.client.store_once(scoped(tenant, content_id(template_data, UPLOAD_PREFIX)), template_data)
            params = dataclasses.replace(params, template_id=stored)
        extra = {"tenant": tenant, **({"webhook_url": webhook_url} if webhook_url else {})}
        handle = gw.client.enqueue(params, blobs, idempotency_key=idempotency, job_id=job_id, extra=extra)
        created = handle.created
    finally:
        if not created:
            gw.quota.release(tenant, job_id)
    if not created:
        return handle.id, False, None
    fields = gw.tenants.record_job(tenant, job_id)
    if webhook_url:
        watch(gw.redis, job_id)
    return job_id, True, fields
