"""Size affinity in routing: a job goes to a worker that is idle or already runs its image size when
one is within ``ROUTING_SIZE_SLACK`` jobs of the least loaded worker, for every load-aware
policy; engines publish each job's latent grid and the dispatcher reads it back."""

from __future__ import annotations

import pytest

from app.dispatcher import parse_worker_hash
from app.routing import ROUTING_SIZE_SLACK, JobDemand, JobLoad, WorkerState, WorkerView, make_policy, size_affine
from tests.test_routing import small_model
from workers.engine.job import EngineJob
from workers.gpu_tasks import RedisEngineHooks

SQUARE, WIDE = (16, 16), (8, 16)
POLICIES = ("least_requests", "least_masked_tokens", "mask_aware")


def jobs(n: int, hw: tuple[int, int] | None, prefix: str) -> list[JobLoad]:
    return [JobLoad(f"{prefix}{k}", 10, 0.2, latent_hw=hw) for k in range(n)]


def job(hw: tuple[int, int] | None = WIDE) -> JobDemand:
    return JobDemand("new", 10, 0.2, latent_hw=hw)


def two_workers(square_jobs: int, wide_jobs: int) -> WorkerView:
    """Worker "sq" runs only 128x128 jobs, worker "wd" only wide ones."""
    return WorkerView([WorkerState("sq", running=jobs(square_jobs, SQUARE, "s")),
                       WorkerState("wd", running=jobs(wide_jobs, WIDE, "w"))])


@pytest.mark.parametrize("policy", POLICIES)
def test_job_joins_the_worker_running_its_size_within_the_slack(policy: str) -> None:
    router = make_policy(policy, small_model(), size_slack=4)
    # "wd" has 3 more jobs than "sq": without affinity every load-aware policy picks "sq".
    assert make_policy(policy, small_model(), size_slack=0).choose(job(), two_workers(1, 4)) == "sq"
    assert router.choose(job(), two_workers(1, 4)) == "wd"
    assert router.choose(job(SQUARE), two_workers(1, 4)) == "sq"


@pytest.mark.parametrize("policy", POLICIES)
def test_beyond_the_slack_the_least_loaded_worker_wins(policy: str) -> None:
    router = make_policy(policy, small_model(), size_slack=2)
    assert router.choose(job(), two_workers(1, 4)) == "sq"  # 3 more jobs > slack 2


def test_an_idle_worker_counts_as_affine_and_unknown_sizes_route_as_before() -> None:
    view = WorkerView([WorkerState("busy", running=jobs(2, SQUARE, "s")), WorkerState("idle")])
    assert size_affine(view.candidates(), job(), 4) == [view.workers["idle"]]
    both = two_workers(1, 4)
    assert size_affine(both.candidates(), job(None), 4) == both.candidates()
    # A size nobody runs: no worker is affine, so all remain (the policy decides as before).
    assert size_affine(both.candidates(), job((12, 16)), 4) == both.candidates()


def test_in_flight_jobs_count_for_their_size() -> None:
    view = two_workers(1, 1)
    router = make_policy("least_requests", size_slack=4)
    view.assign("wd", JobDemand("queued", 10, 0.2, latent_hw=(12, 16)))  # wd: 1 wide + 1 tall in flight
    assert router.choose(job((12, 16)), view) == "wd"


def test_the_parameter_selects_the_slack_and_the_service_has_one() -> None:
    assert make_policy("least_requests", size_slack=0).choose(job(), two_workers(1, 4)) == "sq"
    assert make_policy("least_requests", size_slack=4).choose(job(), two_workers(1, 4)) == "wd"
    assert ROUTING_SIZE_SLACK >= 4  # the service's (the dispatcher passes none): affinity on
    assert make_policy("least_requests").choose(job(), two_workers(1, 4)) == "wd"


def test_published_worker_state_carries_each_jobs_latent_grid() -> None:
    hooks = RedisEngineHooks("w0", 30.0)
    running = EngineJob(job_id="a", total_steps=10, latent_hw=WIDE)
    waiting = EngineJob(job_id="b", total_steps=10)  # not accepted yet: size unknown
    state = hooks._state([running], [waiting])
    parsed = parse_worker_hash("w0", state, now=0.0, stale_s=60.0, max_batch=8,
                               known={"b": JobDemand("b", 10, latent_hw=SQUARE)})
    assert parsed.running[0].latent_hw == WIDE
    assert parsed.waiting[0].latent_hw == SQUARE  # what the dispatcher knew at routing
