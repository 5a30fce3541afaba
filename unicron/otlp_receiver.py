"""A small OTLP/gRPC receiver: keeps the spans it is sent, forwards traces and metrics to
another OTLP endpoint when asked, and answers a subset of Jaeger's query API
(`GET /api/traces?service=NAME`, `GET /api/services`) over HTTP.

Tests use it in process as the collector; `python -m unicron.otlp_receiver` stands in for
the OpenTelemetry collector and the Jaeger viewer where their images cannot be pulled (the
compose test, `deploy/compose.host.yaml`). The HTTP answers have Jaeger's shape, so what
reads them works against a real Jaeger too. With `--tls-ca`, `--tls-cert` and `--tls-key`
it serves OTLP over mutual TLS, as the collector of compose.yaml does: every exporter shows
a certificate of that CA (the standard OTEL_EXPORTER_OTLP_CERTIFICATE, _CLIENT_CERTIFICATE
and _CLIENT_KEY)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from unicron import signals
from unicron.errors import InvalidArgument
from unicron.security.tls import TLS, load_tls


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every trace export request; forwards each to `forward` (host:port) if given."""

    def __init__(self, forward: str | None = None) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        self._forward = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(forward)) if forward else None

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            self.requests.append(request)
        if self._forward is not None:
            self._forward.Export(request, timeout=10)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, trace_pb2.Span]]:
        """(service name, span) for every span received so far."""
        out: list[tuple[str, trace_pb2.Span]] = []
        with self._lock:
            requests = list(self.requests)
        for request in requests:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        out.append((attributes.get("service.name", ""), span))
        return out


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """Accepts metrics (services export them beside traces); forwards them if asked."""

    def __init__(self, forward: str | None = None) -> None:
        self.exports = 0
        self._forward = metrics_service_pb2_grpc.MetricsServiceStub(grpc.insecure_channel(forward)) if forward else None

    def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: grpc.ServicerContext
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        self.exports += 1
        if self._forward is not None:
            self._forward.Export(request, timeout=10)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def serve(bind: str, forward: str | None = None, tls: TLS | None = None) -> tuple[grpc.Server, Receiver, int]:
    """Starts the OTLP/gRPC server; returns it, its trace receiver and its port. With `tls`
    (its CA, certificate and key), over TLS, and only to clients with a certificate of the CA."""
    receiver = Receiver(forward)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsReceiver(forward), server)
    if tls is None:
        port = server.add_insecure_port(bind)
    else:
        assert tls.ca is not None and tls.cert is not None and tls.key is not None
        credentials = grpc.ssl_server_credentials(
            [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True
        )
        port = server.add_secure_port(bind, credentials)
    if port == 0:
        raise OSError(f"cannot bind the OTLP receiver to {bind}")
    server.start()
    return server, receiver, port


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(value)


def jaeger_traces(spans: Sequence[tuple[str, trace_pb2.Span]], service: str | None) -> list[dict[str, Any]]:
    """Traces in the shape of Jaeger's /api/traces `data`: those with a span of `service`."""
    by_trace: dict[str, list[tuple[str, trace_pb2.Span]]] = {}
    for item in spans:
        by_trace.setdefault(item[1].trace_id.hex(), []).append(item)
    traces = []
    for trace_id, items in by_trace.items():
        if service is not None and all(name != service for name, _ in items):
            continue
        processes: dict[str, str] = {}
        out_spans = []
        for name, span in items:
            process_id = processes.setdefault(name, f"p{len(processes) + 1}")
            references = (
                [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": span.parent_span_id.hex()}]
                if span.parent_span_id
                else []
            )
            out_spans.append(
                {
                    "traceID": trace_id,
                    "spanID": span.span_id.hex(),
                    "operationName": span.name,
                    "references": references,
                    "startTime": span.start_time_unix_nano // 1000,
                    "duration": (span.end_time_unix_nano - span.start_time_unix_nano) // 1000,
                    "tags": [{"key": a.key, "value": _value(a.value)} for a in span.attributes],
                    "processID": process_id,
                }
            )
        traces.append(
            {
                "traceID": trace_id,
                "spans": out_spans,
                "processes": {pid: {"serviceName": name, "tags": []} for name, pid in processes.items()},
            }
        )
    return traces


def http_server(bind: str, receiver: Receiver) -> ThreadingHTTPServer:
    """The Jaeger-shaped query API over `receiver`'s spans, served from a thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            if url.path == "/api/services":
                body: dict[str, Any] = {"data": sorted({name for name, _ in receiver.spans()})}
            elif url.path == "/api/traces":
                body = {"data": jaeger_traces(receiver.spans(), query.get("service", [None])[0])}
            else:
                self.send_error(404)
                return
            payload = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    host, _, port = bind.rpartition(":")
    server = ThreadingHTTPServer((host, int(port)), Handler)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="OTLP/gRPC receiver with a Jaeger-shaped query API")
    parser.add_argument("--bind", default="127.0.0.1:4317", help="OTLP/gRPC address")
    parser.add_argument("--http", default="", help="query API address (host:port); none if empty")
    parser.add_argument("--forward", default="", help="OTLP/gRPC endpoint (host:port) to pass everything on to")
    parser.add_argument("--tls-ca", default="", help="serve mutual TLS: the CA every client's certificate is of")
    parser.add_argument("--tls-cert", default="", help="with --tls-ca: this receiver's certificate")
    parser.add_argument("--tls-key", default="", help="with --tls-ca: this receiver's key")
    args = parser.parse_args(argv)
    given = [bool(args.tls_ca), bool(args.tls_cert), bool(args.tls_key)]
    if any(given) and not all(given):
        parser.error("--tls-ca, --tls-cert and --tls-key go together")
    try:
        tls = load_tls(args.tls_ca, args.tls_cert, args.tls_key) if all(given) else None
    except InvalidArgument as exc:
        parser.error(str(exc))
    server, receiver, port = serve(args.bind, args.forward or None, tls)
    web = http_server(args.http, receiver) if args.http else None
    over = "mutual TLS" if tls else "plaintext"
    print(
        f"otlp receiver on port {port} ({over})" + (f", query API on {args.http}" if web else ""),
        file=sys.stderr,
        flush=True,
    )
    done = threading.Event()
    signals.stop_on_signals(lambda _signum: done.set())
    while not done.wait(1.0):
        pass
    if web is not None:
        web.shutdown()
    server.stop(1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
