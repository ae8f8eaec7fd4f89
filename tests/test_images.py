"""Input decoding and validation (unit tests)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from app.maskgen import SHAPES, make_mask
from app.masks import mask_from_array
from workers.images import InvalidInput, decode_image, target_size, to_mask


def png(size=(32, 32), mode="RGB") -> bytes:  # type: ignore[no-untyped-def]
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, format="PNG")
    return buf.getvalue()


def test_decode_ok() -> None:
    assert decode_image(png(), what="x", max_pixels=10_000, max_bytes=10**6).size == (32, 32)


@pytest.mark.parametrize("data, reason", [
    (b"", "is empty"),
    (b"garbage", "could not be decoded"),
    (png()[:40], "could not be decoded"),
    (png((200, 200)), "over STENCIL_MAX_IMAGE_PIXELS"),
])
def test_decode_rejects(data: bytes, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason):
        decode_image(data, what="x", max_pixels=10_000, max_bytes=10**6)


def test_byte_limit() -> None:
    with pytest.raises(InvalidInput, match="bytes"):
        decode_image(png(), what="x", max_pixels=10_000, max_bytes=10)


def test_mask_conversions() -> None:
    assert np.asarray(mask_from_array(np.array([[True, False]]))).tolist() == [[255, 0]]
    assert np.asarray(mask_from_array(np.array([[1.0, 0.0]]))).tolist() == [[255, 0]]
    rgba = Image.new("RGBA", (2, 2), (0, 0, 0, 255))
    assert to_mask(rgba).mode == "L" and np.asarray(to_mask(rgba)).max() == 255
    with pytest.raises(InvalidInput):
        mask_from_array(np.zeros((2, 2, 3)))


def test_target_size_rounds_to_multiple_and_caps() -> None:
    assert target_size(130, 70, 8, 1024) == (128, 64)
    assert target_size(4000, 2000, 8, 1024) == (1024, 512)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", [0.03, 0.2, 0.5])
def test_mask_generator_hits_ratio(shape: str, ratio: float) -> None:
    mask = make_mask(ratio, (128, 96), shape, seed=1)
    assert mask.shape == (96, 128)
    assert abs(mask.mean() - ratio) < 0.02
