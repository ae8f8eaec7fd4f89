"""Routing policies: which GPU worker queue a job goes to. One interface, chosen by setting."""

from __future__ import annotations

import itertools
from typing import Protocol

from app.jobs import JobRecord


class Router(Protocol):
    def choose(self, job: JobRecord) -> str:
        """The GPU worker id for ``job``."""
        ...


class RoundRobinRouter:
    def __init__(self, worker_ids: list[str]) -> None:
        if not worker_ids:
            raise ValueError("no GPU workers configured (STENCIL_GPU_WORKERS)")
        self._cycle = itertools.cycle(worker_ids)

    def choose(self, job: JobRecord) -> str:
        return next(self._cycle)


POLICIES = {"round_robin": RoundRobinRouter}


def make_router(policy: str, worker_ids: list[str]) -> Router:
    try:
        return POLICIES[policy](worker_ids)
    except KeyError as exc:
        raise ValueError(f"unknown routing policy {policy!r}; known: {sorted(POLICIES)}") from exc
