"""Flux Fill through the whole service: faithful to the stock pipeline, mask-aware in the engine."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from app.client import StencilClient
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask
from tests.test_service import result_array, template, wait_until

pytestmark = pytest.mark.integration

SIZE = 64


@pytest.fixture(scope="module")
def flux_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    workdir = tmp_path_factory.mktemp("flux")
    with EmbeddedStack.start(workdir, home=workdir / "home", model_id="tiny-flux-fill", max_batch=4) as stack:
        yield stack


def stock_flux(stack: EmbeddedStack, image: Image.Image, mask: np.ndarray, **kw) -> np.ndarray:  # type: ignore[no-untyped-def]
    from diffusers import FluxFillPipeline

    from workers.models.loader import ensure_model_dir

    pipe = FluxFillPipeline.from_pretrained(ensure_model_dir(stack.settings))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=kw["prompt"], image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
               num_inference_steps=kw["steps"], guidance_scale=kw["guidance"], height=SIZE, width=SIZE,
               generator=torch.Generator("cpu").manual_seed(kw["seed"])).images[0]
    return np.asarray(out, dtype=np.int16)


def test_flux_jobs_match_the_stock_pipeline_alone_and_in_a_shared_batch(flux_stack: EmbeddedStack) -> None:
    client = StencilClient(flux_stack.settings)
    image, mask = template(80, SIZE), make_mask(0.25, (SIZE, SIZE), "blob", seed=8)
    params = dict(prompt="a hat", steps=8, guidance=30.0, seed=11)
    alone = client.submit(template=image, mask=mask, **params)
    assert alone.wait(120).status == JobStatus.DONE
    expected = stock_flux(flux_stack, image, mask, **params)
    assert np.abs(result_array(alone) - expected).max() <= 1
    long_job = client.submit(template=template(81, SIZE), mask=make_mask(0.4, (SIZE, SIZE), seed=1),
                             prompt="flowers", steps=80, guidance=30.0, seed=3)
    wait_until(lambda: long_job.progress()[0] >= 4)
    joined = client.submit(template=image, mask=mask, **params)
    rec = joined.wait(120)
    assert rec.status == JobStatus.DONE, rec.error
    assert rec.ts("finalizing") < long_job.wait(300).ts("finalizing")
    assert np.abs(result_array(joined) - expected).max() <= 1


def test_flux_masked_edit_with_fresh_cache_equals_full_compute(flux_stack: EmbeddedStack) -> None:
    client = StencilClient(flux_stack.settings)
    image, mask = template(82, SIZE), make_mask(0.1, (SIZE, SIZE), "stroke", seed=9)
    params = dict(prompt="a cat", steps=8, guidance=30.0, seed=5)
    tid = client.add_template(image)
    warm = client.warm_template(tid, mask=mask, **params).wait(120)
    assert warm.status == JobStatus.DONE and warm.fields["cache_mode"] == "record", warm.error
    edit = client.submit(template=tid, mask=mask, **params)
    rec = edit.wait(120)
    assert rec.status == JobStatus.DONE and rec.fields["cache_mode"] == "masked", rec.fields
    assert rec.fields["cache_path"] == "exact" and rec.fields["approximate"] == "0", rec.fields
    assert int(rec.fields["masked_steps"]) > 0 and int(rec.fields["refresh_steps"]) == 0
    diff = np.abs(result_array(edit) - stock_flux(flux_stack, image, mask, **params))
    assert diff.max() <= 1, diff.max()


def test_flux_turbo_edits_reuse_patches_and_say_how_many(flux_stack: EmbeddedStack) -> None:
    """``turbo`` on Flux Fill (``workers/maskaware/flux_reuse.py``): the template's warm-up serves the
    edit with fast's refresh steps, and the record says what share of the block computations was
    taken from the job's last step."""
    client = StencilClient(flux_stack.settings)
    image, mask = template(83, SIZE), make_mask(0.3, (SIZE, SIZE), "blob", seed=4)
    tid = client.add_template(image)
    assert client.warm_template(tid, steps=10, guidance=30.0).wait(120).status == JobStatus.DONE
    params = dict(template=tid, mask=mask, prompt="a hat", seed=5, steps=10, guidance=30.0)
    fast = client.submit(**params, fidelity="fast").wait(120)
    turbo = client.submit(**params, fidelity="turbo").wait(120)
    assert turbo.status == JobStatus.DONE and turbo.fields["fidelity"] == "turbo", turbo.fields
    assert turbo.fields["cache_path"] == "template" and turbo.fields["approximate"] == "1", turbo.fields
    assert turbo.fields["refresh_plan"] == fast.fields["refresh_plan"]
    assert int(turbo.fields["masked_steps"]) > 0, turbo.fields  # (fast brought the cache to the host tier)
    assert 0.0 < float(turbo.fields["reused_share"]) <= 2 / 3, turbo.fields  # at most 2 steps in 3
    assert fast.fields.get("reused_share", "") in ("", "None"), fast.fields
