"""Uploaded parts, checked before anything is stored: within their byte limit, and images fully
decoded with the workers' own decoder (``workers/images.py``: formats, STENCIL_MAX_IMAGE_PIXELS,
truncation), so an unusable image is a 413 or 422 at the door rather than a failed job later."""

from __future__ import annotations

from fastapi import UploadFile

from app.gateway.errors import ApiProblem
from app.masks import InvalidInput
from app.settings import Settings
from workers.images import decode_image


def read_part(upload: UploadFile, part: str, limit: int, setting: str) -> bytes:
    data = upload.file.read(limit + 1)
    if len(data) > limit:
        raise ApiProblem(413, f"{part} is over {limit} bytes ({setting})", parameter=part)
    if not data:
        raise ApiProblem(422, f"{part} is empty", parameter=part)
    return data


def read_image(upload: UploadFile, part: str, settings: Settings) -> bytes:
    """An image part's bytes, once they decode within the settings' limits."""
    return check_image(read_part(upload, part, settings.max_upload_bytes, "STENCIL_MAX_UPLOAD_BYTES"), part, settings)


def check_image(data: bytes, part: str, settings: Settings) -> bytes:
    try:
        decode_image(data, what=part, max_pixels=settings.max_image_pixels, max_bytes=settings.max_upload_bytes)
    except InvalidInput as exc:
        raise ApiProblem(422, str(exc), parameter=part) from None
    return data
