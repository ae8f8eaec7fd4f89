"""The adapter bank: fetches deduplicated and off the caller's thread, readiness callbacks once,
failures remembered with a reason (and tried again later), never a blocked fetch thread."""

from __future__ import annotations

import threading
import time

import torch

from workers.adapters.bank import AdapterBank
from workers.adapters.lora import LoraModule, LoraWeights


def _weights(lora_id: str) -> LoraWeights:
    return LoraWeights(lora_id, {"unet": {"m": LoraModule(torch.zeros(2, 4), torch.zeros(4, 2), 1.0)}})


def _wait(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_fetches_once_and_calls_back_once_when_all_land() -> None:
    gate = threading.Event()
    reads: list[str] = []

    def read(i: str) -> LoraWeights:
        reads.append(i)
        gate.wait(5)
        return _weights(i)

    bank = AdapterBank(read, 1 << 20, fetch_threads=1)
    calls: list[str] = []
    for k in range(3):  # three routed jobs want the same two adapters
        bank.prefetch(["a", "b"], on_ready=lambda k=k: calls.append(f"job{k}"))
    assert not bank.ready(["a", "b"]) and calls == []
    gate.set()
    _wait(lambda: len(calls) == 3)
    assert sorted(reads) == ["a", "b"] and sorted(calls) == ["job0", "job1", "job2"]
    bank.prefetch(["a"], on_ready=lambda: calls.append("resident"))  # already there: at once
    assert calls[-1] == "resident" and bank.resident() == {"a", "b"}


def test_a_failed_fetch_is_reported_not_waited_for_and_retried_later() -> None:
    attempts: list[str] = []

    def read(i: str) -> LoraWeights:
        attempts.append(i)
        if len(attempts) == 1:
            raise FileNotFoundError(i)
        return _weights(i)

    bank = AdapterBank(read, 1 << 20, retry_after_s=0.2)
    called: list[bool] = []
    bank.prefetch(["x"], on_ready=lambda: called.append(True))
    _wait(lambda: bank.failure(["x"]) is not None)
    assert "could not be loaded (FileNotFoundError)" in (bank.failure(["x"]) or "") and not called
    bank.prefetch(["x"])  # within retry_after_s: not tried again
    time.sleep(0.05)
    assert attempts == ["x"]
    time.sleep(0.2)
    bank.prefetch(["x"])
    _wait(lambda: bank.ready(["x"]))
    assert attempts == ["x", "x"] and bank.failure(["x"]) is None
