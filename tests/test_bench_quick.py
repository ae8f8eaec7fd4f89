"""Every benchmark's ``--quick`` mode runs from the repository alone and writes its report.

Each runs as the README says (``python -m ops.bench.<name> --quick``) in its own process, with a
fresh home, ``HOME`` and temporary folder (nothing read from outside the repository: the traces ship in
``ops/data/mask_ratios``, models are built or shipped in ``workers/models``), its output in a
temporary folder. The process is a fork of one that imported torch and diffusers once
(``tests/support/bench_launch.py``: that import was a quarter of these tests' time); it imports the
project's modules itself. New modules of ``ops/bench`` are picked up without editing this file.
"""

from __future__ import annotations

import os
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import ops.bench
from tests.support.bench_launch import Launcher

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(m.name for m in pkgutil.iter_modules(ops.bench.__path__) if m.name != "harness")
# Extra options beside --quick and --out (where a benchmark's main output is not one Markdown file).
EXTRA = {"profile": ["--report", "{tmp}/profile.md", "--plot", "{tmp}/cm.png"]}
REPORT = {"e2e": "README.md", "profile": "profile.md"}
# redis-server, Celery workers
STARTS_PROCESSES = {"e2e", "e2e_gpu", "recovery", "replay", "overheads", "api_load", "stack_start"}


def _cases() -> list:  # type: ignore[type-arg]
    cases = [(name, []) for name in BENCHMARKS] + [("bubble", ["--mode", "steady"]), ("bubble", ["--mode", "replay"]),
                                                   ("gpu_step", ["--parts", "reuse", "--models", "sd15,flux"]),
                                                   ("gpu_step", ["--parts", "resnets,flops", "--models", "sd15"]),
                                                   ("gpu_step", ["--parts", "dispatch", "--models", "sd15,flux"]),
                                                   ("maskaware_unet", ["--resnets", "full,masked"])]
    return [pytest.param(name, extra, id=" ".join([name, *extra]),
                         marks=[pytest.mark.integration] if name in STARTS_PROCESSES else [])
            for name, extra in cases]


def _base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STENCIL_")}
    env.update(HOME=str(home), STENCIL_MODEL_ID="tiny-sd-inpaint", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return env


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """The forkserver, started with a fresh home of its own (read by imports such as huggingface_hub's)."""
    yield Launcher(_base_env(tmp_path_factory.mktemp("launcher-home")))


def test_every_benchmark_module_is_listed_in_the_package_docstring() -> None:
    for name in BENCHMARKS:
        assert f"``{name}``" in (ops.bench.__doc__ or ""), name


@pytest.mark.parametrize(("name", "extra"), _cases())
def test_quick_mode_runs_from_the_repository_alone(name: str, extra: list[str], tmp_path: Path,
                                                   launcher: Launcher) -> None:
    env = _base_env(tmp_path / "home")
    (tmp_path / "tmp").mkdir()
    env.update(TMPDIR=str(tmp_path / "tmp"), STENCIL_HOME=str(tmp_path / "stencil-home"))
    out = tmp_path / ("e2e" if name == "e2e" else "cm.json" if name == "profile" else "report.md")
    argv = ["--quick", "--out", str(out), *extra, *(a.format(tmp=tmp_path) for a in EXTRA.get(name, []))]
    code, stderr = launcher.run(f"ops.bench.{name}", argv, env, ROOT, tmp_path, timeout=300)
    assert code == 0, stderr[-4000:]
    report = (out / REPORT["e2e"]) if name == "e2e" else tmp_path / REPORT.get(name, out.name)
    text = report.read_text()
    assert f"python -m ops.bench.{name} --quick --out {out}" in text, text[:2000]
