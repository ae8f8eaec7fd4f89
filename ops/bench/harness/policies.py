"""What a fidelity policy costs a job, priced from measured per-step speedups.

Why: a policy's refresh steps compute fully and its other steps take the masked step's speedup, so
whether computing the ResNets at the masked tokens too (``workers/maskaware/resnets.py``) pays
depends on the policy it goes with: the benchmarks that time both ResNet modes price each
variant of ``POLICY_VARIANTS`` with the same arithmetic. Which variants meet the fidelity targets
is measured apart (``python -m ops.bench.fidelity --resnets full,masked``).
"""

from __future__ import annotations

from ops.bench.harness.edits import OPTIONS, Option

POLICY_VARIANTS = ("fast", "fast+resnets", "balanced", "balanced+resnets")
POLICY_STEPS = 20  # steps of the job the policy table prices (the client's default)


def option_seconds(costs: dict[str, float], option: Option, steps: int) -> float | None:
    """A job's denoising seconds under ``option`` (None: needs its own warm-up, not a per-step cost),
    from the cost of each step kind: ``masked`` (cache as is), ``offset`` and ``refresh``."""
    if option.region:
        return steps * costs["masked"]  # exact cache: masked steps, no offset (its warm-up is extra)
    refresh = len(option.schedule(steps))
    if refresh == 0:
        return steps * costs["masked"]
    return refresh * costs["refresh"] + (steps - refresh) * costs["offset"]


def policy_costs(speedups: dict[str, float], steps: int = POLICY_STEPS) -> dict[str, float]:
    """A job's speedup over full compute under each policy of ``POLICY_VARIANTS``: its refresh steps
    compute fully, its other steps at the graph-replayed masked step's speedup (``speedups``: "" =
    ResNets on the whole map, "+resnets" = at the masked tokens too). Which variants meet the
    fidelity targets is measured apart (``ops.bench.fidelity --resnets``)."""
    out = {}
    for name in POLICY_VARIANTS:
        policy, _, resnets = name.partition("+")
        masked = 1.0 / speedups["+resnets" if resnets else ""]
        seconds = option_seconds({"masked": masked, "offset": masked, "refresh": 1.0}, OPTIONS[policy], steps)
        out[name] = steps / seconds  # type: ignore[operator]
    return out


def policy_table(rows: list[str], steps_from: str) -> list[str]:
    """A Markdown table of ``policy_costs`` rows (model, jobs, ratio, one cell per variant);
    ``steps_from``: which of the report's step timings priced them."""
    return [f"A job of {POLICY_STEPS} steps against full compute under each fidelity policy, with its ResNets on "
            f"the whole map or at the masked tokens too ({steps_from}; refresh steps compute fully, "
            "`app/fidelity.py`). The fidelity of each variant: `python -m ops.bench.fidelity --families sd "
            "--guidance 1.0,3.0,7.5 --options fast,balanced --resnets full,masked`.", "",
            "| model | jobs | ratio | " + " | ".join(f"`{v}`" for v in POLICY_VARIANTS) + " |",
            "|---|---|---|" + "---|" * len(POLICY_VARIANTS), *rows]


def policy_row(model: str, jobs: int, ratio: float, costs: dict[str, float]) -> str:
    return f"| {model} | {jobs} | {ratio:g} | " + " | ".join(f"{costs[v]:.2f}x" for v in POLICY_VARIANTS) + " |"
