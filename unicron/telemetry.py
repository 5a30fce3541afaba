"""OpenTelemetry setup, once per process. Spans are exported over OTLP when
OTEL_EXPORTER_OTLP_ENDPOINT is set (the standard variable), and dropped otherwise, so a
first run needs no collector. gRPC spans come from interceptors, never from business code."""

from __future__ import annotations

import os

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import client_interceptor, grpcext, server_interceptor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_provider: TracerProvider | None = None


def setup_telemetry(service: str) -> TracerProvider:
    global _provider
    if _provider is not None:
        return _provider
    provider = TracerProvider(resource=Resource.create({"service.name": f"unicron-{service}"}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        # Imported lazily: the exporter pulls in its own gRPC channel machinery.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_telemetry() -> None:
    if _provider is not None:
        _provider.shutdown()


def server_interceptors() -> list[grpc.ServerInterceptor]:
    return [server_interceptor(tracer_provider=_provider)] if _provider else []


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """Wraps a client channel so each call is a span and carries the trace context."""
    if _provider is None:
        return channel
    # OpenTelemetry's client interceptor speaks its own interceptor interface (grpcext),
    # not grpc.intercept_channel's.
    return grpcext.intercept_channel(channel, client_interceptor(tracer_provider=_provider))


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)
