"""The monitoring part of the compose stack: the Grafana dashboard queries only metrics the
coordinator exports (services/coordinator/prometheus.py: METRICS) and shows each of them;
Grafana's provisioning and Prometheus's scrape config fit deploy/compose.yaml."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.coordinator import prometheus

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "unicron.json"
SERIES = re.compile(r"\b(unicron_[a-z0-9_]+)")


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and template variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query", "")
        yield f"${variable['name']}", query["query"] if isinstance(query, dict) else query


def test_every_query_names_an_exported_metric_and_every_metric_is_shown(dashboard: dict[str, Any]) -> None:
    shown: set[str] = set()
    for where, expr in queries(dashboard):
        names = SERIES.findall(expr)
        assert names, f"{where}: {expr} queries no unicron metric"
        for name in names:
            family = prometheus.family_of(name)
            assert family is not None, f"{where}: {name} is not a series the coordinator exports"
            shown.add(family)
    assert shown == set(prometheus.METRICS), f"not on the dashboard: {set(prometheus.METRICS) - shown}"


def test_the_check_above_can_fail() -> None:
    assert prometheus.family_of("unicron_cluster_waf") is None  # the unit suffix is part of the name
    assert SERIES.findall('rate(unicron_incidents_total{kind="x"}[5m])') == ["unicron_incidents_total"]


def test_panels_read_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    (source,) = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "${UNICRON_PROMETHEUS_URL}"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, panel["title"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"]), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_compose_runs_prometheus_on_the_coordinator_and_grafana_on_the_dashboard() -> None:
    services = load_yaml(DEPLOY / "compose.yaml")["services"]
    host = load_yaml(DEPLOY / "compose.host.yaml")["services"]
    for name in ("prometheus", "grafana"):
        _image, _, tag = services[name]["image"].partition(":")
        assert tag and tag != "latest", f"{name}: pin the image's tag"
    # Prometheus scrapes the port the coordinator serves its metrics on, in both files.
    for stack, config in ((services, "prometheus.yaml"), (host, "prometheus.host.yaml")):
        bind = stack["coordinator"]["environment"]["UNICRON_COORDINATOR_METRICS_BIND"]
        scrape = load_yaml(DEPLOY / config)["scrape_configs"]
        (target,) = [t for job in scrape for static in job["static_configs"] for t in static["targets"]]
        assert target.rpartition(":")[2] == bind.rpartition(":")[2], config
    assert any(
        v.startswith("./prometheus.yaml:/etc/prometheus/prometheus.yml") for v in services["prometheus"]["volumes"]
    )
    assert any(v.startswith("./prometheus.host.yaml:") for v in host["prometheus"]["volumes"])
    # Grafana: provisioning mounted where it looks, the dashboards where the provider reads.
    volumes = dict(v.rsplit(":", 1)[0].split(":", 1) for v in services["grafana"]["volumes"])
    assert volumes["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = load_yaml(DEPLOY / "grafana/provisioning/dashboards/unicron.yaml")["providers"]
    assert volumes["./grafana/dashboards"] == provider["options"]["path"]
    assert services["grafana"]["environment"]["UNICRON_PROMETHEUS_URL"] == "http://prometheus:9090"
    # Neither image can be pulled where compose.host.yaml runs: there they wait for a profile.
    assert host["prometheus"]["profiles"] == host["grafana"]["profiles"] == ["monitoring"]
