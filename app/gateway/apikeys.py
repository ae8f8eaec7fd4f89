"""API keys: bound to a tenant and scopes, stored hashed, checked on every request.

A key is ``stk_<key id>_<secret>``: 12 hex digits that name its record and 256 random bits
(``secrets.token_urlsafe(32)``). Redis keeps only the SHA-256 of the whole key. A fast hash is the
right one here: the secret is a uniformly random 256-bit value, so there is nothing a slow KDF
(scrypt, argon2) would protect against (those stretch low-entropy passwords), while it would add tens
of milliseconds to every request. Digests are compared in constant time (``hmac.compare_digest``).

The record is read on every request, never cached: revocation takes effect on the next request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from app.gateway.tenants import check_tenant
from app.validation import InvalidParameter

KEY_PREFIX = "stencil:apikey:"
KEYS_INDEX = "stencil:apikeys"
SCOPES = ("submit", "read", "admin")
_TOKEN = re.compile(r"stk_([0-9a-f]{12})_[A-Za-z0-9_-]{43}")


@dataclass(frozen=True)
class Principal:
    """Who a request acts for."""

    key_id: str
    tenant: str
    scopes: frozenset[str]


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def key_id_of(token: str) -> str | None:
    """The key id of a well-formed token, else None (nothing is looked up for a malformed one)."""
    m = _TOKEN.fullmatch(token or "")
    return m.group(1) if m else None


def _text(fields: Mapping[Any, Any], name: str) -> str:
    value = fields.get(name, fields.get(name.encode(), b""))
    return value.decode() if isinstance(value, bytes) else str(value)


def principal_from(token: str, fields: Mapping[Any, Any]) -> Principal | None:
    """The principal of ``token`` given its key's stored record, or None (unknown, revoked, wrong)."""
    if not fields or _text(fields, "revoked_at"):
        return None
    if not hmac.compare_digest(_text(fields, "sha256"), digest(token)):
        return None
    return Principal(key_id=key_id_of(token) or "", tenant=_text(fields, "tenant"),
                     scopes=frozenset(s for s in _text(fields, "scopes").split(",") if s))


def check_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(s.strip() for s in scopes if s.strip()))
    unknown = [s for s in out if s not in SCOPES]
    if unknown or not out:
        raise InvalidParameter("scopes", f"must be some of {', '.join(SCOPES)} (got {','.join(out) or 'none'})")
    return out


class ApiKeys:
    """Create, list, revoke and verify keys (operators' commands and the gateway)."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def create(self, tenant: str, scopes: Iterable[str], name: str = "") -> tuple[str, dict[str, Any]]:
        """A new key: ``(token, description)``. The token is shown once; only its digest is kept."""
        tenant = check_tenant(tenant)
        scopes = check_scopes(scopes)
        key_id = secrets.token_hex(6)
        token = f"stk_{key_id}_{secrets.token_urlsafe(32)}"
        info = {"key_id": key_id, "tenant": tenant, "scopes": ",".join(scopes), "name": name[:200],
                "created": repr(time.time()), "sha256": digest(token)}
        pipe = self.r.pipeline()
        pipe.hset(KEY_PREFIX + key_id, mapping=info)
        pipe.sadd(KEYS_INDEX, key_id)
        pipe.execute()
        return token, self._describe(info)

    def list(self, tenant: str | None = None) -> list[dict[str, Any]]:
        ids = sorted(k.decode() for k in self.r.smembers(KEYS_INDEX))
        pipe = self.r.pipeline(transaction=False)
        for key_id in ids:
            pipe.hgetall(KEY_PREFIX + key_id)
        out = []
        for raw in pipe.execute():
            info = {k.decode(): v.decode() for k, v in raw.items()}
            if info and (tenant is None or info.get("tenant") == tenant):
                out.append(self._describe(info))
        return sorted(out, key=lambda d: (d["tenant"], d["created"]))

    def revoke(self, key_id: str) -> bool:
        """Revoke a key (its record stays, marked, for the listing); False if there is no such key."""
        key = KEY_PREFIX + key_id
        if not self.r.exists(key):
            return False
        self.r.hsetnx(key, "revoked_at", repr(time.time()))
        return True

    def verify(self, token: str) -> Principal | None:
        key_id = key_id_of(token)
        return principal_from(token, self.r.hgetall(KEY_PREFIX + key_id)) if key_id else None

    @staticmethod
    def _describe(info: Mapping[str, str]) -> dict[str, Any]:
        """What a listing shows: never the digest."""
        return {"key_id": info["key_id"], "tenant": info["tenant"], "scopes": info["scopes"].split(","),
                "name": info.get("name", ""), "created": float(info["created"]),
                "revoked_at": float(info["revoked_at"]) if info.get("revoked_at") else None}
