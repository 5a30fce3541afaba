"""Incident traces: one trace per incident, the root emitted last with ids chosen first,
context carried over a real gRPC call, and a restarted process closing the trace."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext

from unicron import incident_trace as it
from unicron import rpc, telemetry
from unicron.v1 import common_pb2, node_service_pb2

ENV_VARS = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
    telemetry.TRACE_FILE_ENV,
    telemetry.TRACE_RPCS_ENV,
]
PROBE = "/unicron.test.Probe/Traceparent"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    telemetry.reset_telemetry()
    yield monkeypatch
    telemetry.reset_telemetry()


@pytest.fixture
def spans(clean_env: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    telemetry.setup_telemetry("test", extra_exporter=exporter)
    return exporter


def hexid(value: int) -> str:
    return format(value, "016x")


def by_name(finished: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in finished:
        out.setdefault(span.name, []).append(span)
    return out


def ctx(span: ReadableSpan) -> SpanContext:
    context = span.get_span_context()
    assert context is not None
    return context


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def start_probe_server() -> rpc.Server:
    """A real gRPC server (health, reflection, the telemetry interceptor) with one method
    answering the traceparent its handler sees as current."""

    def handle(_request: bytes, _context: grpc.ServicerContext) -> bytes:
        return it.current_traceparent().encode()

    handler = grpc.method_handlers_generic_handler(
        "unicron.test.Probe", {"Traceparent": grpc.unary_unary_rpc_method_handler(handle)}
    )
    server = rpc.Server(bind="127.0.0.1:0", max_workers=2, grace_s=0.2)
    server.add(lambda _servicer, grpc_server: grpc_server.add_generic_rpc_handlers((handler,)), None, "")
    server.start()
    return server


def wait_for(exporter: InMemorySpanExporter, name: str, count: int = 1) -> None:
    deadline = time.monotonic() + 5
    while len(by_name(exporter.get_finished_spans()).get(name, [])) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_incident_trace_is_one_tree_across_a_grpc_call(spans: InMemorySpanExporter) -> None:
    server = start_probe_server()
    try:
        traceparent = it.new_incident_context()
        root = it.parse_traceparent(traceparent)
        assert root is not None
        assert spans.get_finished_spans() == ()  # chosen, not exported

        first_seen = time.time() - 2.0
        detected = first_seen + 0.4
        it.record_span(traceparent, it.DETECT, first_seen, detected, {it.ATTR_NODE: "node-1"})
        it.record_span(traceparent, it.CLASSIFY, detected, detected + 0.01, {it.ATTR_REMEDY: "REMEDY_RESTART"})
        with it.child_span(traceparent, it.PLAN, {it.ATTR_JOB: "job-1"}) as plan:
            plan_traceparent = it.current_traceparent()
            with rpc.channel(server.address) as channel:
                seen_by_server = channel.unary_unary(PROBE)(b"", timeout=5).decode()
            plan.set_attributes({it.ATTR_SOLVER_STATUS: "OPTIMAL", it.ATTR_OBJECTIVE: 7.5, it.ATTR_SOLVE_SECONDS: 0.02})
        # The agents' side: each command carries the incident's traceparent.
        command = node_service_pb2.NodeCommand(command_id="c-1", traceparent=traceparent)
        for node in ("node-1", "node-2"):
            with it.child_span(command.traceparent, it.TRANSITION, {it.ATTR_NODE: node, it.ATTR_JOB: "job-1"}) as span:
                span.set_attributes(
                    {it.ATTR_ACTION: "restart", it.ATTR_STATE_SOURCE: "peer", it.ATTR_BYTES_MOVED: 1024}
                )
        resumed = time.time()
        it.record_span(traceparent, it.RESUMED, resumed - 0.1, resumed, {it.ATTR_ITERATION: 42})
        wait_for(spans, PROBE, 2)
        it.finish_incident(traceparent, first_seen, resumed, {it.ATTR_INCIDENT_ID: "inc-1"})
    finally:
        server.stop()

    finished = spans.get_finished_spans()
    named = by_name(finished)
    assert {ctx(span).trace_id for span in finished} == {root.trace_id}

    (incident,) = named[it.INCIDENT]
    assert incident.parent is None
    assert ctx(incident).span_id == root.span_id
    assert incident.start_time == round(first_seen * 1e9)
    assert incident.end_time == round(resumed * 1e9)
    assert incident.attributes == {it.ATTR_INCIDENT_ID: "inc-1"}

    for name in (it.DETECT, it.CLASSIFY, it.PLAN, it.TRANSITION, it.RESUMED):
        assert all(parent_id(span) == root.span_id for span in named[name]), name
    assert len(named[it.TRANSITION]) == 2
    assert {span.attributes[it.ATTR_NODE] for span in named[it.TRANSITION] if span.attributes} == {"node-1", "node-2"}
    assert all(span.attributes and span.attributes[it.ATTR_BYTES_MOVED] == 1024 for span in named[it.TRANSITION])

    (detect,) = named[it.DETECT]
    assert (detect.start_time, detect.end_time) == (round(first_seen * 1e9), round(detected * 1e9))
    (plan_span,) = named[it.PLAN]
    assert plan_span.attributes is not None
    assert plan_span.attributes[it.ATTR_SOLVER_STATUS] == "OPTIMAL"
    assert plan_span.attributes[it.ATTR_OBJECTIVE] == 7.5
    assert plan_traceparent.split("-")[2] == hexid(ctx(plan_span).span_id)

    # The gRPC hop: client span under plan, server span under the client span, and the
    # server's handler runs inside the server span.
    client = next(span for span in named[PROBE] if span.kind.name == "CLIENT")
    served = next(span for span in named[PROBE] if span.kind.name == "SERVER")
    assert parent_id(client) == ctx(plan_span).span_id
    assert parent_id(served) == ctx(client).span_id
    assert it.trace_id_of(seen_by_server) == format(root.trace_id, "032x")
    assert seen_by_server.split("-")[2] == hexid(ctx(served).span_id)


def test_rpcs_outside_a_trace_are_not_recorded(spans: InMemorySpanExporter) -> None:
    server = start_probe_server()
    try:
        with rpc.channel(server.address) as channel:
            assert channel.unary_unary(PROBE)(b"", timeout=5) == b""
    finally:
        server.stop()
    # Only this test's call counts: threads other tests left behind may still trace theirs.
    probe = PROBE.rsplit("/", 1)[-1]
    assert [s.name for s in spans.get_finished_spans() if probe in s.name] == []


def test_restarted_process_finishes_the_root_from_the_stored_traceparent(clean_env: pytest.MonkeyPatch) -> None:
    before = InMemorySpanExporter()
    telemetry.setup_telemetry("coordinator", extra_exporter=before)
    traceparent = it.new_incident_context()
    stored = common_pb2.Incident(incident_id="inc-9", traceparent=traceparent).SerializeToString()
    it.record_span(traceparent, it.DETECT, 100.0, 101.0)
    with it.child_span(traceparent, it.PLAN):
        pass

    telemetry.reset_telemetry()  # the coordinator dies; a new one starts with a new provider
    after = InMemorySpanExporter()
    provider = telemetry.setup_telemetry("coordinator", extra_exporter=after)
    assert provider is telemetry.setup_telemetry("coordinator")  # idempotent
    incident = common_pb2.Incident.FromString(stored)
    first_seen = Timestamp(seconds=100)
    resumed = datetime(1970, 1, 1, 0, 2, 0, tzinfo=UTC)
    it.record_span(incident.traceparent, it.RESUMED, 110.0, resumed)
    it.finish_incident(incident.traceparent, first_seen, resumed, {it.ATTR_INCIDENT_ID: incident.incident_id})

    root = it.parse_traceparent(traceparent)
    assert root is not None
    (incident_span,) = by_name(after.get_finished_spans())[it.INCIDENT]
    context = ctx(incident_span)
    assert (context.trace_id, context.span_id) == (root.trace_id, root.span_id)
    assert incident_span.parent is None
    assert (incident_span.start_time, incident_span.end_time) == (100 * 10**9, 120 * 10**9)
    children = [*before.get_finished_spans(), *by_name(after.get_finished_spans())[it.RESUMED]]
    assert sorted(span.name for span in children) == [it.DETECT, it.PLAN, it.RESUMED]
    assert all(parent_id(span) == root.span_id for span in children)
    assert all(ctx(span).trace_id == root.trace_id for span in children)


def test_forced_ids_apply_only_inside(spans: InMemorySpanExporter) -> None:
    generator = telemetry.ForcedIdGenerator()
    with telemetry.forced_ids(0xABC, 0xDEF):
        assert (generator.generate_trace_id(), generator.generate_span_id()) == (0xABC, 0xDEF)
    assert generator.generate_span_id() != 0xDEF
    tracer = telemetry.tracer("test")
    with tracer.start_as_current_span("outer"):
        # finish_incident makes a root even when another span is current.
        traceparent = it.new_incident_context()
        it.finish_incident(traceparent, 1.0, 0.5)
    (incident,) = by_name(spans.get_finished_spans())[it.INCIDENT]
    assert incident.parent is None
    assert incident.end_time == incident.start_time  # never a negative duration


def test_missing_or_malformed_traceparent_traces_nothing(spans: InMemorySpanExporter) -> None:
    for bad in ("", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"):
        assert it.parse_traceparent(bad) is None
        assert it.trace_id_of(bad) == ""
        it.record_span(bad, it.DETECT, 1.0, 2.0)
        it.finish_incident(bad, 1.0, 2.0)
        with it.child_span(bad, it.PLAN) as span:
            assert not span.is_recording()
            assert it.current_traceparent() == ""
    assert spans.get_finished_spans() == ()


def test_without_setup_context_still_propagates(clean_env: pytest.MonkeyPatch) -> None:
    traceparent = it.new_incident_context()
    with it.child_span(traceparent, it.TRANSITION):
        assert it.trace_id_of(it.current_traceparent()) == it.trace_id_of(traceparent)
    it.finish_incident(traceparent, 1.0, 2.0)  # nothing to export to, and no error
    assert it.current_traceparent() == ""


def test_exception_inside_child_span_is_recorded_and_reraised(spans: InMemorySpanExporter) -> None:
    traceparent = it.new_incident_context()
    with pytest.raises(RuntimeError), it.child_span(traceparent, it.PLAN):
        raise RuntimeError("solver crashed")
    (plan,) = spans.get_finished_spans()
    assert plan.status.status_code.name == "ERROR"
    assert plan.events[0].name == "exception"


def test_trace_file_has_one_json_span_per_line(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "traces" / "spans.jsonl"
    clean_env.setenv(telemetry.TRACE_FILE_ENV, str(path))
    telemetry.setup_telemetry("coordinator")
    traceparent = it.new_incident_context()
    it.record_span(traceparent, it.DETECT, 10.0, 10.5, {it.ATTR_NODE: "node-1", "tags": ("a", "b")})
    it.finish_incident(traceparent, 10.0, 12.0)
    telemetry.shutdown_telemetry()

    records = [json.loads(line) for line in path.read_text().splitlines()]
    root = it.parse_traceparent(traceparent)
    assert root is not None
    assert [record["name"] for record in records] == [it.DETECT, it.INCIDENT]
    detect, incident = records
    assert detect == {
        "name": it.DETECT,
        "trace_id": format(root.trace_id, "032x"),
        "span_id": detect["span_id"],
        "parent_id": hexid(root.span_id),
        "start": 10.0,
        "end": 10.5,
        "attributes": {it.ATTR_NODE: "node-1", "tags": ["a", "b"]},
        "service": "unicron-coordinator",
        "kind": "INTERNAL",
        "status": "UNSET",
    }
    assert incident["span_id"] == hexid(root.span_id)
    assert incident["parent_id"] is None


@pytest.mark.parametrize(
    ("env", "kinds"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, ["OTLPSpanExporter"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "none"}, []),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "console"},
            ["ConsoleSpanExporter"],
        ),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["OTLPSpanExporter", "ConsoleSpanExporter"]),
        ({telemetry.TRACE_FILE_ENV: "{tmp}/t.jsonl"}, ["JsonLinesSpanExporter"]),
    ],
)
def test_exporters_follow_the_environment(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], kinds: list[str]
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value.format(tmp=tmp_path))
    exporters = telemetry.exporters_from_env()
    try:
        assert [type(exporter).__name__ for exporter in exporters] == kinds
    finally:
        for exporter in exporters:
            exporter.shutdown()


def test_console_exporter_prints_spans(clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("OTEL_TRACES_EXPORTER", "console")
    telemetry.setup_telemetry("coordinator")
    it.finish_incident(it.new_incident_context(), 1.0, 2.0)
    telemetry.shutdown_telemetry()
    assert '"name": "unicron.incident"' in capsys.readouterr().out
    assert isinstance(telemetry.exporters_from_env()[0], ConsoleSpanExporter)
