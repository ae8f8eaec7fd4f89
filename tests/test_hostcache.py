"""Host-RAM cache tier: single-flight fetches, byte-budgeted LRU, pins that are never evicted."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from app.storage.hostcache import HostCache, nbytes_of, to_device


def blob(n: int, fill: int = 0) -> bytes:
    return bytes([fill]) * n


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll until ``condition`` holds; fail (not hang) if it never does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        time.sleep(0.002)


def test_concurrent_fetches_of_one_key_call_fetch_once() -> None:
    cache: HostCache[bytes] = HostCache(budget_bytes=10_000)
    calls = Counter()
    gate = threading.Event()

    def fetch() -> bytes:
        calls["k"] += 1
        gate.wait(5)  # hold the fetch open until every thread has asked
        return blob(100, 7)

    results: list[bytes] = []
    lock = threading.Lock()

    def worker() -> None:
        value = cache.get_or_fetch("k", fetch)
        with lock:
            results.append(value)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: cache.stats().coalesced == 7)
    gate.set()
    for t in threads:
        t.join(5)
    assert calls["k"] == 1
    assert len(results) == 8 and all(r is results[0] for r in results)
    stats = cache.stats()
    assert (stats.misses, stats.coalesced, stats.hits) == (1, 7, 0)
    assert stats.bytes_fetched == 100 and stats.resident_bytes == 100
    assert cache.get_or_fetch("k", fetch) is results[0]
    assert cache.stats().hits == 1 and calls["k"] == 1


def test_fetch_error_reaches_every_waiter_and_caches_nothing() -> None:
    cache: HostCache[bytes] = HostCache(budget_bytes=10_000)
    gate = threading.Event()
    calls = Counter()

    def failing() -> bytes:
        calls["n"] += 1
        gate.wait(5)
        raise OSError("store down")

    errors: list[BaseException] = []

    def worker() -> None:
        try:
            cache.get_or_fetch("k", failing)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: cache.stats().coalesced == 3)
    gate.set()
    for t in threads:
        t.join(5)
    assert calls["n"] == 1 and len(errors) == 4
    assert "k" not in cache and cache.stats().fetch_errors == 1
    assert cache.get_or_fetch("k", lambda: blob(10)) == blob(10)  # the next request retries


def test_lru_evicts_least_recently_used_within_budget() -> None:
    cache: HostCache[bytes] = HostCache(budget_bytes=100)
    cache.get_or_fetch("a", lambda: blob(40))
    cache.get_or_fetch("b", lambda: blob(40))
    cache.get_or_fetch("a", lambda: pytest.fail("a is resident"))  # a becomes most recent
    cache.get_or_fetch("c", lambda: blob(40))  # 120 > 100: evict the LRU entry, b
    assert "a" in cache and "c" in cache and "b" not in cache
    stats = cache.stats()
    assert stats.evictions == 1 and stats.bytes_evicted == 40
    assert stats.resident_bytes == 80 <= stats.budget_bytes


def test_pinned_entries_are_never_evicted() -> None:
    cache: HostCache[bytes] = HostCache(budget_bytes=100)
    cache.get_or_fetch("pinned", lambda: blob(60), pin=True)
    for i in range(20):
        cache.get_or_fetch(f"x{i}", lambda: blob(30))
        assert "pinned" in cache
        assert cache.stats().resident_bytes <= 100
    cache.unpin("pinned")
    for i in range(5):
        cache.get_or_fetch(f"y{i}", lambda: blob(30))
    assert "pinned" not in cache  # unpinned: an ordinary LRU entry again


def test_all_pinned_admits_over_budget_and_recovers_on_unpin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache: HostCache[bytes] = HostCache(budget_bytes=100)
    with caplog.at_level(logging.WARNING, logger="app.storage.hostcache"):
        for key in ("a", "b", "c"):
            cache.get_or_fetch(key, lambda: blob(40), pin=True)
    stats = cache.stats()
    assert stats.resident_bytes == 120 and stats.pinned_entries == 3
    assert stats.over_budget_admissions == 1
    assert any("over budget" in r.message for r in caplog.records)
    cache.unpin("a")  # now evictable: the budget is enforced immediately
    stats = cache.stats()
    assert "a" not in cache and stats.resident_bytes == 80 and stats.evictions == 1


def test_pinned_context_manager_and_nesting() -> None:
    cache: HostCache[bytes] = HostCache(budget_bytes=50)
    with cache.pinned("k", lambda: blob(40)) as value:
        assert value == blob(40)
        with cache.pinned("k") as again:  # pins nest
            assert again is value
        cache.get_or_fetch("other", lambda: blob(40))  # would need k's space
        assert "k" in cache
    with pytest.raises(RuntimeError):
        with cache.pinned("k2", lambda: blob(40)):
            raise RuntimeError("step failed")
    assert cache.stats().pinned_entries == 0  # unpinned despite the error
    with pytest.raises(KeyError):
        cache.unpin("k2")
    with pytest.raises(KeyError):
        cache.pin("never-fetched")


def test_unpinned_value_larger_than_budget_is_served_but_not_cached() -> None:
    cache: HostCache[bytes] = HostCache(budget_bytes=100)
    cache.get_or_fetch("small", lambda: blob(50))
    assert cache.get_or_fetch("huge", lambda: blob(500)) == blob(500)
    assert "huge" not in cache and "small" in cache


def test_waiters_pins_are_applied_atomically() -> None:
    """A waiter that asked for a pin must find the entry pinned, even under eviction pressure."""
    cache: HostCache[bytes] = HostCache(budget_bytes=10)
    gate = threading.Event()

    def slow() -> bytes:
        gate.wait(5)
        return blob(8)

    leader = threading.Thread(target=lambda: cache.get_or_fetch("k", slow))
    leader.start()
    wait_for(lambda: cache.stats().misses == 1)
    waiter = threading.Thread(target=lambda: cache.get_or_fetch("k", slow, pin=True))
    waiter.start()
    wait_for(lambda: cache.stats().coalesced == 1)
    gate.set()
    leader.join(5)
    waiter.join(5)
    cache.get_or_fetch("evictor", lambda: blob(8))
    assert "k" in cache and cache.stats().pinned_entries == 1
    cache.unpin("k")


def test_stats_and_sizes_of_tensors() -> None:
    t = torch.zeros(4, 8, dtype=torch.float16)
    assert nbytes_of(t) == 64
    assert nbytes_of({"k": t, "v": [t, b"1234"]}) == 132
    cache: HostCache[dict[str, torch.Tensor]] = HostCache(budget_bytes=1000)
    cache.get_or_fetch(("tpl", 3, "down.0.attn1"), lambda: {"k": t, "v": t})
    stats = cache.stats()
    assert stats.bytes_fetched == 128 and stats.resident_bytes == 128 and stats.entries == 1
    with pytest.raises(TypeError):
        nbytes_of(object())


def test_thread_safety_under_random_load() -> None:
    cache: HostCache[bytes] = HostCache(budget_bytes=2_000)
    fetches = Counter()
    lock = threading.Lock()

    def make(key: str) -> bytes:
        with lock:
            fetches[key] += 1
        return blob(100 + 10 * int(key[1:]))

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            key = f"k{rng.randrange(40)}"
            if rng.random() < 0.3:
                with cache.pinned(key, lambda: make(key)) as value:
                    assert len(value) == 100 + 10 * int(key[1:])
            else:
                assert len(cache.get_or_fetch(key, lambda: make(key))) == 100 + 10 * int(key[1:])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stats = cache.stats()
    assert stats.pinned_entries == 0
    assert stats.resident_bytes <= stats.budget_bytes
    assert stats.hits + stats.misses + stats.coalesced == 6 * 400
    assert stats.misses == sum(fetches.values())


def test_to_device_is_identity_on_cpu() -> None:
    t = torch.randn(3, 3)
    assert to_device(t, "cpu") is t
    assert to_device(t, torch.device("cpu")) is t
