"""Webhooks: a signed POST to a job's ``webhook_url`` when it ends.

Signature (as Stripe signs its events): header ``Stencil-Signature: t=<unix seconds>,v1=<hex>`` where
``v1 = HMAC-SHA256(tenant's webhook secret, "<t>.<raw body>")``. A receiver recomputes it over the
raw body, compares in constant time and refuses timestamps older than a few minutes (replays):
``verify_signature`` does exactly that. ``Stencil-Event-Id`` (``<job id>.<status>``) is the same
on every retry of one event, so receivers can drop duplicates (delivery is at least once).

The gateway registers a job in the watch set at submission (``watch``); the separate sender process
(``app/webhook_sender.py``) notices the job's end and delivers, so no worker ever waits on a
receiver.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from urllib.parse import urlsplit

import redis

from app.validation import InvalidParameter

SIGNATURE_HEADER = "Stencil-Signature"
EVENT_ID_HEADER = "Stencil-Event-Id"
WATCH_KEY = "stencil:webhooks:watch"  # sorted set: job id -> registration time
DUE_KEY = "stencil:webhooks:due"  # sorted set: delivery (JSON) -> when its next attempt is due
INFLIGHT_KEY = "stencil:webhooks:inflight"  # sorted set: delivery -> when its claim lapses
DEAD_KEY = "stencil:webhooks:dead"  # list: deliveries that failed every attempt (newest first, capped)
HEARTBEAT_KEY = "stencil:webhooks:heartbeat"  # a sender's last round (its container's healthcheck)
MAX_URL_CHARS = 2048
DEFAULT_TOLERANCE_S = 300


def signature(secret: str, body: bytes, timestamp: int) -> str:
    """The ``Stencil-Signature`` header value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify_signature(secret: str, header: str, body: bytes, *, tolerance_s: float = DEFAULT_TOLERANCE_S,
                     now: float | None = None) -> bool:
    """Whether ``header`` signs ``body`` with ``secret`` and is at most ``tolerance_s`` old."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        timestamp = int(parts.get("t", ""))
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = signature(secret, body, timestamp).rpartition("v1=")[2]
    return hmac.compare_digest(expected, parts.get("v1", ""))


def private_address(host: str) -> bool:
    """Loopback, private, link-local, multicast, reserved or unspecified (an IP literal)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return not ip.is_global or ip.is_multicast


def check_url(url: str, *, allow_private: bool) -> str:
    """A webhook URL: http(s), a host, no credentials; no private address unless allowed. The
    sender checks again what the host name resolves to when it delivers."""
    if len(url) > MAX_URL_CHARS:
        raise InvalidParameter("webhook_url", f"must be at most {MAX_URL_CHARS} characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidParameter("webhook_url", "must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise InvalidParameter("webhook_url", "must not carry credentials")
    if not allow_private and (parts.hostname == "localhost" or private_address(parts.hostname)):
        raise InvalidParameter("webhook_url", "must not point at a loopback, private or link-local address "
                                              "(STENCIL_WEBHOOK_ALLOW_PRIVATE)")
    return url


def watch(r: redis.Redis, job_id: str) -> None:
    """Deliver this job's webhook when it ends."""
    r.zadd(WATCH_KEY, {job_id: time.time()})
