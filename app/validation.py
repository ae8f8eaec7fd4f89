"""The one boundary where job parameters and object ids are checked and normalised.

The client, the CLI and catalogs call it before anything is stored; the dispatcher calls it
again on the record (``JobParams.validate``), so a job written by anything else fails with the
same reason. Refusals name the parameter and say what is accepted; they never echo server paths.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_GUIDANCE = 50.0  # classifier-free (SD) or embedded (Flux) guidance; 0 <= g <= 50
MAX_PROMPT_CHARS = 2000
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range
MAX_PRIORITY = 1000
MAX_ID_CHARS = 128
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class InvalidParameter(ValueError):
    """A job parameter or id that cannot be used; ``name`` says which."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name


def integer(name: str, value: Any, lo: int, hi: int) -> int:
    """An integer in [lo, hi]: ints, integral strings; never floats like 1.5 or booleans."""
    if isinstance(value, bool):
        raise InvalidParameter(name, f"must be an integer, got {value!r}")
    if isinstance(value, int):
        out = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
        out = int(value)
    elif isinstance(value, float) and value.is_integer():
        out = int(value)
    else:
        raise InvalidParameter(name, f"must be an integer, got {_show(value)}")
    if not lo <= out <= hi:
        raise InvalidParameter(name, f"must be between {lo} and {hi}, got {out}")
    return out


def number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite number in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    if isinstance(value, bool):
        raise InvalidParameter(name, f"must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise InvalidParameter(name, f"must be a number, got {_show(value)}") from None
    if not math.isfinite(out):
        raise InvalidParameter(name, f"must be a finite number, got {out}")
    if out < lo or out > hi or (lo_open and out == lo):
        bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidParameter(name, f"must be in {bounds}, got {out:g}")
    return out


def text(name: str, value: Any, max_chars: int = MAX_PROMPT_CHARS) -> str:
    if not isinstance(value, str):
        raise InvalidParameter(name, f"must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidParameter(name, "must not contain NUL characters")
    if len(value) > max_chars:
        raise InvalidParameter(name, f"must be at most {max_chars} characters, got {len(value)}")
    return value


def object_id(name: str, value: Any) -> str:
    """A template (or other stored object) id: letters, digits, ``.``, ``_``, ``-``, starting with
    a letter or digit, at most ``MAX_ID_CHARS``; surrounding white space is dropped. No path
    separators, so an id can never name anything outside its own key prefix."""
    if not isinstance(value, str):
        raise InvalidParameter(name, f"must be a string, got {type(value).__name__}")
    out = value.strip()
    if not out:
        raise InvalidParameter(name, "must not be empty")
    if len(out) > MAX_ID_CHARS:
        raise InvalidParameter(name, f"must be at most {MAX_ID_CHARS} characters, got {len(out)}")
    if not _ID.fullmatch(out):
        raise InvalidParameter(name, "may contain only letters, digits, '.', '_' and '-' and must start with "
                                     f"a letter or digit (got {_show(out)})")
    return out


def _show(value: Any) -> str:
    """A short, safe rendering of a bad value for an error message."""
    s = repr(value) if isinstance(value, (str, int, float)) else type(value).__name__
    return s if len(s) <= 40 else s[:37] + "..."
