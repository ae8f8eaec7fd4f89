"""What a gateway process holds: the settings, the Python client over Redis (the intake), sync and
async Redis connections, keys, tenants and limits. One per process, made at start-up."""

from __future__ import annotations

import redis
import redis.asyncio

from app.client import StencilClient
from app.gateway.apikeys import KEY_PREFIX, ApiKeys, Principal, key_id_of, principal_from
from app.gateway.limits import JobQuota, TokenBucket
from app.gateway.tenants import Limits, Tenants, limits_from
from app.settings import Settings


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = StencilClient(settings, redis_url=settings.redis_url)
        self.redis: redis.Redis = self.client.redis
        self.aredis = redis.asyncio.Redis.from_url(settings.redis_url)
        self.keys = ApiKeys(self.redis)
        self.tenants = Tenants(self.redis, settings)
        self.quota = JobQuota(self.redis, self.client.jobs)
        self.bucket = TokenBucket(self.aredis)

    async def authenticate(self, token: str) -> tuple[Principal, Limits] | None:
        """The key's principal and its tenant's limits, or None: read from Redis on every call."""
        key_id = key_id_of(token)
        if key_id is None:
            return None
        principal = principal_from(token, await self.aredis.hgetall(KEY_PREFIX + key_id))
        if principal is None:
            return None
        return principal, limits_from(await self.aredis.hgetall(Tenants.key(principal.tenant)), self.settings)

    async def key_active(self, key_id: str) -> bool:
        """Whether a key still exists unrevoked (long streams check it as they go)."""
        revoked, exists = await self.aredis.pipeline(transaction=False).hget(
            KEY_PREFIX + key_id, "revoked_at").exists(KEY_PREFIX + key_id).execute()
        return bool(exists) and not revoked

    async def close(self) -> None:
        await self.aredis.aclose()
        self.redis.close()
