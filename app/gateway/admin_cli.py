"""Operators' commands (they hold the Redis credentials; tenants never do):

    stencil api-key create --tenant acme --scopes submit,read [--name "web shop"]   # prints the key once
    stencil api-key list [--tenant acme] [--json]
    stencil api-key revoke KEY_ID                                                   # effective at once
    stencil tenant limits acme [--rate 50] [--burst 100] [--max-jobs 64]            # 0 = the settings'
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import redis

from app.gateway.apikeys import SCOPES, ApiKeys
from app.gateway.tenants import Tenants
from app.settings import Settings


def _redis(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url)


def cmd_key_create(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    r = _redis(settings)
    token, info = ApiKeys(r).create(args.tenant, args.scopes.split(","), args.name)
    out: dict[str, Any] = {"key": token, **info}
    secret = Tenants(r, settings).ensure(args.tenant)
    if secret:  # a new tenant: the secret its webhooks are signed with, shown this once
        out["webhook_secret"] = secret
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0


def cmd_key_list(args: argparse.Namespace) -> int:
    rows = ApiKeys(_redis(Settings.from_env())).list(args.tenant or None)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    for row in rows:
        state = "revoked" if row["revoked_at"] else "active"
        sys.stdout.write(f"{row['key_id']}\t{row['tenant']}\t{','.join(row['scopes'])}\t{state}\t{row['name']}\n")
    return 0


def cmd_key_revoke(args: argparse.Namespace) -> int:
    if not ApiKeys(_redis(Settings.from_env())).revoke(args.key_id):
        sys.stderr.write(f"stencil api-key revoke: no key {args.key_id!r}\n")
        return 1
    sys.stdout.write(f"revoked {args.key_id}\n")
    return 0


def cmd_tenant_limits(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    limits = Tenants(_redis(settings), settings).set_limits(args.tenant, rate_per_s=args.rate, burst=args.burst,
                                                            max_jobs=args.max_jobs)
    sys.stdout.write(json.dumps({"tenant": args.tenant, **limits.__dict__}) + "\n")
    return 0


def add_admin_commands(sub: Any) -> None:
    keys = sub.add_parser("api-key", help="API keys of the HTTP gateway").add_subparsers(dest="kcmd", required=True)
    s = keys.add_parser("create", help="a new key for a tenant (printed once; stored hashed)")
    s.add_argument("--tenant", required=True, help="lower-case letters, digits, '-'")
    s.add_argument("--scopes", default="submit,read", help=f"comma-separated: {', '.join(SCOPES)}")
    s.add_argument("--name", default="", help="what the key is for (shown by list)")
    s.set_defaults(func=cmd_key_create)
    s = keys.add_parser("list", help="keys (never their secrets)")
    s.add_argument("--tenant", default="")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_key_list)
    s = keys.add_parser("revoke", help="revoke a key (its next request gets 401)")
    s.add_argument("key_id")
    s.set_defaults(func=cmd_key_revoke)
    tenant = sub.add_parser("tenant", help="tenants of the HTTP gateway").add_subparsers(dest="tcmd", required=True)
    s = tenant.add_parser("limits", help="a tenant's own rate, burst and job quota (0 = the settings')")
    s.add_argument("tenant")
    s.add_argument("--rate", type=float, default=None, help="requests per second")
    s.add_argument("--burst", type=int, default=None, help="requests at once")
    s.add_argument("--max-jobs", type=int, default=None, help="jobs not yet ended")
    s.set_defaults(func=cmd_tenant_limits)
