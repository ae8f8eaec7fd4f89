"""Mask-aware Flux: exactness against full compute in mixed, staggered batches (the test that
catches indexing bugs), plus the tiny Flux Fill pipeline, token masks and the API's guards.

The harness drives the transformer the way ``FluxFillPipeline.__call__`` does (pipeline helpers
for prompt/latent/mask preparation, one ``FlowMatchEulerDiscreteScheduler`` per job, packed
latents, ``img_ids``/``txt_ids``, ``timestep / 1000``, guidance), but as a tiny continuous-batching
engine: jobs start at different ticks, so rows of one transformer call sit at different timesteps.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from diffusers import FluxFillPipeline
from diffusers.pipelines.flux.pipeline_flux_fill import calculate_shift, retrieve_timesteps
from PIL import Image

from workers.maskaware.flux import MaskAwareFlux, RowGroup, flux_cache_nbytes
from workers.maskaware.flux_tokens import (
    dilate_token_grid,
    mask_ratio,
    pixel_to_token_mask,
    synthetic_token_grid,
    token_grid_to_pixels,
)
from workers.models.tiny_flux import build_flux_fill_pipeline

log = logging.getLogger(__name__)

H = W = 256            # 16 x 16 = 256 packed image tokens
STEPS = 5
TEXT_LEN = 16
TOL = 1e-4


@dataclass
class Job:
    """One edit: inputs as the Fill pipeline prepares them, plus engine bookkeeping."""

    name: str
    seed: int
    prompt: str
    image: Image.Image
    mask: Image.Image
    guidance: float
    start: int
    latents: torch.Tensor = None
    cond: torch.Tensor = None
    prompt_embeds: torch.Tensor = None
    pooled: torch.Tensor = None
    text_ids: torch.Tensor = None
    img_ids: torch.Tensor = None
    token_mask: torch.Tensor = None
    sched: object = None
    timesteps: torch.Tensor = None
    step: int = 0
    caches: list[dict[str, torch.Tensor]] = field(default_factory=list)


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.random((8, 8, 3))
    arr = np.kron(base, np.ones((H // 8, W // 8, 1))) * 0.7 + rng.random((H, W, 3)) * 0.3
    return Image.fromarray((arr * 255).astype("uint8"))


def _mask_from_array(arr: np.ndarray) -> Image.Image:
    return Image.fromarray((arr > 0).astype("uint8") * 255, mode="L")


def _rect_mask(y0: int, y1: int, x0: int, x1: int) -> Image.Image:
    arr = np.zeros((H, W))
    arr[y0:y1, x0:x1] = 1
    return _mask_from_array(arr)


def _blob_mask(cy: float, cx: float, r: float, seed: int) -> Image.Image:
    """Irregular pixel blob: a wobbly-radius disc (crosses token borders at arbitrary pixels)."""
    yy, xx = np.mgrid[0:H, 0:W]
    theta = np.arctan2(yy - cy, xx - cx)
    rng = np.random.default_rng(seed)
    radius = r * (1 + 0.25 * np.cos(3 * theta + rng.random() * 6) + 0.15 * np.cos(5 * theta + rng.random() * 6))
    return _mask_from_array(np.hypot(yy - cy, xx - cx) < radius)


def _prepare(pipe: FluxFillPipeline, job: Job) -> None:
    """Inputs exactly as FluxFillPipeline.__call__ builds them (same helpers, same RNG order)."""
    dev = torch.device("cpu")
    init_image = pipe.image_processor.preprocess(job.image, height=H, width=W).to(dtype=torch.float32)
    pe, pooled, text_ids = pipe.encode_prompt(prompt=job.prompt, prompt_2=None, device=dev,
                                              num_images_per_prompt=1, max_sequence_length=TEXT_LEN)
    sigmas = np.linspace(1.0, 1 / STEPS, STEPS)
    seq = (H // pipe.vae_scale_factor // 2) * (W // pipe.vae_scale_factor // 2)
    cfg = pipe.scheduler.config
    mu = calculate_shift(seq, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    timesteps, n = retrieve_timesteps(pipe.scheduler, STEPS, dev, sigmas=sigmas, mu=mu)
    timesteps, n = pipe.get_timesteps(n, 1.0, dev)
    gen = torch.Generator().manual_seed(job.seed)
    latents, img_ids = pipe.prepare_latents(init_image, timesteps[:1].repeat(1), 1, pipe.latent_channels,
                                            H, W, pe.dtype, dev, gen)
    mask_image = pipe.mask_processor.preprocess(job.mask, height=H, width=W)
    masked_image = (init_image * (1 - mask_image)).to(dtype=pe.dtype)
    mask, masked_latents = pipe.prepare_mask_latents(mask_image, masked_image, 1, pipe.latent_channels, 1,
                                                     H, W, pe.dtype, dev, gen)
    job.latents, job.img_ids = latents, img_ids
    job.cond = torch.cat((masked_latents, mask), dim=-1)
    job.prompt_embeds, job.pooled, job.text_ids = pe, pooled, text_ids
    job.token_mask = pixel_to_token_mask(mask_image)
    job.sched = copy.deepcopy(pipe.scheduler)   # one scheduler instance per job
    job.timesteps = timesteps


def _run_engine(transformer: torch.nn.Module, ctrl: MaskAwareFlux | None, jobs: list[Job],
                modes: dict[str, str], caches: dict[str, list] | None = None) -> tuple[dict[str, torch.Tensor], list]:
    """Continuous batching: each tick, every started unfinished job contributes one row."""
    lat = {j.name: j.latents.clone() for j in jobs}
    scheds = {j.name: copy.deepcopy(j.sched) for j in jobs}
    step = {j.name: 0 for j in jobs}
    recorded: dict[str, list] = {j.name: [] for j in jobs}
    tick_timesteps: list[list[float]] = []
    tick = 0
    while any(step[j.name] < len(j.timesteps) for j in jobs):
        rows = [j for j in jobs if j.start <= tick and step[j.name] < len(j.timesteps)]
        tick += 1
        if not rows:
            continue
        ts = [j.timesteps[step[j.name]] for j in rows]
        tick_timesteps.append([float(t) for t in ts])
        kwargs = dict(
            hidden_states=torch.cat([torch.cat((lat[j.name], j.cond), dim=2) for j in rows]),
            timestep=torch.stack([t.to(torch.float32) for t in ts]) / 1000,
            guidance=torch.tensor([j.guidance for j in rows], dtype=torch.float32),
            pooled_projections=torch.cat([j.pooled for j in rows]),
            encoder_hidden_states=torch.cat([j.prompt_embeds for j in rows]),
            txt_ids=rows[0].text_ids, img_ids=rows[0].img_ids, return_dict=False)
        if ctrl is None:
            out = transformer(**kwargs)[0]
        else:
            groups = []
            for j in rows:
                mode = modes[j.name]
                if mode == "masked":
                    groups.append(RowGroup(1, "masked", token_mask=j.token_mask, cache=caches[j.name][step[j.name]]))
                else:
                    groups.append(RowGroup(1, mode))
            with ctrl.batch(groups) as ctx:
                out = transformer(**kwargs)[0]
            for j, rec in zip(rows, ctx.recorded):
                if rec is not None:
                    recorded[j.name].append(rec)
        for i, (j, t) in enumerate(zip(rows, ts)):
            lat[j.name] = scheds[j.name].step(out[i:i + 1], t, lat[j.name], return_dict=False)[0]
            step[j.name] += 1
    return lat, (recorded, tick_timesteps)


@pytest.fixture(scope="module", autouse=True)
def _inference_one_thread():
    """No autograd, one intra-op thread: with 2 threads on a busy 2-core box every OpenMP region
    waits for a descheduled worker (10-20x slower); the global state is restored afterwards."""
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    yield
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)


@pytest.fixture(scope="module")
def world():
    """Pipeline, jobs, stock references and fresh caches recorded from the same inputs."""
    pipe = build_flux_fill_pipeline(0)
    tr = pipe.transformer
    jobs = [
        Job("small_rect", 11, "a red cat", _image(1), _rect_mask(18, 40, 100, 150), 30.0, start=0),
        Job("blob", 12, "a blue dog", _image(2), _blob_mask(150, 90, 40, 5), 10.0, start=1),
        Job("full_mask", 13, "green sky", _image(3), _rect_mask(0, H, 0, W), 30.0, start=2),
        Job("same_image_other_mask", 14, "yellow hat", _image(1), _blob_mask(60, 190, 28, 9), 5.0, start=0),
        Job("full_compute", 15, "a blue dog", _image(2), _blob_mask(100, 60, 30, 3), 30.0, start=3),
        Job("empty_mask", 16, "nothing", _image(3), _mask_from_array(np.zeros((H, W))), 30.0, start=1),
        Job("blob_no_output_cache", 17, "a blue dog", _image(2), _blob_mask(150, 90, 40, 5), 10.0, start=2),
    ]
    for j in jobs:
        _prepare(pipe, j)
    # stock reference: no hooks at all, and the real pipeline for two of the jobs
    ref, _ = _run_engine(tr, None, jobs, {})
    for j in (jobs[0], jobs[1]):
        out = pipe(prompt=j.prompt, image=j.image, mask_image=j.mask, height=H, width=W,
                   num_inference_steps=STEPS, guidance_scale=j.guidance, max_sequence_length=TEXT_LEN,
                   generator=torch.Generator().manual_seed(j.seed), output_type="latent").images
        assert (out - ref[j.name]).abs().max() <= 1e-5, "harness must reproduce FluxFillPipeline"
    ctrl = MaskAwareFlux(tr)
    rec_lat, (recorded, _) = _run_engine(tr, ctrl, jobs, {j.name: "record" for j in jobs})
    caches = recorded
    caches["blob_no_output_cache"] = [{k: v for k, v in c.items() if k != "output"}
                                      for c in caches["blob_no_output_cache"]]
    state = {"pipe": pipe, "tr": tr, "ctrl": ctrl, "jobs": jobs, "ref": ref, "rec_lat": rec_lat, "caches": caches}
    yield state
    state["ctrl"].remove()


def test_record_mode_equals_stock(world) -> None:
    for j in world["jobs"]:
        assert (world["rec_lat"][j.name] - world["ref"][j.name]).abs().max() <= 1e-5, j.name
        assert len(world["caches"][j.name]) == STEPS


def test_masked_mixed_batch_matches_full_compute(world) -> None:
    """One engine run mixing templates, masks (~0.03, blob, 1.0, 0.0), a full-compute job and staggered
    starts: masked-token latents (and the whole latent, via the cached output) equal full compute."""
    jobs, ref, caches = world["jobs"], world["ref"], world["caches"]
    ratios = {j.name: mask_ratio(j.token_mask) for j in jobs}
    log.info("token mask ratios: %s", ratios)
    assert 0.02 <= ratios["small_rect"] <= 0.04
    assert 0.1 <= ratios["blob"] <= 0.4 and ratios["full_mask"] == 1.0 and ratios["empty_mask"] == 0.0
    # Cached values AT masked tokens must never be read (fresh ones replace them): poison them, so
    # a missing or misplaced scatter shows up even though the caches come from the same inputs.
    caches = {j.name: [_poison(c, j.token_mask) for c in caches[j.name]] for j in jobs}
    snapshot = {n: [{k: v.clone() for k, v in c.items()} for c in cs] for n, cs in caches.items()}

    modes = {j.name: "masked" for j in jobs}
    modes["full_compute"] = "full"
    lat, (_, tick_ts) = _run_engine(world["tr"], world["ctrl"], jobs, modes, caches)

    assert max(len(set(ts)) for ts in tick_ts) >= 3, "rows of one call must be at different timesteps"
    assert max(len(ts) for ts in tick_ts) == len(jobs)
    for j in jobs:
        m = j.token_mask
        diff = (lat[j.name] - ref[j.name]).abs()[0]
        masked_err = float(diff[m].max()) if m.any() else 0.0
        log.info("%s: ratio %.3f masked-token err %.2e whole err %.2e", j.name, ratios[j.name], masked_err, diff.max())
        assert masked_err <= TOL, j.name
        if j.name == "blob_no_output_cache":
            # unmasked tokens got zero velocity; the final inpaint blend restores them from the template
            blended = torch.where(m[None, :, None], lat[j.name], world["rec_lat"][j.name])
            assert (blended - ref[j.name]).abs().max() <= TOL
            assert diff[~m].max() > 1e-3
        else:
            assert diff.max() <= TOL, j.name
    for n, cs in caches.items():
        for c, snap in zip(cs, snapshot[n]):
            assert all(torch.equal(c[k], snap[k]) for k in c), f"cache of {n} was written"


def _poison(cache: dict[str, torch.Tensor], token_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in cache.items():
        v = v.clone()
        v[:, token_mask] = 1e3
        out[k] = v
    return out


def test_multi_row_groups_use_their_own_cache_rows(world) -> None:
    """A group of 2 rows records [2, N, C] tensors and, masked, reads row i of each cache tensor."""
    tr, ctrl = world["tr"], world["ctrl"]
    a, b = world["jobs"][1], world["jobs"][3]
    kw = {k: torch.cat([va, vb]) if k not in ("txt_ids", "img_ids") else va
          for (k, va), vb in zip(_one_step_kwargs(a, 1).items(), _one_step_kwargs(b, 1).values())}
    full = tr(**kw).sample
    with ctrl.batch([RowGroup(2, "record")]) as ctx:
        tr(**kw)
    cache = ctx.recorded[0]
    assert cache["transformer_blocks.0.k_roped"].shape[0] == 2
    mask = a.token_mask | b.token_mask
    with ctrl.batch([RowGroup(2, "masked", mask, _poison(cache, mask))]):
        out = tr(**kw).sample
    assert (out - full).abs().max() <= 1e-5


def test_wrong_template_cache_changes_masked_tokens(world) -> None:
    """Another template's cache (same shapes) must change the result: the test can fail."""
    jobs = {j.name: j for j in world["jobs"]}
    j = jobs["small_rect"]
    wrong = {j.name: world["caches"]["blob"]}
    lat, _ = _run_engine(world["tr"], world["ctrl"], [j], {j.name: "masked"}, wrong)
    err = float((lat[j.name] - world["ref"][j.name]).abs()[0][j.token_mask].max())
    assert err > 1e-3
    right = {j.name: world["caches"][j.name]}
    lat, _ = _run_engine(world["tr"], world["ctrl"], [j], {j.name: "masked"}, right)
    assert float((lat[j.name] - world["ref"][j.name]).abs()[0][j.token_mask].max()) <= TOL


def test_raw_kv_format_is_exact(world) -> None:
    """The alternative cache layout (K before qk-norm and RoPE, DESIGN 2's) gives the same results;
    the default (roped) controller refuses its caches and it refuses the default's."""
    tr, base = world["tr"], world["ctrl"]
    assert base.kv_format == "roped" and base.cache_layout == "flux-kv-roped"
    base.remove()
    try:
        ctrl = MaskAwareFlux(tr, kv_format="raw")
        jobs = [j for j in world["jobs"] if j.name in ("small_rect", "blob", "same_image_other_mask")]
        _, (rec, _) = _run_engine(tr, ctrl, jobs, {j.name: "record" for j in jobs})
        assert all("transformer_blocks.0.k" in c and "transformer_blocks.0.k_roped" not in c for c in rec["blob"])
        lat, _ = _run_engine(tr, ctrl, jobs, {j.name: "masked" for j in jobs}, rec)
        for j in jobs:
            assert (lat[j.name] - world["ref"][j.name]).abs().max() <= TOL, j.name
        with pytest.raises(KeyError):  # a roped-format cache is refused by a raw controller
            with ctrl.batch([RowGroup(1, "masked", jobs[0].token_mask, world["caches"]["small_rect"][0])]):
                tr(**_one_step_kwargs(jobs[0], 0))
        ctrl.remove()
        default = MaskAwareFlux(tr)
        with pytest.raises(KeyError):  # and a raw-format cache by the default controller
            with default.batch([RowGroup(1, "masked", jobs[0].token_mask, rec["small_rect"][0])]):
                tr(**_one_step_kwargs(jobs[0], 0))
        default.remove()
    finally:
        world["ctrl"] = MaskAwareFlux(tr)


def _one_step_kwargs(j: Job, step: int) -> dict:
    t = j.timesteps[step]
    return dict(hidden_states=torch.cat((j.latents, j.cond), dim=2), timestep=t.reshape(1).float() / 1000,
                guidance=torch.tensor([j.guidance]), pooled_projections=j.pooled,
                encoder_hidden_states=j.prompt_embeds, txt_ids=j.text_ids, img_ids=j.img_ids)


def test_edge_cases_and_guards(world) -> None:
    tr, ctrl, jobs, caches = world["tr"], world["ctrl"], world["jobs"], world["caches"]
    j = jobs[0]
    kw = _one_step_kwargs(j, 0)
    full = tr(**kw).sample
    n = j.token_mask.numel()
    # ratio 1 without any cache is full compute; ratio 0 without "output" returns zeros, no crash
    with ctrl.batch([RowGroup(1, "masked", torch.ones(n, dtype=torch.bool), None)]):
        assert (tr(**kw).sample - full).abs().max() <= 1e-6
    with ctrl.batch([RowGroup(1, "masked", torch.zeros(n, dtype=torch.bool), None)]) as ctx:
        assert tr(**kw).sample.abs().max() == 0
    assert ctx.image_tokens_computed == 0
    with pytest.raises(ValueError):  # partial mask without a cache
        with ctrl.batch([RowGroup(1, "masked", j.token_mask, None)]):
            tr(**kw)
    with pytest.raises(KeyError):  # cache missing a block
        bad = {k: v for k, v in caches[j.name][0].items() if not k.startswith("single_transformer_blocks.1")}
        with ctrl.batch([RowGroup(1, "masked", j.token_mask, bad)]):
            tr(**kw)
    with pytest.raises(ValueError):  # rows declared != batch rows
        with ctrl.batch([RowGroup(2, "full")]):
            tr(**kw)
    with pytest.raises(RuntimeError):  # one call per batch context
        with ctrl.batch([RowGroup(1, "full")]):
            tr(**kw)
            tr(**kw)
    with pytest.raises(RuntimeError):
        with ctrl.batch([RowGroup(1, "full")]), ctrl.batch([RowGroup(1, "full")]):
            pass
    # after all those errors the controller is clean: stock behaviour outside a batch
    assert torch.equal(tr(**kw).sample, full)


def test_token_wise_layers_see_only_selected_tokens(world) -> None:
    """The claim behind the speedup: every token-wise linear and norm runs on the m selected image
    tokens (+ T text tokens), never on all N; also exact without text tokens (T = 0)."""
    tr, ctrl = world["tr"], world["ctrl"]
    j = world["jobs"][0]                                   # small_rect, ratio ~0.03
    m, n = int(j.token_mask.sum()), j.token_mask.numel()
    for text_len in (TEXT_LEN, 0):
        kw = _one_step_kwargs(j, 2)
        kw["encoder_hidden_states"] = kw["encoder_hidden_states"][:, :text_len]
        kw["txt_ids"] = kw["txt_ids"][:text_len]
        full = tr(**kw).sample
        with ctrl.batch([RowGroup(1, "record")]) as ctx:
            tr(**kw)
        rows: dict[str, int] = {}

        def count(name: str):
            def hook(_mod: torch.nn.Module, args: tuple) -> None:
                rows[name] = max(rows.get(name, 0), args[0].reshape(-1, args[0].shape[-1]).shape[0])
            return hook

        handles = [mod.register_forward_pre_hook(count(name)) for name, mod in tr.named_modules()
                   if isinstance(mod, (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.RMSNorm))
                   and name.startswith(("transformer_blocks", "single_transformer_blocks", "norm_out"))
                   and ".norm1.linear" not in name and ".norm1_context.linear" not in name
                   and ".norm.linear" not in name and name != "norm_out.linear"]
        try:
            with ctrl.batch([RowGroup(1, "masked", j.token_mask, ctx.recorded[0])]) as mctx:
                out = tr(**kw).sample
        finally:
            for h in handles:
                h.remove()
        assert float((out - full)[0][j.token_mask].abs().max()) <= TOL
        heads = tr.config.num_attention_heads
        # qk-norms see [tokens, heads, head_dim]; the cached keys' norm sees the n - m cached tokens
        limit = {name: (max(m + text_len, n - m) * heads if ".attn.norm_" in name else m + text_len) for name in rows}
        over = {name: r for name, r in rows.items() if r > limit[name]}
        assert not over, over
        # (x_embedder / proj_out are called by the hooks themselves: their pre-hooks see placeholders)
        assert mctx.image_tokens_computed == m and rows["norm_out.norm"] == m
        assert rows["single_transformer_blocks.0.proj_mlp"] == m + text_len
        assert rows["transformer_blocks.0.attn.to_q"] == m


def test_cache_nbytes_matches_recorded(world) -> None:
    tr, caches = world["tr"], world["caches"]
    n = world["jobs"][0].token_mask.numel()
    actual = sum(t.numel() * t.element_size() for c in caches["small_rect"] for t in c.values())
    assert flux_cache_nbytes(tr, n, STEPS, torch.float32) == actual
    assert world["ctrl"].cache_nbytes(n, rows=1, steps=STEPS) == actual
    assert world["ctrl"].block_names == [f"transformer_blocks.{i}" for i in range(2)] + [
        f"single_transformer_blocks.{i}" for i in range(2)]


def test_token_masks_follow_fill_pipeline_packing(world) -> None:
    """A token is masked iff the Fill pipeline's packed mask channels for it are non-zero."""
    pipe = world["pipe"]
    rng = np.random.default_rng(0)
    arr = np.zeros((H, W))
    for _ in range(6):
        y, x = rng.integers(0, H), rng.integers(0, W)
        arr[y:y + rng.integers(1, 20), x:x + rng.integers(1, 20)] = 1
    mask_image = pipe.mask_processor.preprocess(_mask_from_array(arr), height=H, width=W)
    packed_mask, _ = pipe.prepare_mask_latents(mask_image, torch.zeros(1, 16, H // 8, W // 8), 1, 16, 1, H, W,
                                               torch.float32, torch.device("cpu"), None)
    expected = packed_mask[0].amax(dim=-1) > 0
    assert torch.equal(pixel_to_token_mask(mask_image), expected)
    # one pixel -> one token; dilation by one token -> its 3x3 neighbourhood
    one = torch.zeros(H, W)
    one[100, 37] = 1
    grid = pixel_to_token_mask(one).view(H // 16, W // 16)
    assert grid.sum() == 1 and grid[100 // 16, 37 // 16]
    assert dilate_token_grid(grid, 1).sum() == 9
    assert torch.equal(pixel_to_token_mask(token_grid_to_pixels(grid)).view_as(grid), grid)
    for shape in ("blob", "rect"):
        g = synthetic_token_grid(32, 32, 0.2, shape=shape, seed=4)
        assert int(g.sum()) == round(0.2 * 1024)


def test_tiny_pipeline_runs_and_round_trips(tmp_path) -> None:
    pipe = build_flux_fill_pipeline(0)
    kwargs = dict(prompt="a red cat", image=_image(4).resize((128, 128)), height=128, width=128,
                  mask_image=_rect_mask(10, 60, 20, 90).resize((128, 128)), num_inference_steps=3,
                  max_sequence_length=TEXT_LEN, output_type="np")
    out = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert out.shape == (1, 128, 128, 3) and np.isfinite(out).all()
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    loaded = FluxFillPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    again = loaded(generator=torch.Generator().manual_seed(0), **kwargs).images
    # same weights, new allocations: the BLAS may round differently (seen: 1e-7), never more
    np.testing.assert_allclose(again, out, rtol=0, atol=1e-5)
    ctrl = MaskAwareFlux(loaded.transformer)   # installed but idle: the stock pipeline is unchanged
    idle = loaded(generator=torch.Generator().manual_seed(0), **kwargs).images
    ctrl.remove()
    assert np.array_equal(again, idle)
