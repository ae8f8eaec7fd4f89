"""End-to-end behaviour of the service on real processes: redis-server, Celery workers, dispatcher."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
import torch
from PIL import Image

from app.client import InvalidParameter, JobFailed, StencilClient
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask

pytestmark = pytest.mark.integration

SIZE = 128


def template(seed: int, size: int = SIZE) -> Image.Image:
    """A smooth random image (gradients + shapes), different per seed."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    arr = np.stack([np.sin(xx * rng.uniform(2, 8) + rng.uniform(0, 6)),
                    np.cos(yy * rng.uniform(2, 8) + rng.uniform(0, 6)),
                    np.sin((xx + yy) * rng.uniform(2, 8))], axis=-1)
    return Image.fromarray(((arr * 0.5 + 0.5) * 255).astype(np.uint8))


def wait_until(predicate, timeout: float = 60.0, poll: float = 0.02) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(poll)


def stock_result(stack: EmbeddedStack, image: Image.Image, mask: np.ndarray, **kw) -> np.ndarray:  # type: ignore[no-untyped-def]
    from diffusers import StableDiffusionInpaintPipeline

    from workers.models.loader import ensure_model_dir

    pipe = StableDiffusionInpaintPipeline.from_pretrained(ensure_model_dir(stack.settings))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=kw["prompt"], image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
               num_inference_steps=kw["steps"], guidance_scale=kw["guidance"], height=SIZE, width=SIZE,
               generator=torch.Generator("cpu").manual_seed(kw["seed"])).images[0]
    return np.asarray(out, dtype=np.int16)


def result_array(handle) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.asarray(handle.result(), dtype=np.int16)


def test_job_alone_matches_stock_pipeline(stack: EmbeddedStack, client: StencilClient) -> None:
    image, mask = template(1), make_mask(0.2, (SIZE, SIZE), "blob", seed=1)
    params = dict(prompt="a red scarf", steps=12, guidance=7.5, seed=42)
    handle = client.submit(template=image, mask=mask, **params)
    rec = handle.wait(120)
    assert rec.status == JobStatus.DONE, rec.error
    diff = np.abs(result_array(handle) - stock_result(stack, image, mask, **params))
    assert diff.max() <= 1, f"max pixel diff {diff.max()} vs the stock pipeline"


def test_keep_unmasked_pastes_the_template_back_outside_the_mask(stack: EmbeddedStack,
                                                                  client: StencilClient) -> None:
    """Outside the mask the result is the template's pixels; inside, the stock pipeline's edit."""
    image, mask = template(3), make_mask(0.25, (SIZE, SIZE), "rect", seed=3)
    params = dict(prompt="a hat", steps=6, guidance=7.5, seed=5)
    handle = client.submit(template=image, mask=mask, keep_unmasked=True, **params)
    rec = handle.wait(120)
    assert rec.status == JobStatus.DONE, rec.error
    out = result_array(handle)
    stock = stock_result(stack, image, mask, **params)
    keep = ~mask.astype(bool)
    assert np.abs(out[keep] - np.asarray(image, dtype=np.int16)[keep]).max() <= 1
    assert np.abs(out[~keep] - stock[~keep]).max() <= 1
    # Without it, the decoded output differs from the template outside the mask (VAE round trip).
    assert np.abs(stock[keep] - np.asarray(image, dtype=np.int16)[keep]).max() > 1


def test_job_in_shared_batch_matches_stock_pipeline_and_batching_is_continuous(
        stack: EmbeddedStack, client: StencilClient) -> None:
    """Jobs join a running batch at other steps; the joined job still equals the stock pipeline."""
    long_jobs = [client.submit(template=template(10 + i), mask=make_mask(0.3, (SIZE, SIZE), "rect", seed=i),
                               prompt="flowers", steps=120, guidance=7.5, seed=i) for i in range(2)]
    wait_until(lambda: long_jobs[0].progress()[0] >= 5 and long_jobs[1].progress()[0] >= 5)
    image, mask = template(2), make_mask(0.1, (SIZE, SIZE), "stroke", seed=2)
    params = dict(prompt="a cat", steps=15, guidance=5.0, seed=7)
    joined = client.submit(template=image, mask=mask, **params)
    rec = joined.wait(120)
    assert rec.status == JobStatus.DONE, rec.error
    long_recs = [h.wait(300) for h in long_jobs]
    for lr in long_recs:
        assert lr.status == JobStatus.DONE, lr.error
    # Continuous batching: the later job started denoising before the earlier ones finished,
    # and finished first although it arrived last (one engine).
    assert rec.worker == long_recs[0].worker == long_recs[1].worker
    for lr in long_recs:
        assert rec.ts("denoising") < lr.ts("finalizing")
        assert rec.ts("finalizing") < lr.ts("finalizing")
    diff = np.abs(result_array(joined) - stock_result(stack, image, mask, **params))
    assert diff.max() <= 1, f"max pixel diff {diff.max()} vs the stock pipeline"


def test_staggered_jobs_join_the_running_batch(stack: EmbeddedStack, client: StencilClient) -> None:
    handles = []
    for i in range(3):
        handles.append(client.submit(template=template(20 + i), mask=make_mask(0.2, (SIZE, SIZE), seed=i),
                                     prompt="a hat", steps=60, guidance=7.5, seed=i))
        wait_until(lambda: handles[-1].progress()[0] >= 3)
    recs = [h.wait(300) for h in handles]
    assert all(r.status == JobStatus.DONE for r in recs), [r.error for r in recs]
    for earlier, later in zip(recs, recs[1:]):
        assert later.ts("denoising") < earlier.ts("finalizing"), "later job waited for the earlier to finish"


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_bad_input_fails_with_reason_and_others_complete(stack: EmbeddedStack, client: StencilClient) -> None:
    good_mask = make_mask(0.2, (SIZE, SIZE), seed=3)
    healthy = [client.submit(template=template(30 + i), mask=good_mask, prompt="ok", steps=30, seed=i)
               for i in range(2)]
    png = _png(template(3))
    bad = {
        "corrupt image": client.submit(template=b"this is not an image at all", mask=good_mask, steps=5),
        "truncated image": client.submit(template=png[: len(png) // 2], mask=good_mask, steps=5),
        "mask of the wrong size": client.submit(template=template(3), mask=np.ones((64, 64), bool), steps=5),
        "unknown template": client.submit(template="no-such-template", mask=good_mask, steps=5),
        "image over the pixel limit": client.submit(template=template(3, size=512), mask=np.ones((512, 512), bool),
                                                    steps=5),
    }
    expected = {
        "corrupt image": "could not be decoded",
        "truncated image": "could not be decoded",
        "mask of the wrong size": "does not match image size",
        "unknown template": "unknown template",
        "image over the pixel limit": "over STENCIL_MAX_IMAGE_PIXELS",
    }
    with pytest.raises(InvalidParameter, match="steps"):  # refused before anything is stored
        client.submit(template=template(3), mask=good_mask, steps=0)
    for what, handle in bad.items():
        rec = handle.wait(60)
        assert rec.status == JobStatus.FAILED, f"{what}: {rec.status}"
        assert expected[what] in (rec.error or ""), f"{what}: reason was {rec.error!r}"
        with pytest.raises(JobFailed):
            handle.result()
    for handle in healthy:
        rec = handle.wait(120)
        assert rec.status == JobStatus.DONE, rec.error
    # The workers are still alive and serve a new job.
    assert all(p.poll() is None for p in stack.procs.values())
    after = client.submit(template=template(4), mask=good_mask, steps=5)
    assert after.wait(60).status == JobStatus.DONE


def test_cancel_before_denoising(stack: EmbeddedStack, client: StencilClient) -> None:
    handle = client.submit(template=template(5), mask=make_mask(0.2, (SIZE, SIZE)), steps=50)
    assert handle.cancel()
    rec = handle.wait(30)
    assert rec.status == JobStatus.CANCELLED
    time.sleep(1.0)  # give any in-flight task the chance to (wrongly) run it
    rec = handle.record()
    assert rec.status == JobStatus.CANCELLED
    assert rec.ts("denoising") is None and rec.result_key is None


def test_cancel_while_denoising_leaves_the_batch(stack: EmbeddedStack, client: StencilClient) -> None:
    other = client.submit(template=template(6), mask=make_mask(0.3, (SIZE, SIZE)), steps=80, seed=1)
    victim = client.submit(template=template(7), mask=make_mask(0.3, (SIZE, SIZE)), steps=200, seed=2)
    wait_until(lambda: victim.progress()[0] >= 5)
    assert victim.cancel()
    step_at_cancel = victim.progress()[0]
    time.sleep(1.0)
    rec = victim.record()
    assert rec.status == JobStatus.CANCELLED
    assert rec.progress[0] <= step_at_cancel + 1, "the cancelled job kept running"
    assert rec.progress[0] < 200 and rec.result_key is None
    assert other.wait(120).status == JobStatus.DONE


def test_idempotency_key_returns_the_same_job(client: StencilClient) -> None:
    kwargs = dict(template=template(8), mask=make_mask(0.2, (SIZE, SIZE)), steps=5, idempotency_key="order-17")
    first = client.submit(**kwargs)
    second = client.submit(**kwargs)
    assert first.id == second.id and first.created and not second.created
    assert first.wait(60).status == JobStatus.DONE


def test_empty_mask_returns_the_template_without_denoising(client: StencilClient) -> None:
    image = template(9)
    handle = client.submit(template=image, mask=np.zeros((SIZE, SIZE), bool), steps=30)
    rec = handle.wait(60)
    assert rec.status == JobStatus.DONE, rec.error
    assert rec.ts("denoising") is None
    diff = np.abs(result_array(handle) - np.asarray(image, dtype=np.int16))
    assert diff.max() <= 1


def test_stored_template_and_submit_many(client: StencilClient) -> None:
    template_id = client.add_template(template(11))
    handles = client.submit_many([{"template": template_id, "mask": make_mask(r, (SIZE, SIZE), seed=k),
                                   "prompt": "a hat", "steps": 8, "seed": k}
                                  for k, r in enumerate((0.05, 0.3, 1.0))])
    recs = client.wait_all(handles, timeout=120)
    assert [r.status for r in recs] == [JobStatus.DONE] * 3, [r.error for r in recs]
    assert handles[0].result().size == (SIZE, SIZE)
