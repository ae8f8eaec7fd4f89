"""Mask-aware inference inside the service: warm-up, masked edits in mixed continuous batches."""

from __future__ import annotations

import numpy as np
import pytest

from app.client import StencilClient
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask
from tests.test_service import SIZE, result_array, stock_result, template, wait_until

pytestmark = pytest.mark.integration


def warm(client: StencilClient, template_id: str, **kw) -> None:  # type: ignore[no-untyped-def]
    rec = client.warm_template(template_id, **kw).wait(120)
    assert rec.status == JobStatus.DONE, rec.error
    assert rec.fields.get("cache_mode") == "record"


def test_masked_edits_with_fresh_caches_equal_full_compute_in_a_mixed_batch(
        stack: EmbeddedStack, client: StencilClient) -> None:
    """Warm-ups recorded with each edit's own prompt, seed and mask make mask-aware edits exact,
    whatever the mask, with several templates, a full-compute job and staggered steps sharing
    the engine's batches."""
    steps = 16
    specs = [
        dict(tpl=60, ratio=0.03, shape="blob", prompt="a hat", seed=1, guidance=7.5),
        dict(tpl=61, ratio=0.25, shape="stroke", prompt="a cat", seed=2, guidance=7.5),
        dict(tpl=62, ratio=0.5, shape="rect", prompt="flowers", seed=3, guidance=1.0),  # no CFG: 1 row
    ]
    jobs = []
    for spec in specs:
        image = template(spec["tpl"])
        mask = make_mask(spec["ratio"], (SIZE, SIZE), spec["shape"], seed=spec["tpl"])
        tid = client.add_template(image)
        params = dict(prompt=spec["prompt"], seed=spec["seed"], steps=steps, guidance=spec["guidance"])
        warm(client, tid, mask=mask, **params)
        jobs.append((tid, image, mask, params))
    # A long full-compute job (uploaded image: no template cache) keeps the batch busy.
    background = client.submit(template=template(63), mask=make_mask(0.2, (SIZE, SIZE)), prompt="x",
                               steps=100, seed=9)
    wait_until(lambda: background.progress()[0] >= 3)
    handles = []
    for tid, image, mask, params in jobs:  # staggered: each joins at another step
        handles.append(client.submit(template=tid, mask=mask, **params))
        wait_until(lambda: handles[-1].progress()[0] >= 2 or handles[-1].status().terminal)
    for handle, (tid, image, mask, params) in zip(handles, jobs):
        rec = handle.wait(180)
        assert rec.status == JobStatus.DONE, rec.error
        assert rec.fields["cache_mode"] == "masked", rec.fields
        assert int(rec.fields["masked_steps"]) >= steps // 2, rec.fields
        assert int(rec.fields["masked_steps"]) + int(rec.fields["fallback_steps"]) == steps
        assert rec.ts("denoising") < background.wait(300).ts("finalizing")
        diff = np.abs(result_array(handle) - stock_result(stack, image, mask, **params))
        assert diff.max() <= 1, f"mask-aware edit differs from full compute by {diff.max()}"


def test_a_cache_from_the_warm_seed_serves_other_seeds_approximately(stack: EmbeddedStack,
                                                                      client: StencilClient) -> None:
    """The check above can fail: the production warm-up (STENCIL_WARM_SEED) serves an edit with
    another seed, which starts from the warm-up's noise outside its mask, so it is not the full
    compute of that seed."""
    image = template(64)
    mask = make_mask(0.2, (SIZE, SIZE), "blob", seed=4)
    tid = client.add_template(image)
    warm(client, tid, mask=mask, prompt="a hat", seed=stack.settings.warm_seed, steps=10)
    masked = client.submit(template=tid, mask=mask, prompt="a hat", seed=5, steps=10)
    full = client.submit(template=image, mask=mask, prompt="a hat", seed=5, steps=10)
    rec_m, rec_f = masked.wait(120), full.wait(120)
    assert rec_m.fields["cache_mode"] == "masked" and rec_f.fields["cache_mode"] == "full"
    assert rec_m.fields["noise_seed"] == str(stack.settings.warm_seed)
    assert int(rec_m.fields["masked_steps"]) > 0
    assert np.abs(result_array(masked) - result_array(full)).max() > 1


def test_a_cache_recorded_with_another_seed_is_never_used(stack: EmbeddedStack, client: StencilClient) -> None:
    """A warm-up with a custom seed serves only edits with that seed: any other edit would start
    from noise inconsistent with the cached activations."""
    image = template(67)
    mask = make_mask(0.2, (SIZE, SIZE), "rect", seed=6)
    tid = client.add_template(image)
    assert stack.settings.warm_seed != 100
    warm(client, tid, mask=mask, prompt="a hat", seed=100, steps=10)
    other = client.submit(template=tid, mask=mask, prompt="a hat", seed=5, steps=10).wait(120)
    same = client.submit(template=tid, mask=mask, prompt="a hat", seed=100, steps=10).wait(120)
    assert other.status == JobStatus.DONE and other.fields["cache_mode"] == "full", other.fields
    assert same.status == JobStatus.DONE and same.fields["cache_mode"] == "masked", same.fields


def test_edit_of_an_unwarmed_template_runs_full_and_triggers_its_warm_up(client: StencilClient) -> None:
    tid = client.add_template(template(65))
    mask = make_mask(0.1, (SIZE, SIZE), seed=5)
    first = client.submit(template=tid, mask=mask, prompt="a hat", steps=8)
    rec = first.wait(120)
    assert rec.status == JobStatus.DONE and rec.fields["cache_mode"] == "full"
    assert rec.fields["cache_note"] == "template not warmed"
    digest = rec.fields.get("cache_digest") or ""
    # The warm-up job appears and commits the cache; the next edit uses it.
    r = client.redis
    wait_until(lambda: any(r.hget(k, "kind") == b"warm" and r.hget(k, "template_id") == tid.encode()
                           and r.hget(k, "status") == b"done" for k in r.scan_iter("stencil:job:*")), timeout=120)
    second = client.submit(template=tid, mask=mask, prompt="another prompt", seed=3, steps=8)
    rec2 = second.wait(120)
    assert rec2.status == JobStatus.DONE and rec2.fields["cache_mode"] == "masked", rec2.fields
    assert digest == "" or rec2.fields["cache_digest"] == digest


def test_full_mask_runs_full_compute(client: StencilClient) -> None:
    tid = client.add_template(template(66))
    warm(client, tid, steps=6)
    rec = client.submit(template=tid, mask=np.ones((SIZE, SIZE), bool), steps=6).wait(120)
    assert rec.status == JobStatus.DONE and rec.fields["cache_mode"] == "full"
