"""Decoding and validating user images and masks (Pillow), with limits, before any model runs."""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps

from app.masks import InvalidInput

ALLOWED_FORMATS = {"PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF"}


def decode_image(data: bytes, *, what: str, max_pixels: int, max_bytes: int) -> Image.Image:
    """Decode image bytes fully (so truncation is detected here, not in a later stage) and turn
    the image upright as its EXIF orientation says (as every viewer shows a phone photo; a mask
    drawn on the upright view must land on the same pixels). Errors name the limit's setting and
    never quote library internals (object reprs, paths)."""
    if not data:
        raise InvalidInput(f"{what} is empty")
    if len(data) > max_bytes:
        raise InvalidInput(f"{what} is {len(data)} bytes, over STENCIL_MAX_UPLOAD_BYTES = {max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.format not in ALLOWED_FORMATS:
                raise InvalidInput(f"{what} has unsupported format {img.format or 'unknown'} "
                                   f"(accepted: {', '.join(sorted(ALLOWED_FORMATS))})")
            width, height = img.size
            if width * height > max_pixels:
                raise InvalidInput(f"{what} is {width}x{height} = {width * height} pixels, over "
                                   f"STENCIL_MAX_IMAGE_PIXELS = {max_pixels}")
            img.load()
    except InvalidInput:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidInput(f"{what} is too large (over STENCIL_MAX_IMAGE_PIXELS = {max_pixels} pixels)") from exc
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError... on corrupt data
        raise InvalidInput(f"{what} could not be decoded as an image ({type(exc).__name__})") from exc
    return _upright(img)


def _upright(img: Image.Image) -> Image.Image:
    """``ImageOps.exif_transpose``; an image whose EXIF block is itself broken stays as stored."""
    try:
        return ImageOps.exif_transpose(img) or img
    except Exception:  # corrupt EXIF must not fail an otherwise valid image
        return img


def to_rgb(img: Image.Image) -> Image.Image:
    return img.convert("RGB") if img.mode != "RGB" else img


def to_mask(img: Image.Image) -> Image.Image:
    """A single-channel mask: white (>= 128 after the pipeline's binarization) = edit."""
    if img.mode in ("RGBA", "LA"):
        img = img.getchannel("A") if img.mode == "RGBA" else img.getchannel(1)
    return img.convert("L")


def target_size(width: int, height: int, multiple: int, max_side: int) -> tuple[int, int]:
    """Processing size: scaled down to ``max_side`` and rounded down to the VAE's multiple."""
    scale = min(1.0, max_side / max(width, height))
    w = max(multiple, int(width * scale) // multiple * multiple)
    h = max(multiple, int(height * scale) // multiple * multiple)
    return w, h


def encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
