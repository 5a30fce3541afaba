"""What every fuzz test shares: the catalog of RPCs (read from the service descriptors, so a
new RPC is fuzzed without a change here), the one place that opens channels, calling a
method with a message or with raw bytes under a deadline, the status codes a server may
answer, and snapshots of the Redis keyspace.

Policy on status codes (checked for every call):
- A servicer may answer OK or a domain status (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
  FAILED_PRECONDITION, RESOURCE_EXHAUSTED), or the authentication statuses
  (UNAUTHENTICATED, PERMISSION_DENIED), which also change nothing.
- UNKNOWN (an exception that escaped a servicer) and INTERNAL from `grpc_errors` (an
  unexpected exception caught at the edge: "internal error: ...") are bugs.
- Raw bytes that do not parse as the request type never reach a servicer: grpc's own
  deserializer answers INTERNAL "Exception deserializing request!". That is accepted, for
  raw bytes only and with exactly that text, provided the server stays healthy (each test
  checks its health after every call).
- DEADLINE_EXCEEDED is a hang; UNAVAILABLE and ABORTED are not expected either: the
  dependencies are up and the fuzzing is the only writer. The exception: an RPC that reads
  from a node's agent (`Target.reaches_nodes`) answers UNAVAILABLE naming the node ("node
  <id> ...") when no agent listens there, as the seeded nodes have none.
"""

from __future__ import annotations

import fnmatch
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc
import redis
from google.protobuf import message_factory, text_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.fuzz.strategies import resolve
from unicron import rpc

# Examples per RPC: a small fixed budget in `make test` (derandomized, so every run fuzzes
# the same cases), more and fresh ones with UNICRON_FUZZ_EXAMPLES=500 for a deeper local run.
_ASKED = int(os.environ.get("UNICRON_FUZZ_EXAMPLES", "0") or 0)
EXAMPLES_PER_RPC = _ASKED or 20
DEEP = _ASKED > 0


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings of every fuzz test: `examples` in all, no per-example deadline
    (calls have their own timeouts), derandomized unless a deeper run was asked for."""
    return settings(
        max_examples=max(1, examples),
        deadline=None,
        derandomize=not DEEP,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ],
    )


# A call that takes longer than this is a hang (the planner's default solve is 2 s).
CALL_TIMEOUT_S = 15.0
# How long a server stream is read before the client cancels it.
STREAM_READ_S = 0.3

DOMAIN_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
# The code names an agent may put in an in-band `Rejected` message to a trainer.
REJECTED_CODES = frozenset(code.name for code in DOMAIN_CODES - {grpc.StatusCode.OK})
GRPC_DESERIALIZE_FAILURE = "Exception deserializing request!"


def open_channel(address: str) -> grpc.Channel:
    """The one place the fuzz tests open a channel: credentials, when the servers require
    them, are added here."""
    return rpc.channel(address)


@dataclass(frozen=True)
class Rpc:
    path: str  # /unicron.v1.JobService/SubmitJob
    request: type[Message]
    response: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]

    def __repr__(self) -> str:
        return self.path


def catalog(*modules: ModuleType) -> dict[str, Rpc]:
    """Every RPC of every service of the generated modules, by path."""
    out: dict[str, Rpc] = {}
    for module in modules:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                out[path] = Rpc(
                    path,
                    message_factory.GetMessageClass(method.input_type),
                    message_factory.GetMessageClass(method.output_type),
                    method.client_streaming,
                    method.server_streaming,
                )
    return out


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    # A server stream the client cancelled after reading for a while (it was still open).
    cancelled_by_us: bool = False

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK or self.cancelled_by_us

    def __str__(self) -> str:
        extra = " (cancelled by the client while open)" if self.cancelled_by_us else ""
        return f"{self.code.name}{extra}: {self.details!r} after {self.seconds:.2f}s, {len(self.responses)} responses"


def invoke(
    channel: grpc.Channel,
    method: Rpc,
    requests: Sequence[Message | bytes],
    *,
    raw: bool = False,
    timeout_s: float = CALL_TIMEOUT_S,
    read_s: float = STREAM_READ_S,
) -> Outcome:
    """Calls `method` with one request (several for a client stream), typed or as raw bytes
    (the server parses them); a server stream is read for read_s, then cancelled."""
    serializer = None if raw else _serialize
    deserializer = None if raw else method.response.FromString
    started = time.monotonic()
    if not method.client_streaming and not method.server_streaming:
        unary = channel.unary_unary(method.path, request_serializer=serializer, response_deserializer=deserializer)
        try:
            reply = unary(requests[0], timeout=timeout_s)
        except grpc.RpcError as exc:
            return Outcome(exc.code(), exc.details() or "", seconds=time.monotonic() - started)
        return Outcome(grpc.StatusCode.OK, "", [reply], time.monotonic() - started)
    if method.client_streaming:
        bidi = channel.stream_stream(method.path, request_serializer=serializer, response_deserializer=deserializer)
        call = bidi(iter(requests), timeout=timeout_s)
    else:
        stream = channel.unary_stream(method.path, request_serializer=serializer, response_deserializer=deserializer)
        call = stream(requests[0], timeout=timeout_s)
    cancelled = threading.Event()

    def cancel() -> None:
        cancelled.set()
        call.cancel()

    timer = threading.Timer(read_s, cancel)
    timer.start()
    responses: list[Any] = []
    try:
        for reply in call:
            responses.append(reply)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        by_us = cancelled.is_set() and code == grpc.StatusCode.CANCELLED
        return Outcome(code, details, responses, time.monotonic() - started, cancelled_by_us=by_us)
    finally:
        timer.cancel()
    return Outcome(grpc.StatusCode.OK, "", responses, time.monotonic() - started)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def check_status(outcome: Outcome, *, raw: bool, context: object, reaches_nodes: bool = False) -> None:
    """Fails unless the call ended with a status a healthy server may answer (see the module
    docstring)."""
    if outcome.cancelled_by_us:
        return
    if reaches_nodes and outcome.code == grpc.StatusCode.UNAVAILABLE and outcome.details.startswith("node "):
        return
    code = outcome.code
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise AssertionError(f"hang: no answer within {CALL_TIMEOUT_S}s to {context}")
    if raw and code == grpc.StatusCode.INTERNAL and outcome.details == GRPC_DESERIALIZE_FAILURE:
        return
    if code not in DOMAIN_CODES:
        raise AssertionError(f"improper status {outcome} for {context}")


def check_healthy(channel: grpc.Channel, what: str) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"{what} is not serving after the call"


# ---- the stored state ----------------------------------------------------------------------


Snapshot = dict[bytes, bytes]


@dataclass(frozen=True)
class Keyspace:
    """Snapshots of a Redis keyspace, leaving out the keys that change on their own (each
    pattern with its reason), so that 'a rejected call changed nothing' can be checked."""

    client: redis.Redis
    self_changing: Mapping[str, str]

    def _counted(self, key: bytes) -> bool:
        text = key.decode(errors="replace")
        return not any(fnmatch.fnmatchcase(text, pattern) for pattern in self.self_changing)

    def snapshot(self) -> Snapshot:
        keys = sorted(k for k in self.client.scan_iter(count=1000) if self._counted(k))
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.dump(key)
            values = pipe.execute()
        return {key: value for key, value in zip(keys, values, strict=True) if value is not None}

    def restore(self, snapshot: Snapshot) -> None:
        """Puts back exactly the snapshot's keys (self-changing keys are left alone)."""
        stale = [k for k in self.client.scan_iter(count=1000) if self._counted(k) and k not in snapshot]
        with self.client.pipeline(transaction=True) as pipe:
            if stale:
                pipe.delete(*stale)
            for key, value in snapshot.items():
                pipe.restore(key, 0, value, replace=True)
            pipe.execute()


def diff(before: Snapshot, after: Snapshot) -> str:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return f"added {_names(added)}, removed {_names(removed)}, changed {_names(changed)}"


def _names(keys: Iterable[bytes]) -> list[str]:
    return [k.decode(errors="replace") for k in keys]


# ---- a server under fuzzing ----------------------------------------------------------------


@dataclass(repr=False)
class Target:
    """One server under fuzzing, with the state it stores (when it stores any): `call`
    checks the status, the server's health, and that a rejected call (or any call of a
    read-only RPC) left the stored state as it was. Between calls the state goes back to
    the seeded baseline whenever an accepted call changed it, so every example starts
    from the same cluster."""

    name: str
    channel: grpc.Channel
    rpcs: Mapping[str, Rpc]
    known: dict[str, str] = field(default_factory=dict)
    keyspace: Keyspace | None = None
    baseline: Snapshot | None = None
    read_only: frozenset[str] = frozenset()
    # RPCs that read from a node's agent, which the seeded nodes do not run (see above).
    reaches_nodes: frozenset[str] = frozenset()
    dirty: bool = False

    def __repr__(self) -> str:
        return f"Target({self.name})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis prints it
        printer.text(repr(self))

    def call(self, path: str, payloads: Sequence[Message | bytes], *, raw: bool = False) -> Outcome:
        method = self.rpcs[path]
        if self.dirty and self.keyspace is not None and self.baseline is not None:
            self.keyspace.restore(self.baseline)
            self.dirty = False
        before = self.keyspace.snapshot() if self.keyspace is not None else None
        outcome = invoke(self.channel, method, payloads, raw=raw)
        context = f"{path} with {describe(payloads)}"
        check_status(outcome, raw=raw, context=context, reaches_nodes=method.name in self.reaches_nodes)
        check_healthy(self.channel, self.name)
        if self.keyspace is not None and before is not None:
            after = self.keyspace.snapshot()
            if not outcome.ok:
                assert after == before, f"rejected call {context} ({outcome}) changed the state: {diff(before, after)}"
            if method.name in self.read_only:
                assert after == before, f"read-only call {context} ({outcome}) changed the state: {diff(before, after)}"
            self.dirty = after != before
        return outcome


def describe(payloads: Sequence[Message | bytes], limit: int = 600) -> str:
    parts = []
    for item in payloads:
        if isinstance(item, Message):
            text = f"{type(item).__name__}({item})".replace("\n", " ")
        else:
            text = repr(item)
        parts.append(text if len(text) <= limit else text[:limit] + "...")
    return "; ".join(parts)


# ---- what the tests generate -------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    path: str
    request: Message

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis prints it
        printer.text(f"Call({self.path}, {text_format.MessageToString(self.request, as_one_line=True)})")


@dataclass(frozen=True)
class RawCall:
    """Bytes sent as a serialized request: arbitrary ones, or a valid request's bytes with
    a few edits (so that some still parse and go deeper)."""

    path: str
    data: bytes = b""
    seed: Message | None = None
    edits: tuple[tuple[str, int, bytes], ...] = ()

    def payload(self, known: dict[str, str]) -> bytes:
        data = resolve(self.seed, known).SerializeToString() if self.seed is not None else self.data
        for kind, at, chunk in self.edits:
            at = at % (len(data) + 1)
            if kind == "insert":
                data = data[:at] + chunk + data[at:]
            elif kind == "truncate":
                data = data[:at]
            elif kind == "flip" and data:
                at = at % len(data)
                data = data[:at] + bytes([data[at] ^ (chunk[0] if chunk else 0xFF)]) + data[at + 1 :]
            elif kind == "repeat":
                data = data + data  # a message concatenated with itself merges: repeated fields double
        return data


_EDITS = st.tuples(
    st.sampled_from(["insert", "truncate", "flip", "repeat"]), st.integers(0, 4096), st.binary(max_size=8)
)


def raw_calls(rpcs: Mapping[str, Rpc], seeds: Mapping[str, list[Message]]) -> st.SearchStrategy[RawCall]:
    def for_path(path: str) -> st.SearchStrategy[RawCall]:
        return st.one_of(
            st.binary(max_size=512).map(lambda data: RawCall(path, data)),
            st.builds(
                RawCall,
                st.just(path),
                st.just(b""),
                st.sampled_from(seeds[path]),
                st.lists(_EDITS, min_size=1, max_size=3).map(tuple),
            ),
        )

    return st.sampled_from(sorted(rpcs)).flatmap(for_path)
