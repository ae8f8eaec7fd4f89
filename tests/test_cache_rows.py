"""Shared CFG rows in template caches (issue 19): bit-equal rows are stored once, losslessly.

A template warm-up records with prompt "" and negative prompt "", so its two CFG rows are
bit-equal; the recorder stores such tensors with one row (``cache_codec.share_rows``) and reading
expands them back. Rows that differ in any bit are stored in full.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from app.storage.hostcache import nbytes_of
from app.storage.local import LocalStore
from workers.engine import cache_codec
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware import ActivationStore, TemplateCacheKey


def _key(template: str, layout: str = "kv+y", steps: int = 2) -> TemplateCacheKey:
    return TemplateCacheKey("m", template, 64, 64, "ddim", steps, 1.0, "cfg2", layout)


def _alike(seed: int, n: int = 32, c: int = 16) -> torch.Tensor:
    """Two bit-equal rows (as a warm-up with prompt "" / "" records), an outlier channel for int8."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(1, n, c, generator=g)
    row[:, :, 2] *= 40.0
    return row.expand(2, n, c).contiguous()


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --- the codec ----------------------------------------------------------------------------------


def test_rows_compare_bit_for_bit_not_by_value() -> None:
    t = torch.zeros(2, 3, 4)
    assert cache_codec.rows_equal(t)
    t[1, 0, 0] = -0.0  # == 0.0 (torch.equal says equal) but another bit pattern: not shared
    assert torch.equal(t[0], t[1]) and not cache_codec.rows_equal(t)
    nan = torch.full((2, 3), float("nan"))
    assert cache_codec.rows_equal(nan)  # the same NaN bits: shared (torch.equal never says so)
    assert not cache_codec.rows_equal(torch.zeros(1, 3))  # one row: nothing to share
    near = torch.ones(2, 5)
    near[1, 4] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))  # one float32 ulp
    assert not cache_codec.rows_equal(near)
    stored, shared = cache_codec.share_rows({"a.k": _alike(0), "a.v": near.reshape(2, 5, 1)}, 2)
    assert shared == ["a.k"] and stored["a.k"].shape == (1, 32, 16) and stored["a.v"].shape == (2, 5, 1)
    with pytest.raises(ValueError):  # a one-row tensor in a 2-row cache would read as shared
        cache_codec.share_rows({"a.k": torch.zeros(1, 3, 4)}, 2)


def test_int8_shared_rows_round_trip_equals_the_unshared_encoding() -> None:
    x = _alike(1)
    full = cache_codec.encode_tensor("b.k", x, "int8")  # [2, N + 4, C]: scales per row
    stored, shared = cache_codec.share_rows({"b.k": full}, 2)
    assert shared == ["b.k"] and stored["b.k"].shape == (1, 32 + cache_codec.SCALE_ROWS, 16)
    back = cache_codec.decode_tensor(stored["b.k"], rows=2)
    assert back.shape == x.shape and torch.equal(back, cache_codec.decode_tensor(full))
    assert 2 * _tensor_bytes(stored) == _tensor_bytes({"b.k": full})
    assert cache_codec.stored_nbytes(tuple(x.shape), "b.k", "int8", shared=True) == _tensor_bytes(stored)
    # Zero-copy: float32 storage of a float32 model is expanded, not copied.
    f32, _ = cache_codec.share_rows({"b.y": x}, 2)
    view = cache_codec.decoded(f32, torch.float32, rows=2)["b.y"]
    assert view.shape == x.shape and view.data_ptr() == f32["b.y"].data_ptr() and torch.equal(view, x)
    assert cache_codec.decoded(f32, torch.float32) is f32  # no row count: handed over as stored


# --- recorder, store and host tier --------------------------------------------------------------


@pytest.mark.parametrize("codec", ["float32", "int8"])
def test_recorder_stores_bit_equal_rows_once_and_the_provider_reads_them_back(tmp_path: Path, codec: str) -> None:
    acts = ActivationStore(LocalStore(tmp_path))
    differ = _alike(5)
    differ[1, 3, 4] += 1.0  # one value differs: this tensor keeps both rows
    steps = [{"b.k": _alike(2 + s), "b.v": _alike(3 + s), "b.y": _alike(4 + s), "c.k": differ} for s in range(2)]
    keys = {share: _key(f"tpl-{share}") for share in (True, False)}
    for share, key in keys.items():
        rec = CacheRecorder(acts, codec=codec, share_rows=share)
        for s, tensors in enumerate(steps):
            rec.put(key, s, tensors).result(timeout=30)
        manifest = rec.commit(key).result(timeout=30)
        rec.close()
        if share:
            assert manifest["rows"] == 2 and manifest["shared_rows"] == ["b.k", "b.v", "b.y"]
        else:
            assert "rows" not in manifest and "shared_rows" not in manifest
    raw = {share: [acts.read_step(key, s) for s in range(2)] for share, key in keys.items()}
    assert raw[True][0]["b.k"].shape[0] == 1 and raw[True][0]["c.k"].shape[0] == 2  # rows that differ: in full
    for s in range(2):
        for name in ("b.k", "b.v", "b.y"):
            assert 2 * raw[True][s][name].numel() == raw[False][s][name].numel()
        assert torch.equal(raw[True][s]["c.k"], raw[False][s]["c.k"])
    provider = StepCacheProvider(acts, 1 << 30)
    try:
        got = {share: [provider.wait(key, s, 30) for s in range(2)] for share, key in keys.items()}
        for s in range(2):
            a, b = got[True][s], got[False][s]
            assert a is not None and b is not None
            for name in steps[s]:
                assert a[name].shape == steps[s][name].shape and torch.equal(a[name], b[name]), name
                if codec == "float32":
                    assert torch.equal(a[name], steps[s][name])
        # The host tier holds the one stored row.
        held = {share: sum(nbytes_of(provider.host.peek((key.digest(), s))) for s in range(2))
                for share, key in keys.items()}
        assert held[True] < held[False]
        assert held[True] == sum(_tensor_bytes(raw[True][s]) for s in range(2))
        assert provider.rows_of(keys[True]) == 2 and provider.rows_of(keys[False]) == 0
        assert provider.shared_rows_of(keys[True]) == {"b.k", "b.v", "b.y"}
    finally:
        provider.close()


def test_a_recording_that_changes_its_row_count_is_refused(tmp_path: Path) -> None:
    rec = CacheRecorder(ActivationStore(LocalStore(tmp_path)))
    key = _key("tpl")
    rec.put(key, 0, {"b.k": _alike(0)}).result(timeout=30)
    with pytest.raises(ValueError):
        rec.put(key, 1, {"b.k": _alike(0)[:1]})
    rec.close()


# --- the engine: block-wise loads and exact-region caches ---------------------------------------


@pytest.mark.parametrize("layout_suffix", ["/noise-0", "/exact-x"])
def test_edits_from_shared_and_full_caches_are_bit_identical(tmp_path: Path, layout_suffix: str) -> None:
    """Unit-by-unit ranged loads (cache plan ``all``) of a shared-row cache give the same latents
    as from the cache stored in full; recorded from the edit's own inputs both equal full compute."""
    from tests.test_maskaware_unet import LATENT, TOL
    from tests.test_plan_engine import _job, _run, _runner_setup
    from workers.engine.sd_runner import SDRunner

    def alike_job(runner, mode: str, key: TemplateCacheKey | None):  # type: ignore[no-untyped-def]
        job = _job(runner, mode, key, steps)
        st = job.state  # one prompt for both CFG rows, as a warm-up with "" / ""
        st.prompt_embeds = st.prompt_embeds[:1].expand_as(st.prompt_embeds).contiguous()
        st.masked_image_latents = st.masked_image_latents[:1].expand_as(st.masked_image_latents).contiguous()
        assert runner._rows_alike(st)
        return job

    steps = 4
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "all", bandwidth=1e9)
    try:
        keys, latents, stored = {}, {}, {}
        for share in (True, False):
            runner.recorder = CacheRecorder(caches.activations, share_rows=share)
            key = keys[share] = TemplateCacheKey("t", f"tpl-{share}", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0,
                                                 "cfg2", ctrl.cache_layout + layout_suffix)
            _run(runner, alike_job(runner, "record", key))["commit"].result(timeout=60)
            stored[share] = sum(_tensor_bytes(caches.activations.read_step(key, s)) for s in range(steps))
            out = _run(runner, alike_job(runner, "masked", key))
            assert out["masked_steps"] == steps and out["cached_unit_share"] == 1.0
            latents[share] = out["latents"]
        assert 2 * stored[True] == stored[False] == ctrl.cache_nbytes(*LATENT, rows=2, steps=steps)
        assert stored[True] == ctrl.cache_nbytes(*LATENT, rows=2, steps=steps, shared=ctrl.tensor_names())
        assert torch.equal(latents[True], latents[False])
        ref = _run(SDRunner(unet, cfg), alike_job(SDRunner(unet, cfg), "full", None))["latents"]
        assert float((latents[True] - ref).abs().max()) <= TOL
        assert any(entry[0][0] == keys[True].digest() for entry in caches.load_log)  # loaded unit by unit
    finally:
        caches.close(wait=True)


# --- the tiny trained model: a production-like warm-up ------------------------------------------


@pytest.fixture(scope="module")
def sd_family(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from ops.bench.harness.edits import Family

    torch.manual_seed(0)
    return Family("sd", ActivationStore(LocalStore(tmp_path_factory.mktemp("rows"))))


def test_warm_up_stores_half_the_bytes_and_edits_from_it_are_bit_identical(sd_family) -> None:  # type: ignore[no-untyped-def]
    from app.demo import demo_templates
    from app.jobs import JobParams
    from app.maskgen import make_mask
    from ops.bench.harness.edits import OPTIONS, edit, warm

    fam, steps = sd_family, 6
    acts: ActivationStore = fam.runner_ma.caches.activations
    image = demo_templates(128)[1][1].resize((fam.size, fam.size))
    empty = np.zeros((fam.size, fam.size), bool)
    warm_params = JobParams(prompt="", seed=0, steps=steps, guidance=7.5)
    tensors, meta = fam.prepare(image, empty, warm_params)
    assert fam.runner_ma._rows_alike(fam.runner_ma.init_state(tensors, dict(meta)))
    keys = {}
    for share in (True, False):
        fam.runner_ma.recorder = CacheRecorder(acts, share_rows=share)
        keys[share] = warm(fam, f"tpl-{share}", image, empty, warm_params)
    tensor_bytes = {s: sum(_tensor_bytes(acts.read_step(k, i)) for i in range(steps)) for s, k in keys.items()}
    object_bytes = {s: int(acts.manifest(k)["nbytes"]) for s, k in keys.items()}
    assert 2 * tensor_bytes[True] == tensor_bytes[False], tensor_bytes  # every tensor's rows shared
    assert object_bytes[True] < 0.52 * object_bytes[False], object_bytes
    names = fam.ctrl.tensor_names()
    assert acts.manifest(keys[True])["shared_rows"] == sorted(names)
    # The plan's unit byte sizes are the stored ones.
    step0 = acts.read_step(keys[True], 0)
    provider = fam.runner_ma.caches
    for u in fam.ctrl.units:
        unit_bytes = _tensor_bytes({n: step0[n] for n in fam.ctrl.unit_tensor_names(u)})
        assert fam.ctrl.unit_nbytes(u, (16, 16), 2, codec="float32", shared=provider.shared_rows_of(keys[True])) \
            == unit_bytes
    # Edits (refresh steps with the offset correction, and the cache as is) from either cache: bit-identical.
    mask = make_mask(0.2, (fam.size, fam.size), "blob", seed=4)
    params = JobParams(prompt="a cat", seed=11, steps=steps, guidance=7.5)
    assert not fam.runner_ma._rows_alike(fam.runner_ma.init_state(*fam.prepare(image, mask, params)))
    for option in ("fast", "cache-as-is"):
        out = {s: edit(fam, OPTIONS[option], image, mask, params, k) for s, k in keys.items()}
        assert out[True]["masked_steps"] > 0
        assert torch.equal(out[True]["latents"], out[False]["latents"]), option
