"""The `ray up` files (deploy/ray/) as Ray's cluster launcher reads them, offline: Ray's
own prepare_config and validate_config (the schema Ray ships), the `ray start` lines
through Ray's CLI, and the planner's bounds against the node types."""
from __future__ import annotations

import copy
import json
import re

import click
import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.deploy.capacity import shortfalls
from tests.deploy.files import LAUNCHERS, commands_in, load, ray_start, serve_command


def launcher_check(config: dict) -> dict:
    """What `ray up` does to a config before it touches a cloud: the prepared config,
    or the error it stops with."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    for command in prepared["head_start_ray_commands"] + prepared["worker_start_ray_commands"]:
        ray_start(command)
    return prepared


def node_types(prepared: dict) -> dict[str, dict]:
    """The node types as the autoscaler sees them. The local provider keeps one type
    whose custom resources are in the workers' `ray start --resources`."""
    if prepared["provider"]["type"] != "local":
        return prepared["available_node_types"]
    params = [p for c in prepared["worker_start_ray_commands"] if (p := ray_start(c))]
    resources = json.loads(params[0]["resources"] or "{}")
    return {"worker": {"resources": resources,
                       "max_workers": len(prepared["provider"]["worker_ips"])}}


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_the_launcher_file_passes_ray_s_own_validation(path):
    prepared = launcher_check(load(path))
    assert prepared["head_start_ray_commands"]


def test_the_tensor_parallel_file_gives_every_rank_of_a_worker_a_gpu_on_one_node():
    """aws-tp4.yaml: workers of four ranks, each node type four GPUs; one GPU fewer a
    node and no worker fits (the check counts every rank)."""
    path = next(p for p in CLOUD if p.name == "aws-tp4.yaml")
    argv = serve_command(commands_in(path))
    assert dict(zip(argv, argv[1:]))["--tensor-parallel-size"] == "4"
    prepared = launcher_check(load(path))
    assert shortfalls(argv, node_types(prepared)) == []
    for kind in ("prefill_gpu", "decode_gpu"):
        prepared["available_node_types"][kind]["resources"]["GPU"] = 3
    assert shortfalls(argv, node_types(prepared))[0].startswith(
        "prefill: up to 2 workers, room for 0")


def test_there_is_a_cloud_and_an_on_premise_launcher_file():
    providers = {load(path)["provider"]["type"] for path in LAUNCHERS}
    assert "local" in providers and providers & {"aws", "gcp"}


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_the_router_starts_on_the_head_with_the_planner_and_its_bounds_fit(path):
    config = load(path)
    argv = serve_command(commands_in(path))
    assert argv[:3] == ["serve", "--ray-address", "auto"]
    assert "--autoscale" in argv and "--api-key" not in argv  # keys: the environment
    assert any("pdserve serve" in c for c in config["head_start_ray_commands"])
    assert shortfalls(argv, node_types(launcher_check(config))) == []


CLOUD = [p for p in LAUNCHERS if load(p)["provider"]["type"] == "aws"]


@pytest.mark.parametrize("path", CLOUD, ids=lambda p: p.name)
def test_the_cloud_file_gives_each_pool_a_node_type_of_its_own(path):
    config = load(path)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert not {"GPU", "prefill", "decode"} & {k for k, v in head["resources"].items() if v}
    for role in ("prefill", "decode"):
        (name,) = [n for n, t in types.items() if role in t["resources"]]
        assert types[name]["resources"]["GPU"] >= 1
        # a node of each kind is kept: pdserve refuses a new worker at once while no
        # node could hold it (WorkerSpawner in router/launch.py)
        assert 1 <= types[name]["min_workers"] <= types[name]["max_workers"]


def _aws() -> dict:
    return load(next(p for p in CLOUD if p.name == "aws.yaml"))


def _break(config: dict, edit) -> dict:
    broken = copy.deepcopy(config)
    edit(broken)
    return broken


@pytest.mark.parametrize("edit, error, message", [
    (lambda c: c["available_node_types"]["decode_gpu"]["resources"].update(decode=0.5),
     jsonschema.ValidationError, "0.5 is not of type 'integer'"),
    (lambda c: c["available_node_types"]["prefill_gpu"].update(max_worker=4),
     jsonschema.ValidationError, "'max_worker' was unexpected"),
    (lambda c: c.update(idle_timeout_minute=5),
     jsonschema.ValidationError, "'idle_timeout_minute' was unexpected"),
    (lambda c: c.update(head_node_type="router"), ValueError, "head_node_type"),
    (lambda c: c.update(max_workers=1), ValueError, "smaller than the sum of `min_workers`"),
    (lambda c: c["provider"].update(type="awz"), NotImplementedError, "awz"),
    (lambda c: c["worker_start_ray_commands"].append("ray start --adress=$RAY_HEAD_IP:6379"),
     click.exceptions.NoSuchOption, "--adress"),
], ids=["fractional-resource", "misspelt-max-workers", "unknown-top-level-key",
        "missing-head-type", "max-workers-below-minimum", "unknown-provider",
        "misspelt-ray-start-flag"])
def test_a_broken_cloud_file_is_refused(edit, error, message):
    with pytest.raises(error, match=re.escape(message)):
        launcher_check(_break(_aws(), edit))


def test_an_unquoted_resources_command_is_read_by_yaml_as_a_mapping_and_refused():
    path = next(p for p in LAUNCHERS if load(p)["provider"]["type"] == "local")
    text = path.read_text()
    quoted = next(line for line in text.splitlines() if "--resources=" in line)
    unquoted = quoted.replace('- "', "- ").rstrip('"').replace('\\"', '"')
    with pytest.raises((yaml.YAMLError, jsonschema.ValidationError)):
        launcher_check(yaml.safe_load(text.replace(quoted, unquoted)))


def test_planner_bounds_the_node_types_cannot_hold_are_named():
    config = _aws()
    argv = serve_command(commands_in(next(p for p in LAUNCHERS if load(p) == config)))
    fewer = _break(config, lambda c: c["available_node_types"]["decode_gpu"].update(
        max_workers=2))
    assert shortfalls(argv, node_types(launcher_check(fewer))) == [
        "decode: up to 4 workers, room for 2 (each needs {'decode': 1.0, 'GPU': 1.0, "
        "'CPU': 1.0})", "--max-workers 8: 6 GPUs in all"]
    renamed = [w.replace('"decode"', '"decoder"') for w in argv]
    assert shortfalls(renamed, node_types(launcher_check(config)))[0].startswith(
        "decode: up to 4 workers, room for 0")
