"""SDXL inpainting in bfloat16 through the whole service (STENCIL_MODEL_ID=tiny-sdxl-inpaint,
STENCIL_DTYPE=bfloat16): CPU tasks encode with both text encoders, the GPU engine passes the added
conditioning, and results equal ``StableDiffusionXLInpaintPipeline`` loaded in bf16 (2/255), for a
job alone, a job that joins a running batch, and an exact mask-aware edit of a region warm-up."""

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
TOL = 2  # of 255, bfloat16


@pytest.fixture(scope="module")
def sdxl_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    workdir = tmp_path_factory.mktemp("sdxl")
    with EmbeddedStack.start(workdir, home=workdir / "home", model_id="tiny-sdxl-inpaint", dtype="bfloat16",
                             max_batch=4) as stack:
        yield stack


def stock_sdxl(stack: EmbeddedStack, image: Image.Image, mask: np.ndarray, **kw) -> np.ndarray:  # type: ignore[no-untyped-def]
    from diffusers import StableDiffusionXLInpaintPipeline

    from workers.models.loader import ensure_model_dir

    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(ensure_model_dir(stack.settings), dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=kw["prompt"], image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
               num_inference_steps=kw["steps"], guidance_scale=kw["guidance"], strength=1.0, height=SIZE,
               width=SIZE, generator=torch.Generator("cpu").manual_seed(kw["seed"])).images[0]
    return np.asarray(out, dtype=np.int16)


def test_sdxl_bf16_jobs_match_the_stock_pipeline_alone_and_joining(sdxl_stack: EmbeddedStack) -> None:
    client = StencilClient(sdxl_stack.settings)
    image, mask = template(90, SIZE), make_mask(0.25, (SIZE, SIZE), "blob", seed=8)
    params = dict(prompt="a hat", steps=8, guidance=7.5, seed=11)
    alone = client.submit(template=image, mask=mask, **params)
    rec = alone.wait(180)
    assert rec.status == JobStatus.DONE, rec.error
    expected = stock_sdxl(sdxl_stack, image, mask, **params)
    assert np.abs(result_array(alone) - expected).max() <= TOL
    long_job = client.submit(template=template(91, SIZE), mask=make_mask(0.4, (SIZE, SIZE), seed=1),
                             prompt="flowers", steps=60, guidance=5.0, seed=3)
    wait_until(lambda: long_job.progress()[0] >= 3, timeout=120)
    joined = client.submit(template=image, mask=mask, **params)
    rec = joined.wait(180)
    assert rec.status == JobStatus.DONE, rec.error
    assert rec.ts("finalizing") < long_job.wait(300).ts("finalizing")
    assert np.abs(result_array(joined) - expected).max() <= TOL


def test_sdxl_bf16_exact_maskaware_edit_equals_stock(sdxl_stack: EmbeddedStack) -> None:
    client = StencilClient(sdxl_stack.settings)
    image, mask = template(92, SIZE), make_mask(0.15, (SIZE, SIZE), "stroke", seed=9)
    params = dict(prompt="a cat", steps=8, guidance=7.5, seed=5)
    tid = client.add_template(image)
    warm = client.warm_template(tid, mask=mask, **params).wait(180)
    assert warm.status == JobStatus.DONE and warm.fields["cache_mode"] == "record", warm.error
    edit = client.submit(template=tid, mask=mask, **params)
    rec = edit.wait(180)
    assert rec.status == JobStatus.DONE and rec.fields["cache_mode"] == "masked", rec.fields
    assert rec.fields["cache_path"] == "exact" and int(rec.fields["masked_steps"]) > 0, rec.fields
    diff = np.abs(result_array(edit) - stock_sdxl(sdxl_stack, image, mask, **params))
    assert diff.max() <= TOL, diff.max()
