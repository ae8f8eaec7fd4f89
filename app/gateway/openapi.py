"""The gateway's OpenAPI schema, checked in as ``docs/openapi.json``.

    python -m app.gateway.openapi --write    # after changing a route
    python -m app.gateway.openapi --check    # exit 1 if the checked-in file differs (the tests do this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from app.gateway.app import create_app
from app.settings import Settings

CHECKED_IN = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def schema() -> dict[str, Any]:
    """The schema of the app with default settings (nothing in it depends on a deployment)."""
    return create_app(Settings()).openapi()


def render(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help=f"write {CHECKED_IN.name}")
    p.add_argument("--check", action="store_true", help="exit 1 if the checked-in schema differs")
    args = p.parse_args(argv)
    text = render(schema())
    if args.write:
        CHECKED_IN.write_text(text)
        return 0
    if args.check:
        if not CHECKED_IN.is_file() or CHECKED_IN.read_text() != text:
            sys.stderr.write(f"{CHECKED_IN} is out of date: python -m app.gateway.openapi --write\n")
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
