"""What a gateway process holds: the settings, the Python client over Redis (the intake), sync and
async Redis connections, keys, tenants and limits. One per process, made at start-up."""

from __future__ import annotations

import redis
import redis.asyncio

from app.client import StencilClient
from app.gateway.apikeys import KEY_PREFIX, ApiKeys, Principal, key_id_of, principal_from
from app.gateway.limits import JobQuota, TokenBucket
from app.gateway.tenants import Tenants
from app.settings import Settings


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = StencilClient(settings, redis_url=settings.redis_url)
        self.redis: redis.Redis = self.client.redis
        self.aredis = redis.asyncio.Redis.from_url(settings.redis_url)
        self.keys = ApiKeys(self.redis)
        self.tenants = Tenants(self.redis, settings)
        self.quota = JobQuota(self.redis)
        self.bucket = TokenBucket(self.aredis, settings)

    async def authenticate(self, token: str) -> Principal | None:
        """The key's principal, or None: its record is read from Redis on every call."""
        key_id = key_id_of(token)
        return principal_from(token, await self.aredis.hgetall(KEY_PREFIX + key_id)) if key_id else None

    async def key_active(self, key_id: str) -> bool:
        """Whether a key still exists unrevoked (long streams check it as they go)."""
        revoked, exists = await self.aredis.pipeline(transaction=False).hget(
            KEY_PREFIX + key_id, "revoked_at").exists(KEY_PREFIX + key_id).execute()
        return bool(exists) and not revoked

    async def close(self) -> None:
        await self.aredis.aclose()
        self.redis.close()
