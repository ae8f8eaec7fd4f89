"""Staging a step's caches (``workers/engine/staging.py``): few kernels per job, since a GPU step's
host issues every one of them. An int8 tensor is its copy to the device and one dequantizing
kernel into its slot, a 16-bit one its copy, and every job's offset is added by one multi-tensor
operation; the staged values equal ``decode_tensor``'s (plus the job's offset), bit for bit."""

from __future__ import annotations

import pytest
import torch

from ops.bench.harness.dispatch import DispatchCounter
from workers.engine import cache_codec
from workers.engine.staging import CacheStager, Offset, pack

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _step(seed: int, shared: bool) -> cache_codec.DecodedStep:
    g = torch.Generator().manual_seed(seed)
    stored = {}
    for b in range(6):
        n, c = (64, 32) if b % 2 else (16, 64)
        for kind in ("k", "v", "y"):
            t = torch.randn(1 if shared else 2, n, c, generator=g)
            stored[f"blk{b}.{kind}"] = cache_codec.encode_tensor(f"blk{b}.{kind}", t, "int8")
    return cache_codec.DecodedStep(stored, torch.bfloat16, None, 2)


def _offsets(step: cache_codec.DecodedStep, seed: int) -> dict[str, torch.Tensor]:
    """A job's offset for every tensor of ``step`` (bfloat16, the decoded shapes)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(2, *cache_codec.decoded_shape(v, 2)[1:], dtype=torch.bfloat16, generator=g)
            for k, v in step.stored.items()}


def _assert_decoded(staged: list, steps: list[cache_codec.DecodedStep], deltas: list) -> None:  # type: ignore[type-arg]
    """Each job's staged tensors equal ``decode_tensor`` of its step plus its offset, bit for bit."""
    for out, st, d in zip(staged, steps, deltas):
        for name, src in st.stored.items():
            want = cache_codec.decode_tensor(src, torch.bfloat16, None, 2)
            if d is not None:
                want = d[name] + want.to(d[name])
            assert torch.equal(out[name], want), name


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("with_delta", [False, True])
def test_staging_int8_caches_costs_a_copy_and_one_kernel_per_tensor_and_equals_decoding(
        shared: bool, with_delta: bool) -> None:
    jobs = 3
    steps = [_step(s, shared) for s in range(jobs)]
    deltas = [_offsets(st, 9 + i) if with_delta else None for i, st in enumerate(steps)]
    counter = DispatchCounter()
    with counter:
        staged, _event = CacheStager("cpu").stage_batch(list(zip(steps, deltas)))
    kv = sum(1 for n in steps[0].stored if cache_codec.is_kv(n))
    other = len(steps[0].stored) - kv
    per_job = 2 * kv + other  # the copy, and dequantizing for int8
    # + one multi-tensor add of every job's offsets (the buffer's allocation launches no kernel)
    assert counter.kernels <= jobs * per_job + with_delta, (counter.kernels, jobs * per_job)
    _assert_decoded(staged, steps, deltas)


def test_jobs_reading_one_template_step_decode_it_once() -> None:
    """Edits of one template at one step (a burst, a catalog): the stored tensors are copied and
    decoded for the first job and broadcast to the others (one kernel per tensor), each job's
    offset added after; the values equal staging each job on its own."""
    step = _step(0, shared=True)
    other = _step(1, shared=True)
    deltas = [None, {k: torch.randn(2, *cache_codec.decoded_shape(v, 2)[1:], dtype=torch.bfloat16,
                                    generator=torch.Generator().manual_seed(3)) for k, v in step.stored.items()},
              None, None]
    items = [(step, deltas[0]), (step, deltas[1]), (step, deltas[2]), (other, deltas[3])]
    counter = DispatchCounter()
    with counter:
        staged, _event = CacheStager("cpu").stage_batch(items)
    kv = sum(1 for n in step.stored if cache_codec.is_kv(n))
    other_names = len(step.stored) - kv
    decoded_twice = 2 * (2 * kv + other_names)  # the template step once, the other step once
    broadcasts = len(step.stored)  # the three jobs of the first step: one broadcast per tensor
    assert counter.kernels <= decoded_twice + broadcasts + 1, counter.kernels  # + offsets (no kernel: the buffer)
    alone = [CacheStager("cpu").stage(cache, delta)[0] for cache, delta in items]
    for got, want in zip(staged, alone):
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_a_packed_step_is_staged_from_one_buffer_and_equals_its_tensors() -> None:
    """The host tier keeps a step read for a GPU in one page-locked buffer (``pack``): staging
    moves it with one copy and decodes from views of it, to the same values as the tensors."""
    step = _step(0, shared=True)
    packed = pack(step.stored, pin=False)
    assert all(torch.equal(packed[n], t) for n, t in step.stored.items())
    assert all(packed[n].untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr() for n in packed)
    stager = CacheStager("meta")  # another device than the buffer's: the step moves as one copy
    counter = DispatchCounter()
    with counter:
        stager.stage_batch([(cache_codec.DecodedStep(packed, torch.bfloat16, None, 2), None)])
    assert counter.ops["aten._to_copy.default"] == 1, counter.ops  # the buffer; nothing tensor by tensor
    on_cpu, _ = CacheStager("cpu").stage_batch([(cache_codec.DecodedStep(packed, torch.bfloat16, None, 2), None)])
    alone, _ = CacheStager("cpu").stage_batch([(step, None)])
    assert all(torch.equal(on_cpu[0][n], alone[0][n]) for n in alone[0])


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("burst", [False, True])
def test_packed_steps_of_several_jobs_decode_each_tensor_once_for_every_job(
        shared: bool, with_delta: bool, burst: bool) -> None:
    """Jobs at different steps, or all at one template step (``burst``; a GPU host's tier keeps
    each step in one buffer, ``pack``): each different buffer goes to the device with one copy,
    then one kernel decodes a tensor for every job (int8: dequantizing), not one per job; the
    values equal decoding each job's step alone."""
    jobs = 4
    steps = [_step(0 if burst else s, shared) for s in range(jobs)]
    packs = [pack(st.stored, pin=False) for st in steps[:1 if burst else jobs]]
    packed = [cache_codec.DecodedStep(packs[0 if burst else i], torch.bfloat16, None, 2) for i in range(jobs)]
    deltas = [_offsets(st, 9 + i) if with_delta and i % 2 else None for i, st in enumerate(steps)]
    counter = DispatchCounter()
    with counter:
        CacheStager("meta").stage_batch(list(zip(packed, deltas)))  # another device: what a GPU host issues
    tensors = len(steps[0].stored)
    sixteen_bit = tensors - sum(1 for n in steps[0].stored if cache_codec.is_kv(n))  # decoded by a copy
    assert counter.ops["aten.copy_.default"] == len(packs) + sixteen_bit, counter.ops  # + one copy per buffer
    assert counter.kernels <= len(packs) + tensors + with_delta, (counter.kernels, len(packs) + tensors)
    staged, _event = CacheStager("cpu").stage_batch(list(zip(packed, deltas)))
    _assert_decoded(staged, steps, deltas)


def test_packed_steps_with_one_step_read_twice_decode_job_by_job() -> None:
    """A step read by two of the jobs (a burst beside other jobs) is decoded once and broadcast;
    the others job by job: the values still equal staging each job alone."""
    steps = [cache_codec.DecodedStep(pack(_step(s, True).stored, pin=False), torch.bfloat16, None, 2) for s in (0, 1)]
    items = [(steps[0], None), (steps[0], None), (steps[1], None)]
    staged, _event = CacheStager("cpu").stage_batch(items)
    for got, (cache, _delta) in zip(staged, items):
        alone = CacheStager("cpu").stage(cache)[0]
        assert all(torch.equal(got[n], alone[n]) for n in alone)


def test_a_step_staged_ahead_with_an_offset_a_refresh_replaced_is_staged_again() -> None:
    """A job's next step staged ahead with its offset, then a refresh made a new one: taking the
    step must add the new offset, not hand over the copy made with the old one (even where the
    new offset object reuses the old one's id, as CPython does for a freed object)."""
    stager = CacheStager("cpu")
    cache = {"b.k": torch.zeros(2, 16, 8)}
    for _ in range(20):  # CPython hands a freed object's memory to the next of its size
        stale = Offset.made_now({"b.k": torch.ones(2, 16, 8)})
        stager.ahead_batch([("job", 1, cache, stale)])
        del stale
        fresh = Offset.made_now({"b.k": torch.full((2, 16, 8), 2.0)})
        staged = stager.take_batch([("job", 1, cache, fresh)])
        assert torch.equal(staged[0]["b.k"], torch.full((2, 16, 8), 2.0))
        stager.reset()


def test_a_step_staged_ahead_with_the_same_offset_is_taken_as_staged() -> None:
    stager = CacheStager("cpu")
    cache = {"b.k": torch.zeros(2, 16, 8)}
    delta = Offset.made_now({"b.k": torch.ones(2, 16, 8)})
    stager.ahead_batch([("job", 1, cache, delta)])
    ahead = stager._ahead[("job", 1)][0]
    assert stager.take_batch([("job", 1, cache, delta)])[0] is ahead
    assert not stager._ahead
