"""Fidelity policies: how a mask-aware edit trades exactness for speed.

Why refresh steps: a template's warm-up is recorded with one prompt, seed and (usually) no mask.
An edit with another prompt differs from it at *every* token under classifier-free guidance
(the conditional branch carries the prompt everywhere and guidance amplifies it), so taking the
unmasked tokens' activations from the warm-up as they are is far off at guidance 7.5 (SSIM 0.77
vs full compute; ``ops/bench/fidelity.py``, cause table in ``docs/bench/fidelity.md``). A refresh
step computes the edit fully and records its own activations; until the next refresh the edit
uses the template's activations of the current step plus the offset (own - template) measured at
the last refresh: the template supplies how activations move with the timestep, the refresh how
far this edit is from the template. The offset drifts, and late steps decide fine detail, so the
refreshes are spread from step 0 to ``LAST_REFRESH_AT`` of the schedule.

Policies (per job ``fidelity=``; the service default ``STENCIL_FIDELITY``, ``fast``: the fastest
that meets the fidelity targets in BENCHMARKS.md):
- ``exact``: a cache recorded for exactly this edit (region warm-up: same mask, prompt, negative
  prompt, seed, guidance) or full compute. Equal to the stock pipeline within 1/255.
- ``balanced``: exact cache if there is one, else the template's warm-up with
  ``REFRESHES["balanced"]`` refresh steps. Approximate.
- ``fast`` (default): as balanced with fewer refresh steps. Approximate.
- ``turbo``: as fast, and between refreshes each plan unit (a UNet's transformer, a Flux block)
  reuses the patches of masked tokens that a learned rule predicts barely move from the last
  step (``workers/maskaware/reuse.py``, ``flux_reuse.py``). Approximate.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

POLICIES = ("exact", "balanced", "fast", "turbo")
REFRESHES = {"balanced": 3, "fast": 2, "turbo": 2}
TEMPORAL_REUSE = frozenset({"turbo"})  # policies that also reuse masked patches from the last step
LAST_REFRESH_AT = 0.85  # share of the schedule where the last refresh step falls
EXPECTED_FILE = Path(__file__).with_name("fidelity_expected.json")


def check_policy(name: str) -> str:
    """The canonical policy name ("" = the service default); a clear error otherwise."""
    name = (name or "").strip().lower()
    if name and name not in POLICIES:
        raise ValueError(f"fidelity must be one of {', '.join(POLICIES)} (got {name!r})")
    return name


def refresh_schedule(refreshes: int, steps: int) -> list[int]:
    """Steps (0-based) computed fully: ``refreshes`` of them, from 0 to ``LAST_REFRESH_AT``."""
    if refreshes <= 0 or steps <= 0:
        return []
    if refreshes == 1:
        return [0]
    last = LAST_REFRESH_AT * steps
    picks = {min(steps - 1, math.floor(k * last / (refreshes - 1) + 0.5)) for k in range(refreshes)}
    return sorted(picks)


def policy_schedule(policy: str, steps: int) -> list[int]:
    """Refresh steps of an approximate (template-cache) edit under ``policy``."""
    return refresh_schedule(REFRESHES.get(policy, 0), steps)


@lru_cache(maxsize=1)
def _expected_table() -> dict[str, dict[str, dict[str, float]]]:
    if not EXPECTED_FILE.is_file():
        return {}
    return json.loads(EXPECTED_FILE.read_text())


def expected_ssim(model_id: str, policy: str, guidance: float) -> float | None:
    """Measured mean SSIM vs full compute (``ops/bench/fidelity.py --write-expected``) at the
    nearest measured guidance, or None where nothing was measured for this model and policy."""
    rows = _expected_table().get(model_id, {}).get(policy, {})
    if not rows:
        return None
    nearest = min(rows, key=lambda g: abs(float(g) - guidance))
    return float(rows[nearest])
