"""Start-up refusal of placeholder or missing secrets (secure by default).

``.env.example`` ships ``change-me-...`` values so that a copied file works syntactically; a
deployment that never replaced them would run with publicly known passwords. Every long-running
process checks the secrets it uses before it starts and exits with a message that names the
variable, never its value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

PLACEHOLDER_MARKERS = ("change-me", "changeme")


class InsecureConfiguration(SystemExit):
    """A secret is a placeholder or missing; the message names the variable only."""

    def __init__(self, message: str) -> None:
        super().__init__(f"refusing to start: {message}")


def _is_placeholder(value: str) -> bool:
    low = value.lower()
    return any(marker in low for marker in PLACEHOLDER_MARKERS)


def check_secrets(env: Mapping[str, str] | None = None, *, flower: bool = False) -> None:
    """Raise ``InsecureConfiguration`` if a secret this process uses is a placeholder: the Redis
    and broker URLs' passwords, the S3 keys, and (``flower``) ``FLOWER_BASIC_AUTH``."""
    env = os.environ if env is None else env
    for var in ("STENCIL_REDIS_URL", "STENCIL_BROKER_URL"):
        url = env.get(var, "")
        if url and _is_placeholder(urlsplit(url).password or ""):
            raise InsecureConfiguration(f"{var} carries a placeholder password: set a real one (.env)")
    for var in ("STENCIL_S3_ACCESS_KEY", "STENCIL_S3_SECRET_KEY"):
        if _is_placeholder(env.get(var, "")):
            raise InsecureConfiguration(f"{var} is a placeholder: set a real one (.env)")
    if flower:
        auth = env.get("FLOWER_BASIC_AUTH", "")
        if auth and _is_placeholder(auth):
            raise InsecureConfiguration("FLOWER_BASIC_AUTH is a placeholder: set user:password (.env)")


def check_basic_auth(value: str) -> None:
    """``user:password`` pairs (comma-separated, Flower's format), none a placeholder or empty."""
    for pair in value.split(","):
        user, sep, password = pair.partition(":")
        if not sep or not user or not password:
            raise InsecureConfiguration("--basic-auth / FLOWER_BASIC_AUTH must be user:password")
        if _is_placeholder(password):
            raise InsecureConfiguration("--basic-auth / FLOWER_BASIC_AUTH has a placeholder password")
