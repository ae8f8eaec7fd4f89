"""``ops/gpu_checks.sh`` fits the device's limit of 600 s a command: the stages its header names for
each command (the default list, and the second command's) have time limits that add up to at most
580 s, and every stage named there exists; the benchmarks' guide states the default stages' limits."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "ops" / "gpu_checks.sh"
BUDGET_S = 580  # of the 600 s a device command may run: set-up and packing the results


def _stages() -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^(?:\w+=\w+ )?stage (\w+) (\d+) ", SCRIPT.read_text(), re.MULTILINE)}


def _commands() -> list[list[str]]:
    text = SCRIPT.read_text()
    default = re.search(r"STAGES=\$\{GPU_CHECKS:-([\w,]+)\}", text)
    assert default, "the default stage list"
    named = re.findall(r"GPU_CHECKS=([\w,]+) bash ops/gpu_checks.sh", text)
    return [default[1].split(",")] + [n.split(",") for n in named]


def test_each_documented_command_fits_the_device_limit() -> None:
    stages = _stages()
    commands = _commands()
    assert len(commands) >= 3  # the default, the add-ons alone, the second command with everything else
    for names in commands:
        unknown = [n for n in names if n not in stages]
        assert not unknown, f"{names}: no such stage {unknown}"
        assert sum(stages[n] for n in names) <= BUDGET_S, f"{names}: {sum(stages[n] for n in names)} s"


def test_every_stage_runs_in_some_documented_command() -> None:
    named = {n for names in _commands() for n in names}
    assert set(_stages()) <= named, set(_stages()) - named


def test_the_benchmarks_guide_states_the_default_stages_limits() -> None:
    guide = " ".join((SCRIPT.parents[1] / "docs" / "benchmarks.md").read_text().split())
    stages = _stages()
    for name in _commands()[0]:
        assert f"`{name}` ({stages[name]} s" in guide, name
