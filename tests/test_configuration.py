"""The configuration reference (docs/configuration.md) agrees with the code, and `stencil config`
prints the effective settings with secrets masked."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from app import config_doc
from app.cli import main
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"STENCIL_[A-Z0-9_]*[A-Z0-9]")
# Settings are read from the environment in these modules only by field name (``from_env``).
DYNAMIC_READERS = {ROOT / "app" / "settings.py", ROOT / "app" / "config_doc.py"}


def _code_files() -> list[Path]:
    return sorted(p for d in ("app", "workers") for p in (ROOT / d).rglob("*.py"))


def _page_variables() -> set[str]:
    return set(re.findall(r"^\| `(STENCIL_[A-Z0-9_]+)` \|", PAGE.read_text(), flags=re.M))


def test_the_page_is_what_the_code_generates() -> None:
    assert PAGE.read_text() == config_doc.markdown(), f"regenerate it: {config_doc.COMMAND}"


def test_every_variable_the_code_names_is_on_the_page_and_nothing_else() -> None:
    """Every ``STENCIL_*`` name in app/ and workers/ (reads, messages, comments) is a documented
    setting, and every documented setting is a field of ``Settings``."""
    named: dict[str, list[str]] = {}
    for path in _code_files():
        for name in NAME.findall(path.read_text()):
            named.setdefault(name, []).append(str(path.relative_to(ROOT)))
    fields = {f"STENCIL_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    page = _page_variables()
    assert page == fields
    undocumented = {n: where for n, where in named.items() if n not in page}
    assert not undocumented, undocumented
    assert len(page) < 70, len(page)


def test_no_setting_is_read_under_a_computed_name() -> None:
    """``os.environ.get(f"STENCIL_{x}")`` would hide a setting from the check above."""
    hidden = []
    for path in _code_files():
        if path in DYNAMIC_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.JoinedStr) and len(node.values) > 1
                    and isinstance(node.values[0], ast.Constant)):
                continue
            head = str(node.values[0].value)
            name = re.match(r"STENCIL_[A-Z0-9_]*", head)
            if name and name.end() == len(head):  # the name goes on in a formatted value
                hidden.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not hidden, hidden


def test_every_setting_has_a_subject_a_meaning_and_a_default_shown() -> None:
    rows = config_doc.reference_rows()
    assert len(rows) == len(dataclasses.fields(Settings))
    for group, var, typ, default, _allowed, meaning in rows:
        assert group and meaning and default and typ in {"str", "int", "float", "bool", "path"}, var


def test_stencil_config_prints_every_setting_with_secrets_masked(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STENCIL_REDIS_URL", "redis://stencil:s3cr3t-redis@redis.internal:6380/2")
    monkeypatch.setenv("STENCIL_S3_SECRET_KEY", "s3cr3t-key")
    monkeypatch.setenv("STENCIL_API_KEY", "sk-s3cr3t")
    monkeypatch.setenv("STENCIL_MAX_BATCH", "5")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out
    printed = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("STENCIL_"))
    assert set(printed) == _page_variables()
    assert printed["STENCIL_REDIS_URL"] == "redis://***:***@redis.internal:6380/2  # set"
    assert printed["STENCIL_S3_SECRET_KEY"] == "***  # set"
    assert printed["STENCIL_MAX_BATCH"] == "5  # set"
    assert printed["STENCIL_DEVICE"] == "cpu" or printed["STENCIL_DEVICE"].endswith("# set")


def test_masking_keeps_what_is_not_secret() -> None:
    assert config_doc.mask_value("redis://127.0.0.1:6379/0", True) == "redis://127.0.0.1:6379/0"
    assert config_doc.mask_value("http://user:pw@minio:9000", True) == "http://***:***@minio:9000"
    assert config_doc.mask_value("", True) == ""
    assert config_doc.mask_value("plain", False) == "plain"
