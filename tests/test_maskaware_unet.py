"""Mask-aware UNet controller and template activation store.

The exactness tests mirror ``StableDiffusionInpaintPipeline``'s loop (9-channel input, CFG with
adjacent (uncond, cond) rows, per-job scheduler, per-row timesteps) and run it through a small
"engine" that staggers job starts, so one UNet call mixes templates, masks, modes and steps.
With caches recorded from the same inputs, mask-aware compute must equal full compute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor2_0

from app.storage.local import LocalStore
from workers.maskaware import (
    ActivationStore,
    CacheKeyMismatch,
    CacheNotFound,
    MaskAwareUNet,
    RowGroup,
    TemplateCacheKey,
    TokenMasks,
)
from workers.maskaware.tokens import blob_mask, rect_mask
from workers.models.tiny_sd import build_scheduler, build_unet

LATENT = (16, 16)
STEPS = 5
GUIDANCE = 5.0
TEXT_LEN = 6
TOL = 1e-4


def sdxl_style_unet(seed: int = 0) -> UNet2DConditionModel:
    """SDXL layout in miniature: no attention at level 0, 2-layer transformers, linear proj."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16, in_channels=9, out_channels=4, layers_per_block=2,
        block_out_channels=(32, 64, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 2), use_linear_projection=True,
        attention_head_dim=(4, 8, 8), cross_attention_dim=32, norm_num_groups=32,
    ).eval()


def tiny_unet(seed: int = 0) -> UNet2DConditionModel:
    """The embedded default's design on 3 levels: cross-attention at levels 0, 1 + mid at 2."""
    return build_unet(seed, hidden=(32, 64, 64)).eval()


def default_unet(seed: int = 0) -> UNet2DConditionModel:
    """The embedded default as shipped (cross-attention at level 0, mid block at level 1)."""
    return build_unet(seed).eval()


MODELS = {"default": default_unet, "tiny": tiny_unet, "sdxl_style": sdxl_style_unet}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> object:
    """Tiny models run fastest single-threaded, and other jobs may share the 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Template:
    """One template's denoising inputs (what prepare would ship) and its latent-size mask."""

    latents: torch.Tensor  # [1, 4, h, w] initial noise
    mask: torch.Tensor  # [h, w] bool, latent-size
    masked_image: torch.Tensor  # [1, 4, h, w]
    embeds: torch.Tensor  # [rows, T, D]: (uncond, cond) or (cond,)


def make_template(seed: int, mask: torch.Tensor, rows: int = 2) -> Template:
    g = torch.Generator().manual_seed(seed)
    return Template(
        latents=torch.randn(1, 4, *LATENT, generator=g),
        mask=mask.bool(),
        masked_image=torch.randn(1, 4, *LATENT, generator=g) * (~mask.bool()).float(),
        embeds=torch.randn(rows, TEXT_LEN, 32, generator=g),
    )


@dataclass
class Job:
    tpl: Template
    mode: str = "full"
    start: int = 0
    token_mask: TokenMasks | None = None
    caches: list[dict[str, torch.Tensor]] | None = None
    recorded: list[dict[str, torch.Tensor]] = field(default_factory=list)
    latents: torch.Tensor | None = None
    i: int = 0

    @property
    def rows(self) -> int:
        return self.tpl.embeds.shape[0]


def run_jobs(unet: torch.nn.Module, ctrl: MaskAwareUNet | None, jobs: list[Job],
             steps: int = STEPS) -> list[torch.Tensor]:
    """Step every active job once per UNet call; jobs start at their own iteration."""
    scheds = []
    for j in jobs:
        s = build_scheduler()
        s.set_timesteps(steps)
        scheds.append(s)
        j.latents = j.tpl.latents * s.init_noise_sigma
        j.i = 0
    it = 0
    with torch.no_grad():
        while any(j.i < steps for j in jobs):
            active = [(j, s) for j, s in zip(jobs, scheds) if j.start <= it and j.i < steps]
            it += 1
            if not active:
                continue
            xs, ts, es, groups = [], [], [], []
            for j, s in active:
                t = s.timesteps[j.i]
                x = s.scale_model_input(torch.cat([j.latents] * j.rows), t)
                m = j.tpl.mask.float()[None, None].expand(j.rows, 1, *LATENT)
                xs.append(torch.cat([x, m, j.tpl.masked_image.expand(j.rows, -1, -1, -1)], dim=1))
                ts.append(t.repeat(j.rows))
                es.append(j.tpl.embeds)
                cache = j.caches[j.i] if j.mode == "masked" else None
                groups.append(RowGroup(j.rows, j.mode, token_mask=j.token_mask, cache=cache))
            x, t, e = torch.cat(xs), torch.cat(ts), torch.cat(es)
            if ctrl is None:
                eps_all, recorded = unet(x, t, e).sample, [None] * len(active)
            else:
                with ctrl.batch(groups) as ctx:
                    eps_all = unet(x, t, e).sample
                recorded = ctx.recorded
            row = 0
            for (j, s), rec in zip(active, recorded):
                eps = eps_all[row:row + j.rows]
                row += j.rows
                if j.rows == 2:
                    u, c = eps.chunk(2)
                    eps = u + GUIDANCE * (c - u)
                j.latents = s.step(eps, s.timesteps[j.i], j.latents).prev_sample
                if j.mode == "record":
                    assert rec is not None
                    j.recorded.append(rec)
                j.i += 1
    return [j.latents for j in jobs]


def _masks() -> dict[str, torch.Tensor]:
    tiny = torch.zeros(LATENT, dtype=torch.bool)
    tiny[11:13, 4:8] = True  # 8 / 256 ~ 0.03
    return {
        "tiny": tiny,
        "blob": blob_mask(*LATENT, 0.25, seed=7),
        "full": torch.ones(LATENT, dtype=torch.bool),
        "rect": rect_mask(*LATENT, 0.12, seed=2),
        "blob2": blob_mask(*LATENT, 0.4, seed=11),
    }


def _snapshot(caches: list[list[dict[str, torch.Tensor]]]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    return [(t, t.clone(), t._version) for c in caches for step in c for t in step.values()]


@pytest.mark.parametrize(("model", "kv_source", "resnets"), [
    ("default", "cache", "full"), ("tiny", "cache", "full"), ("tiny", "recompute", "full"),
    ("sdxl_style", "cache", "full"), ("sdxl_style", "recompute", "full"),
    ("default", "cache", "masked"), ("sdxl_style", "cache", "masked")])
def test_exactness_mixed_batch(model: str, kv_source: str, resnets: str) -> None:
    ref_unet = MODELS[model](0)
    unet = MODELS[model](0)
    ctrl = MaskAwareUNet(unet, kv_source=kv_source, resnets=resnets)
    m = _masks()
    tpls = {
        "tiny": make_template(1, m["tiny"]),
        "blob": make_template(2, m["blob"]),
        "full": make_template(3, m["full"]),
        "single": make_template(4, m["rect"], rows=1),
        "rec": make_template(5, m["blob2"]),
        "plain": make_template(6, m["blob"]),
    }
    ref = dict(zip(tpls, run_jobs(ref_unet, None, [Job(t) for t in tpls.values()])))

    # 1. Warm-up: record four templates in one staggered batch (record rows == full compute).
    names = ["tiny", "blob", "full", "single"]
    rec_jobs = [Job(tpls[n], "record", start=k) for k, n in enumerate(names)]
    for n, out in zip(names, run_jobs(unet, ctrl, rec_jobs)):
        assert (out - ref[n]).abs().max() <= TOL, n
    caches = {n: j.recorded for n, j in zip(names, rec_jobs)}
    assert all(len(c) == STEPS and set(c[0]) == set(ctrl.tensor_names()) for c in caches.values())
    snap = _snapshot(list(caches.values()))

    # 2. One staggered batch: masked jobs on several templates and masks (incl. ~0.03, a blob,
    # ratio 1, a single-row job, dilation, two jobs sharing a cache), a record job, a full job.
    tm = lambda n, d=0: ctrl.token_masks(tpls[n].mask, LATENT, dilation=d)  # noqa: E731
    jobs = [
        Job(tpls["tiny"], "masked", 0, tm("tiny"), caches["tiny"]),
        Job(tpls["blob"], "masked", 1, tm("blob"), caches["blob"]),
        Job(tpls["full"], "masked", 2, tm("full"), caches["full"]),
        Job(tpls["single"], "masked", 0, tm("single"), caches["single"]),
        Job(tpls["rec"], "record", 1),
        Job(tpls["plain"], "full", 3),
        Job(tpls["blob"], "masked", 0, tm("blob", 1), caches["blob"]),  # same cache, other step
        Job(tpls["tiny"], "masked", 0, tm("tiny", 1), caches["tiny"]),  # same cache, same step
    ]
    assert tm("tiny").ratios()[0] == pytest.approx(0.03, abs=0.005)
    outs = run_jobs(unet, ctrl, jobs)
    for j, out, n in zip(jobs, outs, ["tiny", "blob", "full", "single", "rec", "plain", "blob", "tiny"]):
        err = float((out - ref[n]).abs().max())
        assert err <= TOL, f"{n} ({j.mode}, start {j.start}): max abs diff {err}"

    # Cached tensors were only read.
    for t, before, version in snap:
        assert t._version == version and torch.equal(t, before)

    # The record job inside the mixed batch captured the same activations as a solo warm-up (to
    # the outputs' float32 tolerance: a batch of 8 and a batch of 1 take different GEMM kernels, and
    # on an AMD EPYC host up-block values of magnitude ~1 differ by 1.6e-5; a wrong row or
    # template differs by O(0.1)).
    solo = Job(tpls["rec"], "record")
    run_jobs(unet, ctrl, [solo])
    for step_mixed, step_solo in zip(jobs[4].recorded, solo.recorded):
        for k in step_solo:
            assert (step_mixed[k] - step_solo[k]).abs().max() <= TOL, k


@pytest.mark.parametrize(("kv_source", "resnets"), [("cache", "full"), ("recompute", "full"), ("cache", "masked")])
def test_wrong_cache_changes_output(kv_source: str, resnets: str) -> None:
    """Guard against a vacuous exactness test: another template's cache must show."""
    unet = sdxl_style_unet(0)
    ctrl = MaskAwareUNet(unet, kv_source=kv_source, resnets=resnets)
    m = _masks()
    a, b = make_template(1, m["blob"]), make_template(2, m["blob"])
    rec_a, rec_b = Job(a, "record"), Job(b, "record")
    ref_a = run_jobs(unet, ctrl, [rec_a, rec_b])[0]
    tm = ctrl.token_masks(a.mask, LATENT)
    good = run_jobs(unet, ctrl, [Job(a, "masked", 0, tm, rec_a.recorded)])[0]
    wrong = run_jobs(unet, ctrl, [Job(a, "masked", 0, tm, rec_b.recorded)])[0]
    assert (good - ref_a).abs().max() <= TOL
    assert (wrong - ref_a).abs().max() > 1e-2


def _one_forward(unet: torch.nn.Module, rows: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 9, *LATENT, generator=g)
    t = torch.tensor([981, 501][:rows])
    e = torch.randn(rows, TEXT_LEN, 32, generator=g)
    return x, t, e


@pytest.mark.parametrize("kv_source", ["cache", "recompute"])
def test_ratio_one_equals_full_and_ignores_cache(kv_source: str) -> None:
    unet = sdxl_style_unet(0)
    ctrl = MaskAwareUNet(unet, kv_source=kv_source)
    x, t, e = _one_forward(unet)
    with torch.no_grad():
        full = unet(x, t, e).sample
        with ctrl.batch([RowGroup(2, "record")]) as ctx:
            unet(x, t, e)
        garbage = {k: torch.randn_like(v) for k, v in ctx.recorded[0].items()}
        tm = ctrl.token_masks(torch.ones(LATENT), LATENT)
        with ctrl.batch([RowGroup(2, "masked", token_mask=tm, cache=garbage)]):
            out = unet(x, t, e).sample
    assert torch.equal(out, full)


def test_ratio_zero_computes_nothing_and_does_not_crash() -> None:
    unet = tiny_unet(0)
    ctrl = MaskAwareUNet(unet)
    x, t, e = _one_forward(unet)
    x2, t2, e2 = torch.cat([x, x]), torch.cat([t, t]), torch.cat([e, e])
    calls = []
    hook = unet.down_blocks[0].attentions[0].transformer_blocks[0].ff.register_forward_pre_hook(
        lambda mod, args: calls.append(args[0].shape[0]))
    with torch.no_grad():
        full = unet(x, t, e).sample
        with ctrl.batch([RowGroup(2, "record")]) as ctx:
            unet(x, t, e)
        calls.clear()
        tm = ctrl.token_masks(torch.zeros(128, 128), LATENT)
        assert tm.ratios() == [0.0, 0.0, 0.0]
        with ctrl.batch([RowGroup(2, "masked", token_mask=tm, cache=ctx.recorded[0]),
                         RowGroup(2, "full")]):
            out = unet(x2, t2, e2).sample
    hook.remove()
    assert calls == [2]  # only the full group's rows reached the feed-forward
    assert torch.isfinite(out).all()
    assert (out[2:] - full).abs().max() <= 1e-5
    assert (out[:2] - full).abs().max() <= 1e-5  # exact cache: cached outputs == full outputs


def test_masked_forward_leaves_cache_untouched_and_packs_groups() -> None:
    unet = tiny_unet(0)
    ctrl = MaskAwareUNet(unet)
    x, t, e = _one_forward(unet)
    with torch.no_grad():
        with ctrl.batch([RowGroup(2, "record")]) as ctx:
            ref = unet(x, t, e).sample
        cache = ctx.recorded[0]
        snap = {k: (v.clone(), v._version) for k, v in cache.items()}
        tm1 = ctrl.token_masks(blob_mask(*LATENT, 0.2, seed=1), LATENT)
        tm2 = ctrl.token_masks(rect_mask(*LATENT, 0.1, seed=3), LATENT)
        rows_seen = []
        hook = unet.down_blocks[0].attentions[0].transformer_blocks[0].ff.register_forward_pre_hook(
            lambda mod, args: rows_seen.append(tuple(args[0].shape)))
        groups = [RowGroup(2, "masked", token_mask=tm1, cache=cache),
                  RowGroup(2, "masked", token_mask=tm2, cache=cache)]
        with ctrl.batch(groups):
            out = unet(torch.cat([x, x]), torch.cat([t, t]), torch.cat([e, e])).sample
        hook.remove()
    n = LATENT[0] * LATENT[1]
    assert rows_seen == [(2 * tm1.count(n) + 2 * tm2.count(n), 32)]  # one packed call, both jobs
    assert (out[:2] - ref).abs().max() <= 1e-5 and (out[2:] - ref).abs().max() <= 1e-5
    for k, v in cache.items():
        assert v._version == snap[k][1] and torch.equal(v, snap[k][0]), k


def test_block_names_cache_size_and_passthrough() -> None:
    unet, ref = sdxl_style_unet(0), sdxl_style_unet(0)
    for kv_source, resnets in (("cache", "full"), ("recompute", "full"), ("cache", "masked")):
        ctrl = MaskAwareUNet(unet, kv_source=kv_source, resnets=resnets)
        names = ctrl.block_names
        assert len(names) == len(set(names)) == 2 * 2 * 2 + 2 * 3 * 2 + 2  # down, up, mid (x2 layers)
        assert "down_blocks.1.attentions.0.transformer_blocks.1" in names
        x, t, e = _one_forward(unet)
        with torch.no_grad():
            assert torch.equal(unet(x, t, e).sample, ref(x, t, e).sample)  # no context: untouched
            with ctrl.batch([RowGroup(2, "record")]) as ctx:
                unet(x, t, e)
        assert set(ctx.recorded[0]) == set(ctrl.tensor_names())
        nbytes = sum(v.numel() * v.element_size() for v in ctx.recorded[0].values())
        assert nbytes == ctrl.cache_nbytes(*LATENT, rows=2)
        assert ctrl.cache_nbytes(*LATENT, rows=2, steps=30) == 30 * nbytes
        ctrl.remove()
    assert not any(h.hooks for h in (m._diffusers_hook for m in unet.modules()
                                     if hasattr(m, "_diffusers_hook")))


def test_refuses_bad_layouts_and_caches() -> None:
    unet = tiny_unet(0)
    ctrl = MaskAwareUNet(unet)
    x, t, e = _one_forward(unet)
    tm = ctrl.token_masks(blob_mask(*LATENT, 0.2), LATENT)
    with torch.no_grad():
        with pytest.raises(ValueError, match="masked mode needs"):
            with ctrl.batch([RowGroup(2, "masked", token_mask=tm)]):
                pass
        with pytest.raises(ValueError, match="row groups declare"):
            with ctrl.batch([RowGroup(1, "full")]):
                unet(x, t, e)
        with ctrl.batch([RowGroup(2, "record")]) as ctx:
            unet(x, t, e)
        half = {k: v[:1] for k, v in ctx.recorded[0].items()}  # wrong shape (1 row)
        with pytest.raises(ValueError, match="has shape"):
            with ctrl.batch([RowGroup(2, "masked", token_mask=tm, cache=half)]):
                unet(x, t, e)
        with pytest.raises(KeyError, match="cache lacks"):
            with ctrl.batch([RowGroup(2, "masked", token_mask=tm, cache={})]):
                unet(x, t, e)

    class Custom(AttnProcessor2_0):
        pass

    unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2.set_processor(Custom())
    with pytest.raises(ValueError, match="unsupported attention"):
        with ctrl.batch([RowGroup(2, "full")]):
            pass


# --- activation store ---------------------------------------------------------------------------

KEY = TemplateCacheKey("tiny-sd-inpaint", "tpl-1", 128, 128, "ddim", 5, 1.0, "cfg2")


def _step_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"down_blocks.0.attentions.0.transformer_blocks.0.k": torch.randn(2, 256, 32, generator=g),
            "mid_block.attentions.0.transformer_blocks.0.y": torch.randn(2, 64, 64, generator=g)}


def test_key_digest_is_stable() -> None:
    same = TemplateCacheKey("tiny-sd-inpaint", "tpl-1", 128, 128, "ddim", 5, 1, "cfg2")
    assert KEY.digest() == same.digest() and len(KEY.digest()) == 32
    assert KEY.canonical() == (
        '{"guidance":"cfg2","height":128,"layout":"kv+y","model_id":"tiny-sd-inpaint",'
        '"scheduler":"ddim","steps":5,"strength":"1.0","template_id":"tpl-1","width":128}')
    assert KEY.digest() == "4ce5eb5be4d837aaea20f52498c66683"  # pinned: other processes agree
    for change in ({"steps": 6}, {"strength": 0.8}, {"guidance": "single"}, {"layout": "y"},
                   {"height": 256}, {"scheduler": "euler"}, {"model_id": "x"}):
        assert TemplateCacheKey(**{**KEY.to_dict(), **change}).digest() != KEY.digest()


def test_activation_store_round_trip_and_manifest_last(tmp_path: Path) -> None:
    store = ActivationStore(LocalStore(tmp_path))
    for step in range(KEY.steps):
        store.put_step(KEY, step, _step_tensors(step))
        assert not store.has(KEY) and store.list_templates() == []  # invisible before commit
        with pytest.raises(CacheNotFound):
            store.read_step(KEY, 0)
    manifest = store.commit(KEY)
    assert store.has(KEY) and store.list_templates() == [KEY]
    assert sorted(manifest["steps"], key=int) == [str(s) for s in range(KEY.steps)]
    assert store.steps(KEY) == list(range(KEY.steps))
    assert store.step_object(KEY, 3) == f"activations/{KEY.digest()}/step_0003.safetensors"
    for step in range(KEY.steps):
        got = store.read_step(KEY, step)
        want = _step_tensors(step)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(CacheNotFound):
        store.read_step(TemplateCacheKey(**{**KEY.to_dict(), "steps": 6}), 0)
    assert store.delete(KEY) == KEY.steps + 1
    assert not store.has(KEY) and list(LocalStore(tmp_path).list("activations/")) == []


def test_activation_store_refuses_mismatching_key(tmp_path: Path) -> None:
    objects = LocalStore(tmp_path)
    store = ActivationStore(objects)
    other = TemplateCacheKey(**{**KEY.to_dict(), "template_id": "tpl-2"})
    store.put_step(KEY, 0, _step_tensors(0))
    store.commit(KEY)
    # Objects of KEY copied under other's digest (stale copy / collision): both checks refuse.
    objects.put(store.step_object(other, 0), objects.get(store.step_object(KEY, 0)))
    objects.put(store.manifest_object(other), objects.get(store.manifest_object(KEY)))
    with pytest.raises(CacheKeyMismatch):
        store.read_step(other, 0)
    assert not store.has(other)
    manifest = json.loads(objects.get(store.manifest_object(other)))
    manifest["key"] = other.to_dict()  # manifest fixed up, step object still KEY's
    objects.put(store.manifest_object(other), json.dumps(manifest).encode())
    with pytest.raises(CacheKeyMismatch):
        store.read_step(other, 0)
    with pytest.raises(ValueError):
        store.put_step(KEY, KEY.steps, _step_tensors(0))


def test_recorded_step_round_trips_through_store(tmp_path: Path) -> None:
    """What record mode produces is what masked mode consumes after a store round trip."""
    unet = tiny_unet(0)
    ctrl = MaskAwareUNet(unet)
    tpl = make_template(1, _masks()["blob"])
    rec = Job(tpl, "record")
    ref = run_jobs(unet, ctrl, [rec])[0]
    key = TemplateCacheKey("tiny", "t", 128, 128, "ddim", STEPS, 1.0, "cfg2", ctrl.cache_layout)
    store = ActivationStore(LocalStore(tmp_path))
    for step, tensors in enumerate(rec.recorded):
        store.put_step(key, step, tensors)
    store.commit(key)
    caches = [store.read_step(key, s) for s in range(STEPS)]
    out = run_jobs(unet, ctrl, [Job(tpl, "masked", 0, ctrl.token_masks(tpl.mask, LATENT), caches)])[0]
    assert (out - ref).abs().max() <= TOL
