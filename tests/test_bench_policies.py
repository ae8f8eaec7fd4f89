"""The per-policy pricing of the benchmarks that time both ResNet modes (``ops/bench/harness/policies.py``):
a job's refresh steps compute fully, its other steps at the measured masked step's speedup."""

from __future__ import annotations

import pytest

from app.fidelity import policy_schedule
from ops.bench.harness.policies import POLICY_VARIANTS, policy_costs


def test_a_masked_step_no_faster_than_full_leaves_every_policy_at_full_cost() -> None:
    costs = policy_costs({"": 1.0, "+resnets": 1.0})
    assert costs == pytest.approx({name: 1.0 for name in POLICY_VARIANTS})


def test_free_masked_steps_leave_only_the_refresh_steps_to_pay() -> None:
    costs = policy_costs({"": 1e12, "+resnets": 1e12}, steps=20)
    for name in POLICY_VARIANTS:
        refreshes = len(policy_schedule(name.partition("+")[0], 20))
        assert costs[name] == pytest.approx(20 / refreshes)
    assert costs["fast"] > costs["balanced"]  # one refresh step fewer


def test_each_variant_takes_its_own_resnets_speedup() -> None:
    costs = policy_costs({"": 1.5, "+resnets": 2.0}, steps=20)
    assert costs["fast+resnets"] > costs["fast"] and costs["balanced+resnets"] > costs["balanced"]
    refreshes = len(policy_schedule("balanced", 20))
    assert costs["balanced+resnets"] == pytest.approx(20 / (refreshes + (20 - refreshes) / 2.0))
