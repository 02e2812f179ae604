"""The KubeRay manifests (deploy/kuberay/) as the API server, the operator and Ray's
autoscaler read them, offline: the RayCluster CRD's schema (KubeRay v1.7.0, vendored),
the operator's own rules, and Ray's translation into an autoscaler config."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess

import pytest
import ray
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)

from tests.deploy.capacity import shortfalls
from tests.deploy.files import (
    DEPLOY,
    KUBERAY,
    documents,
    load,
    pdserve_commands,
    serve_command,
    strings,
)
from tests.deploy.kuberay_rules import autoscaler_config, operator_errors, schema_errors


def manifests() -> list[dict]:
    """The documents of every resource file the kustomization names (in its folder)."""
    kustomization = load(KUBERAY / "kustomization.yaml")
    return [doc for name in kustomization["resources"] if (KUBERAY / name).is_file()
            for doc in documents(KUBERAY / name)]


def ray_cluster() -> dict:
    (cluster,) = [doc for doc in manifests() if doc["kind"] == "RayCluster"]
    return cluster


def head_container(cluster: dict) -> dict:
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def check(cluster: dict) -> list[str]:
    """Everything the three layers refuse of a RayCluster."""
    errors = schema_errors(cluster) + operator_errors(cluster)
    if not errors:
        autoscaler_config(cluster)
    return errors


def test_the_kustomization_names_every_manifest_here_and_nothing_missing():
    kustomization = load(KUBERAY / "kustomization.yaml")
    here = {p.name for p in KUBERAY.glob("*.yaml")} - {"kustomization.yaml"}
    named = set(kustomization["resources"])
    assert here <= named
    for name in named:
        assert (KUBERAY / name).exists(), name


def test_the_ray_cluster_passes_the_crd_the_operator_and_ray_s_autoscaler():
    cluster = ray_cluster()
    assert schema_errors(cluster) == []
    assert operator_errors(cluster) == []
    types = autoscaler_config(cluster)["available_node_types"]
    assert {name: t["resources"].get(name) for name, t in types.items()
            if name in ("prefill", "decode")} == {"prefill": 1, "decode": 1}
    assert all(t["resources"].get("GPU") == 1 for n, t in types.items() if n != "headgroup")
    # a pod of each group is kept: pdserve refuses a new worker at once while no node
    # could hold it (WorkerSpawner in router/launch.py)
    assert all(g["minReplicas"] >= 1 for g in cluster["spec"]["workerGroupSpecs"])


def test_the_router_serves_on_the_head_with_the_planner_and_its_bounds_fit():
    cluster = ray_cluster()
    head = head_container(cluster)
    argv = serve_command([w for text in strings(head) for w in pdserve_commands(text)])
    assert argv[:3] == ["serve", "--ray-address", "auto"]
    assert "--autoscale" in argv and "--api-key" not in argv
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert "$KUBERAY_GEN_RAY_START_CMD &" in head["args"][0]
    types = autoscaler_config(cluster)["available_node_types"]
    assert shortfalls(argv, types) == []
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in head["env"]}
    assert set(keys) == {"PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY"}


def test_the_service_reaches_the_head_s_named_ports_and_the_probes_ask_the_router():
    cluster = ray_cluster()
    (service,) = [doc for doc in manifests() if doc["kind"] == "Service"]
    head = head_container(cluster)
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"],
                                           "ray.io/node-type": "head"}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    argv = serve_command([w for text in strings(head) for w in pdserve_commands(text)])
    flag = dict(zip(argv, argv[1:]))
    assert (ports["http"], ports["grpc"]) == (int(flag["--http-port"]),
                                              int(flag["--grpc-port"]))
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert head["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    pod = cluster["spec"]["headGroupSpec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert float(flag["--drain-timeout"]) < grace


def test_the_image_and_ray_version_are_the_dockerfile_s():
    cluster = ray_cluster()
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base_ray = re.search(r"rayproject/ray:([\d.]+)-", dockerfile).group(1)
    assert cluster["spec"]["rayVersion"] == base_ray == ray.__version__
    images = {c["image"] for t in [cluster["spec"]["headGroupSpec"]]
              + cluster["spec"]["workerGroupSpecs"] for c in t["template"]["spec"]["containers"]}
    named = {i["name"] for i in load(KUBERAY / "kustomization.yaml")["images"]}
    assert {image.split(":")[0] for image in images} == named


def _edit(path: str, value):
    """A copy of the RayCluster with `value` at `path` (keys split on '.', list indexes
    as numbers)."""
    cluster = copy.deepcopy(ray_cluster())
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = cluster
    for key in parents:
        node = node[key]
    node[last] = value
    return cluster


@pytest.mark.parametrize("path, value, error", [
    ("spec.workerGroupSpecs.0.minReplicas", "one", "is not of type \"integer\""),
    ("spec.workerGroupSpecs.1.resources", {"decode": 1}, "is not of type \"string\""),
    ("spec.autoscalerOptions.upscalingMode", "Fast", "is not one of"),
    ("spec.workerGroupSpecs.0.groupName", None, "is not of type \"string\""),
], ids=["replicas-not-a-number", "resource-not-a-string", "bad-upscaling-mode",
        "group-without-name"])
def test_the_crd_schema_refuses_a_broken_copy(path, value, error):
    assert any(error in e for e in schema_errors(_edit(path, value)))


@pytest.mark.parametrize("path, value, error", [
    ("metadata.name", "pdserve-" + "x" * 50, "no more than 53 characters"),
    ("metadata.name", "PDServe", "DNS1035"),
    ("spec.workerGroupSpecs.1.minReplicas", 5, "minReplicas 5 greater than maxReplicas 4"),
    ("spec.workerGroupSpecs.0.rayStartParams", {"resources": '"{\\"prefill\\": 1}"'},
     "both rayStartParams and Resources"),
    ("spec.workerGroupSpecs.0.rayStartParams", {"labels": "pool=prefill"},
     "rayStartParams['labels'] is not supported"),
    ("spec.headGroupSpec.template.spec.restartPolicy", "Always",
     "restartPolicy for head Pod should be Never"),
    ("spec.workerGroupSpecs.1.template.spec.restartPolicy", "OnFailure",
     "restartPolicy for worker group decode should be Never"),
    ("spec.workerGroupSpecs.0.suspend", True, "cannot be suspended with Autoscaler"),
    ("spec.autoscalerOptions.idleTimeoutSeconds", -1, "must be non-negative"),
], ids=["name-too-long", "name-not-dns", "min-above-max", "resources-twice",
        "labels-in-start-params", "head-restart-policy", "worker-restart-policy",
        "suspended-with-autoscaler", "negative-idle-timeout"])
def test_the_operator_rules_refuse_a_broken_copy(path, value, error):
    broken = _edit(path, value)
    assert any(error in e for e in operator_errors(broken)), operator_errors(broken)


def test_idle_timeout_per_group_needs_autoscaler_v2():
    broken = _edit("spec.workerGroupSpecs.0.idleTimeoutSeconds", 60)
    assert operator_errors(broken) == []
    del broken["spec"]["autoscalerOptions"]["version"]
    assert operator_errors(broken) == [
        "worker group prefill: idleTimeoutSeconds is set, but autoscaler v2 is not enabled"]


def test_ray_s_translation_refuses_what_the_autoscaler_could_not_use():
    broken = _edit("spec.workerGroupSpecs.0.rayStartParams", {"num-gpus": "one"})
    broken["spec"]["workerGroupSpecs"][0]["resources"] = {}
    with pytest.raises(ValueError):
        _derive_autoscaling_config_from_ray_cr({**broken, "metadata": {
            **broken["metadata"], "namespace": "default"}})


def test_a_pool_the_groups_cannot_hold_is_named():
    cluster = _edit("spec.workerGroupSpecs.0.maxReplicas", 2)
    argv = serve_command([w for text in strings(head_container(cluster))
                          for w in pdserve_commands(text)])
    assert shortfalls(argv, autoscaler_config(cluster)["available_node_types"]) == [
        "prefill: up to 4 workers, room for 2 (each needs {'prefill': 1.0, 'GPU': 1.0, "
        "'CPU': 1.0})", "--max-workers 8: 6 GPUs in all"]


@pytest.mark.skipif(shutil.which("kubectl") is None,
                    reason="kubectl (its kustomize) is not installed; the manifests are "
                    "checked file by file above")
def test_kustomize_builds_the_whole_deployment():
    built = subprocess.run(["kubectl", "kustomize", str(KUBERAY)], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    docs = list(yaml.safe_load_all(built))
    assert sorted(doc["kind"] for doc in docs) == [
        "ConfigMap", "PersistentVolumeClaim", "RayCluster", "Service"]
    (cluster,) = [doc for doc in docs if doc["kind"] == "RayCluster"]
    assert check(cluster) == []


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch: what kustomize applies to a custom resource (no
    strategic merge keys: its lists are replaced whole)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


TENSOR_PARALLEL = KUBERAY / "tensor-parallel"


def tensor_parallel_cluster() -> dict:
    """The RayCluster `kubectl apply -k deploy/kuberay/tensor-parallel` makes."""
    kustomization = load(TENSOR_PARALLEL / "kustomization.yaml")
    assert kustomization["resources"] == ["../"]
    (patch,) = kustomization["patches"]
    return merge_patch(ray_cluster(), load(TENSOR_PARALLEL / patch["path"]))


def test_the_tensor_parallel_overlay_serves_four_ranks_a_worker_and_its_bounds_fit():
    """Every worker four ranks, a GPU each, on one pod of four GPUs; the cluster passes
    the CRD, the operator and Ray's autoscaler, and the planner's device budget fits."""
    cluster = tensor_parallel_cluster()
    assert check(cluster) == []
    argv = serve_command([w for text in strings(head_container(cluster))
                          for w in pdserve_commands(text)])
    flag = dict(zip(argv, argv[1:]))
    assert flag["--tensor-parallel-size"] == "4" and flag["--num-gpus-per-worker"] == "1"
    types = autoscaler_config(cluster)["available_node_types"]
    assert all(t["resources"].get("GPU") == 4 for n, t in types.items() if n != "headgroup")
    assert shortfalls(argv, types) == []
    # one GPU fewer a pod and no worker fits: the check counts every rank
    small = copy.deepcopy(cluster)
    for group in small["spec"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        container["resources"]["limits"]["nvidia.com/gpu"] = "3"
        container["resources"]["requests"]["nvidia.com/gpu"] = "3"
    assert shortfalls(argv, autoscaler_config(small)["available_node_types"])[0].startswith(
        "prefill: up to 2 workers, room for 0")

