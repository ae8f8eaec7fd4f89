"""Background prefetch serves fetches in order of expected need, not in request order.

A fake activation store records the order in which steps are read and can hold the single fetch
thread on a gate, so the queue's order is observed exactly (no timing races).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from workers.engine.template_cache import StepCacheProvider
from workers.maskaware.activation_store import TemplateCacheKey


class GatedStore:
    """``read_step`` logs (template, step) and blocks while the gate is closed."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.reads: list[tuple[str, int]] = []
        self.started = threading.Event()
        self._lock = threading.Lock()

    def read_step(self, key: TemplateCacheKey, step: int) -> dict[str, torch.Tensor]:
        with self._lock:
            self.reads.append((key.template_id, step))
        self.started.set()
        assert self.gate.wait(10), "gate never opened"
        return {"x": torch.zeros(4)}


def _key(name: str, steps: int = 30) -> TemplateCacheKey:
    return TemplateCacheKey("m", name, 64, 64, "ddim", steps, 1.0, "cfg2", "kv+y")


def _provider(store: GatedStore, step_s: float = 0.25) -> StepCacheProvider:
    return StepCacheProvider(store, 1 << 30, fetch_threads=1, default_step_s=step_s)  # type: ignore[arg-type]


def _drain(provider: StepCacheProvider, store: GatedStore, n: int) -> list[tuple[str, int]]:
    store.gate.set()
    deadline = time.monotonic() + 10
    while len(store.reads) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    provider.close(wait=True)
    return list(store.reads)


def test_new_jobs_first_steps_beat_a_running_jobs_later_steps() -> None:
    """FIFO would fetch all of A's 19 queued steps before B's first three."""
    store = GatedStore()
    provider = _provider(store)
    a, b = _key("a"), _key("b")
    assert provider.ready(a, 0) is None  # job A runs step 0 (its fetch holds the only thread)
    assert store.started.wait(5)
    provider.prefetch(a, range(1, 20))  # A's later steps requested first ...
    provider.prefetch(b, range(0, 3))  # ... then a newly routed job B
    order = _drain(provider, store, 1 + 19 + 3)
    assert sorted(order) == sorted([("a", s) for s in range(20)] + [("b", s) for s in range(3)])
    pos = {slot: i for i, slot in enumerate(order)}
    assert pos[("b", 0)] < pos[("a", 1)]  # needed now vs one step from now
    assert pos[("b", 2)] < pos[("a", 4)]  # interleaved by expected need time
    assert pos[("b", 2)] < pos[("a", 19)]


def test_running_job_is_rekeyed_as_it_advances() -> None:
    """A job that is further along needs its next steps sooner than another job's later ones."""
    store = GatedStore()
    provider = _provider(store, step_s=1.0)
    a, b, blocker = _key("a"), _key("b"), _key("blocker")
    provider.prefetch(blocker, [0])
    assert store.started.wait(5)
    provider.prefetch(b, range(0, 6))  # B not started: steps needed at now + s
    provider.prefetch(a, range(0, 12))  # A not started either: a little later than B's
    before = [provider._templates[d] for d, _s in provider.queued()]  # noqa: SLF001
    assert before[:2] == ["b", "a"]  # both not started: by request time, then step
    provider.ready(a, 8)  # the runner asks for A's step 8: A's steps 8.. are needed from now on
    q = [(provider._templates[d], s) for d, s in provider.queued()]  # noqa: SLF001
    assert q.index(("a", 8)) < q.index(("b", 1))
    assert q.index(("a", 9)) < q.index(("b", 2))
    # Steps A has already passed sort first (another job of the template may need them now).
    assert q.index(("a", 0)) < q.index(("b", 0))
    order = _drain(provider, store, 1 + 6 + 12)
    assert len(order) == len(set(order)) == 1 + 6 + 12


def test_dedup_and_earlier_request_moves_a_queued_step_forward() -> None:
    store = GatedStore()
    provider = _provider(store)
    late, blocker = _key("late"), _key("blocker")
    provider.prefetch(blocker, [0])
    assert store.started.wait(5)
    provider.prefetch(late, [0, 1, 2], start_in_s=60.0)  # expected to start in a minute
    provider.prefetch(blocker, range(1, 5))
    assert [s for _d, s in provider.queued()][:4] == [1, 2, 3, 4]  # blocker's steps first
    provider.prefetch(late, [2])  # requested again, job may start now: moves forward, not duplicated
    expected = [("blocker", 1), ("blocker", 2), ("late", 2), ("blocker", 3), ("blocker", 4),
                ("late", 0), ("late", 1)]
    assert [(provider._templates[d], s) for d, s in provider.queued()] == expected  # noqa: SLF001
    order = _drain(provider, store, 1 + 3 + 4)
    assert order == [("blocker", 0), *expected]


def test_prefetch_never_blocks_and_close_drops_the_queue() -> None:
    store = GatedStore()
    provider = _provider(store)
    key = _key("k")
    t0 = time.perf_counter()
    provider.prefetch(key, range(30))
    assert provider.ready(key, 0) is None
    assert time.perf_counter() - t0 < 0.5
    assert store.started.wait(5)
    provider.close()
    store.gate.set()
    time.sleep(0.1)
    assert len(store.reads) == 1  # queued fetches dropped on close
    with pytest.raises(ValueError):
        StepCacheProvider(store, 1, fetch_threads=0)  # type: ignore[arg-type]


class GatedUnitStore:
    """Unit-wise reads (``step_header`` + ``read_tensors``); reads of step 1 wait for the gate."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.reads: list[tuple[int, tuple[str, ...]]] = []
        self.step1_started = threading.Event()

    def step_header(self, key: TemplateCacheKey, step: int) -> tuple[str, int]:
        return f"obj{step}", step

    def read_tensors(self, obj: str, header: int, names: list[str]) -> dict[str, torch.Tensor]:
        self.reads.append((header, tuple(names)))
        if header == 1:
            self.step1_started.set()
            assert self.gate.wait(10), "gate never opened"
        return {n: torch.zeros(4) for n in names}


def test_units_queued_on_the_copy_stream_are_not_taken_by_background_prefetch() -> None:
    """The plan's demand load of a step's first unit stays a unit-wise load even if the step's
    background completion starts first (else compute would wait for the whole step's GET)."""
    store = GatedUnitStore()
    provider = StepCacheProvider(store, 1 << 30, fetch_threads=1)  # type: ignore[arg-type]
    provider.set_units({"u0": ["a"], "u1": ["b"], "u2": ["c"]})
    key = _key("k")
    provider.load_units(key, 1, ["u0"], complete=False)  # the copy stream is busy (held at the gate)
    assert store.step1_started.wait(5)
    provider.load_units(key, 0, ["u0"], complete=False)  # queued behind it
    provider.prefetch(key, [0])  # background completion of step 0 runs at once
    deadline = time.monotonic() + 5
    while (0, ("b", "c")) not in store.reads and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (0, ("b", "c")) in store.reads  # the rest of the step, without the claimed unit
    store.gate.set()
    assert provider.drain(10)
    assert provider.wait(key, 0, 10) is not None  # assembled once the demand load landed
    assert sorted(r for r in store.reads if r[0] == 0) == [(0, ("a",)), (0, ("b", "c"))]
    provider.close(wait=True)


def test_known_batch_slots_key_a_waiting_job_at_its_expected_start() -> None:
    """One batch slot, busy with A for 20 more steps: B (routed, waiting) starts after A, so A's
    next steps come first; without slot information B's first steps would jump ahead."""
    for slots, b_first in ((None, True), (1, False)):
        store = GatedStore()
        provider = _provider(store, step_s=1.0)
        provider.batch_slots = slots
        a, b = _key("a", steps=20), _key("b", steps=20)
        provider.ready(a, 0)
        assert store.started.wait(5)
        provider.prefetch(a, range(1, 20))
        provider.prefetch(b, range(0, 3))
        provider.ready(a, 1)  # A advances: estimates and keys are refreshed
        q = [(provider._templates[d], s) for d, s in provider.queued()]  # noqa: SLF001
        assert (q.index(("b", 0)) < q.index(("a", 2))) is b_first
        if slots is not None:
            assert q[-3:] == [("b", 0), ("b", 1), ("b", 2)]
        _drain(provider, store, 1 + 19 + 3)
