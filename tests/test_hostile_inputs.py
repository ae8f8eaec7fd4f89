"""Hostile inputs through every entry point: each ends in a refusal that names what was wrong (no
traceback, no server path, no object repr) or a normalised success, and the workers keep
serving good jobs submitted beside the bad ones."""

from __future__ import annotations

import io
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.client import InvalidParameter, StencilClient
from app.jobs import JobParams, JobStatus, clean_reason
from app.maskgen import make_mask
from app.settings import Settings
from app.validation import MAX_ID_CHARS, object_id
from tests.test_service import SIZE, template
from workers.images import decode_image, to_mask, to_rgb

LIMITS = dict(max_pixels=4096 * 4096, max_bytes=32 << 20)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring huge dimensions (the data itself is tiny and wrong)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
            + chunk(b"IEND", b""))


def _rotated_jpeg(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif, quality=95)
    return buf.getvalue()


def _clean(reason: str) -> None:
    assert not re.search(r"at 0x[0-9a-fA-F]+", reason) and "/tmp" not in reason and "Traceback" not in reason, reason
    assert len(reason) <= 300, reason


# -- parameters: one boundary for client, CLI, catalogs and the service ---------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(guidance=float("nan")), "guidance"), (dict(guidance=float("inf")), "guidance"),
    (dict(guidance=1e9), "guidance"), (dict(guidance=-1.0), "guidance"), (dict(guidance="high"), "guidance"),
    (dict(steps=1.5), "steps"), (dict(steps="ten"), "steps"), (dict(steps=0), "steps"),
    (dict(steps=10**6), "steps"),
    (dict(steps=True), "steps"), (dict(seed="abc"), "seed"), (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"),
    (dict(strength=0.0), "strength"), (dict(strength=1.5), "strength"), (dict(priority=10**9), "priority"),
    (dict(prompt="x" * 5000), "prompt"), (dict(prompt="a\x00b"), "prompt"),
    (dict(negative_prompt=None), "negative_prompt"),
    (dict(fidelity="fastest"), "fidelity"), (dict(width=100), "width"), (dict(deadline=float("nan")), "deadline"),
    (dict(template_id="/etc/passwd"), "template"), (dict(template_id="etc/passwd"), "template"),
    (dict(template_id="etc//passwd"), "template"), (dict(template_id="../x"), "template"),
    (dict(template_id="a\x00b"), "template"), (dict(template_id="x" * 5000), "template"),
])
def test_bad_parameters_are_refused_naming_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidParameter) as err:
        JobParams(**kwargs).check(200)
    assert err.value.name == name and str(err.value).startswith(f"{name}: ")
    _clean(str(err.value))
    assert JobParams(**kwargs).validate(200) == str(err.value)  # the service's check says the same


def test_good_parameters_are_normalised_once() -> None:
    p = JobParams(steps="12", seed="7", guidance="3.5", priority=2.0, template_id="  sku-1.png ").check(200)
    assert (p.steps, p.seed, p.guidance, p.priority, p.template_id) == (12, 7, 3.5, 2, "sku-1.png")
    assert object_id("id", "A" * MAX_ID_CHARS) == "A" * MAX_ID_CHARS


def test_client_refuses_before_storing_anything(tmp_path: Path) -> None:
    """No Redis is needed to refuse: the check runs before any write (the URL points nowhere)."""
    client = StencilClient(Settings(redis_url="redis://127.0.0.1:1/0", store_dir=tmp_path / "store"))
    mask = make_mask(0.2, (SIZE, SIZE), seed=1)
    for kwargs, name in [(dict(steps="ten"), "steps"), (dict(seed="abc"), "seed"),
                         (dict(guidance=float("nan")), "guidance"), (dict(template="../../etc/passwd"), "template")]:
        kwargs.setdefault("template", template(1))
        with pytest.raises(InvalidParameter, match=name):
            client.submit(mask=mask, **kwargs)
    with pytest.raises(InvalidParameter, match="template id"):
        client.add_template(template(1), "../../etc/passwd")
    assert not any((tmp_path / "store").rglob("*.png")) and not any((tmp_path / "store").rglob("image"))


def test_cli_refuses_a_path_as_template_id_in_one_line(tmp_path: Path) -> None:
    img = tmp_path / "t.png"
    template(2).save(img)
    out = subprocess.run([sys.executable, "-m", "app.cli", "template", "add", str(img), "--id", "../../etc/passwd"],
                         capture_output=True, text=True, env={"STENCIL_HOME": str(tmp_path / "home"),
                                                              "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "template id: may contain only" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# -- images: decoded, limited, upright ------------------------------------------------------------

@pytest.mark.parametrize("data, expect", [
    (b"", "is empty"),
    (b"GIF89a" + bytes(40), "could not be decoded"),
    (bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "could not be decoded"),
    (_bomb_png(100_000, 100_000), "over STENCIL_MAX_IMAGE_PIXELS"),
    (_bomb_png(5000, 4000), "over STENCIL_MAX_IMAGE_PIXELS"),
])
def test_bad_images_are_refused_cleanly(data: bytes, expect: str) -> None:
    from app.masks import InvalidInput

    with pytest.raises(InvalidInput) as err:
        decode_image(data, what="template image", **LIMITS)
    assert expect in str(err.value)
    _clean(str(err.value))


def test_random_bytes_never_escape_as_other_errors() -> None:
    """A small fuzzer: prefixes of real image files with random tails never raise anything but a
    clean refusal (or decode)."""
    from app.masks import InvalidInput

    rng = np.random.default_rng(1)
    seeds = [_png(template(3)), _rotated_jpeg(template(4), 6)]
    for i in range(60):
        base = seeds[i % 2]
        cut = int(rng.integers(8, len(base)))
        data = base[:cut] + bytes(rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8))
        try:
            decode_image(data, what="template image", **LIMITS)
        except InvalidInput as exc:
            _clean(str(exc))


@pytest.mark.parametrize("mode", ["CMYK", "I;16", "P", "PA", "LA", "1", "L", "RGBA", "I", "F"])
def test_odd_modes_normalise_to_rgb_and_mask(mode: str) -> None:
    img = template(5).convert("RGBA" if mode in ("PA",) else "RGB")
    if mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE)
        img.info["transparency"] = 0
    elif mode == "PA":
        img = img.convert("PA")
    else:
        img = img.convert(mode)
    fmt = "TIFF" if mode in ("CMYK", "I", "F", "PA") else "PNG"
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    decoded = decode_image(buf.getvalue(), what="template image", **LIMITS)
    assert to_rgb(decoded).mode == "RGB" and to_rgb(decoded).size == (SIZE, SIZE)
    assert to_mask(decoded).mode == "L"


@pytest.mark.parametrize("orientation, turned", [(1, False), (3, False), (6, True), (8, True)])
def test_exif_orientation_is_applied(orientation: int, turned: bool) -> None:
    """A phone photo is stored sideways with an orientation tag: decoded, it is upright (what every
    viewer shows and the mask was drawn on)."""
    stored = template(6).resize((160, 96))
    upright = decode_image(_rotated_jpeg(stored, orientation), what="template image", **LIMITS)
    assert upright.size == ((96, 160) if turned else (160, 96))


def test_reasons_lose_paths_and_reprs() -> None:
    raw = ("prepare failed: OSError: [Errno 36] File name too long: '/srv/stencil/store/templates/x/image' "
           "<_io.BytesIO object at 0x7f3a2c1b2e80>")
    out = clean_reason(raw)
    assert "/srv" not in out and "0x7f" not in out and "File name too long" in out


# -- through the service: bad jobs beside good ones -----------------------------------------------

@pytest.mark.integration
def test_hostile_jobs_fail_cleanly_beside_good_ones(stack, client: StencilClient) -> None:  # type: ignore[no-untyped-def]
    from tests.test_service import result_array

    good_mask = make_mask(0.2, (SIZE, SIZE), seed=3)
    good = [client.submit(template=template(90 + i), mask=good_mask, prompt="ok", steps=6, seed=i) for i in range(2)]
    rotated = template(95).resize((SIZE, SIZE))
    phone = client.submit(template=_rotated_jpeg(rotated.transpose(Image.Transpose.ROTATE_90), 6),
                          mask=good_mask, steps=4)
    bad = {
        "bomb": client.submit(template=_bomb_png(100_000, 100_000), mask=good_mask, steps=4),
        "random bytes": client.submit(template=bytes(range(256)) * 8, mask=good_mask, steps=4),
        "mask bomb": client.submit(template=template(96), mask=_bomb_png(50_000, 50_000), steps=4),
        "unknown template": client.submit(template="sku-does-not-exist", mask=good_mask, steps=4),
    }
    for what, handle in bad.items():
        rec = handle.wait(60)
        assert rec.status == JobStatus.FAILED, f"{what}: {rec.status}"
        _clean(rec.error or "")
        assert not list(client.redis.scan_iter(f"stencil:blob:{handle.id}:*")), f"{what}: uploads kept"
    assert "STENCIL_MAX_IMAGE_PIXELS" in (bad["bomb"].record().error or "")
    assert not client.store.exists(f"templates/{bad['random bytes'].record().params.template_id}/image")
    for handle in good:
        assert handle.wait(120).status == JobStatus.DONE
    rec = phone.wait(120)
    assert rec.status == JobStatus.DONE, rec.error
    assert result_array(phone).shape[:2] == (SIZE, SIZE)
    assert all(p.poll() is None for p in stack.procs.values())
