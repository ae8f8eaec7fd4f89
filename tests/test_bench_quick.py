"""Every benchmark's ``--quick`` mode runs from the repository alone and writes its report.

Each runs as the README says (``python -m ops.bench.<name> --quick``) in its own process, with a
fresh home, ``HOME`` and temporary folder (nothing read from outside the repository: the traces ship in
``ops/data/mask_ratios``, models are built or shipped in ``workers/models``), its output in a
temporary folder. New modules of ``ops/bench`` are picked up without editing this file.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import ops.bench

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(m.name for m in pkgutil.iter_modules(ops.bench.__path__) if m.name != "harness")
# Extra options beside --quick and --out (where a benchmark's main output is not one Markdown file).
EXTRA = {"profile": ["--report", "{tmp}/profile.md", "--plot", "{tmp}/cm.png"]}
REPORT = {"e2e": "README.md", "profile": "profile.md"}
STARTS_PROCESSES = {"e2e", "recovery", "replay", "overheads"}  # redis-server, Celery workers


def _cases() -> list:  # type: ignore[type-arg]
    cases = [(name, []) for name in BENCHMARKS] + [("bubble", ["--mode", "steady"]), ("bubble", ["--mode", "replay"])]
    return [pytest.param(name, extra, id=" ".join([name, *extra]),
                         marks=[pytest.mark.integration] if name in STARTS_PROCESSES else [])
            for name, extra in cases]


def test_every_benchmark_module_is_listed_in_the_package_docstring() -> None:
    for name in BENCHMARKS:
        assert f"``{name}``" in (ops.bench.__doc__ or ""), name


@pytest.mark.parametrize(("name", "extra"), _cases())
def test_quick_mode_runs_from_the_repository_alone(name: str, extra: list[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STENCIL_")}
    (tmp_path / "tmp").mkdir()
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"), STENCIL_HOME=str(tmp_path / "stencil-home"),
               STENCIL_MODEL_ID="tiny-sd-inpaint", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = tmp_path / ("e2e" if name == "e2e" else "cm.json" if name == "profile" else "report.md")
    argv = [sys.executable, "-m", f"ops.bench.{name}", "--quick", "--out", str(out), *extra,
            *(a.format(tmp=tmp_path) for a in EXTRA.get(name, []))]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = (out / REPORT["e2e"]) if name == "e2e" else tmp_path / REPORT.get(name, out.name)
    text = report.read_text()
    assert f"python -m ops.bench.{name} --quick --out {out}" in text, text[:2000]
