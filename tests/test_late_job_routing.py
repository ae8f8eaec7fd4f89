"""Late jobs and routing: SLO admission leaves its verdict on each waiting job (``EngineJob.late``: its
soft deadline is out of reach, so it runs behind every on-time job), the engine publishes it, the
dispatcher parses it, and routers do not count such a job ahead of a new one (app/routing.py)."""

from __future__ import annotations

from collections.abc import Sequence

from app.dispatcher import parse_worker_hash
from app.routing import JobDemand, JobLoad, WorkerState, WorkerView, make_policy
from tests.test_routing import small_model
from workers.engine.job import EngineJob
from workers.engine.scheduler import BatchScheduler

NOW = 1000.0


def tenth_per_step(jobs: Sequence[EngineJob]) -> float:
    return 0.1


def soft(job_id: str, steps: int, deadline: float) -> EngineJob:
    return EngineJob(job_id, steps, arrival=NOW - 1.0, latent_hw=(8, 8), deadline=deadline, hard_deadline=False)


def _scheduled_with_a_late_job() -> BatchScheduler:
    """One slot, one long job running; "late" cannot make its deadline even alone (10 x 0.1 s > 0.5 s),
    "fine" can."""
    s = BatchScheduler(1, step_time=tenth_per_step, clock=lambda: NOW)
    s.add(soft("run", 100, NOW + 1000.0))
    s.schedule()
    s.add(soft("late", 10, NOW + 0.5))
    s.add(soft("fine", 10, NOW + 500.0))
    s.schedule()
    return s


def test_slo_admission_marks_the_waiting_jobs_whose_soft_deadline_is_out_of_reach() -> None:
    s = _scheduled_with_a_late_job()
    assert {j.job_id: j.late for j in s.waiting} == {"late": True, "fine": False}
    assert not s.running[0].late


def test_plain_admission_marks_nobody_late() -> None:
    s = BatchScheduler(1, clock=lambda: NOW)
    s.add(soft("run", 100, NOW + 1000.0))
    s.add(soft("late", 10, NOW + 0.5))
    s.schedule()
    assert [j.late for j in s.waiting] == [False]


def test_the_engine_publishes_late_jobs_and_the_dispatcher_reads_them() -> None:
    from workers.gpu_tasks import RedisEngineHooks

    s = _scheduled_with_a_late_job()
    state = RedisEngineHooks("w0", 30.0)._state(list(s.running), list(s.waiting))
    parsed = parse_worker_hash("w0", state, now=0.0, stale_s=60.0, max_batch=1, known={})
    assert {j.job_id: j.late for j in parsed.waiting} == {"late": True, "fine": False}
    assert parsed.n_jobs == 2  # "run" and "fine": "late" is not ahead of a new job
    older = dict(state, waiting='[{"job_id": "x", "remaining": 3}]')  # an engine that does not publish it
    assert [j.late for j in parse_worker_hash("w0", older, now=0.0, stale_s=60.0, max_batch=1, known={}).waiting] \
        == [False]


def _loads(prefix: str, n: int, late: bool = False) -> list[JobLoad]:
    return [JobLoad(f"{prefix}{k}", 10, 0.2, late=late) for k in range(n)]


def _workers() -> WorkerView:
    """Worker a: 2 running, 4 waiting, all late; worker b: 2 running, 2 waiting on time."""
    return WorkerView([WorkerState("a", running=_loads("ar", 2), waiting=_loads("aw", 4, late=True)),
                       WorkerState("b", running=_loads("br", 2), waiting=_loads("bw", 2))])


def test_every_load_based_policy_sends_a_new_job_past_late_jobs() -> None:
    new = JobDemand("new", 10, 0.2)
    for name in ("least_requests", "least_masked_tokens", "mask_aware"):
        assert make_policy(name, small_model()).choose(new, _workers()) == "a", name
    # Without the verdict (an engine that does not publish it) the same queue counts: b is chosen.
    for w in (v := _workers()).workers.values():
        for j in w.waiting:
            j.late = False
    assert make_policy("least_requests", small_model()).choose(new, v) == "b"
