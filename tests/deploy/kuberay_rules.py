"""What the KubeRay operator checks of a RayCluster before it acts on it, offline.

Two layers, as the operator has them:
- the CRD's openAPIV3Schema (the API server enforces it on `kubectl apply`): the CRD of
  KubeRay v1.7.0, vendored in tests/deploy/kuberay/ (ORIGIN.md);
- the rules the operator enforces only in its Go code, re-implemented from
  `ray-operator/controllers/ray/utils/validation.go` (`ValidateRayClusterMetadata`,
  `ValidateRayClusterSpec`, `validateRayGroupResources`, `validateRayGroupLabels`,
  `validateWorkerGroupIdleTimeout`) at the same tag. The GCS fault tolerance, history
  server, network policy and TLS rules are left out: these manifests set none of them.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import jsonschema_rs
import yaml

CRD = Path(__file__).parent / "kuberay" / "ray.io_rayclusters.yaml"
MAX_NAME = 53  # utils.MaxRayClusterNameLength
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_AUTOSCALER_V2_ENV = "RAY_enable_autoscaler_v2"
_START_RESOURCES = ("num-cpus", "num-gpus", "memory", "resources")


@functools.cache
def _validator():
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema_rs.Draft7Validator(v1["schema"]["openAPIV3Schema"])


def schema_errors(cluster: dict) -> list[str]:
    """Where the RayCluster breaks the CRD's schema."""
    return [f"{'/'.join(map(str, e.instance_path))}: {e.message}"
            for e in _validator().iter_errors(cluster)]


def operator_errors(cluster: dict) -> list[str]:
    """What the operator's Go validation would refuse."""
    errors = []
    name = cluster.get("metadata", {}).get("name", "")
    if len(name) > MAX_NAME:
        errors.append(f"RayCluster name should be no more than {MAX_NAME} characters")
    if not _DNS1035.match(name) or len(name) > 63:
        errors.append(f"RayCluster name should be a valid DNS1035 label: {name!r}")
    spec = cluster.get("spec", {})
    head = spec.get("headGroupSpec", {})
    head_pod = head.get("template", {}).get("spec", {})
    if not head_pod.get("containers"):
        return errors + ["headGroupSpec should have at least one container"]
    head_env = {e["name"]: e.get("value") for e in head_pod["containers"][0].get("env", [])}
    errors += _group_errors("Head", head)
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    options = spec.get("autoscalerOptions") or {}
    v2 = options.get("version") == "v2"
    for group in spec.get("workerGroupSpecs", []):
        name = group.get("groupName")
        if not group.get("template", {}).get("spec", {}).get("containers"):
            errors.append("workerGroupSpec should have at least one container")
            continue
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            errors.append(f"worker group {name} must set both minReplicas and maxReplicas "
                          "when autoscaling is disabled")
        if low is not None and low < 0:
            errors.append(f"worker group {name} has negative minReplicas {low}")
        if high is not None and high < 0:
            errors.append(f"worker group {name} has negative maxReplicas {high}")
        if low is not None and high is not None and low > high:
            errors.append(f"worker group {name} has minReplicas {low} greater than "
                          f"maxReplicas {high}")
        errors += _group_errors(name, group)
        idle = group.get("idleTimeoutSeconds")
        if idle is not None:
            if idle < 0:
                errors.append(f"worker group {name}: idleTimeoutSeconds must be non-negative")
            elif not v2 and head_env.get(_AUTOSCALER_V2_ENV) not in ("1", "true"):
                errors.append(f"worker group {name}: idleTimeoutSeconds is set, but "
                              "autoscaler v2 is not enabled")
    if not autoscaling and head_env.get(_AUTOSCALER_V2_ENV) in ("1", "true"):
        errors.append(f"environment variable {_AUTOSCALER_V2_ENV} cannot be set when "
                      "enableInTreeAutoscaling is false")
    if autoscaling:
        for group in spec.get("workerGroupSpecs", []):
            if group.get("suspend"):
                errors.append(f"worker group {group.get('groupName')} cannot be suspended "
                              "with Autoscaler enabled")
        if "version" in options and _AUTOSCALER_V2_ENV in head_env:
            errors.append("both .spec.autoscalerOptions.version and head Pod env var "
                          f"{_AUTOSCALER_V2_ENV} are set")
        if v2:
            pods = [("head Pod", head_pod)] + [
                (f"worker group {g.get('groupName')}", g["template"]["spec"])
                for g in spec.get("workerGroupSpecs", [])]
            for what, pod in pods:
                if pod.get("restartPolicy", "Never") != "Never":
                    errors.append(f"restartPolicy for {what} should be Never or unset when "
                                  "using autoscaler V2")
    if options.get("idleTimeoutSeconds", 0) < 0:
        errors.append("autoscalerOptions.idleTimeoutSeconds must be non-negative")
    if (spec.get("authOptions") or {}).get("mode") == "token":
        version = tuple(int(p) for p in re.findall(r"\d+", spec.get("rayVersion", ""))[:3])
        if version < (2, 52, 0):
            errors.append("authOptions.mode is 'token' but minimum Ray version is 2.52.0")
    return errors


def _group_errors(name: str, group: dict) -> list[str]:
    """validateRayGroupResources and validateRayGroupLabels."""
    errors = []
    params = group.get("rayStartParams") or {}
    if any(params.get(key) for key in _START_RESOURCES) and group.get("resources"):
        errors.append(f"resource fields should not be set in both rayStartParams and "
                      f"Resources for {name} group")
    if "labels" in params:
        errors.append(f"rayStartParams['labels'] is not supported for {name} group")
    for key, value in (group.get("labels") or {}).items():
        prefix, _, base = key.rpartition("/")
        if not _QUALIFIED.match(base) or len(base) > 63 or len(prefix) > 253:
            errors.append(f"invalid label key for {name} group: {key!r}")
        if not _LABEL_VALUE.match(value) or len(value) > 63:
            errors.append(f"invalid label value for key {key!r} in {name} group")
    return errors


def autoscaler_config(cluster: dict) -> dict:
    """The config Ray's autoscaler derives from the RayCluster (as the KubeRay
    autoscaler sidecar does), checked by Ray's own validate_config."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )
    from ray.autoscaler._private.util import validate_config

    cluster = {**cluster, "metadata": {"namespace": "default", **cluster["metadata"]}}
    config = _derive_autoscaling_config_from_ray_cr(cluster)
    validate_config(config)
    return config
