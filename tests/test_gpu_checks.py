"""``ops/gpu_checks.sh`` fits the device's limit of 600 s a command: the stages its header names for
each command (the default list, and the second command's) have time limits that add up to at most
580 s, and every stage named there exists; the benchmarks' guide states the default stages' limits;
every benchmark command in it parses (a lent GPU's minutes are not spent on a misspelt option)."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

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


def _bench_commands() -> list[tuple[str, str, list[str]]]:
    """(stage, module, arguments) of every benchmark the script runs, shell variables and
    redirections left out (``bench M ARGS`` stands for ``python3 -m ops.bench.M --out .. --json ..``)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out = []
    for m in re.finditer(r"^(?:\w+=\w+ )?stage (\w+) \d+ bash -c \"(.*)\"$", text, re.MULTILINE):
        stage, command = m[1], re.sub(r"\s*>.*$", "", m[2])
        words = shlex.split(command)
        if words[0] == "bench":
            out.append((stage, words[1], ["--out", "$OUT/x.md", "--json", "$work/x.json", *words[2:]]))
        elif words[:3] == ["exec", "python3", "-m"] and words[3].startswith("ops.bench."):
            out.append((stage, words[3].removeprefix("ops.bench."), words[4:]))
    return out


class _Parsed(Exception):
    pass


def test_every_benchmark_command_of_the_script_parses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A misspelt option or a value its benchmark does not know would cost a lent GPU's stage: each
    command's arguments go through its module's own parser (stopped there, nothing runs), and
    the models and parts it names exist."""
    commands = _bench_commands()
    assert {stage for stage, _m, _a in commands} == set(_stages()) - {"tests"}
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for stage, name, args in commands:
        module = importlib.import_module(f"ops.bench.{name}")
        args = [a.replace("$OUT", str(tmp_path)).replace("$work", str(tmp_path)) for a in args]
        with pytest.raises(_Parsed) as parsed:
            module.main(args)
        ns = parsed.value.args[0]
        for option, known in (("models", "MODELS"), ("parts", "PARTS")):
            value = getattr(ns, option, None)
            if value is not None and hasattr(module, known):
                names = value.split(",") if isinstance(value, str) else value
                assert set(names) <= set(getattr(module, known)), (stage, option, names)
