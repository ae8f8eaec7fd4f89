"""What README.md, BENCHMARKS.md and docs/ point at exists: relative links (and their anchors),
``python -m`` modules, ``stencil`` subcommands, ``ops/`` paths and ``STENCIL_*`` settings.

Modules are looked up without importing them: a repository module by its file, anything else by
``importlib.util.find_spec`` of its top-level name.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from app.cli import build_parser
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")])
LOCAL_PACKAGES = {"app", "ops", "workers", "tests"}
# Variables of the tools in ops/, not settings of the service (docs/benchmarks.md names them).
TOOL_VARIABLES = {"STENCIL_TEST_PROCESSES", "STENCIL_TORCH_INDEX_URL", "STENCIL_TRACES_DIR", "STENCIL_PROFILE_TMP",
                  "STENCIL_IMAGE", "STENCIL_CPU_CONCURRENCY"}  # the last two: docker-compose.yml's own

FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
COMMAND = re.compile(r"(?:^|[\s`(])stencil ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", flags=re.M)
OPS_PATH = re.compile(r"(?<![\w/.-])ops/[\w./-]*")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _prose(text: str) -> str:
    """The page without fenced code blocks (links there are not links)."""
    return FENCE.sub("", text)


def _code(text: str) -> str:
    """Fenced blocks and inline code spans: where commands are written."""
    blocks = FENCE.findall(text)
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return "\n".join(blocks + spans)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    found: set[str] = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).strip().lower()
        slug = "".join(ch for ch in title if ch.isalnum() or ch in " -_").replace(" ", "-")
        base, n = slug, 1
        while slug in found:
            slug, n = f"{base}-{n}", n + 1
        found.add(slug)
    return found


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            bad.append(f"{_rel(page)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{_rel(page)}: {target} (no such heading)")
    return bad


def module_exists(name: str) -> bool:
    parts = name.split(".")
    if parts[0] in LOCAL_PACKAGES:
        base = ROOT.joinpath(*parts)
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
    return importlib.util.find_spec(parts[0]) is not None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_python_m_names_a_module(page: Path) -> None:
    names = {n for n in MODULE.findall(page.read_text()) if not n.endswith(".")}  # "ops.bench.<name>"
    assert sorted(n for n in names if not module_exists(n)) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_stencil_commands_exist(page: Path) -> None:
    commands = _subcommands(build_parser())
    bad = []
    for first, second in COMMAND.findall(_code(page.read_text())):
        if first not in commands:
            bad.append(f"stencil {first}")
            continue
        nested = _subcommands(commands[first])
        if nested and second and second not in nested:
            bad.append(f"stencil {first} {second}")
    assert bad == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_ops_paths_exist(page: Path) -> None:
    paths = {p.rstrip(".,;:") for p in OPS_PATH.findall(page.read_text())}
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


def test_pages_name_only_settings_that_exist() -> None:
    """README.md, BENCHMARKS.md and docs/*.md name no removed or misspelled setting (the reports in
    docs/bench/ keep the commands they were made with)."""
    settings = {f"STENCIL_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    bad = []
    for page in PAGES:
        if page.is_relative_to(ROOT / "docs" / "bench"):
            continue
        for name in set(re.findall(r"STENCIL_[A-Z0-9_]*[A-Z0-9]", page.read_text())):
            if name not in settings | TOOL_VARIABLES:
                bad.append(f"{_rel(page)}: {name}")
    assert sorted(bad) == []


def test_the_checks_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [gone](missing.md) [anchor](page.md#nowhere)\n")
    assert broken_links(page) == [f"{page}: missing.md (no such file)", f"{page}: page.md#nowhere (no such heading)"]
    assert module_exists("ops.bench.e2e") and module_exists("pytest")
    assert not module_exists("ops.bench.no_such_benchmark") and not module_exists("no_such_package_xyz")
    assert "config" in _subcommands(build_parser()) and "nosuch" not in _subcommands(build_parser())
