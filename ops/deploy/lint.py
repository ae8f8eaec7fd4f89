"""Checks on a resolved compose configuration (``docker compose config`` output) that compose v1
does not make but compose v2 or ``docker compose up`` would fail on, plus the deployment's rules.

Run by ops/compose_check.sh after ``config`` succeeded: ``python3 -m ops.deploy.lint RESOLVED.yml``
(or ``python3 ops/deploy/lint.py``). Needs only PyYAML. Exit 1 with one line per problem.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
ONE_SHOT_RESTARTS = {None, "no", "on-failure"}


def _depends(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):  # short syntax
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def problems(config: dict[str, Any]) -> list[str]:
    """Every rule broken by ``config`` (empty when it is fine)."""
    out: list[str] = []
    services: dict[str, dict[str, Any]] = config.get("services") or {}
    for name, svc in services.items():
        profiles = set(svc.get("profiles") or [])
        for dep, condition in _depends(svc).items():
            target = services.get(dep)
            if target is None:
                out.append(f"{name}: depends on undefined service {dep!r}")
                continue
            if condition not in CONDITIONS:
                out.append(f"{name}: depends_on {dep} has unknown condition {condition!r}")
            health = target.get("healthcheck") or {}
            if condition == "service_healthy" and (not health or health.get("disable")):
                out.append(f"{name}: waits for {dep} to be healthy but {dep} has no healthcheck")
            one_shot = target.get("restart") in ONE_SHOT_RESTARTS or target.get("restart") is False
            if condition == "service_completed_successfully" and not one_shot:
                out.append(f"{name}: waits for {dep} to complete but {dep} restarts ({target.get('restart')})")
            dep_profiles = set(target.get("profiles") or [])
            if dep_profiles and not dep_profiles & profiles:
                out.append(f"{name}: depends on {dep}, which only runs in profiles {sorted(dep_profiles)}")
        restart = "no" if svc.get("restart") is False else svc.get("restart")  # YAML 1.1: no == False
        if restart is None:
            out.append(f"{name}: no restart policy (unless-stopped, or \"no\" for a one-shot)")
        if restart not in ONE_SHOT_RESTARTS and "healthcheck" not in svc:
            out.append(f"{name}: long-running service without a healthcheck")
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        for dev in devices or []:
            if "count" in dev and "device_ids" in dev:
                out.append(f"{name}: a device reservation sets both count and device_ids")
            if "gpu" not in (dev.get("capabilities") or []):
                out.append(f"{name}: a device reservation without the gpu capability")
    return out


def main(argv: list[str] | None = None) -> int:
    import yaml

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: lint.py RESOLVED_COMPOSE.yml\n")
        return 2
    found = problems(yaml.safe_load(Path(args[0]).read_text()) or {})
    for line in found:
        sys.stderr.write(f"compose lint: {line}\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
