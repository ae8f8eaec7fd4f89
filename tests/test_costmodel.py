"""Cost model: feature derivation against the real UNet, fit/save/load round trip, predictions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app.costmodel import (
    STEP_FEATURES,
    CostModel,
    FitReport,
    TierFit,
    UNetArch,
    admission_profile,
    finish_times,
    queue_finish_time,
    token_counts_from_mask,
)


@pytest.fixture(scope="module")
def tiny_unet():  # type: ignore[no-untyped-def]
    from workers.models.tiny_sd import build_unet

    return build_unet().eval()


def _hooked_fullmap_macs(unet: torch.nn.Module, latent: int) -> int:
    """MACs of every conv/linear outside the transformer blocks, counted on a real forward."""
    from diffusers.models.attention import BasicTransformerBlock

    inside = {id(m) for b in unet.modules() if isinstance(b, BasicTransformerBlock) for m in b.modules()}
    total = [0]

    def hook(mod: torch.nn.Module, _inp: object, out: torch.Tensor) -> None:
        if id(mod) in inside:
            return
        if isinstance(mod, torch.nn.Conv2d):
            total[0] += out.numel() * mod.in_channels // mod.groups * mod.kernel_size[0] * mod.kernel_size[1]
        elif isinstance(mod, torch.nn.Linear):
            total[0] += out.numel() * mod.in_features

    kinds = (torch.nn.Conv2d, torch.nn.Linear)
    handles = [m.register_forward_hook(hook) for m in unet.modules() if isinstance(m, kinds)]
    try:
        with torch.no_grad():
            unet(torch.randn(1, 9, latent, latent), torch.tensor([10]),
                 torch.randn(1, 77, unet.config.cross_attention_dim))
    finally:
        for h in handles:
            h.remove()
    return total[0]


def test_arch_derivation_matches_the_real_model(tiny_unet) -> None:  # type: ignore[no-untyped-def]
    from workers.maskaware.unet import MaskAwareUNet

    arch = UNetArch.from_unet_config(dict(tiny_unet.config), (16, 16))
    assert arch.fullmap_macs_per_row == _hooked_fullmap_macs(tiny_unet, 16)
    ctrl = MaskAwareUNet(tiny_unet)
    try:
        assert sorted(b.name for b in arch.blocks) == sorted(ctrl.block_names)
        assert arch.cache_bytes_per_step() == ctrl.cache_nbytes(16, 16, rows=2)
    finally:
        ctrl.remove()


@pytest.mark.parametrize("size, latent", [((128, 128), (16, 16)), ((120, 200), (15, 25)), ((64, 96), (9, 13))])
def test_token_counts_match_the_torch_token_masks(size: tuple[int, int], latent: tuple[int, int]) -> None:
    from workers.maskaware.tokens import blob_mask, build_token_masks, rect_mask

    for k, ratio in enumerate((0.02, 0.1, 0.4)):
        mask = (blob_mask if k % 2 else rect_mask)(*size, ratio, seed=k)
        tm = build_token_masks(mask, latent, 3)
        assert token_counts_from_mask(mask.numpy(), latent, 3) == tuple(int(lvl.sum()) for lvl in tm.levels)


def test_ratio_estimate_tracks_real_masks() -> None:
    """The estimate used when only a ratio is known, calibrated on some realistic masks, stays
    near the real pooled counts of other masks."""
    from workers.maskaware.tokens import blob_mask, build_token_masks, rect_mask

    arch = UNetArch(latent_hw=(32, 32), num_levels=3, blocks=(), fullmap_macs_per_row=0.0)

    def counts(ratio: float, seed: int) -> tuple[int, ...]:
        make = blob_mask if seed % 2 else rect_mask
        return tuple(int(x.sum()) for x in build_token_masks(make(256, 256, ratio, seed=seed), (32, 32), 3).levels)

    ratios = (0.05, 0.1, 0.35)
    calibrated = arch.with_edges([(r, counts(r, s)) for r in ratios for s in range(4)])
    assert len(calibrated.edge_cells) == 3
    for ratio in ratios:
        real = np.mean([counts(ratio, s) for s in range(10, 14)], axis=0)
        est = np.array(calibrated.tokens_from_ratio(ratio))
        assert np.all(np.abs(est - real) <= np.maximum(0.3 * real, 3)), (ratio, est, real)
    assert calibrated.tokens_from_ratio(0.0) == (0, 0, 0)
    assert calibrated.tokens_from_ratio(1.0) == (1024, 256, 64)


def _synthetic_model(arch: UNetArch) -> tuple[CostModel, np.ndarray, np.ndarray]:
    """Points from a known linear law + 2% noise, fitted by the profiler's own fitting code."""
    from ops.bench.profile import fit_linear

    rng = np.random.default_rng(0)
    true_coef = np.array([0.02, 0.05, 0.01, 0.001, 0.003])
    rows = []
    for _ in range(60):
        n = int(rng.integers(1, 9))
        jobs = [None if rng.random() < 0.3 else arch.tokens_from_ratio(rng.uniform(0.01, 0.9)) for _ in range(n)]
        feats = np.sum([arch.job_features(t) for t in jobs], axis=0)
        rows.append(feats)
    x = np.array(rows)
    y = (0.004 + x @ true_coef) * rng.lognormal(0, 0.02, len(rows))
    reg, report, _ = fit_linear(x, y, 0.25, 0)
    model = CostModel("tiny-sd-inpaint", "cpu-test", arch, float(reg.intercept_), tuple(float(c) for c in reg.coef_),
                      tiers={"local": TierFit(0.001, 500e6), "host": TierFit(0.0, 5e9)}, step_report=report)
    return model, true_coef, y


def test_fit_save_load_round_trip_and_predictions(tiny_unet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    arch = UNetArch.from_unet_config(dict(tiny_unet.config), (16, 16))
    model, true_coef, _ = _synthetic_model(arch)
    assert model.step_report is not None and model.step_report.r2_test > 0.95
    path = model.save(tmp_path / "m.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == "stencil-costmodel" and raw["version"] == 1
    assert raw["step"]["features"] == list(STEP_FEATURES)
    assert len(raw["step"]["report"]["residuals_test"]) == raw["step"]["report"]["n_test"]
    loaded = CostModel.load(path)
    assert loaded.coef == model.coef and loaded.intercept == model.intercept and loaded.arch == arch
    assert loaded.tiers["local"].bytes_per_s == 500e6
    # Prediction sanity: more masked tokens cost more; a full mask costs what no cache costs.
    costs = [loaded.job_seconds(mask_ratio=r) for r in (0.01, 0.1, 0.3, 0.7)]
    assert costs == sorted(costs) and costs[0] > 0
    assert loaded.job_seconds(mask_ratio=1.0) == loaded.job_seconds(mask_ratio=0.2, cached=False)
    assert loaded.job_seconds(mask_ratio=0.2) < loaded.job_seconds(mask_ratio=0.2, cached=False)
    batch = [loaded.job_seconds(mask_ratio=r) for r in (0.1, 0.5)]
    assert loaded.step_seconds(batch) == pytest.approx(loaded.intercept + sum(batch))
    # Fetching a template's cache: bytes per step x steps through the tier's fit.
    nbytes = 30 * arch.cache_bytes_per_step()
    assert loaded.template_fetch_seconds(30, "local") == pytest.approx(0.001 + nbytes / 500e6)
    assert loaded.template_fetch_seconds(30, "s3") == 0.0  # no fit for a tier: no penalty


def test_load_refuses_other_formats(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "pickle"}))
    with pytest.raises(ValueError):
        CostModel.load(bad)
    arch = UNetArch(latent_hw=(8, 8), num_levels=2, blocks=(), fullmap_macs_per_row=1e6)
    d = CostModel("m", "d", arch, 0.0, (0.0,) * 5, step_report=FitReport(1, 1, 0, 1, 1)).to_dict()
    d["version"] = 99
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError):
        CostModel.load(bad)


def test_profiler_runs_the_real_runner_end_to_end(tmp_path: Path, model_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny real profile: the engine's runner (mask-aware when available), JSON out, loads back."""
    from ops.bench import profile

    monkeypatch.setenv("STENCIL_HOME", str(model_home))
    out = tmp_path / "cm.json"
    assert profile.main(["--model", "tiny", "--points", "8", "--max-jobs", "3", "--repeats", "1",
                         "--load-sizes-mib", "0.25", "0.5", "1", "2", "--load-repeats", "2", "--out", str(out)]) == 0
    model = CostModel.load(out)
    assert model.model_id == "tiny-sd-inpaint" and model.device_kind.startswith("cpu-")
    assert model.step_report is not None and model.step_report.n_test >= 2
    assert {"local", "host"} <= set(model.tiers)
    assert model.meta["maskaware_profiled"] is True
    assert model.step_seconds([model.job_seconds(mask_ratio=0.2)]) > 0


def test_profiler_builds_the_true_size_unet_it_is_asked_for_and_names_the_device() -> None:
    """``--model sd15-inpaint`` profiles the UNet a GPU deployment serves (its shrunk twin here: the
    same structure); a CPU fit's device kind keeps naming the processor and the threads."""
    from ops.bench import profile
    from ops.bench.harness.runner_timing import load_model
    from workers.models import true_size

    mut = load_model("sd15-inpaint", 8, 0, quick=True)
    want = true_size.shrunk("sd15-inpaint").components["unet"].config
    assert mut.model_id == "sd15-inpaint" and mut.latent == 8
    assert list(mut.unet.config.block_out_channels) == list(want["block_out_channels"])
    assert mut.unet.config.in_channels == 9 and mut.cross_dim == want["cross_attention_dim"]
    assert profile.device_kind("cpu").startswith("cpu-") and profile.device_kind("cpu").endswith(
        f"-{torch.get_num_threads()}t")
    assert profile.host_copy_seconds(torch.ones(1 << 16), "cpu") >= 0


def test_profiled_steps_are_graph_replays_where_the_engine_replays_graphs() -> None:
    """Where steps are graphed (CUDA; the CPU stand-in here), the profiler's timed steps are the
    replays the engine runs in steady state, full and masked batches alike, never the capture."""
    from ops.bench.harness.runner_timing import JobSpec, RunnerTimer, load_model

    timer = RunnerTimer(load_model("sd15-inpaint", 8, 0, quick=True), steps=8, graphs=True)
    graphs = timer.runner.graphs
    assert graphs is not None and timer.warm == graphs.repeats
    for specs in ([JobSpec(0.3, True, "blob", 1), JobSpec(0.1, True, "rect", 2)], [JobSpec(1.0, False, "blob", 3)]):
        before = (graphs.captures, graphs.replays)
        wall, _, jobs = timer.time_batch(specs, 3)
        assert len(wall) == 3 and all(j.steps_done == 3 + timer.warm for j in jobs)
        # one eager step, one capture (which replays once), then the 3 timed replays
        assert graphs.captures == before[0] + 1 and graphs.replays == before[1] + 1 + 3
    with pytest.raises(ValueError, match="exceed"):
        timer.time_batch([JobSpec(0.3, True, "blob", 1)], 7)


def test_the_profilers_caches_serve_the_runners_stage_ahead_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the runner stages each masked job's next step while the current one computes (the
    stager's side stream); the profiler's in-memory caches answer that path too. Here the stager
    claims a side stream and stages inline, which runs the same runner code on the CPU."""
    from ops.bench.harness.runner_timing import JobSpec, RunnerTimer, load_model
    from workers.engine.staging import CacheStager

    monkeypatch.setattr(CacheStager, "asynchronous", property(lambda self: True))
    ahead: list[int] = []
    original = CacheStager.ahead_batch
    monkeypatch.setattr(CacheStager, "ahead_batch", lambda self, entries: (ahead.append(len(entries)),
                                                                           original(self, entries))[1])
    timer = RunnerTimer(load_model("sd15-inpaint", 8, 0, quick=True), steps=8)
    wall, _, jobs = timer.time_batch([JobSpec(0.3, True, "blob", 1), JobSpec(0.1, True, "rect", 2)], 3)
    assert len(wall) == 3 and all(j.state.mode == "masked" for j in jobs)
    assert sum(ahead) > 0, ahead  # masked jobs' next steps were staged ahead


def test_the_profiler_records_and_replays_caches_in_half_precision() -> None:
    """On a GPU the profiler runs in bfloat16 (``--device cuda``'s default): its warm-ups key their
    caches by that dtype, as the service's do, so the runner accepts them for masked steps."""
    from ops.bench.harness.runner_timing import JobSpec, RunnerTimer, load_model

    timer = RunnerTimer(load_model("sd15-inpaint", 8, 0, dtype=torch.bfloat16, quick=True), steps=4)
    wall, _, jobs = timer.time_batch([JobSpec(0.3, True, "blob", 1), JobSpec(0.1, True, "rect", 2)], 2)
    assert len(wall) == 2 and all(j.state.mode == "masked" for j in jobs)
    assert all(j.state.cache_key.layout.endswith("@bfloat16") for j in jobs)


def test_queue_integration_matches_step_by_step_simulation() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        b = int(rng.integers(1, 5))
        n_running = int(rng.integers(0, b + 1))
        running = [(float(rng.uniform(0.01, 0.1)), int(rng.integers(1, 20))) for _ in range(n_running)]
        queued = [(float(rng.uniform(0.01, 0.1)), int(rng.integers(1, 20))) for _ in range(int(rng.integers(1, 5)))]
        # Reference: literally step the batch.
        active = [[s, r] for s, r in running]
        queue = [[s, r] for s, r in queued]
        target = queue[-1]
        t = 0.0
        while True:
            while queue and len(active) < b:
                active.append(queue.pop(0))
            t += 0.005 + sum(s for s, _ in active)
            for job in active:
                job[1] -= 1
            if target[1] == 0:
                break
            active = [j for j in active if j[1] > 0]
        assert queue_finish_time(running, queued, b, 0.005) == pytest.approx(t)
    t_admit, alive = admission_profile([(0.1, 3)], [], 1, 0.0)
    assert t_admit == pytest.approx(0.3) and alive == []


def test_finish_times_with_a_general_predictor() -> None:
    step = lambda idx: 1.0 + len(idx)  # noqa: E731
    assert finish_times([2, 1, 3], step) == [1 * 4 + 1 * 3, 4.0, 4 + 3 + 2]
    assert finish_times([], step) == []
