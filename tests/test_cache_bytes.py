"""Cache bytes a host can hold: storage codecs, link-speed unit selection, the auto host budget."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from app.settings import Settings
from app.storage.local import LocalStore
from tests.test_plan_engine import TOL, _job, _run, _runner_setup
from workers.engine import cache_codec
from workers.engine.host_budget import FLOOR_BYTES, RESERVE_BYTES, auto_budget, host_cache_budget, read_meminfo
from workers.engine.runner_base import GAP
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware import ActivationStore, TemplateCacheKey

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3


# --- codecs -----------------------------------------------------------------------------------


def _kv(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 64, 24, generator=g)
    x[:, :, 3] *= 50.0  # an outlier channel: per-channel scales keep the others fine
    x[:, :, 5] = 0.0  # an all-zero channel
    return x


def test_int8_round_trip_error_is_bounded_per_channel() -> None:
    x = _kv()
    q = cache_codec.encode_tensor("down_blocks.0.attentions.0.transformer_blocks.0.k", x, "int8")
    assert q.dtype == torch.int8 and tuple(q.shape) == (2, 64 + cache_codec.SCALE_ROWS, 24)
    y = cache_codec.decode_tensor(q)
    assert y.shape == x.shape and y.dtype == torch.float32
    err = (y - x).abs().amax(dim=1)  # [rows, C]
    step = x.abs().amax(dim=1) / 127.0
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-7).all()), (err / step).max()
    assert bool((y[:, :, 5] == 0).all())
    # The outlier channel did not coarsen the others (a per-tensor scale would: 50x the step).
    assert float(err[:, 0].max()) < float(x.abs().max()) / 127 / 10
    assert cache_codec.stored_nbytes(tuple(x.shape), "a.k", "int8") == q.numel() * q.element_size()


@pytest.mark.parametrize("rows", [1, 2])
def test_int8_decodes_where_the_scales_bytes_are_not_4_byte_aligned(rows: int) -> None:
    """Tokens x channels not a multiple of 4: the scales' bytes start at an odd offset, so they are
    read from a copy (viewing them in place cannot work)."""
    x = torch.randn(rows, 3, 5, generator=torch.Generator().manual_seed(0))
    q = cache_codec.quantize(x)
    y = cache_codec.dequantize(q)
    assert y.shape == x.shape
    assert bool(((y - x).abs() <= x.abs().amax(dim=1, keepdim=True) / 127 / 2 * (1 + 1e-5) + 1e-7).all())


def test_16_bit_codecs_and_int8_keeps_block_outputs_in_16_bits() -> None:
    x = _kv(1)
    for codec, dtype, rel in (("float16", torch.float16, 2**-11), ("bfloat16", torch.bfloat16, 2**-8)):
        t = cache_codec.encode_tensor("a.k", x, codec)
        assert t.dtype == dtype
        back = cache_codec.decode_tensor(t)
        assert bool(((back - x).abs() <= x.abs() * rel + 1e-6).all())
    y = cache_codec.encode_tensor("up_blocks.1.attentions.0.transformer_blocks.0.y", x, "int8")
    assert y.dtype == torch.float16
    huge = x * 1e4  # beyond float16's range: bfloat16 instead of inf
    assert cache_codec.encode_tensor("output", huge, "int8").dtype == torch.bfloat16
    assert cache_codec.encode_tensor("a.k", x, "float32") is not None
    with pytest.raises(ValueError):
        cache_codec.check_codec("int4")


def test_float32_storage_is_handed_over_untouched() -> None:
    stored = {"a.k": torch.randn(1, 4, 8)}
    assert cache_codec.decoded(stored) is stored
    view = cache_codec.decoded({"a.k": stored["a.k"].half()})
    assert isinstance(view, cache_codec.DecodedStep) and view["a.k"].dtype == torch.float32


def _key(layout: str = "kv+y/noise-0") -> TemplateCacheKey:
    return TemplateCacheKey("m", "tpl", 64, 64, "ddim", 2, 1.0, "cfg2", layout)


def test_recorder_stores_compressed_host_tier_holds_compressed_model_reads_decoded(tmp_path: Path) -> None:
    acts = ActivationStore(LocalStore(tmp_path))
    rec = CacheRecorder(acts, codec="int8")
    tensors = {"b.k": _kv(2), "b.v": _kv(3), "b.y": _kv(4)}
    key, exact = _key(), _key("kv+y/exact-abc")
    for k in (key, exact):
        for step in range(2):
            rec.put(k, step, tensors).result(timeout=30)
        manifest = rec.commit(k).result(timeout=30)
        assert manifest["codec"] == ("float32" if k is exact else "int8")
    raw = acts.read_step(key, 0)
    assert raw["b.k"].dtype == torch.int8 and raw["b.y"].dtype == torch.float16
    assert all(t.dtype == torch.float32 for t in acts.read_step(exact, 0).values())  # exact: lossless
    provider = StepCacheProvider(acts, 1 << 30)
    try:
        got = provider.wait(key, 0, 30)
        assert got is not None and got["b.k"].dtype == torch.float32 and got["b.k"].shape == tensors["b.k"].shape
        assert float((got["b.k"] - tensors["b.k"]).abs().max()) <= float(tensors["b.k"].abs().max()) / 254 * 1.001
        resident = provider.host.stats().resident_bytes
        f32 = sum(t.numel() * 4 for t in tensors.values())
        assert resident < 0.45 * f32, (resident, f32)  # the host tier holds the compressed bytes
        assert provider.codec_of(key) == "int8" and provider.codec_of(exact) == "float32"
        ex = provider.wait(exact, 0, 30)
        assert ex is not None and all(torch.equal(ex[n], tensors[n]) for n in tensors)
    finally:
        provider.close()


def test_default_codec_comes_from_settings_and_matches_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    default = Settings().cache_dtype
    assert default in cache_codec.CODECS
    # The default is the one the benchmark selected (most compact with SSIM loss <= 0.005).
    doc = (ROOT / "docs/bench/cache_bytes.md").read_text()
    chosen = re.search(r"Selected default codec: `(\w+)`", doc)
    assert chosen is not None and chosen.group(1) == default
    monkeypatch.setenv("STENCIL_CACHE_DTYPE", "bfloat16")
    s = Settings.from_env()
    assert s.cache_dtype == "bfloat16"
    rec = CacheRecorder(ActivationStore(LocalStore(Path("/nonexistent"))), codec=s.cache_dtype)
    assert rec.codec_for(_key()) == "bfloat16" and rec.codec_for(_key("kv+y/exact-1")) == "float32"


# --- link-speed unit selection ----------------------------------------------------------------


def _train_cost_model(runner, unit_rows: dict[str, int], slow: str) -> None:  # type: ignore[no-untyped-def]
    """Unit costs: ``slow`` saves 1 s of compute per step when cached, the others ~nothing."""
    for u, n in unit_rows.items():
        runner.unit_cost.observe(GAP + u, 2, 0.0)
        full = 1.0 if u == slow else 1e-6
        runner.unit_cost.observe(u, n, full)
        runner.unit_cost.observe(u, max(1, round(0.2 * n)), 0.2 * full)


def test_warm_up_at_a_read_speed_stores_fewer_units_and_edits_compute_the_rest(tmp_path: Path) -> None:
    from workers.engine.sd_runner import SDRunner

    steps = 3
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan")
    units = ctrl.units
    rows = {u: 2 * ctrl.unit_tokens(u, (16, 16)) for u in units}
    slow = units[len(units) // 2]
    _train_cost_model(runner, rows, slow)
    runner.read_gbps = 1e-3  # 1 MB/s: reading a unit (~0.1 MB) costs ~0.1 s
    key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout + "/noise-0")
    rec = _run(runner, _job(runner, "record", key, steps))
    manifest = rec["commit"].result(timeout=60)
    assert manifest["units"] == [slow]
    full_key = TemplateCacheKey("t", "tpl2", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout + "/noise-0")
    runner.read_gbps = 0.0  # store everything
    _run(runner, _job(runner, "record", full_key, steps))["commit"].result(timeout=60)
    fewer = sum(store.size(o) for o in store.list(f"activations/{key.digest()}/") if "step_" in o)
    every = sum(store.size(o) for o in store.list(f"activations/{full_key.digest()}/") if "step_" in o)
    assert 0 < fewer < every / 2, (fewer, every)
    assert caches.stored_units(key) == {slow} and caches.stored_units(full_key) is None
    # The edit completes; the units not stored are computed fully, the stored one from the cache.
    ref = _run(SDRunner(unet, cfg), _job(SDRunner(unet, cfg), "full", None, steps))["latents"]
    out = _run(runner, _job(runner, "masked", key, steps))
    assert out["masked_steps"] + out["fallback_steps"] == steps
    assert float((out["latents"] - ref).abs().max()) <= TOL  # record seed == edit seed: exact
    assert runner.last_ctx is not None
    assert all(runner.last_ctx.unit_full.get((0, u)) for u in units if u != slow)


def test_edits_of_a_warm_up_that_stored_no_unit_count_their_steps_as_full(tmp_path: Path) -> None:
    """Where no unit is worth its read (a slow read against units that save nothing), the warm-up
    stores none; its edits compute every step fully and their records say so: no masked step, no
    cached unit, every step a fallback step."""
    steps = 3
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan")
    _train_cost_model(runner, {u: 2 * ctrl.unit_tokens(u, (16, 16)) for u in ctrl.units}, slow="")
    runner.read_gbps = 1e-3
    key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout + "/noise-0")
    manifest = _run(runner, _job(runner, "record", key, steps))["commit"].result(timeout=60)
    assert manifest["units"] == []
    for s in range(steps):
        assert caches.wait(key, s, timeout=30) is not None  # the step is "resident": it holds nothing
    out = _run(runner, _job(runner, "masked", key, steps))
    assert (out["masked_steps"], out["fallback_steps"], out["cached_unit_share"]) == (0, steps, 0.0)


def test_without_unit_costs_or_for_exact_regions_every_unit_is_stored(tmp_path: Path) -> None:
    steps = 2
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan")
    runner.read_gbps = 1e-6
    key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout + "/noise-0")
    manifest = _run(runner, _job(runner, "record", key, steps))["commit"].result(timeout=60)
    assert "units" not in manifest  # no measured unit costs yet
    _train_cost_model(runner, {u: 2 * ctrl.unit_tokens(u, (16, 16)) for u in ctrl.units}, ctrl.units[0])
    exact = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout + "/exact-x")
    manifest = _run(runner, _job(runner, "record", exact, steps))["commit"].result(timeout=60)
    assert "units" not in manifest


# --- host budget --------------------------------------------------------------------------------


def test_host_budget_auto_from_memory() -> None:
    total, avail = 64 * GiB, 48 * GiB
    assert auto_budget(total, avail, 4 * GiB, 0.5) == 28 * GiB
    assert auto_budget(total, avail, 4 * GiB, 0.5, workers_per_host=4) == 4 * GiB
    assert auto_budget(total, 8 * GiB, 2 * GiB, 0.5) == 8 * GiB - RESERVE_BYTES - 2 * GiB  # capped by available
    assert auto_budget(4 * GiB, 2 * GiB, 8 * GiB, 0.5) == FLOOR_BYTES
    assert host_cache_budget(123, 0.5) == 123  # configured wins
    module = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    got = host_cache_budget(0, 0.5, [module], meminfo=(total, avail))
    assert got == 32 * GiB - (1024 * 1024 + 1024) * 4
    machine_total, machine_avail = read_meminfo()
    assert machine_total > 0 and 0 < machine_avail <= machine_total
    assert FLOOR_BYTES <= host_cache_budget(0, 0.5) <= machine_avail
    assert Settings().host_cache_bytes == 0  # auto by default


def test_exact_region_caches_are_stored_in_the_dtype_they_were_recorded_in() -> None:
    """Lossless for the exact path without doubling a half-precision recording's bytes."""
    from workers.engine.cache_codec import encode, lossless_codec

    assert lossless_codec("kv+y@bfloat16/exact-abc") == "bfloat16"
    assert lossless_codec("flux-kv-raw@float16/exact-abc/noise-3") == "float16"
    assert lossless_codec("kv+y/exact-abc") == "float32"
    t = torch.randn(2, 16, 8).to(torch.bfloat16)
    stored = encode({"a.k": t}, lossless_codec("kv+y@bfloat16/exact-abc"))["a.k"]
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, t)
