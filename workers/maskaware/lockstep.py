"""Several calls of one model in lockstep, so that their token-wise work can be packed together.

A UNet step over jobs of different image sizes cannot be one dense call: convolutions and ResNet
blocks need one shape per call. But every call runs the same modules in the same order, so the
calls can run as coroutines: each on its own thread, exactly one thread computing at a time (a
baton: no oversubscribed cores, deterministic order), and at every transformer block each call
deposits its inputs at a rendezvous; the last one to arrive computes the block for all of them at
once (one packed pass over every call's tokens, attention per job) and hands each call its output.
Spatial work runs per call (per shape), token-wise work runs once for the whole batch.

If a call fails, every other call waiting at (or later reaching) a rendezvous fails too, so a
step never hangs; the runner then retries job by job as for any failed step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


class LockstepAborted(RuntimeError):
    """Another call of the same lockstep group failed."""


class Lockstep:
    """One step's group of calls (``run``) and the rendezvous they meet at (``meet``)."""

    _local = threading.local()

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._baton = threading.Lock()
        self._cv = threading.Condition()
        self._active = 0
        self._round: list[tuple[int, Any]] = []  # (call index, payload) at the current rendezvous
        self._results: dict[int, Any] = {}
        self._generation = 0
        self._error: BaseException | None = None

    @classmethod
    def current(cls) -> "Lockstep | None":
        """The lockstep group of the calling thread (None outside ``run``)."""
        return getattr(cls._local, "group", None)

    @classmethod
    def index(cls) -> int:
        return int(getattr(cls._local, "index", 0))

    def run(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``calls`` in lockstep (each under ``torch.no_grad``); their results in order."""
        self._active = len(calls)
        grad = torch.is_grad_enabled()

        def body(i: int, fn: Callable[[], Any]) -> Any:
            Lockstep._local.group, Lockstep._local.index = self, i
            self._baton.acquire()
            try:
                with torch.set_grad_enabled(grad):
                    return fn()
            except BaseException as exc:
                self._fail(exc)
                raise
            finally:
                Lockstep._local.group = None
                with self._cv:
                    self._active -= 1
                    self._cv.notify_all()
                self._baton.release()

        futures = [self._pool.submit(body, i, fn) for i, fn in enumerate(calls)]
        return [f.result() for f in futures]

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def meet(self, payload: Any, compute: Callable[[list[tuple[int, Any]]], dict[int, Any]]) -> Any:
        """Deposit ``payload``; the last call to arrive runs ``compute`` on everyone's payloads
        (call index, payload) and every call gets its own entry of the result. Called holding the
        baton; gives it up while waiting."""
        me = Lockstep.index()
        with self._cv:
            if self._error is not None:
                raise LockstepAborted("another call of this step failed") from self._error
            self._round.append((me, payload))
            generation = self._generation
            last = len(self._round) == self._active
        if last:
            with self._cv:
                round_, self._round = self._round, []
            try:
                results = compute(sorted(round_, key=lambda item: item[0]))
            except BaseException as exc:
                self._fail(exc)
                raise
            with self._cv:
                self._results = results
                self._generation += 1
                self._cv.notify_all()
            return results[me]
        self._baton.release()
        try:
            with self._cv:
                while self._generation == generation and self._error is None:
                    self._cv.wait()
                if self._generation == generation:
                    raise LockstepAborted("another call of this step failed") from self._error
                out = self._results[me]
        finally:
            self._baton.acquire()
        return out


__all__ = ["Lockstep", "LockstepAborted"]
