"""Per-tenant limits in Redis, atomic under any number of gateway processes.

- ``TokenBucket``: requests per second with a burst (one Lua script: refill by elapsed time on the
  Redis clock, take a token or say how long until one is there: the 429's Retry-After).
- ``JobQuota``: jobs a tenant has not seen end. A tenant's live jobs are a sorted set; a new job is
  admitted by one script only while the set is below the quota, and ended jobs are pruned from it
  first (the workers and the dispatcher know nothing of tenants, so the gateway reads the records).
"""

from __future__ import annotations

import time

import redis
import redis.asyncio

from app.gateway.tenants import TENANT_PREFIX, Limits
from app.jobs import JOB_PREFIX
from app.settings import Settings

# KEYS[1] = the tenant's record, KEYS[2] = its bucket (hash: tokens, ts). ARGV: the settings' rate
# (requests/s), burst and job quota, used where the tenant has none of its own. Returns the tenant's
# limits and {1, "0"} when a token was taken, else {0, seconds until one is there}: one round trip.
_BUCKET_LUA = """
local own = redis.call('HMGET', KEYS[1], 'rate_per_s', 'burst', 'max_jobs')
local rate = tonumber(own[1]) or tonumber(ARGV[1])
local burst = tonumber(own[2]) or tonumber(ARGV[2])
local jobs = tonumber(own[3]) or tonumber(ARGV[3])
if rate <= 0 then return {1, '0', tostring(rate), tostring(burst), tostring(jobs)} end
if burst < 1 then burst = 1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[2], 'tokens', 'ts')
local tokens = tonumber(b[1])
local ts = tonumber(b[2])
if tokens == nil or ts == nil then tokens = burst; ts = now end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[2], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[2], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(wait), tostring(rate), tostring(burst), tostring(jobs)}
"""

# KEYS[1] = the tenant's live jobs. ARGV: quota (<= 0: count only), job id, now, the job-record key
# prefix, the grace for jobs without a record. Drops ended jobs (a terminal record; no record after
# the grace: a submission that died), then admits the job while fewer than the quota are left.
# Returns {admitted (1/0), jobs left}. The records are read by key from their ids, so Redis must not
# be a cluster (as everywhere here: one Redis holds the intake, the records and the broker).
_ADMIT_LUA = """
local rows = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local now = tonumber(ARGV[3])
local left = 0
for i = 1, #rows, 2 do
  local status = redis.call('HGET', ARGV[4] .. rows[i], 'status')
  local ended = status == 'done' or status == 'failed' or status == 'cancelled' or status == 'expired'
  if not status then ended = tonumber(rows[i + 1]) < now - tonumber(ARGV[5]) end
  if ended then redis.call('ZREM', KEYS[1], rows[i]) else left = left + 1 end
end
if tonumber(ARGV[1]) <= 0 or left >= tonumber(ARGV[1]) then return {0, left} end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
return {1, left + 1}
"""

CREATE_GRACE_S = 60.0  # longer than any submission takes between admission and its record


def bucket_key(tenant: str) -> str:
    return f"{TENANT_PREFIX}{tenant}:bucket"


def live_key(tenant: str) -> str:
    return f"{TENANT_PREFIX}{tenant}:live"


class TokenBucket:
    """The per-tenant request rate (async: the gateway checks it before a route runs), with the
    tenant's limits read in the same script."""

    def __init__(self, r: redis.asyncio.Redis, settings: Settings) -> None:
        self._take = r.register_script(_BUCKET_LUA)
        self.defaults = [settings.api_rate_per_s, settings.api_burst, settings.api_max_jobs_per_tenant]

    async def take(self, tenant: str) -> tuple[float, Limits]:
        """(0 when the request may go on, else the seconds until the tenant's next token; its limits)."""
        allowed, wait, rate, burst, jobs = await self._take(keys=[TENANT_PREFIX + tenant, bucket_key(tenant)],
                                                            args=self.defaults)
        limits = Limits(rate_per_s=float(rate), burst=int(float(burst)), max_jobs=int(float(jobs)))
        return (0.0 if int(allowed) else float(wait)), limits


class QuotaExceeded(Exception):
    def __init__(self, tenant: str, quota: int) -> None:
        super().__init__(f"tenant {tenant} has {quota} jobs that have not ended (its quota): "
                         "wait for one to end")
        self.quota = quota


class JobQuota:
    """The per-tenant concurrent-job quota."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._admit = r.register_script(_ADMIT_LUA)

    def _run(self, tenant: str, quota: int, job_id: str = "") -> tuple[bool, int]:
        admitted, left = self._admit(keys=[live_key(tenant)],
                                     args=[quota, job_id, repr(time.time()), JOB_PREFIX, CREATE_GRACE_S])
        return bool(int(admitted)), int(left)

    def prune(self, tenant: str) -> int:
        """Drop ended jobs from the tenant's live set; returns how many are left. A job without a
        record is dropped only after ``CREATE_GRACE_S``: it may be one being submitted right now."""
        return self._run(tenant, 0)[1]

    def admit(self, tenant: str, job_id: str, quota: int) -> None:
        """Count ``job_id`` against the quota, or raise ``QuotaExceeded`` (one script: pruned first)."""
        if quota > 0 and not self._run(tenant, quota, job_id)[0]:
            raise QuotaExceeded(tenant, quota)

    def release(self, tenant: str, job_id: str) -> None:
        """A job that was not created after all gives its place back."""
        self.r.zrem(live_key(tenant), job_id)
