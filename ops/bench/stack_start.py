"""How fast an embedded stack's processes start and a killed GPU worker is back: processes forked
by the preloaded launcher (``app.launcher``, the default) against each one a new interpreter that
imports torch, diffusers, transformers, PEFT and Celery itself, side by side in one run.

Per launch mode and round: a fresh stack (redis-server, CPU worker, GPU worker, dispatcher; the
embedded model) from start to ready (every process published it is up), then its GPU worker
SIGKILLed and started again, from the restart to ready (what ``stencil serve``'s restart and a
fault's recovery wait for). The launcher's own start (its imports, once per process and
environment) is timed apart: the first preloaded stack of a process pays it, later ones do not.

    python -m ops.bench.stack_start --out docs/bench/stack_start.md
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from app.embedded import EmbeddedStack
from app.launcher import launcher_for
from ops.bench.harness import cli
from ops.bench.harness.timing import cpu_model

log = logging.getLogger(__name__)
MODES = ("preloaded", "interpreter")


def warm_launcher(home: Path) -> float:
    """Seconds until this process's launcher has imported its packages (0 if it already had): the
    launcher of the environment ``EmbeddedStack`` gives its processes."""
    from app.settings import Settings

    t0 = time.monotonic()
    env = EmbeddedStack(settings=Settings.from_env(home=home), redis_server=None, workdir=home).env()
    if not launcher_for(env).wait_ready():
        raise RuntimeError("the preloaded launcher did not start")
    return time.monotonic() - t0


def one_round(mode: str, home: Path) -> dict[str, float]:
    """A stack from start to ready, then its GPU worker killed and back to ready (seconds)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"stencil-start-{mode}-"))
    t0 = time.monotonic()
    stack = EmbeddedStack.start(workdir, home=home, preload=mode == "preloaded")
    try:
        started = time.monotonic() - t0
        stack.kill("gpu0", signal.SIGKILL)
        t1 = time.monotonic()
        stack.start_gpu_worker("0")
        stack.wait_ready()
        restarted = time.monotonic() - t1
    finally:
        stack.stop()
    return {"start_s": started, "restart_s": restarted}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/stack_start.md", threads=None, seed=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help="launch modes, in order: preloaded, interpreter")
    p.add_argument("--json", default="", help="also write the measurements here")
    run = cli.start(p, argv, __file__, quick=dict(rounds=1, modes="preloaded"))
    args = run.args
    from app.settings import Settings
    from workers.models.loader import ensure_model_dir

    home = Path(tempfile.mkdtemp(prefix="stencil-start-home-"))
    ensure_model_dir(Settings.from_env(home=home))
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)} (known: {', '.join(MODES)})")
    launcher_s = warm_launcher(home) if "preloaded" in modes else 0.0
    log.info("launcher ready after %.1f s", launcher_s)
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):  # interleaved: a drift of the machine's speed hits both modes alike
        for mode in modes:
            rounds[mode].append(one_round(mode, home))
            log.info("round %d %s: %s", r + 1, mode, rounds[mode][-1])
    med = {m: {k: statistics.median(x[k] for x in rs) for k in ("start_s", "restart_s")} for m, rs in rounds.items()}
    lines = ["# Stack start and GPU-worker restart: preloaded launcher vs a new interpreter per process\n",
             f"Command: `{run.command}`. {cpu_model()}, {os.cpu_count()} cores; load average "
             f"{os.getloadavg()[0]:.1f} at the end. "
             f"{args.rounds} round(s), interleaved; medians. A stack: redis-server, a CPU worker, a GPU worker "
             "and the dispatcher with the embedded model, from `EmbeddedStack.start` to ready; a restart: the "
             "GPU worker SIGKILLed, started again, until it has published its state.\n",
             "| launch | stack start to ready | GPU worker restart to ready |", "|---|---|---|"]
    for mode in modes:
        lines.append(f"| {mode} | {med[mode]['start_s']:.1f} s | {med[mode]['restart_s']:.1f} s |")
    if len(med) == 2:
        ratio = {k: med["interpreter"][k] / max(med["preloaded"][k], 1e-9) for k in ("start_s", "restart_s")}
        lines.append(f"\nPreloaded is {ratio['start_s']:.1f}x faster to start a stack and {ratio['restart_s']:.1f}x "
                     "faster to restart a GPU worker.")
    if "preloaded" in modes:
        lines.append(f"\nThe launcher's own start (its imports, once per process and environment, before the first "
                     f"preloaded stack): {launcher_s:.1f} s.")
    run.write(lines)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": run.command, "launcher_s": launcher_s, "rounds": rounds,
                                               "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
