"""The Grafana dashboard against real data: a real Prometheus server (Debian's, `make
test-e2e` installs it) scrapes the active coordinator of a LocalCluster from its start, a job
trains and one of its failures is healed, and then every query of every panel of
deploy/grafana/dashboards/unicron.json is evaluated through Prometheus's HTTP API: each returns
data, numbers and not NaN, with the labels its legend names."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import running, wait_for
from tests.e2e.healing import healed, incident_ids, inject, newest_incident
from unicron.ports import free_port
from unicron.v1 import common_pb2
from unicron_dev.localcluster import ROOT, LocalCluster, tiny_gpt

pytestmark = pytest.mark.e2e

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "unicron.json"
# Grafana's variables as a user sees the dashboard: every job, the last 10 minutes.
VARIABLES = {"$job": ".+", "$__range": "10m"}
NAME = "dash"


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, PromQL with Grafana's variables filled in, legend format) of every target."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in VARIABLES.items():
                expr = expr.replace(variable, value)
            out.append((panel["title"], expr, target.get("legendFormat", "")))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = Path(tmp_path_factory.mktemp("dashboard"))
    quotas = work / "quotas.yaml"  # so that the team panel has teams to show
    quotas.write_text("teams:\n  vision: {guarantee: 1, borrow_limit: 1}\n  nlp: {guarantee: 1}\n")
    local = LocalCluster(work / "cluster", agents=2, slots_per_agent=1, fault_injection=True, quotas_file=quotas)
    cluster = running(local)
    yield next(cluster)
    next(cluster, None)


@pytest.fixture(scope="module")
def prometheus(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus server scraping the coordinator every second; its HTTP address."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: `make test-e2e` installs it (scripts/ensure-tool.sh)"
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: unicron, static_configs: [{{targets: ['{cluster.metrics_address}']}}]}}\n"
    )
    address = f"127.0.0.1:{free_port()}"
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={work / 'data'}",
        f"--web.listen-address={address}",
    ]
    with open(work / "prometheus.log", "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _ready(address):
            assert server.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        # Ready is not scraped: a series first seen after the incident would start at 1, and
        # no windowed panel could see it grow (seen once in CI, on a loaded machine).
        while not query(address, 'unicron_incidents_total{kind="collective_timeout"}'):
            assert time.monotonic() < deadline, "prometheus never scraped the coordinator"
            time.sleep(0.2)
        yield address
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/-/ready", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def query(address: str, expr: str) -> list[dict[str, Any]]:
    """The instant vector ``expr`` evaluates to now; AssertionError if Prometheus refuses it."""
    url = f"http://{address}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as answer:
        body = json.load(answer)
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_every_panel_of_the_dashboard_shows_data(cluster: LocalCluster, prometheus: str) -> None:
    spec = tiny_gpt(NAME, data=2)
    spec.throughput[2] = 1.9e9  # measured-looking, so the job has a WAF from its start
    with cluster.client() as client:
        client.submit(spec)
        wait_for(client, NAME, lambda j: j.progress.iteration >= 3, "never trained", timeout_s=180)
        seen = incident_ids(client, NAME)
        inject(cluster, NAME, "exception:collective_timeout", rank=1)
        incident = newest_incident(client, NAME, seen)
        healed(client, NAME, incident)
        assert incident.kind == common_pb2.FAILURE_KIND_COLLECTIVE_TIMEOUT
    # The heal is in a scrape once the incident counter is there (a few seconds at most).
    deadline = time.monotonic() + 30
    while not query(prometheus, "unicron_incident_transition_seconds_count > 0"):
        assert time.monotonic() < deadline, "the healed incident never reached Prometheus"
        time.sleep(0.5)
    time.sleep(2)  # and a further scrape, so that increase() and rate() see it grow
    empty = []
    for title, expr, legend in panel_queries():
        result = query(prometheus, expr)
        if not result:
            empty.append(f"{title}: {expr}")
            continue
        for sample in result:
            value = float(sample["value"][1])
            assert not math.isnan(value), f"{title}: {expr} is NaN"
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
                assert label in sample["metric"], f"{title}: {expr} has no label {label}: {sample['metric']}"
    assert not empty, "panels without data:\n" + "\n".join(empty)
