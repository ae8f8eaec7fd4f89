"""``stencil webhook-sender``: delivers the webhooks of jobs that ended, never inside a worker.

Each round it (1) reads the status of watched jobs (``app/webhooks.py``: the gateway's watch set)
and turns every ended one into a delivery, due now; (2) claims due deliveries (moved to an in-flight
set with a lease, so a sender that dies mid-POST has its claims retried once they lapse, by itself
or another sender) and POSTs them from a small thread pool with the tenant's signature. A 2xx ends a
delivery; anything else is retried with exponential backoff (1 s doubling, at most 1 h, +-20%
jitter) up to ``MAX_ATTEMPTS``, then kept in a dead-letter list. The job record gets
``webhook_status`` (delivered / failed: the reason) and ``webhook_attempts``.

Receivers on loopback, private or link-local addresses are refused unless
``STENCIL_WEBHOOK_ALLOW_PRIVATE`` (the host name is resolved when delivering), and redirects are
never followed: a tenant's URL must not reach the deployment's own services.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import redis
import requests

from app.gateway.tenants import Tenants
from app.gateway.views import decode, job_view
from app.jobs import JOB_PREFIX, TERMINAL
from app.settings import Settings
from app.webhooks import (
    DEAD_KEY,
    DUE_KEY,
    EVENT_ID_HEADER,
    HEARTBEAT_KEY,
    INFLIGHT_KEY,
    SIGNATURE_HEADER,
    WATCH_KEY,
    private_address,
    signature,
)

log = logging.getLogger(__name__)

# Attempts per event (backoff 1 s doubling up to 1 h: about 2 minutes in all), and one POST's timeout.
MAX_ATTEMPTS = 8
POST_TIMEOUT_S = 10.0

BATCH = 500
CLAIM = 32
DEAD_KEEP = 1000
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 3600.0

# KEYS[1] = due, KEYS[2] = in flight. ARGV: now, lease seconds, count. Moves up to count due
# deliveries to in flight (score: when the claim lapses) and returns them.
_CLAIM_LUA = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(due) do
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZADD', KEYS[2], tonumber(ARGV[1]) + tonumber(ARGV[2]), member)
end
return due
"""

# KEYS[1] = in flight, KEYS[2] = due. ARGV: now. Lapsed claims become due again.
_REAP_LUA = """
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, member in ipairs(lapsed) do
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZADD', KEYS[2], ARGV[1], member)
end
return #lapsed
"""


_HSET_EXISTING_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HSET', KEYS[1], unpack(ARGV)) end
return 0
"""


class PermanentFailure(Exception):
    """A delivery that no retry can make succeed (the receiver's address is not allowed)."""


def backoff(attempt: int, rng: random.Random) -> float:
    """Seconds before attempt ``attempt + 1`` (``attempt`` >= 1 attempts made)."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (attempt - 1)) * rng.uniform(0.8, 1.2)


class WebhookSender:
    def __init__(self, settings: Settings, threads: int = 8) -> None:
        self.settings = settings
        self.r = redis.Redis.from_url(settings.redis_url)
        self.tenants = Tenants(self.r, settings)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="webhook")
        self.session = requests.Session()
        self.rng = random.Random()
        self.lease_s = POST_TIMEOUT_S * 3 + 5
        self._claim = self.r.register_script(_CLAIM_LUA)
        self._reap = self.r.register_script(_REAP_LUA)
        self._hset_existing = self.r.register_script(_HSET_EXISTING_LUA)

    def run(self, stop: threading.Event, poll_s: float = 0.2) -> None:
        log.info("webhook sender started (max %d attempts)", MAX_ATTEMPTS)
        while not stop.is_set():
            try:
                self.round()
            except redis.RedisError as exc:
                log.warning("webhook sender: Redis unavailable (%s); retrying", exc)
                stop.wait(1.0)
            stop.wait(poll_s)
        self.pool.shutdown(wait=True)

    def round(self) -> None:
        now = time.time()
        self.r.set(HEARTBEAT_KEY, repr(now), ex=30)
        self.collect_ended()
        self._reap(keys=[INFLIGHT_KEY, DUE_KEY], args=[now])
        for member in self._claim(keys=[DUE_KEY, INFLIGHT_KEY], args=[now, self.lease_s, CLAIM]):
            self.pool.submit(self._deliver_claimed, member)

    def collect_ended(self) -> int:
        """Ended watched jobs become deliveries (same event id and body on every attempt)."""
        ids = [k.decode() for k in self.r.zrange(WATCH_KEY, 0, BATCH - 1)]
        if not ids:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(JOB_PREFIX + job_id)
        terminal = {s.value for s in TERMINAL}
        ended = 0
        for job_id, raw in zip(ids, pipe.execute()):
            fields = decode(raw)
            if fields and fields.get("status") not in terminal:
                continue
            if fields and fields.get("webhook_url") and fields.get("tenant"):
                tenant = fields["tenant"]
                body = json.dumps({"type": f"job.{fields['status']}", "job": job_view(tenant, job_id, fields)},
                                  separators=(",", ":"))
                delivery = {"event_id": f"{job_id}.{fields['status']}", "job_id": job_id, "tenant": tenant,
                            "url": fields["webhook_url"], "body": body, "attempt": 0}
                self.r.zadd(DUE_KEY, {json.dumps(delivery, sort_keys=True): time.time()})
                ended += 1
            self.r.zrem(WATCH_KEY, job_id)
        return ended

    def _deliver_claimed(self, member: bytes) -> None:
        delivery = json.loads(member)
        attempt = delivery["attempt"] + 1
        try:
            failure, permanent = self.post(delivery), False
        except PermanentFailure as exc:
            failure, permanent = str(exc), True
        except Exception as exc:  # never lose a claim to an unexpected error: it is retried
            failure, permanent = f"{type(exc).__name__}: {exc}", False
        pipe = self.r.pipeline()
        pipe.zrem(INFLIGHT_KEY, member)
        if failure is None:
            log.info("webhook %s delivered (attempt %d)", delivery["event_id"], attempt)
            self._note(delivery["job_id"], webhook_status="delivered", webhook_attempts=attempt)
        elif permanent or attempt >= MAX_ATTEMPTS:
            log.warning("webhook %s failed after %d attempts: %s", delivery["event_id"], attempt, failure)
            pipe.lpush(DEAD_KEY, json.dumps({**delivery, "attempt": attempt, "reason": failure}))
            pipe.ltrim(DEAD_KEY, 0, DEAD_KEEP - 1)
            self._note(delivery["job_id"], webhook_status=f"failed: {failure}"[:300], webhook_attempts=attempt)
        else:
            wait = backoff(attempt, self.rng)
            log.info("webhook %s attempt %d failed (%s); next in %.1f s", delivery["event_id"], attempt, failure, wait)
            pipe.zadd(DUE_KEY, {json.dumps({**delivery, "attempt": attempt}, sort_keys=True): time.time() + wait})
            self._note(delivery["job_id"], webhook_status=f"retrying: {failure}"[:300], webhook_attempts=attempt)
        pipe.execute()

    def _note(self, job_id: str, **fields: object) -> None:
        """Delivery state on the job record, unless the record has expired (never recreated)."""
        args = [str(v) for kv in fields.items() for v in kv]
        self._hset_existing(keys=[JOB_PREFIX + job_id], args=args)

    def post(self, delivery: dict[str, Any]) -> str | None:
        """One signed POST; None on a 2xx, else why it failed."""
        self._check_address(delivery["url"])
        secret = self.tenants.webhook_secret(delivery["tenant"])
        if not secret:
            raise PermanentFailure(f"tenant {delivery['tenant']} has no webhook secret")
        body = delivery["body"].encode()
        headers = {"Content-Type": "application/json", "User-Agent": "stencil-webhooks/1",
                   SIGNATURE_HEADER: signature(secret, body, int(time.time())), EVENT_ID_HEADER: delivery["event_id"]}
        try:
            resp = self.session.post(delivery["url"], data=body, headers=headers, allow_redirects=False,
                                     timeout=POST_TIMEOUT_S)
        except requests.RequestException as exc:
            return f"{type(exc).__name__}"
        resp.close()
        return None if 200 <= resp.status_code < 300 else f"HTTP {resp.status_code}"

    def _check_address(self, url: str) -> None:
        if self.settings.webhook_allow_private:
            return
        parts = urlsplit(url)
        try:
            infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        except OSError:
            return  # unresolvable now: the POST fails and is retried
        if any(private_address(str(info[4][0])) for info in infos):
            raise PermanentFailure("webhook_url resolves to a loopback, private or link-local address")


__all__ = ["PermanentFailure", "WebhookSender", "backoff"]
