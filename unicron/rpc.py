"""gRPC plumbing shared by every service: the server (health, reflection, bounded pool,
graceful SIGTERM), client channels, and the edge that turns domain errors into statuses."""

from __future__ import annotations

import asyncio as _asyncio
import functools
import inspect
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from unicron import errors, signals, telemetry
from unicron.security import (
    DEFAULT_MAX_MESSAGE_BYTES,
    AsyncGuard,
    ClientSecurity,
    Guard,
    Limits,
    ServerSecurity,
    client_interceptor,
)

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

MAX_MESSAGE_BYTES = DEFAULT_MAX_MESSAGE_BYTES
# A unary call made without a timeout by Unicron's own clients gets this one (a server serves
# a call without a deadline under its default of 60 s, Limits.default_deadline_s).
DEFAULT_CALL_TIMEOUT_S = 30.0
# What an in-process server (tests) is without a configuration: plaintext, every caller
# trusted, calls without deadlines served for as long as they take.
IN_PROCESS = ServerSecurity(limits=Limits(default_deadline_s=None))
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC's default reconnect backoff grows to 120 s: an agent whose coordinator restarted
    # would stay silent past the heartbeat timeout and be declared lost. Retry within 1 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Despite its name, gRPC core reads this as the minimum time one connection attempt may
    # take (MIN_CONNECT_TIMEOUT). At 100 ms, a busy server that sends its HTTP/2 SETTINGS a
    # little late failed the attempt, and the call with it (UNAVAILABLE), on a loaded machine.
    ("grpc.min_reconnect_backoff_ms", 5000),
]
# Open streams an asyncio server admits in all (Limits.max_streams overrides): each holds
# memory and a connection's share, not a thread. Each node's agent holds two on the
# coordinator (its commands, its heartbeats): room for four thousand nodes.
ASYNC_MAX_STREAMS = 8192
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]

STATUS_OF: dict[type[errors.UnicronError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Conflict: grpc.StatusCode.ABORTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_for(exc: errors.UnicronError) -> grpc.StatusCode:
    for kind in type(exc).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.UNKNOWN


StatusOf = Callable[[BaseException], tuple[grpc.StatusCode, str]]


def grpc_errors(method: F) -> F:
    """Servicer-method decorator: domain errors become their status code with the
    message as details; anything else is a bug, logged with its traceback, INTERNAL.
    Works on plain and generator methods, and on their asyncio forms."""

    def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
        if isinstance(exc, errors.UnicronError):
            return status_for(exc), str(exc)
        log.exception("unhandled error in %s", method.__qualname__)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"

    if inspect.isasyncgenfunction(method):
        wrapped = _async_stream_wrapper(method, status_of)
    elif inspect.iscoroutinefunction(method):
        wrapped = _async_wrapper(method, status_of)
    elif inspect.isgeneratorfunction(method):
        wrapped = _stream_wrapper(method, status_of)
    else:
        wrapped = _wrapper(method, status_of)
    return functools.wraps(method)(wrapped)  # type: ignore[return-value]


# Trailing metadata on every error a Unicron server answers itself: a client tells "the
# coordinator said UNAVAILABLE" (its Redis failing over, say) from "no server answered".
ANSWERED_KEY = "unicron-answered"
ANSWERED = ((ANSWERED_KEY, "1"),)


def answered_by_server(exc: grpc.RpcError) -> bool:
    """Whether a failed call's status came from a Unicron server, not from gRPC itself."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(key == ANSWERED_KEY for key, _ in trailing or ())


def _async_stream_wrapper(method: Callable[..., Any], status_of: StatusOf) -> Callable[..., Any]:
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for reply in method(self, request, context):
                yield reply
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the edge of the server
            await context.abort(*status_of(exc), trailing_metadata=ANSWERED)

    return wrapper


def _async_wrapper(method: Callable[..., Any], status_of: StatusOf) -> Callable[..., Any]:
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the edge of the server
            await context.abort(*status_of(exc), trailing_metadata=ANSWERED)

    return wrapper


def _stream_wrapper(method: Callable[..., Any], status_of: StatusOf) -> Callable[..., Any]:
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            yield from method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the edge of the server
            context.set_trailing_metadata(ANSWERED)
            context.abort(*status_of(exc))

    return wrapper


def _wrapper(method: Callable[..., Any], status_of: StatusOf) -> Callable[..., Any]:
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the edge of the server
            context.set_trailing_metadata(ANSWERED)
            context.abort(*status_of(exc))

    return wrapper


class Server:
    """A gRPC server with health checking and reflection, stopped gracefully on SIGTERM.

    Every call passes the security Guard first (unicron.security): TLS, who calls, the
    policy, limits. Without `security` it serves plaintext and trusts every caller, which is
    for in-process tests; services pass what their configuration says (run_server).

    Threaded (the default): each call holds one of `max_workers` threads while it runs. With
    `asyncio=True` the servicers are coroutines on one event loop, in a thread of its own,
    and hand blocking work to `max_workers` threads (asyncio.to_thread): a thousand agents'
    open streams and heartbeats then cost no thread each, where a thread per stream and the
    switching between them had held the coordinator's process at one core."""

    def __init__(
        self,
        *,
        bind: str,
        max_workers: int,
        grace_s: float = 5.0,
        security: ServerSecurity | None = None,
        asyncio: bool = False,
    ) -> None:
        self._grace_s = grace_s
        self.security = security if security is not None else IN_PROCESS
        self.is_async = asyncio
        limit = self.security.limits.max_message_bytes
        options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            *SERVER_OPTIONS,
        ]
        self._loop: _asyncio.AbstractEventLoop | None = None
        self._server: Any
        if asyncio:
            self._loop = _asyncio.new_event_loop()
            self._loop.set_default_executor(futures.ThreadPoolExecutor(max_workers, thread_name_prefix="rpc"))
            threading.Thread(target=self._loop.run_forever, name="rpc-loop", daemon=True).start()
            self._server, self._health = self._on_loop(self._make_async(options, max_workers))
        else:
            self._server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
                interceptors=[Guard(self.security, max_workers), *telemetry.server_interceptors()],
                options=options,
                # Bounds the work queue as well as the pool: excess calls get RESOURCE_EXHAUSTED.
                maximum_concurrent_rpcs=max_workers * 4,
            )
            self._health = health.HealthServicer(experimental_non_blocking=True)
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        credentials = self.security.credentials()
        if credentials is None:
            self.port = self._server.add_insecure_port(bind)
        else:
            self.port = self._server.add_secure_port(bind, credentials)
        if self.port == 0:
            raise errors.Unavailable(f"cannot bind gRPC server to {bind}")
        host = bind.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"
        self._stopped = threading.Event()
        self._terminated = threading.Event()
        self._on_stop: list[Callable[[], None]] = []

    async def _make_async(self, options: list[tuple[str, Any]], max_workers: int) -> tuple[Any, Any]:
        # grpc.aio binds a server to the loop it is made on: this one's.
        max_streams = self.security.limits.max_streams or ASYNC_MAX_STREAMS
        server = grpc.aio.server(
            interceptors=[AsyncGuard(self.security, max_streams), *telemetry.aio_server_interceptors()],
            options=options,
            maximum_concurrent_rpcs=max_streams + max_workers * 4,
        )
        servicer = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        return server, servicer

    def _on_loop(self, coroutine: Any) -> Any:
        assert self._loop is not None
        return _asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def add(self, register: Callable[[Any, Any], None], servicer: Any, full_name: str) -> None:
        register(servicer, self._server)
        self._service_names.append(full_name)

    def add_port(self, bind: str, client_certificates: bool = True) -> str:
        """Serves on one more address (before start), with the same services and guard; its
        host:port. Without `client_certificates` its TLS asks callers for none: they check the
        server against the CA and prove who they are by token alone (an agent's trainers,
        which hold no key of their own: services/agent/__main__.py)."""
        credentials = self.security.credentials()
        tls = self.security.tls
        if credentials is None or tls is None:
            port = self._server.add_insecure_port(bind)
        else:
            if not client_certificates:
                assert tls.key is not None and tls.cert is not None  # credentials() checked them
                credentials = grpc.ssl_server_credentials([(tls.key, tls.cert)])
            port = self._server.add_secure_port(bind, credentials)
        if port == 0:
            raise errors.Unavailable(f"cannot bind gRPC server to {bind}")
        return f"{bind.rsplit(':', 1)[0]}:{port}"

    def on_stop(self, callback: Callable[[], None]) -> None:
        self._on_stop.append(callback)

    def start(self) -> None:
        reflection.enable_server_reflection(self._service_names, self._server)
        names = [*self._service_names, ""]
        if self._loop is None:
            self._server.start()
            for name in names:
                self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
            return

        async def start() -> None:
            await self._server.start()
            for name in names:
                await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

        self._on_loop(start())

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        # Health goes NOT_SERVING first so load balancers stop sending before we drain.
        if self._loop is None:
            self._health.enter_graceful_shutdown()
        else:
            self._on_loop(self._health.enter_graceful_shutdown())
        for callback in self._on_stop:
            try:
                callback()
            except Exception:
                log.exception("stop callback failed")
        if self._loop is None:
            self._server.stop(self._grace_s).wait()
        else:
            self._on_loop(self._server.stop(self._grace_s))
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._terminated.set()

    def install_signal_handlers(self) -> None:
        def stop(signum: int) -> None:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            self.stop()

        signals.stop_on_signals(stop)

    def wait(self) -> None:
        if self._loop is None:
            self._server.wait_for_termination()
        self._terminated.wait()


def target(address: str) -> str:
    """The gRPC target for `host:port`, or for a comma-separated list of them.

    One address is used as it is. A list (every coordinator of a standby set) becomes one
    `ipv4:`/`ipv6:` target, host names resolved now: gRPC's default pick_first policy tries
    the addresses in order and keeps the first that accepts, and a standby coordinator does
    not listen, so calls go to the active one; when it dies the channel reconnects, down
    the same list, to whichever took over."""
    addresses = split_addresses(address)
    if len(addresses) <= 1:
        return address.strip()
    v4: list[str] = []
    v6: list[str] = []
    for item in addresses:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise errors.InvalidArgument("address", f"{item!r} in {address!r} must be host:port")
        if host.startswith("["):
            v6.append(item)
            continue
        try:
            ipaddress.IPv4Address(host)
            v4.append(item)
            continue
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            raise errors.Unavailable(f"cannot resolve {host!r}: {exc}") from None
        v4 += list(dict.fromkeys(f"{info[4][0]}:{port}" for info in infos))
    if v4 and v6:
        raise errors.InvalidArgument("address", f"{address!r} mixes IPv4 and IPv6 addresses")
    return ("ipv6:" + ",".join(v6)) if v6 else ("ipv4:" + ",".join(v4))


def channel(
    address: str,
    security: ClientSecurity | None = None,
    default_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    own_connection: bool = False,
) -> grpc.Channel:
    """A client channel with the shared options and tracing interceptors; `address` may
    list several servers, comma-separated, of which one serves (see `target`). `security`
    None: plaintext, no token (in-process tests; services pass their configuration's).

    Channels to one address share one TCP connection in gRPC unless `own_connection`: on a
    lossy link, one lost segment holds back every stream behind it until TCP retransmits it
    (head-of-line blocking), so a small stream that must arrive on time (heartbeats) is best
    alone on its connection."""
    token = security.token if security is not None else ""
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)] if own_connection else CHANNEL_OPTIONS
    raw = _raw_channel(address, security, options)
    return telemetry.traced_channel(grpc.intercept_channel(raw, client_interceptor(token, default_timeout_s)))


def _raw_channel(
    address: str, security: ClientSecurity | None, options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS
) -> grpc.Channel:
    resolved = target(address)
    credentials = security.credentials() if security is not None else None
    if credentials is None:
        return grpc.insecure_channel(resolved, options=options)
    return grpc.secure_channel(resolved, credentials, options=[*options, *_tls_name(address, resolved)])


def _tls_name(address: str, resolved: str) -> list[tuple[str, str]]:
    """A list of servers becomes one `ipv4:` target, whose authority is no host name: the
    servers' certificates are checked against the first listed host instead."""
    if resolved == address.strip():
        return []
    host = split_addresses(address)[0].rpartition(":")[0].strip("[]")
    return [("grpc.ssl_target_name_override", host)]


def wait_ready(address: str, timeout_s: float, security: ClientSecurity | None = None) -> bool:
    """True once the server at address (or one of the listed ones) answers health checks
    as SERVING."""
    with _raw_channel(address, security) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        try:
            grpc.channel_ready_future(chan).result(timeout=timeout_s)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError):
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def split_addresses(value: str | Sequence[str]) -> list[str]:
    items: Iterable[str] = value.split(",") if isinstance(value, str) else value
    return [item.strip() for item in items if item.strip()]
