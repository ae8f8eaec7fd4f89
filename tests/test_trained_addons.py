"""The committed style LoRAs and canny ControlNet (workers/models/trained/): they load in the stock
diffusers pipelines and do what they were trained for, measured on held-out images.

Each effect check is a function of (reference result, result) that is also run on a random-init
adapter / ControlNet of the same shape and must fail there: the thresholds (from the measurements
in docs/bench/training_addons.md) sit between what the trained weights do and what an adapter
that merely changes *something* does. A zero adapter is the reference itself and fails trivially.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ops.train.styles import STYLE_NAMES, sepia_distance, style_scores
from ops.train.verify_addons import (
    COMBINED,
    CONTROLNET,
    LORAS,
    SCALES,
    Case,
    canny_edges,
    control_image,
    controlnet_pipe,
    edge_f1,
    edit,
    held_out_cases,
    inpaint_pipe,
    psnr,
    random_lora,
)


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return held_out_cases()


@pytest.fixture(scope="module")
def lora_pipe():  # type: ignore[no-untyped-def]
    pipe = inpaint_pipe()
    for style in STYLE_NAMES:
        pipe.load_lora_weights(LORAS / style, adapter_name=style)
    random_lora(pipe, "random_init", "sepia")
    return pipe


def _run(pipe, case: Case, names: list[str], weights: list[float]) -> np.ndarray:  # type: ignore[no-untyped-def]
    if names:
        pipe.enable_lora()
        pipe.set_adapters(names, weights)
    else:
        pipe.disable_lora()
    return edit(pipe, case)


# Thresholds on means over the two test cases (a clock and a motorcycle edit whose no-LoRA fill is
# far from both styles), set from docs/bench/training_addons.md: the trained LoRAs clear them by
# a wide margin; the random-init adapter (and the other style) miss them by a wide margin.
SEPIA_MAX, SEPIA_MIN_DROP = 0.08, 0.06   # sepia_distance (0-1 RGB units): trained 0.056, no LoRA 0.18, random 0.19
NOIR_MAX, NOIR_MIN_DROP = 12.0, 10.0     # noir Lab W1: trained (scale 0.5) ~8, no LoRA ~31, random ~23, sepia ~21
OUTSIDE_MAX_LOSS_DB = 1.5  # outside the mask, mean PSNR to the template may drop at most this much
TEST_CASES = (0, 4)


def _mean(f, outs: list[np.ndarray], cases: list[Case]) -> float:  # type: ignore[no-untyped-def]
    return float(np.mean([f(o, c) for o, c in zip(outs, cases)]))


def _sepia(img: np.ndarray, case: Case) -> float:
    return sepia_distance(img, case.mask)


def _noir(img: np.ndarray, case: Case) -> float:
    return style_scores("noir", img, np.asarray(case.template), case.mask)["lab_w1"]


def _outside(img: np.ndarray, case: Case) -> float:
    keep = ~case.mask
    return psnr(img[keep], np.asarray(case.template)[keep])


def _sepia_ok(none: list[np.ndarray], out: list[np.ndarray], cases: list[Case]) -> bool:
    got = _mean(_sepia, out, cases)
    return got <= SEPIA_MAX and _mean(_sepia, none, cases) - got >= SEPIA_MIN_DROP


def _noir_ok(none: list[np.ndarray], out: list[np.ndarray], cases: list[Case]) -> bool:
    got = _mean(_noir, out, cases)
    return got <= NOIR_MAX and _mean(_noir, none, cases) - got >= NOIR_MIN_DROP


def _outside_ok(none: list[np.ndarray], out: list[np.ndarray], cases: list[Case]) -> bool:
    return _mean(_outside, out, cases) >= _mean(_outside, none, cases) - OUTSIDE_MAX_LOSS_DB


def test_loras_are_diffusers_lora_files_with_model_cards() -> None:
    from safetensors import safe_open

    for style in STYLE_NAMES:
        path = LORAS / style / "pytorch_lora_weights.safetensors"
        assert path.stat().st_size < 2_000_000 and (LORAS / style / "README.md").is_file()
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
        assert keys and all(k.startswith(("unet.", "text_encoder.")) for k in keys)
    with safe_open(LORAS / "sepia" / "pytorch_lora_weights.safetensors", "pt") as f:
        assert any(k.startswith("text_encoder.") for k in f.keys())  # the text-encoder LoRA path


@pytest.fixture(scope="module")
def lora_outputs(lora_pipe, cases):  # type: ignore[no-untyped-def]
    """Edits of the test cases with no LoRA, each LoRA (recommended scale), both, and a random adapter."""
    sel = [cases[i] for i in TEST_CASES]
    variants = {"none": ([], []), "sepia": (["sepia"], [SCALES["sepia"]]), "noir": (["noir"], [SCALES["noir"]]),
                "both": ([n for n, _ in COMBINED], [w for _, w in COMBINED]), "random_init": (["random_init"], [1.0])}
    return sel, {k: [_run(lora_pipe, c, *v) for c in sel] for k, v in variants.items()}


def test_lora_styles_move_the_masked_region_and_keep_the_rest(lora_pipe, lora_outputs) -> None:  # type: ignore[no-untyped-def]
    sel, o = lora_outputs
    assert "sepia" in lora_pipe.text_encoder.peft_config  # its text-encoder LoRA is loaded
    assert _sepia_ok(o["none"], o["sepia"], sel) and _outside_ok(o["none"], o["sepia"], sel)
    assert _noir_ok(o["none"], o["noir"], sel) and _outside_ok(o["none"], o["noir"], sel)
    # Each style is its own: the other LoRA does not pass the check.
    assert not _sepia_ok(o["none"], o["noir"], sel) and not _noir_ok(o["none"], o["sepia"], sel)


def test_random_init_adapter_fails_the_style_checks(lora_outputs) -> None:  # type: ignore[no-untyped-def]
    sel, o = lora_outputs
    assert not all(np.array_equal(a, b) for a, b in zip(o["random_init"], o["none"]))  # it does change the output
    assert not _sepia_ok(o["none"], o["random_init"], sel) and not _noir_ok(o["none"], o["random_init"], sel)


def test_two_loras_combine(lora_pipe, lora_outputs) -> None:  # type: ignore[no-untyped-def]
    sel, o = lora_outputs
    assert not any(np.array_equal(a, b) for a, b in zip(o["both"], o["noir"]))  # sepia contributes
    assert not any(np.array_equal(a, b) for a, b in zip(o["both"], o["sepia"]))  # noir contributes
    # Both styles show: noir's tone, and a clear move towards sepia's colour.
    assert _noir_ok(o["none"], o["both"], sel) and _outside_ok(o["none"], o["both"], sel)
    assert _mean(_sepia, o["none"], sel) - _mean(_sepia, o["both"], sel) >= 0.03
    assert _mean(_sepia, o["none"], sel) - _mean(_sepia, o["random_init"], sel) < 0.03


@pytest.fixture(scope="module")
def cn_pipes():  # type: ignore[no-untyped-def]
    from diffusers import ControlNetModel

    cn = ControlNetModel.from_pretrained(CONTROLNET)
    rand = ControlNetModel.from_pretrained(CONTROLNET)
    torch.manual_seed(1)
    with torch.no_grad():  # random (instead of trained) zero convolutions: residuals, but not edges
        for m in [*rand.controlnet_down_blocks, rand.controlnet_mid_block, rand.controlnet_cond_embedding.conv_out]:
            m.weight.normal_(0, 0.02)
    return controlnet_pipe(cn), controlnet_pipe(rand)


# Mean edge F1 over the six held-out cases at the pipeline's default conditioning scale (0.5, as
# trained), docs/bench/training_addons.md: without 0.18, matched 0.47, mismatched control 0.27,
# random-init ControlNet 0.25. Dense controls (the motorcycle) give high chance-level F1, so the
# margins are on the mean over both images.
F1_MARGIN_WITHOUT = 0.15  # matched control vs no ControlNet (random-init: +0.06)
F1_MARGIN_MISMATCHED = 0.1  # matched vs a mismatched control (the edges of the other image)


def test_controlnet_fits_the_stock_inpaint_pipeline(cn_pipes) -> None:  # type: ignore[no-untyped-def]
    pipe, _ = cn_pipes
    assert pipe.controlnet.config.in_channels == 4  # what the pipeline feeds it (not the UNet's 9)
    assert pipe.unet.config.in_channels == 9
    assert (CONTROLNET / "README.md").is_file()
    assert (CONTROLNET / "diffusion_pytorch_model.safetensors").stat().st_size < 10_000_000


def test_controlnet_fill_follows_the_control_edges(cn_pipes, cases) -> None:  # type: ignore[no-untyped-def]
    pipe, rand_pipe = cn_pipes
    idx = range(len(cases))
    f1: dict[str, list[float]] = {"without": [], "matched": [], "mismatched": [], "random_init": []}
    for i in idx:
        case = cases[i]
        other = cases[(i + len(cases) // 2) % len(cases)]
        edges, wrong = canny_edges(np.asarray(case.template)), canny_edges(np.asarray(other.template))
        ctrl = control_image(edges)
        outs = {"without": edit(pipe, case, control_image=ctrl, controlnet_conditioning_scale=0.0),
                "matched": edit(pipe, case, control_image=ctrl),
                "mismatched": edit(pipe, case, control_image=control_image(wrong)),
                "random_init": edit(rand_pipe, case, control_image=ctrl)}
        for k, v in outs.items():
            f1[k].append(edge_f1(v, edges, case.mask))
    mean = {k: float(np.mean(v)) for k, v in f1.items()}
    assert mean["matched"] >= mean["without"] + F1_MARGIN_WITHOUT, mean
    assert mean["matched"] >= mean["mismatched"] + F1_MARGIN_MISMATCHED, mean
    assert mean["random_init"] < mean["without"] + F1_MARGIN_WITHOUT, mean  # the check fails for a random ControlNet
