"""Tenants: a namespace, limits and a webhook secret.

Everything a tenant creates is named ``<tenant>.<id>``: job ids (``<tenant>.<32 hex>``, hence result
keys ``results/<tenant>.<hex>.png``), template, LoRA and ControlNet ids, catalog ids and idempotency
keys. A request names objects by their public id; the gateway prefixes the caller's tenant, so a
tenant can only ever reach its own keys, and another tenant's object is simply not there (404).
Tenant names are lower-case letters, digits and ``-`` (never ``.``): the first ``.`` of a scoped id
always ends the tenant.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from app.jobs import JOB_PREFIX
from app.settings import Settings
from app.validation import InvalidParameter

TENANT_PREFIX = "stencil:tenant:"
_TENANT = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_OWNED_ID = re.compile(r"([a-z0-9][a-z0-9-]{0,31})\.[0-9a-f]{32}")


def check_tenant(name: str) -> str:
    if not isinstance(name, str) or not _TENANT.fullmatch(name):
        raise InvalidParameter("tenant", "must be 1-32 lower-case letters, digits or '-', starting with a letter "
                                         f"or digit (got {name!r:.40})")
    return name


def scoped(tenant: str, public_id: str) -> str:
    """The stored id of a tenant's object."""
    return f"{tenant}.{public_id}"


def public(tenant: str, stored_id: str) -> str:
    """The id a tenant sees (its own prefix removed)."""
    prefix = f"{tenant}."
    return stored_id[len(prefix):] if stored_id.startswith(prefix) else stored_id


def new_owned_id(tenant: str) -> str:
    """A job or catalog id in the tenant's namespace."""
    return f"{tenant}.{uuid.uuid4().hex}"


def owns(tenant: str, object_id: str) -> bool:
    """Whether a job or catalog id is well formed and in ``tenant``'s namespace."""
    m = _OWNED_ID.fullmatch(object_id or "")
    return m is not None and m.group(1) == tenant


@dataclass(frozen=True)
class Limits:
    rate_per_s: float
    burst: int
    max_jobs: int


def limits_from(fields: Mapping[bytes | str, bytes | str], settings: Settings) -> Limits:
    """A tenant's limits: its own (``stencil tenant limits``) where set, else the settings'."""
    def get(name: str) -> str | None:
        value = fields.get(name) or fields.get(name.encode())  # type: ignore[call-overload]
        return value.decode() if isinstance(value, bytes) else value

    rate, burst, jobs = get("rate_per_s"), get("burst"), get("max_jobs")
    return Limits(rate_per_s=float(rate) if rate else settings.api_rate_per_s,
                  burst=int(burst) if burst else settings.api_burst,
                  max_jobs=int(jobs) if jobs else settings.api_max_jobs_per_tenant)


class Tenants:
    """Tenant records (``stencil:tenant:<name>``) and each tenant's job index."""

    def __init__(self, r: redis.Redis, settings: Settings) -> None:
        self.r = r
        self.settings = settings

    @staticmethod
    def key(tenant: str) -> str:
        return TENANT_PREFIX + tenant

    @staticmethod
    def jobs_key(tenant: str) -> str:
        return f"{TENANT_PREFIX}{tenant}:jobs"

    def ensure(self, tenant: str) -> str | None:
        """Create the tenant's record if it has none; returns its webhook secret when created now."""
        secret = "whsec_" + secrets.token_urlsafe(32)
        if self.r.hsetnx(self.key(check_tenant(tenant)), "webhook_secret", secret):
            self.r.hset(self.key(tenant), "created", repr(time.time()))
            return secret
        return None

    def webhook_secret(self, tenant: str) -> str | None:
        value = self.r.hget(self.key(tenant), "webhook_secret")
        return value.decode() if value is not None else None

    def rotate_webhook_secret(self, tenant: str) -> str:
        secret = "whsec_" + secrets.token_urlsafe(32)
        self.r.hset(self.key(tenant), "webhook_secret", secret)
        return secret

    def set_limits(self, tenant: str, *, rate_per_s: float | None = None, burst: int | None = None,
                   max_jobs: int | None = None) -> Limits:
        """Set a tenant's own limits (None leaves one as it is; 0 returns it to the settings')."""
        key = self.key(check_tenant(tenant))
        for name, value in (("rate_per_s", rate_per_s), ("burst", burst), ("max_jobs", max_jobs)):
            if value is None:
                continue
            if value < 0:
                raise InvalidParameter(name, f"must be >= 0, got {value}")
            if value:
                self.r.hset(key, name, str(value))
            else:
                self.r.hdel(key, name)
        return self.limits(tenant)

    def limits(self, tenant: str) -> Limits:
        return limits_from(self.r.hgetall(self.key(tenant)), self.settings)

    def record_job(self, tenant: str, job_id: str) -> dict[str, str]:
        """Index a job under its tenant (listing; entries older than the job TTL are dropped) and
        return its record, in one round trip."""
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self.jobs_key(tenant), {job_id: now})
        pipe.zremrangebyscore(self.jobs_key(tenant), "-inf", now - self.settings.job_ttl_seconds)
        pipe.hgetall(JOB_PREFIX + job_id)
        raw = pipe.execute()[-1]
        return {k.decode(): v.decode() for k, v in raw.items()}

    def job_ids(self, tenant: str, limit: int, before: float | None = None) -> list[tuple[str, float]]:
        """The tenant's newest job ids (submitted before ``before``), with their submission times."""
        top = f"({before}" if before is not None else "+inf"
        rows = self.r.zrevrangebyscore(self.jobs_key(tenant), top, "-inf", start=0, num=limit, withscores=True)
        return [(k.decode() if isinstance(k, bytes) else k, float(s)) for k, s in rows]
