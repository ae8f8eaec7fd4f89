"""Container healthchecks for docker-compose: ``python -m ops.deploy.healthcheck KIND ...``.

Each check asks the thing that matters rather than whether a process exists: the dispatcher's
heartbeat key (and the webhook sender's), the GPU engine's published state (fresh, and written by
this container), a Celery ping to this container's CPU worker, an HTTP endpoint. Exit 0 = healthy,
1 = not.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
import urllib.request

log = logging.getLogger("stencil.healthcheck")


def _redis():  # type: ignore[no-untyped-def]
    import redis

    from app.settings import Settings

    return redis.Redis.from_url(Settings.from_env().redis_url, socket_timeout=3, socket_connect_timeout=3)


def check_dispatcher(args: argparse.Namespace) -> bool:
    """The dispatcher refreshes this key (30 s TTL) on every loop iteration."""
    from app.dispatcher import HEARTBEAT_KEY

    raw = _redis().get(HEARTBEAT_KEY)
    return raw is not None and time.time() - float(raw) < args.max_age


def check_webhook_sender(args: argparse.Namespace) -> bool:
    """A webhook sender refreshes this key (30 s TTL) every round."""
    from app.webhooks import HEARTBEAT_KEY

    raw = _redis().get(HEARTBEAT_KEY)
    return raw is not None and time.time() - float(raw) < args.max_age


def check_gpu_worker(args: argparse.Namespace) -> bool:
    """The engine publishes its state at least every second, even when idle."""
    state = _redis().hgetall(f"stencil:worker:{args.worker_id}")
    if not state:
        return False
    updated = float(state.get(b"updated", b"0"))
    holder = state.get(b"holder", b"").decode()
    ours = holder.split(":", 1)[0] == socket.gethostname()
    return ours and time.time() - updated < args.max_age


def check_celery(args: argparse.Namespace) -> bool:
    """A broadcast ping answered by this container's worker (``<name>@<hostname>``)."""
    from app.celery_app import make_celery

    destination = f"{args.name}@{socket.gethostname()}"
    replies = make_celery().control.ping(destination=[destination], timeout=args.timeout) or []
    return any(destination in reply for reply in replies)


def check_http(args: argparse.Namespace) -> bool:
    with urllib.request.urlopen(args.url, timeout=args.timeout) as resp:  # noqa: S310 (local URL)
        return 200 <= resp.status < 300


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ops.deploy.healthcheck", description=__doc__)
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("dispatcher")
    s.add_argument("--max-age", type=float, default=30.0)
    s.set_defaults(func=check_dispatcher)
    s = sub.add_parser("webhook-sender")
    s.add_argument("--max-age", type=float, default=30.0)
    s.set_defaults(func=check_webhook_sender)
    s = sub.add_parser("gpu-worker")
    s.add_argument("--worker-id", required=True)
    s.add_argument("--max-age", type=float, default=30.0)
    s.set_defaults(func=check_gpu_worker)
    s = sub.add_parser("celery")
    s.add_argument("--name", required=True, help="the worker name given to `stencil cpu-worker --name`")
    s.add_argument("--timeout", type=float, default=5.0)
    s.set_defaults(func=check_celery)
    s = sub.add_parser("http")
    s.add_argument("url")
    s.add_argument("--timeout", type=float, default=5.0)
    s.set_defaults(func=check_http)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        healthy = bool(args.func(args))
    except Exception as exc:  # any failure to check is "unhealthy", with the reason in the log
        sys.stderr.write(f"unhealthy: {type(exc).__name__}: {exc}\n")
        return 1
    if not healthy:
        sys.stderr.write(f"unhealthy: {args.kind}\n")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
