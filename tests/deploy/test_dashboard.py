"""The Grafana dashboard (deploy/observability/) against a live router's /metrics (the
router deploy/ray/local.yaml starts, conftest.py): every metric a panel queries is
exported, with the labels the panel selects, groups and names its series by."""
from __future__ import annotations

import copy
import json
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.files import DASHBOARD, DEPLOY, load

_METRIC = re.compile(r"\bpdserve:[A-Za-z0-9_:]+")
_SELECTOR = re.compile(r"(pdserve:[A-Za-z0-9_:]+)\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def exported(text: str) -> dict[str, set[str] | None]:
    """Each name a query may use (a family's, and its samples': _total, _bucket, ...)
    -> the labels its samples carry; None for a family with no sample yet (declared,
    its labels unseen)."""
    names: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(text):
        labels = {k for s in family.samples for k in s.labels} - {"le", "quantile"} or None
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        for name in [family.name] + [family.name + s for s in suffixes.get(family.type, [])]:
            names[name] = labels
    return names


def dashboard_errors(dashboard: dict, metrics: dict[str, set[str] | None]) -> list[str]:
    errors = []
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    if len({p["id"] for p in dashboard["panels"]}) != len(dashboard["panels"]):
        errors.append("panel ids repeat")
    for panel in panels:
        where = f"panel {panel['title']!r}"
        if panel["datasource"]["uid"] != "${datasource}":
            errors.append(f"{where}: not on the $datasource variable")
        for target in panel["targets"]:
            expr = target["expr"]
            used = _METRIC.findall(expr)
            if not used:
                errors.append(f"{where}: queries no pdserve metric")
            known: set[str] = set()
            for name in used:
                if name not in metrics:
                    errors.append(f"{where}: {name} is not exported")
                else:
                    known |= metrics[name] or set()
            for name, matchers in _SELECTOR.findall(expr):
                for label in _MATCHER.findall(matchers):
                    if metrics.get(name) and label not in metrics[name]:
                        errors.append(f"{where}: {name} has no label {label!r}")
            grouped = {label.strip() for by in _BY.findall(expr) for label in by.split(",")}
            complete = all(metrics.get(name) is not None for name in used)
            for label in grouped - {"le"}:
                if complete and label not in known:
                    errors.append(f"{where}: grouped by {label!r}, which no metric has")
            # a series keeps the labels it is grouped by, or all of its own
            unnamed = set(_LEGEND.findall(target.get("legendFormat", ""))) - (grouped or known)
            if complete and unnamed:
                errors.append(f"{where}: legend names {sorted(unnamed)}")
    return errors


def scrape(local_cluster) -> str:
    """/metrics once a request with SLOs finished (so its labelled series exist)."""
    headers = {"Authorization": f"Bearer {local_cluster.api_key}"}
    done = httpx.post(f"{local_cluster.http_url}/v1/completions", headers=headers, json={
        "model": "test-llama", "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True},
        timeout=120)
    assert done.status_code == 200, done.text
    answer = httpx.get(f"{local_cluster.http_url}/metrics", headers=headers, timeout=60)
    assert answer.status_code == 200
    return answer.text


def test_every_metric_the_dashboard_queries_is_exported_by_a_live_router(local_cluster):
    metrics = exported(scrape(local_cluster))
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard_errors(dashboard, metrics) == []
    # the checks had labels to check: the headline series exist once a request finished
    assert metrics["pdserve:router_goodput_requests_total"] == {"model_name", "met", "kind"}
    assert {"role", "state"} <= metrics["pdserve:pool_workers"]
    queried = {name for p in dashboard["panels"] if p["type"] != "row"
               for t in p["targets"] for name in _METRIC.findall(t["expr"])}
    assert len(queried) >= 20


def test_a_dashboard_querying_what_is_not_exported_is_refused(local_cluster):
    metrics = exported(scrape(local_cluster))
    dashboard = json.loads(DASHBOARD.read_text())
    renamed = json.loads(json.dumps(dashboard).replace(
        "pdserve:router_goodput_requests_total", "pdserve:router_goodput_total"))
    assert any("pdserve:router_goodput_total is not exported" in e
               for e in dashboard_errors(renamed, metrics))
    regrouped = copy.deepcopy(dashboard)
    panel = next(p for p in regrouped["panels"] if p["title"] == "Workers by role and state")
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace("by (role, state)",
                                                                      "by (pool, state)")
    assert dashboard_errors(regrouped, metrics) == [
        "panel 'Workers by role and state': grouped by 'pool', which no metric has",
        "panel 'Workers by role and state': legend names ['role']"]


def test_the_dashboard_ships_in_the_kustomization_as_grafana_s_sidecar_loads_it():
    observability = load(DEPLOY / "observability" / "kustomization.yaml")
    (generated,) = observability["configMapGenerator"]
    assert generated["files"] == [DASHBOARD.name]
    assert observability["generatorOptions"]["labels"] == {"grafana_dashboard": "1"}
    assert "../observability" in load(DEPLOY / "kuberay" / "kustomization.yaml")["resources"]
