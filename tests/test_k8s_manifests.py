"""The Kubernetes example (ops/deploy/k8s/): valid against the Kubernetes API schemas
(kubernetes-validate, offline), and the topology docs/multi-host.md describes: one image for every
Stencil process, credentials only from the Secret, settings that exist, a GPU per GPU worker pod,
worker ids from the StatefulSet's ordinals matching STENCIL_GPU_WORKERS, probes, no shared volume."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from app.settings import Settings

K8S = Path(__file__).resolve().parents[1] / "ops" / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"
STENCIL_IMAGE = "stencil-serve:latest"
SECRET = "stencil-secrets"
CREDENTIALS = {"REDIS_PASSWORD", "STENCIL_S3_ACCESS_KEY", "STENCIL_S3_SECRET_KEY", "MINIO_ROOT_USER",
               "MINIO_ROOT_PASSWORD"}
SETTINGS = {f"STENCIL_{f.name.upper()}" for f in dataclasses.fields(Settings)}


def _documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


DOCS = _documents()


def _by(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name)


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def _workloads() -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def _config() -> dict[str, str]:
    return _by("ConfigMap", "stencil-config")["data"]


def test_every_file_is_in_the_kustomization_and_valid_against_the_api_schemas() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    for doc in DOCS:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(_by("StatefulSet", "gpu-worker"))
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = "one gpu"
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator does reject a wrong shape
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_topology_redis_store_dispatcher_api_cpu_and_gpu_workers() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in DOCS}
    assert {("StatefulSet", "redis"), ("StatefulSet", "minio"), ("Job", "minio-init"), ("Deployment", "dispatcher"),
            ("Deployment", "api"), ("Deployment", "cpu-worker"), ("StatefulSet", "gpu-worker"),
            ("ConfigMap", "stencil-config")} <= kinds
    commands = {d["metadata"]["name"]: _containers(d)[0].get("command", [])[:2] for d in _workloads()}
    assert commands["dispatcher"] == ["stencil", "dispatcher"] and commands["api"] == ["stencil", "api"]
    assert commands["cpu-worker"] == ["stencil", "cpu-worker"] and commands["gpu-worker"] == ["stencil", "gpu-worker"]
    for doc in _workloads():
        for c in _containers(doc):
            if c.get("command", [""])[0] == "stencil":
                assert c["image"] == STENCIL_IMAGE, doc["metadata"]["name"]
            else:  # third-party images pinned to a release
                assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


def test_gpu_workers_one_gpu_each_ids_from_ordinals_listed_for_the_dispatcher() -> None:
    gpu = _by("StatefulSet", "gpu-worker")
    (container,) = _containers(gpu)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["command"] == ["stencil", "gpu-worker", "--worker-id", "$(STENCIL_WORKER_ID)"]
    worker_id = next(e for e in container["env"] if e["name"] == "STENCIL_WORKER_ID")
    assert worker_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert _config()["STENCIL_GPU_WORKERS"].split(",") == [str(i) for i in range(gpu["spec"]["replicas"])]
    for doc in _workloads():  # no other container holds a GPU
        if doc is not gpu:
            assert all("nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}) for c in _containers(doc))


def test_settings_exist_credentials_come_from_the_secret_and_nothing_is_shared() -> None:
    config = _config()
    assert set(k for k in config if k.startswith("STENCIL_")) <= SETTINGS
    assert not CREDENTIALS & set(config) and config["STENCIL_STORE_BACKEND"] == "s3"
    for doc in _workloads():
        spec = doc["spec"]["template"]["spec"]
        for c in _containers(doc):
            env = {e["name"]: e for e in c.get("env", [])}
            assert {n for n in env if n.startswith("STENCIL_")} <= SETTINGS, doc["metadata"]["name"]
            for name in CREDENTIALS & set(env):
                assert env[name]["valueFrom"]["secretKeyRef"]["name"] == SECRET, (doc["metadata"]["name"], name)
            if "STENCIL_REDIS_URL" in env:
                assert env["STENCIL_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@redis:6379/0"
                assert list(env).index("REDIS_PASSWORD") < list(env).index("STENCIL_REDIS_URL")  # defined first
            for e in env.values():  # no literal secret
                assert "value" not in e or not any(w in e["name"] for w in ("PASSWORD", "SECRET", "ACCESS_KEY"))
        if doc["kind"] != "Job" and doc["metadata"]["name"] not in ("redis", "minio"):
            # A Stencil pod's folders are its own: emptyDirs, no PersistentVolumeClaim, no hostPath.
            assert all(set(v) - {"name"} == {"emptyDir"} for v in spec.get("volumes", [])), doc["metadata"]["name"]
            assert spec["securityContext"]["runAsNonRoot"] is True


def test_long_running_containers_have_probes() -> None:
    for doc in _workloads():
        if doc["kind"] == "Job":
            continue
        for c in _containers(doc):
            assert "readinessProbe" in c and "livenessProbe" in c, (doc["metadata"]["name"], c["name"])
    gpu = _containers(_by("StatefulSet", "gpu-worker"))[0]
    assert gpu["startupProbe"]["failureThreshold"] * gpu["startupProbe"]["periodSeconds"] >= 300  # model load
    assert "gpu-worker" in gpu["livenessProbe"]["exec"]["command"][-1]
