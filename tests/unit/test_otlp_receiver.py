"""unicron.otlp_receiver, the collector and viewer stand-in of the compose test: spans
exported to the first receiver are forwarded to the second, whose query API answers in
Jaeger's shape."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from unicron import otlp_receiver
from unicron.redisutil import free_port

TRACE = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
ROOT_SPAN, CHILD_SPAN = bytes.fromhex("b7ad6b7169203331"), bytes.fromhex("00f067aa0ba902b7")


@pytest.fixture
def chain() -> Iterator[tuple[int, str]]:
    """A viewer (OTLP and query API) and a collector forwarding to it: (collector port, API)."""
    viewer, viewer_spans, viewer_port = otlp_receiver.serve("127.0.0.1:0")
    api = f"127.0.0.1:{free_port()}"
    web = otlp_receiver.http_server(api, viewer_spans)
    collector, _, collector_port = otlp_receiver.serve("127.0.0.1:0", forward=f"127.0.0.1:{viewer_port}")
    yield collector_port, f"http://{api}"
    collector.stop(0)
    web.shutdown()
    viewer.stop(0)


def export(port: int) -> None:
    attribute = common_pb2.KeyValue(key="unicron.job.id", value=common_pb2.AnyValue(string_value="job-1"))
    spans = [
        trace_pb2.Span(
            trace_id=TRACE,
            span_id=ROOT_SPAN,
            name="unicron.incident",
            attributes=[attribute],
            start_time_unix_nano=1_000_000_000,
            end_time_unix_nano=3_000_000_000,
        ),
        trace_pb2.Span(
            trace_id=TRACE,
            span_id=CHILD_SPAN,
            parent_span_id=ROOT_SPAN,
            name="detect",
            start_time_unix_nano=1_000_000_000,
            end_time_unix_nano=1_500_000_000,
        ),
    ]
    service = common_pb2.KeyValue(key="service.name", value=common_pb2.AnyValue(string_value="unicron-coordinator"))
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=resource_pb2.Resource(attributes=[service]),
                scope_spans=[trace_pb2.ScopeSpans(spans=spans)],
            )
        ]
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


def test_spans_reach_the_viewer_through_the_collector(chain: tuple[int, str]) -> None:
    collector_port, api = chain
    export(collector_port)
    assert get(f"{api}/api/services") == {"data": ["unicron-coordinator"]}
    assert get(f"{api}/api/traces?service=someone-else") == {"data": []}
    (trace,) = get(f"{api}/api/traces?service=unicron-coordinator")["data"]
    assert trace["traceID"] == TRACE.hex()
    assert trace["processes"] == {"p1": {"serviceName": "unicron-coordinator", "tags": []}}
    root, child = trace["spans"]
    assert (root["operationName"], root["references"], root["duration"]) == ("unicron.incident", [], 2_000_000)
    assert root["tags"] == [{"key": "unicron.job.id", "value": "job-1"}]
    assert child["references"] == [{"refType": "CHILD_OF", "traceID": TRACE.hex(), "spanID": ROOT_SPAN.hex()}]
