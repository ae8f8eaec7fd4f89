"""Recovery times after process faults on the real stack, with the shipped recovery settings.

Each scenario starts a fresh embedded stack (real redis-server with an append-only file, Celery
CPU and GPU workers, the dispatcher), submits jobs, waits until some are denoising, injects one
fault, restarts what died after 1 s (as compose's restart policy would), and measures the time
from the fault until every job is terminal; it checks exactly one stored result per done job.

    python -m ops.bench.recovery --out docs/bench/recovery.md
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

from app.client import StencilClient
from app.demo import demo_templates
from app.embedded import EmbeddedStack
from app.maskgen import make_mask
from ops.bench.harness import cli


def _restart(stack: EmbeddedStack, name: str) -> None:
    """Start a dead process again after 1 s, as compose's restart policy would."""
    time.sleep(1.0)
    if name.startswith("gpu"):
        stack.start_gpu_worker(name[3:])
    elif name == "cpu":
        stack.start_cpu_worker()
    else:
        stack.start_dispatcher()


def inject(stack: EmbeddedStack, scenario: str) -> None:
    if scenario == "redis-restart":
        stack.redis_server.restart(pause_s=5.0)  # type: ignore[union-attr]
        return
    name = {"gpu-kill": "gpu0", "cpu-kill": "cpu", "dispatcher-kill": "dispatcher"}[scenario]
    stack.kill(name, signal.SIGKILL)
    _restart(stack, name)


def supervise_until_terminal(stack: EmbeddedStack, handles: list, timeout: float) -> list[str]:  # type: ignore[type-arg]
    """Wait for every job to end, restarting any process that exits on its own after 1 s (as
    compose's restart policy and ``stencil serve`` do); returns the names that exited."""
    exited: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(h.record().status.terminal for h in handles):
        for name, proc in list(stack.procs.items()):
            if proc.poll() is not None:
                exited.append(name)
                stack.procs.pop(name)
                _restart(stack, name)
        time.sleep(0.5)
    return exited


def run_scenario(scenario: str, jobs: int, steps: int, home: Path, **settings: float) -> dict[str, object]:
    """One fault on a fresh stack (``settings``: recovery settings other than the shipped ones)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"stencil-fault-{scenario}-"))
    with EmbeddedStack.start(workdir, home=home, redis_appendonly=True, max_batch=4, **settings) as stack:
        client = StencilClient(stack.settings)
        templates = [img for _n, img in demo_templates(128)]
        handles = [client.submit(template=templates[i % len(templates)], mask=make_mask(0.2, (128, 128), seed=i),
                                 prompt="a cat", steps=steps, seed=i) for i in range(jobs)]
        deadline = time.monotonic() + 300
        while sum(h.progress()[0] >= 2 for h in handles) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        t0 = time.monotonic()
        inject(stack, scenario)
        exited = supervise_until_terminal(stack, handles, timeout=900)
        recs = [h.record() for h in handles]
        took = time.monotonic() - t0
        done = [r for r in recs if r.status.value == "done"]
        results_ok = all(r.result_key and client.store.exists(r.result_key) for r in done)
        redriven = sum(int(r.fields.get("redrives") or 0) > 0 for r in recs)
        return {"scenario": scenario, "jobs": jobs, "done": len(done), "failed": len(recs) - len(done),
                "exited": ", ".join(exited) or "-",
                "seconds_to_all_terminal": round(took, 1), "redriven": redriven, "results_ok": results_ok,
                "bound_s": stack.settings.stall_timeout_s + stack.settings.lease_seconds
                + stack.settings.sweep_interval_s}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/recovery.md", threads=None, seed=None)
    p.add_argument("--scenarios", default="gpu-kill,cpu-kill,dispatcher-kill,redis-restart")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stall-timeout-s", type=float, default=0.0, help="0 = the shipped STENCIL_STALL_TIMEOUT_S")
    run = cli.start(p, argv, __file__, quick=dict(scenarios="gpu-kill", jobs=2, steps=4, stall_timeout_s=8.0))
    args = run.args
    from app.settings import Settings
    from workers.models.loader import ensure_model_dir

    home = Path(tempfile.mkdtemp(prefix="stencil-fault-home-"))
    ensure_model_dir(Settings.from_env(home=home))
    short = dict(stall_timeout_s=args.stall_timeout_s, sweep_interval_s=1.0, lease_seconds=4.0)
    rows = [run_scenario(s, args.jobs, args.steps, home, **(short if args.stall_timeout_s else {}))
            for s in args.scenarios.split(",")]
    settings = "shortened" if args.stall_timeout_s else "shipped"
    lines = [f"# Recovery after process faults (real stack, {settings} recovery settings)\n",
             f"Command: `{run.command}`. Each scenario: a fresh stack (redis-server with AOF, 1 CPU worker, 1 GPU "
             "worker, the dispatcher; embedded random-init model, 128 px), jobs submitted, the fault injected "
             "once two jobs are denoising, the dead process restarted after 1 s. Time = fault to every job "
             "terminal; bound = STENCIL_STALL_TIMEOUT_S + STENCIL_LEASE_SECONDS + STENCIL_SWEEP_INTERVAL_S "
             "(plus the jobs' own remaining work).\n",
             "| scenario | jobs | done | failed | re-driven | exited on their own (restarted) | all terminal after "
             "| recovery bound | one result per done job |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['jobs']} | {r['done']} | {r['failed']} | {r['redriven']} | "
                     f"{r['exited']} | "
                     f"{r['seconds_to_all_terminal']} s | {r['bound_s']:.0f} s | "
                     f"{'yes' if r['results_ok'] else 'NO'} |")
    run.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
