"""One OpenTelemetry trace per failure incident (docs/architecture.md: Observability).

The root span `unicron.incident` is named up front and emitted last: `new_incident_context()`
picks its trace id and span id and returns them as a W3C traceparent string, which the
incident record keeps (Incident.traceparent) and commands carry (NodeCommand.traceparent).
Every step is a child of that root, emitted when it is over, in whichever process runs it:
`detect`, `classify`, `plan`, `transition` (one per job and node), `resumed`. gRPC calls made
inside `child_span` carry the context to the server (the interceptors in `telemetry`).
`finish_incident` then emits the root itself with the pre-chosen ids, so a coordinator that
restarted mid-incident still closes the trace.

Nothing here talks to gRPC or Redis, and nothing raises for a missing or malformed
traceparent (an incident recorded before tracing): the step is simply not traced. Before
`telemetry.setup_telemetry` spans go to the global provider (a no-op unless one is set).

Times (`TimeLike`) are Unix seconds (float), datetimes (naive ones are UTC, as protobuf's
ToDatetime returns) or protobuf Timestamps; an unset Timestamp means now."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from unicron import telemetry

log = logging.getLogger(__name__)

TimeLike = float | int | datetime | Timestamp
Attributes = Mapping[str, AttributeValue]

TRACER_NAME = "unicron.incident"

# Span names.
INCIDENT = "unicron.incident"
DETECT = "detect"
CLASSIFY = "classify"
PLAN = "plan"
TRANSITION = "transition"
RESUMED = "resumed"

# Attribute keys, shared so every process names things alike.
ATTR_INCIDENT_ID = "unicron.incident.id"
ATTR_JOB = "unicron.job.id"
ATTR_NODE = "unicron.node.id"
ATTR_GENERATION = "unicron.job.generation"
ATTR_FAILURE_KIND = "unicron.failure.kind"
ATTR_SEVERITY = "unicron.failure.severity"
ATTR_DETECTION_SOURCE = "unicron.failure.source"
ATTR_REMEDY = "unicron.remedy"
ATTR_SOLVER_STATUS = "unicron.plan.solver_status"
ATTR_OBJECTIVE = "unicron.plan.objective"
ATTR_SOLVE_SECONDS = "unicron.plan.solve_seconds"
ATTR_ACTION = "unicron.transition.action"
ATTR_STATE_SOURCE = "unicron.transition.state_source"
ATTR_BYTES_MOVED = "unicron.transition.bytes_moved"
ATTR_ITERATION = "unicron.resumed.iteration"

_PROPAGATOR = TraceContextTextMapPropagator()
_IDS = RandomIdGenerator()


def new_incident_context() -> str:
    """A traceparent naming the incident's root span, not emitted yet (finish_incident does)."""
    return _format(_IDS.generate_trace_id(), _IDS.generate_span_id())


def parse_traceparent(traceparent: str) -> trace.SpanContext | None:
    """The span context a traceparent names, or None when it is empty or malformed."""
    if not traceparent:
        return None
    context = _PROPAGATOR.extract({"traceparent": traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def trace_id_of(traceparent: str) -> str:
    """The trace id in hex (for logs and for finding the trace in a backend), or ""."""
    span_context = parse_traceparent(traceparent)
    return format(span_context.trace_id, "032x") if span_context else ""


def current_traceparent() -> str:
    """The current span's context as a traceparent (to put into a command), or ""."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")


@contextmanager
def child_span(
    traceparent: str, name: str, attributes: Attributes | None = None, start_time: TimeLike | None = None
) -> Iterator[trace.Span]:
    """A span whose parent is the span `traceparent` names (an incident's root, emitted or
    not yet); inside, it is the current span, so traced gRPC calls carry it. An exception
    is recorded on it and re-raised. With no valid traceparent: a non-recording span and
    the current context unchanged."""
    parent = _parent_context(traceparent)
    if parent is None:
        yield trace.INVALID_SPAN
        return
    tracer = telemetry.tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        name, context=parent, attributes=attributes, start_time=_start_ns(start_time)
    ) as span:
        yield span


def record_span(
    traceparent: str, name: str, start: TimeLike, end: TimeLike, attributes: Attributes | None = None
) -> None:
    """Emits a finished child of `traceparent` with explicit times (a step already over)."""
    parent = _parent_context(traceparent)
    if parent is None:
        return
    start_ns = _start_ns(start)
    end_ns = _end_ns(end, start_ns)
    span = telemetry.tracer(TRACER_NAME).start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    span.end(end_time=end_ns)


def finish_incident(traceparent: str, start: TimeLike, end: TimeLike, attributes: Attributes | None = None) -> None:
    """Emits the root span `unicron.incident` with the ids `traceparent` names, so the
    children emitted before (by any process) hang under it. Call it once per incident."""
    root = parse_traceparent(traceparent)
    if root is None:
        return
    start_ns = _start_ns(start)
    end_ns = _end_ns(end, start_ns)
    with telemetry.forced_ids(root.trace_id, root.span_id):
        # An empty context: a root span, whatever span is current here.
        span = telemetry.tracer(TRACER_NAME).start_span(
            INCIDENT, context=otel_context.Context(), attributes=attributes, start_time=start_ns
        )
    emitted = span.get_span_context()
    if span.is_recording() and (emitted.trace_id, emitted.span_id) != (root.trace_id, root.span_id):
        log.warning("tracer provider ignores forced ids (not set up by unicron.telemetry?): incident trace broken")
    span.end(end_time=end_ns)


def _format(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{int(trace.TraceFlags.SAMPLED):02x}"


def _parent_context(traceparent: str) -> otel_context.Context | None:
    span_context = parse_traceparent(traceparent)
    if span_context is None:
        if traceparent:
            log.warning("malformed traceparent %r: span not traced", traceparent)
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context), otel_context.Context())


def to_ns(value: TimeLike) -> int | None:
    """Nanoseconds since the Unix epoch, or None for an unset Timestamp."""
    if isinstance(value, Timestamp):
        return value.ToNanoseconds() if (value.seconds or value.nanos) else None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        delta = value - datetime(1970, 1, 1, tzinfo=UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000
    return round(value * 1e9)


def _start_ns(value: TimeLike | None) -> int | None:
    return None if value is None else to_ns(value)


def _end_ns(value: TimeLike, start_ns: int | None) -> int | None:
    end_ns = to_ns(value)
    if end_ns is not None and start_ns is not None and end_ns < start_ns:
        return start_ns  # clocks of different hosts: never a negative duration
    return end_ns
