"""Incident traces over real OTLP/gRPC: a receiver in the test, three processes (a
coordinator that dies mid-incident, an agent, the restarted coordinator) exporting to it
through the standard OTEL_EXPORTER_OTLP_* variables, and one trace at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from unicron import certs
from unicron.otlp_receiver import Receiver, serve
from unicron.security.tls import load_tls

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# One script, three roles; each exports what it emits, flushed at exit.
SCRIPT = """
import sys, time
from unicron import incident_trace as it, telemetry

role = sys.argv[1]
telemetry.setup_telemetry(role.split("-")[0])
now = time.time()
if role == "coordinator-before":
    tp = it.new_incident_context()
    it.record_span(tp, it.DETECT, now - 1.0, now - 0.6, {it.ATTR_NODE: "node-2"})
    it.record_span(tp, it.CLASSIFY, now - 0.6, now - 0.5, {it.ATTR_REMEDY: "REMEDY_RECONFIGURE"})
    with it.child_span(tp, it.PLAN, start_time=now - 0.5) as plan:
        plan.set_attributes({it.ATTR_SOLVER_STATUS: "OPTIMAL", it.ATTR_OBJECTIVE: 3.0, it.ATTR_SOLVE_SECONDS: 0.1})
    print(tp)
elif role == "agent":
    with it.child_span(sys.argv[2], it.TRANSITION, {it.ATTR_NODE: "node-1", it.ATTR_JOB: "job-1"}) as span:
        span.set_attributes({it.ATTR_ACTION: "reconfigure", it.ATTR_STATE_SOURCE: "peer", it.ATTR_BYTES_MOVED: 4096})
else:
    it.record_span(sys.argv[2], it.RESUMED, now, now, {it.ATTR_ITERATION: 11})
    it.finish_incident(sys.argv[2], now - 5.0, now, {it.ATTR_INCIDENT_ID: "inc-1"})
telemetry.shutdown_telemetry()
"""


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    server, servicer, port = serve("127.0.0.1:0")
    yield servicer, port
    server.stop(0)


def run_role(port: int, *args: str, otel: dict[str, str] | None = None) -> str:
    """Runs one role; `otel`: the exporter's settings (default: plaintext to `port`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and not k.startswith("UNICRON_TRACE")}
    env.update(
        otel or {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
        PYTHONPATH=str(ROOT),
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_incident_trace_reaches_an_otlp_receiver_across_processes(receiver: tuple[Receiver, int]) -> None:
    servicer, port = receiver
    traceparent = run_role(port, "coordinator-before")
    run_role(port, "agent", traceparent)
    run_role(port, "coordinator-after", traceparent)

    deadline = time.monotonic() + 5
    while len(servicer.spans()) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    received = servicer.spans()
    names = sorted(span.name for _, span in received)
    assert names == sorted(["detect", "classify", "plan", "transition", "resumed", "unicron.incident"])

    _, trace_hex, root_hex, _ = traceparent.split("-")
    by_name = {span.name: (service, span) for service, span in received}
    assert {span.trace_id.hex() for _, span in received} == {trace_hex}
    service, root = by_name["unicron.incident"]
    assert (service, root.span_id.hex(), root.parent_span_id) == ("unicron-coordinator", root_hex, b"")
    assert root.end_time_unix_nano - root.start_time_unix_nano == pytest.approx(5e9, abs=1e6)
    for name in ("detect", "classify", "plan", "transition", "resumed"):
        assert by_name[name][1].parent_span_id.hex() == root_hex, name
    assert by_name["transition"][0] == "unicron-agent"
    plan_attributes = {a.key: a.value for a in by_name["plan"][1].attributes}
    assert plan_attributes["unicron.plan.solver_status"].string_value == "OPTIMAL"
    assert plan_attributes["unicron.plan.objective"].double_value == 3.0
    transition_attributes = {a.key: a.value for a in by_name["transition"][1].attributes}
    assert transition_attributes["unicron.transition.bytes_moved"].int_value == 4096


def test_traces_travel_over_mutual_tls_and_no_certificate_gets_none_in(tmp_path: Path) -> None:
    """The compose stack's collector serves OTLP over mutual TLS: a service that shows its
    certificate through the standard variables is heard, one without is not."""
    pki = certs.create_dev_pki(tmp_path / "pki", nodes=[])
    collector = pki.backends["otel-collector"]
    server, servicer, port = serve("127.0.0.1:0", tls=load_tls(str(pki.ca), str(collector.cert), str(collector.key)))
    try:
        endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"https://127.0.0.1:{port}"}
        # The CA alone: the handshake fails (the exporter logs it and exits 0), nothing arrives.
        run_role(port, "coordinator-before", otel={**endpoint, "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca)})
        assert servicer.spans() == []

        leaf = pki.services["coordinator"]
        traceparent = run_role(
            port,
            "coordinator-before",
            otel={
                **endpoint,
                "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca),
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(leaf.cert),
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(leaf.key),
            },
        )
        received = servicer.spans()
        assert sorted(span.name for _, span in received) == ["classify", "detect", "plan"]
        assert {span.trace_id.hex() for _, span in received} == {traceparent.split("-")[1]}
        assert {service for service, _ in received} == {"unicron-coordinator"}
    finally:
        server.stop(0)
