"""The configuration reference and the effective configuration, both from ``app/settings.py``.

``stencil config --markdown`` writes docs/configuration.md from the settings' own metadata (subject,
type, default, allowed values, meaning), so the page cannot drift from the code: a test regenerates
it and compares. ``stencil config`` prints this process's effective settings with secrets masked,
for a bug report.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from app.settings import AUTO_CACHE_STEPS, GROUPS, Settings

MASK = "***"
COMMAND = "stencil config --markdown > docs/configuration.md"


def env_name(field: dataclasses.Field[Any]) -> str:
    return f"STENCIL_{field.name.upper()}"


def _type_name(field: dataclasses.Field[Any]) -> str:
    default = _default(field)
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, Path):
        return "path"
    return "str"


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return Path(".stencil")  # ``home``: ./.stencil of the working directory unless STENCIL_HOME


def _show_default(field: dataclasses.Field[Any]) -> str:
    value = _default(field)
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, Path):
        return "derived" if value == Path() else f"`./{value}`"
    if isinstance(value, int) and value >= 1024**2 and field.name.endswith("bytes"):
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
            if value % size == 0:
                return f"`{value}` ({value // size} {unit})"
    if isinstance(value, int) and value >= 1024**2:  # pixels
        side = int(value ** 0.5)
        return f"`{value}` ({side}x{side})" if side * side == value else f"`{value}`"
    if isinstance(value, int) and field.name.endswith("seconds") and value >= 3600:
        return f"`{value}` ({value // 3600} h)"
    return f"`{value}`" if value != "" else "empty"


def _allowed(field: dataclasses.Field[Any]) -> str:
    choices = field.metadata.get("choices", ())
    if choices:
        return ", ".join(f"`{c}`" if c else "empty" for c in choices)
    if _type_name(field) == "bool":
        return "`1`/`true`/`yes`/`on`, else false"
    if field.name == "cache_steps":
        return "`auto`, or a step count (`0` = every step)"
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_rows() -> list[tuple[str, str, str, str, str, str]]:
    """(group, variable, type, default, allowed values, meaning) of every setting, in module order."""
    rows = []
    for f in dataclasses.fields(Settings):
        rows.append((f.metadata["group"], env_name(f), _type_name(f), _show_default(f), _allowed(f),
                     f.metadata["meaning"]))
    return rows


def auto_rows() -> list[tuple[str, str, str, str]]:
    """(choice, on CUDA, elsewhere, why) for every device-dependent default, computed by the
    functions the service calls, so the table cannot disagree with them."""
    import torch

    from workers.engine.scheduler import device_defaults
    from workers.engine.sd_runner import mixed_size_calls

    s = Settings(home=Path("."))
    cuda, cpu = device_defaults("cuda"), device_defaults("cpu")

    def onoff(flag: bool) -> str:
        return "on" if flag else "off"

    def invariant(device: str) -> str:
        half = onoff(s.batch_invariant_for("bfloat16", device))
        full = onoff(s.batch_invariant_for("float32", device))
        return half if half == full else f"{half} in float16/bfloat16, {full} in float32"

    steps = ", ".join(f"{family}: {n or 'every step'}" for family, n in AUTO_CACHE_STEPS.items())
    return [
        ("`STENCIL_BATCH_INVARIANT=auto`", invariant("cuda"), invariant("cpu"),
         "one GEMM per job per layer cost 19% of jobs/s on an H200; on a CPU half precision's last bit "
         "reached 7/255 ([batch invariance](bench/batch_invariance.md))"),
        ("`STENCIL_CUDA_GRAPHS=auto`", onoff(s.cuda_graphs_for("cuda")), onoff(s.cuda_graphs_for("cpu")),
         "CUDA graphs exist only on CUDA"),
        ("`STENCIL_CACHE_STEPS=auto`", steps, steps,
         "by model family, not device: the fewest stored steps within SSIM 0.005 of every-step caches "
         "([cache steps](bench/cache_steps.md))"),
        ("Size switch under a queue (engine)", cuda["size_switch"], cpu["size_switch"],
         "on CUDA an empty slot is the dearer, elsewhere a second denoiser call a step "
         "([mixed sizes](bench/mixed_sizes.md))"),
        ("SLO admission's queue order (engine)", cuda["slo_order"], cpu["slo_order"],
         "kept the most deadlines in the GPU-shaped / CPU-fitted simulator ([mixed sizes](bench/mixed_sizes.md))"),
        ("When a late soft-deadline job yields (engine)", cuda["slo_yield"], cpu["slo_yield"],
         "GPU-shaped simulator at 1.3x capacity, 10 seeds: 92.2% -> 93.1% of deadlines kept"),
        ("SLO admission's finish-time margin (engine)", f"{cuda['slo_margin']:g}", f"{cpu['slo_margin']:g}",
         "GPU-shaped simulator: 0 / 0.01 / 0.02 / 0.03 kept 91.6 / 92.2 / 92.0 / 91.6%"),
        ("A mixed-size step's UNet calls (engine)", mixed_size_calls("auto", torch.device("cuda")),
         mixed_size_calls("auto", torch.device("cpu")),
         "lockstep packs every size's tokens into fewer, larger kernels ([mixing cost](bench/mixing_cost.md))"),
    ]


def markdown() -> str:
    """docs/configuration.md."""
    rows = reference_rows()
    lines = ["# Configuration reference", "",
             f"Generated from `app/settings.py` by `{COMMAND}`; a test fails when this page and the code "
             "disagree. Every setting is an environment variable; `stencil config` prints the values a "
             "process would use (secrets masked). Unset variables take the default.", "",
             f"{len(rows)} settings. What an ablation varies (size switch, SLO order, yield and margin, "
             "mixed-size calls, size affinity, cache plan, pooling threshold, ...) is not a setting: it is an "
             "option of the benchmark that measured it ([benchmarks and tools](benchmarks.md)), and the "
             "service uses the value the table of device-dependent defaults below shows.", ""]
    lines += ["Subjects: " + ", ".join(f"[{g}](#{_anchor(g)})" for g in GROUPS) + ", "
              "[device-dependent defaults](#device-dependent-defaults).", ""]
    for group in GROUPS:
        lines += [f"## {group}", "", "| variable | type | default | allowed values | meaning |",
                  "|---|---|---|---|---|"]
        lines += [f"| `{var}` | {typ} | {default} | {_cell(allowed)} | {_cell(meaning)} |"
                  for g, var, typ, default, allowed, meaning in rows if g == group]
        lines.append("")
    lines += ["## Device-dependent defaults", "",
              "What `auto` (and the engine's fixed choices) resolve to on a CUDA device and elsewhere (CPU), as "
              "the service's own functions compute them.", "",
              "| choice | on CUDA | elsewhere | why |", "|---|---|---|---|"]
    lines += [f"| {c} | {a} | {b} | {why} |" for c, a, b, why in auto_rows()]
    lines.append("")
    return "\n".join(lines)


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


def mask_value(value: str, secret: bool) -> str:
    """``value`` safe to paste: a URL keeps everything but its password (and user name), any other
    secret shows only whether it is set."""
    if not secret or not value:
        return value
    parts = urlsplit(value)
    if parts.scheme and parts.netloc:
        if parts.password is None and parts.username is None:
            return value
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, f"{MASK}:{MASK}@{host}", parts.path, parts.query, parts.fragment))
    return MASK


def effective(settings: Settings, environ: dict[str, str] | None = None) -> str:
    """This process's settings as ``STENCIL_<NAME>=value`` lines by subject, secrets masked; a variable set
    in the environment is marked ``# set``."""
    environ = dict(os.environ) if environ is None else environ
    fields = dataclasses.fields(settings)
    lines: list[str] = []
    for group in GROUPS:
        lines.append(f"# {group}")
        for f in fields:
            if f.metadata["group"] != group:
                continue
            value = mask_value(str(getattr(settings, f.name)), bool(f.metadata["secret"]))
            lines.append(f"{env_name(f)}={value}" + ("  # set" if env_name(f) in environ else ""))
    return "\n".join(lines) + "\n"


__all__ = ["COMMAND", "auto_rows", "effective", "markdown", "mask_value", "reference_rows"]
