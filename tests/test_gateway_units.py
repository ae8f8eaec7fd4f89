"""The gateway's parts on a real redis-server: keys stored hashed and revoked at once, the token
bucket's arithmetic, the job quota, tenant namespaces, webhook signatures and URL checks."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis
import redis.asyncio

from app.gateway.apikeys import KEY_PREFIX, ApiKeys, digest, key_id_of
from app.gateway.limits import JobQuota, QuotaExceeded, TokenBucket
from app.gateway.tenants import Tenants, check_tenant, new_owned_id, owns, public, scoped
from app.gateway.views import public_record
from app.jobs import JobParams, JobStatus, JobStore
from app.keys import is_upload
from app.settings import Settings
from app.validation import InvalidParameter
from app.webhook_sender import backoff
from app.webhooks import check_url, signature, verify_signature


def test_keys_are_stored_hashed_bound_to_tenant_and_scopes_and_revoked_at_once(redis_client: redis.Redis) -> None:
    keys = ApiKeys(redis_client)
    token, info = keys.create("acme", ["submit", "read"], name="shop")
    key_id = key_id_of(token)
    assert key_id == info["key_id"] and token.startswith(f"stk_{key_id}_") and len(token) == 4 + 12 + 1 + 43
    stored = {k.decode(): v.decode() for k, v in redis_client.hgetall(KEY_PREFIX + key_id).items()}
    # the secret is what follows the prefix: it may itself hold "_" (base64url), so no split on it
    secret = token.removeprefix(f"stk_{key_id}_")
    assert stored["sha256"] == digest(token) and token not in str(stored) and secret not in str(stored)
    principal = keys.verify(token)
    assert principal is not None and principal.tenant == "acme" and principal.scopes == {"submit", "read"}
    tampered = token[:-1] + ("A" if token[-1] != "A" else "B")
    assert keys.verify(tampered) is None
    assert keys.verify("stk_" + key_id + "_short") is None and keys.verify("") is None
    assert [k["key_id"] for k in keys.list("acme")] == [key_id] and "sha256" not in keys.list()[0]
    assert keys.revoke(key_id) and keys.verify(token) is None
    assert keys.list()[0]["revoked_at"] is not None and not keys.revoke("000000000000")
    with pytest.raises(InvalidParameter, match="scopes"):
        keys.create("acme", ["submit", "root"])
    with pytest.raises(InvalidParameter, match="tenant"):
        keys.create("Acme.Inc", ["read"])


def test_token_bucket_allows_the_burst_then_the_rate(redis_server) -> None:  # type: ignore[no-untyped-def]
    async def run() -> tuple[list[float], float, list[float], list[object]]:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        await r.flushdb()
        bucket = TokenBucket(r, Settings(api_rate_per_s=10.0, api_burst=5, api_max_jobs_per_tenant=3))
        first = [(await bucket.take("t"))[0] for _ in range(7)]
        await asyncio.sleep(0.35)  # 3.5 tokens back
        later = [(await bucket.take("t"))[0] for _ in range(4)]
        other, limits = await bucket.take("u")
        await r.hset("stencil:tenant:own", mapping={"rate_per_s": "0.5", "max_jobs": "9"})
        own = [await bucket.take("own") for _ in range(6)]
        await r.aclose()
        return first, other, later, [limits, *own]

    first, other, later, limits = asyncio.run(run())
    assert first[:5] == [0.0] * 5 and 0.05 < first[5] <= 0.1 and first[6] > 0
    assert later[:3] == [0.0] * 3 and later[3] > 0
    assert other == 0.0  # another tenant's bucket
    assert limits[0].__dict__ == {"rate_per_s": 10.0, "burst": 5, "max_jobs": 3}
    own = limits[1:]
    assert own[0][1].__dict__ == {"rate_per_s": 0.5, "burst": 5, "max_jobs": 9}  # a tenant's own limits win
    assert [w == 0.0 for w, _ in own] == [True] * 5 + [False] and 1.9 < own[5][0] <= 2.0


def test_job_quota_counts_live_jobs_and_prunes_ended_ones(redis_client: redis.Redis) -> None:
    jobs = JobStore(redis_client, ttl_seconds=60, intake_stream="test:intake")
    quota = JobQuota(redis_client)
    ids = [new_owned_id("acme") for _ in range(3)]
    for job_id in ids[:2]:
        quota.admit("acme", job_id, 2)
        jobs.create(JobParams(), job_id=job_id)
    with pytest.raises(QuotaExceeded, match="2 jobs"):
        quota.admit("acme", ids[2], 2)
    quota.admit("other", new_owned_id("other"), 2)  # per tenant
    jobs.transition(ids[0], JobStatus.DONE)
    quota.admit("acme", ids[2], 2)  # admitted, its record not written yet: it counts
    assert quota.prune("acme") == 2
    with pytest.raises(QuotaExceeded):
        quota.admit("acme", new_owned_id("acme"), 2)
    quota.release("acme", ids[2])  # a submission that failed gives its place back
    assert quota.prune("acme") == 1
    redis_client.zadd("stencil:tenant:acme:live", {new_owned_id("acme"): time.time() - 120})
    assert quota.prune("acme") == 1  # admitted long ago and never written: gone


def test_tenant_namespaces_and_limits(redis_client: redis.Redis) -> None:
    assert scoped("acme", "shoe") == "acme.shoe" and public("acme", "acme.shoe") == "shoe"
    job = new_owned_id("acme")
    assert owns("acme", job) and not owns("acm", job) and not owns("acme", "acme.shoe")
    assert not owns("acme", "acme.../../x") and not owns("acme", job + "/x")
    for bad in ("", "a.b", "A", "-x", "x" * 33, "a/b"):
        with pytest.raises(InvalidParameter):
            check_tenant(bad)
    assert is_upload("upload-abc") and is_upload("acme.upload-abc") and not is_upload("acme.shoe")
    tenants = Tenants(redis_client, Settings(api_rate_per_s=20, api_burst=40, api_max_jobs_per_tenant=8))
    secret = tenants.ensure("acme")
    assert secret and secret.startswith("whsec_") and tenants.ensure("acme") is None
    assert tenants.webhook_secret("acme") == secret
    assert tenants.limits("acme").__dict__ == {"rate_per_s": 20.0, "burst": 40, "max_jobs": 8}
    tenants.set_limits("acme", rate_per_s=5, max_jobs=2)
    assert tenants.limits("acme").__dict__ == {"rate_per_s": 5.0, "burst": 40, "max_jobs": 2}
    tenants.set_limits("acme", rate_per_s=0)
    assert tenants.limits("acme").rate_per_s == 20.0
    record = public_record("acme", {"tenant": "acme", "template_id": "acme.shoe", "loras": '[["acme.ink",0.8]]',
                                    "controls": '[["acme.edges",0.5,0.0,1.0]]', "idempotency_key": "acme:order-1",
                                    "prepare_worker": "cpu@host"})
    assert record == {"template_id": "shoe", "loras": '[["ink",0.8]]', "controls": '[["edges",0.5,0.0,1.0]]',
                      "idempotency_key": "order-1"}


def test_webhook_signatures_and_urls() -> None:
    body, now = b'{"type":"job.done"}', int(time.time())
    header = signature("whsec_s", body, now)
    assert header.startswith(f"t={now},v1=") and verify_signature("whsec_s", header, body)
    assert not verify_signature("whsec_other", header, body)
    assert not verify_signature("whsec_s", header, body + b"x")
    assert not verify_signature("whsec_s", header, body, now=now + 301)  # a replay, too late
    assert not verify_signature("whsec_s", "t=x,v1=00", body) and not verify_signature("whsec_s", "", body)
    assert check_url("https://hooks.example.com/x", allow_private=False)
    for url in ("http://127.0.0.1/x", "http://localhost:8080/", "http://10.0.0.5/", "http://169.254.169.254/latest",
                "http://[::1]/", "http://192.168.1.1/"):
        with pytest.raises(InvalidParameter, match="private"):
            check_url(url, allow_private=False)
        assert check_url(url, allow_private=True) == url
    for url in ("ftp://x/", "file:///etc/passwd", "https://user:pw@example.com/", "http:///nohost", "x" * 3000):
        with pytest.raises(InvalidParameter, match="webhook_url"):
            check_url(url, allow_private=True)
    rng = random.Random(0)
    waits = [backoff(n, rng) for n in range(1, 15)]
    assert 0.8 <= waits[0] <= 1.2 and 1.6 <= waits[1] <= 2.4 and max(waits) <= 3600 * 1.2
