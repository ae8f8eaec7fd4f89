"""Style transforms the LoRAs are trained to paint, and the statistics that measure them.

Why these styles: a LoRA changes only the UNet (and text encoder); what the masked region becomes
still goes through the trained model's small VAE decoder, whose gamut is neutrals and warm
orange-browns: flat posterized colours, 1-px outlines and large magenta, cyan, blue, green or
crimson areas come back grey or orange from a VAE round trip (measured, see
``docs/bench/training_addons.md``). And the x0 UNet paints the *mean* of the plausible fills of
content it cannot see, so a style must be a pointwise colour map whose averages stay in style
(a line in colour space). Both committed styles are such maps, visible at a glance and
measurable on invented content:

- ``sepia``: warm faded toning -- luminance mapped onto a brown line, blacks lifted, whites dimmed;
- ``noir``: low-key black and white -- grey, midtones darkened (gamma 1.6), contrast x1.3.

``neon`` (CIELAB lightness inverted, chroma x1.6) is kept for the record: its LoRA learned to
darken and saturate but not to invert the tones of invented content (it inverted the clock's
flat light background and darkened the motorcycle instead), so its statistic moved the wrong
way on half the held-out cases and it is not shipped.

Statistics over the masked pixels (lower = closer to the style); ``PRIMARY`` names each
style's own:

- ``sepia_distance`` (sepia): mean RGB distance (0-1 units) to the nearest point of the sepia
  line -- 0 for the transform itself whatever the content, so it needs no reference;
- ``lab_w1`` (noir): mean over L*, a*, b* of the 1-D Wasserstein distance between the fill's
  masked pixels and the style transform of the template's (CIELAB units): the colour and
  luminance histogram distance to what the style makes of the covered region (for noir: grey,
  and as dark / contrasty as the transform);
- ``lum_w1``: the same for L* only (neon's).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

STYLE_NAMES = ("sepia", "noir")  # committed LoRAs; "neon" was tried and dropped (module docstring)
PRIMARY = {"sepia": "sepia_distance", "noir": "lab_w1", "neon": "lum_w1"}
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def _u8(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def sepia_curve(y: np.ndarray) -> np.ndarray:
    """Colour of luminance ``y`` in [0, 1]: brown tone, blacks lifted, whites dimmed (a faded print)."""
    tone = np.array([1.0, 0.78, 0.52], dtype=np.float32)
    lift = np.array([0.16, 0.11, 0.06], dtype=np.float32)
    return lift + 0.80 * np.asarray(y, dtype=np.float32)[..., None] * tone


def sepia(img: np.ndarray) -> np.ndarray:
    return _u8(sepia_curve((np.asarray(img, dtype=np.float32) / 255.0) @ LUMA))


def noir(img: np.ndarray) -> np.ndarray:
    """Low-key black and white: gray, midtones darkened (gamma 1.6), contrast x1.3 around 0.45."""
    y = (np.asarray(img, dtype=np.float32) / 255.0) @ LUMA
    y = np.clip((y**1.6 - 0.5) * 1.3 + 0.45, 0.0, 1.0)
    return _u8(np.repeat(y[..., None], 3, axis=-1))


def neon(img: np.ndarray) -> np.ndarray:
    from skimage.color import lab2rgb, rgb2lab

    lab = rgb2lab(np.asarray(img))
    lab[..., 0] = 100.0 - lab[..., 0]
    lab[..., 1:] *= 1.6
    return _u8(lab2rgb(lab))


STYLES: dict[str, Callable[[np.ndarray], np.ndarray]] = {"sepia": sepia, "noir": noir, "neon": neon}


def apply_style(name: str, img: np.ndarray) -> np.ndarray:
    """``uint8`` HxWx3 -> the style's ``uint8`` HxWx3."""
    return STYLES[name](np.asarray(img)[..., :3])


def sepia_distance(img: np.ndarray, mask: np.ndarray) -> float:
    """Mean RGB distance (0-1) of the masked pixels to the nearest point of the sepia curve."""
    curve = sepia_curve(np.linspace(0, 1, 256, dtype=np.float32))  # [256, 3]
    p = np.asarray(img)[..., :3][mask].astype(np.float32) / 255.0
    return float(np.sqrt(((p[:, None, :] - curve[None]) ** 2).sum(-1)).min(1).mean())


def _w1(a: np.ndarray, b: np.ndarray) -> float:
    """1-D Wasserstein-1 distance of two samples (compared at 101 quantiles)."""
    q = np.linspace(0, 1, 101)
    return float(np.abs(np.quantile(a, q) - np.quantile(b, q)).mean())


def lab_w1(img: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """W1 distances between two images' masked pixels (CIELAB units): (L* only, mean over L*, a*, b*)."""
    from skimage.color import rgb2lab

    a, b = rgb2lab(np.asarray(img)[..., :3])[mask], rgb2lab(np.asarray(ref)[..., :3])[mask]
    per = [_w1(a[:, c], b[:, c]) for c in range(3)]
    return per[0], float(np.mean(per))


def style_scores(name: str, img: np.ndarray, template: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """The statistics of a result ``img`` for style ``name`` inside ``mask`` (``PRIMARY[name]`` first)."""
    lum, lab = lab_w1(img, apply_style(name, template), mask)
    out = {"lum_w1": lum, "lab_w1": lab}
    if name == "sepia":
        out = {"sepia_distance": sepia_distance(img, mask), **out}
    return out


def mean_lch(img: np.ndarray, mask: np.ndarray) -> tuple[float, float, float]:
    """Mean L*, mean chroma C*ab and chroma-weighted mean hue (degrees) of the masked pixels (descriptive)."""
    from skimage.color import rgb2lab

    lab = rgb2lab(np.asarray(img)[..., :3])[mask]
    chroma = np.hypot(lab[:, 1], lab[:, 2])
    hue = np.degrees(np.arctan2(lab[:, 2].sum(), lab[:, 1].sum())) % 360
    return float(lab[:, 0].mean()), float(chroma.mean()), float(hue)
