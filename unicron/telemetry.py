"""OpenTelemetry setup, once per process. Spans go where the standard variables say: over
OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set,
to the console when OTEL_TRACES_EXPORTER names `console` (`none` turns both off), and, for
local use, one JSON line per span appended to UNICRON_TRACE_FILE. With none set they are
dropped, so a first run needs no collector.

gRPC spans come from interceptors, never from business code. They record the calls that
belong to a trace (made inside a span, or arriving with a traceparent), so heartbeats do
not bury the incident traces (`unicron.incident_trace`); UNICRON_TRACE_RPCS=all records
every call. Span ids come from `ForcedIdGenerator`, which lets a span announced earlier by
its traceparent (an incident's root) be emitted later with exactly that identity."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor, client_interceptor, grpcext, server_interceptor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

log = logging.getLogger(__name__)

TRACE_FILE_ENV = "UNICRON_TRACE_FILE"
TRACE_RPCS_ENV = "UNICRON_TRACE_RPCS"

_provider: TracerProvider | None = None
_global_installed = False
_lock = threading.Lock()
_forced_ids: ContextVar[tuple[int, int] | None] = ContextVar("unicron_forced_span_ids", default=None)


class ForcedIdGenerator(RandomIdGenerator):
    """Random ids, except for a span started inside `forced_ids(trace_id, span_id)`."""

    def generate_trace_id(self) -> int:
        forced = _forced_ids.get()
        return forced[0] if forced is not None else super().generate_trace_id()

    def generate_span_id(self) -> int:
        forced = _forced_ids.get()
        return forced[1] if forced is not None else super().generate_span_id()


@contextmanager
def forced_ids(trace_id: int, span_id: int) -> Iterator[None]:
    """The span started inside (start exactly one) gets these ids, when it is a root span;
    a child keeps its parent's trace id and takes only the span id."""
    token = _forced_ids.set((trace_id, span_id))
    try:
        yield
    finally:
        _forced_ids.reset(token)


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span to a file: name, trace_id, span_id, parent_id (hex;
    parent_id null for a root), start and end (Unix seconds), attributes, service, kind,
    status. Each batch is one append-mode write, so processes can share the file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(span), default=str) + "\n" for span in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as the plain dict JsonLinesSpanExporter writes."""
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent is not None else None,
        "start": (span.start_time or 0) / 1e9,
        "end": (span.end_time or 0) / 1e9,
        "attributes": dict(span.attributes or {}),
        "service": span.resource.attributes.get("service.name"),
        "kind": span.kind.name,
        "status": span.status.status_code.name,
    }


def exporters_from_env() -> list[SpanExporter]:
    """The exporters the environment asks for (see the module docstring); none by default."""
    names = {name.strip().lower() for name in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()}
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    exporters: list[SpanExporter] = []
    if "otlp" in names or (endpoint and not names):
        # Imported lazily: the exporter pulls in its own gRPC channel machinery.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    if "console" in names:
        exporters.append(ConsoleSpanExporter(out=sys.stdout))  # the stream now, not at import
    for unknown in sorted(names - {"otlp", "console", "none"}):
        log.warning("OTEL_TRACES_EXPORTER: unsupported exporter %r ignored", unknown)
    if path := os.environ.get(TRACE_FILE_ENV):
        exporters.append(JsonLinesSpanExporter(path))
    return exporters


def setup_telemetry(service: str, *, extra_exporter: SpanExporter | None = None) -> TracerProvider:
    """The process's tracer provider, made on the first call with the exporters the
    environment names; later calls return it. `extra_exporter` (for tests, e.g. an
    InMemorySpanExporter) is added to it synchronously, whichever call passes it."""
    global _provider, _global_installed
    with _lock:
        if _provider is None:
            provider = TracerProvider(
                resource=Resource.create({"service.name": f"unicron-{service}"}), id_generator=ForcedIdGenerator()
            )
            for exporter in exporters_from_env():
                # The file is local and cheap: written as each span ends, so it can be tailed.
                sync = isinstance(exporter, JsonLinesSpanExporter)
                provider.add_span_processor(SimpleSpanProcessor(exporter) if sync else BatchSpanProcessor(exporter))
            if not _global_installed:
                trace.set_tracer_provider(provider)
                _global_installed = True
            _provider = provider
        if extra_exporter is not None:
            _provider.add_span_processor(SimpleSpanProcessor(extra_exporter))
        return _provider


def shutdown_telemetry() -> None:
    """Flushes and shuts down the exporters (call once, at exit)."""
    if _provider is not None:
        _provider.shutdown()


def reset_telemetry() -> None:
    """Shuts the provider down and forgets it: the next setup_telemetry makes a fresh one,
    as a restarted process would. For tests; interceptors made before keep the old one."""
    global _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()
            _provider = None


def _trace_all_rpcs() -> bool:
    return os.environ.get(TRACE_RPCS_ENV, "").strip().lower() == "all"


def _client_call_in_trace(_client_info: Any) -> bool:
    return trace.get_current_span().get_span_context().is_valid


def _server_call_in_trace(details: grpc.HandlerCallDetails) -> bool:
    metadata = getattr(details, "invocation_metadata", None) or ()
    return any(item[0] == "traceparent" for item in metadata)


def server_interceptors() -> list[grpc.ServerInterceptor]:
    if _provider is None:
        return []
    return [server_interceptor(tracer_provider=_provider, filter_=None if _trace_all_rpcs() else _server_call_in_trace)]


def aio_server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The same spans for an asyncio server (unicron.rpc.Server(asyncio=True))."""
    if _provider is None:
        return []
    return [
        aio_server_interceptor(tracer_provider=_provider, filter_=None if _trace_all_rpcs() else _server_call_in_trace)
    ]


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """Wraps a client channel so each call is a span and carries the trace context."""
    if _provider is None:
        return channel
    # OpenTelemetry's client interceptor speaks its own interceptor interface (grpcext),
    # not grpc.intercept_channel's.
    interceptor = client_interceptor(
        tracer_provider=_provider, filter_=None if _trace_all_rpcs() else _client_call_in_trace
    )
    return grpcext.intercept_channel(channel, interceptor)


def tracer(name: str) -> trace.Tracer:
    """A tracer from this process's provider (the global one before setup_telemetry)."""
    return _provider.get_tracer(name) if _provider is not None else trace.get_tracer(name)
