"""The server side: the interceptor (Guard, AsyncGuard on an asyncio server) that
authenticates, authorizes and limits every call before its servicer runs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from unicron.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated, UnicronError
from unicron.ratelimit import KeyedLimiter
from unicron.security.identity import TRUSTED, Kind, Principal, TokenLookup, authenticate, bearer_token, current_caller
from unicron.security.limits import Limits, StreamGate, caller_key, default_budget
from unicron.security.policy import POLICY, Rule, authorize, rule_for
from unicron.security.tls import TLS

log = logging.getLogger(__name__)


# Refusals are logged at most this often per caller: a flood of bad calls is not a flood of lines.
REFUSAL_LOGS_PER_S = 1.0


# ---- the server side --------------------------------------------------------------------


class Authenticator(Protocol):
    def __call__(self, token: str | None, common_name: str | None) -> Principal: ...


def token_authenticator(lookup: TokenLookup, certificates: bool = True) -> Authenticator:
    """Callers by their token, or (with `certificates`) by their certificate's name."""

    def auth(token: str | None, common_name: str | None) -> Principal:
        return authenticate(token, common_name if certificates else None, lookup)

    return auth


@dataclass(frozen=True)
class ServerSecurity:
    """How a server accepts calls. tls None: plaintext; authenticator None: no one is
    authenticated and every caller is TRUSTED (only ever with plaintext, and said loudly)."""

    tls: TLS | None = None
    authenticator: Authenticator | None = None
    policy: Mapping[str, Rule] = field(default_factory=lambda: POLICY)
    limits: Limits = field(default_factory=Limits)

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        if self.tls.cert is None or self.tls.key is None or self.tls.ca is None:
            raise InvalidArgument("tls_cert", "a TLS server needs a CA, a certificate and a key")
        return grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert)], root_certificates=self.tls.ca, require_client_auth=True
        )

    def warnings(self, name: str) -> list[str]:
        """What a service says at start when it runs less than secure."""
        said = []
        if self.tls is None:
            said.append(f"{name} serves PLAINTEXT gRPC (--plaintext): anyone on the network can read and forge calls")
        if self.authenticator is None:
            said.append(f"{name} authenticates NO ONE: every caller may do everything")
        return said


class _Admission:
    """What both guards decide before a servicer runs: a deadline, a caller, the policy, the
    caller's rate and stream count. A refusal is logged and raised as a `Refusal`, which each
    guard turns into an aborted call in its own way (a sync context aborts by raising, an
    asyncio one by being awaited)."""

    def __init__(self, security: ServerSecurity, max_streams: int) -> None:
        self.security = security
        self.limits = security.limits
        self._rates = KeyedLimiter(self.limits.rate_per_s, self.limits.burst)
        self.streams = StreamGate(self.limits.streams_per_caller, max_streams)
        self._log_limiter = KeyedLimiter(REFUSAL_LOGS_PER_S, 5)

    def rule(self, method: str) -> Rule | None:
        return rule_for(self.security.policy, method)

    @staticmethod
    def exempt(rule: Rule | None) -> bool:
        """A public method (health, reflection) is served to anyone, unlimited."""
        return rule is not None and rule.public

    def admit(self, method: str, rule: Rule | None, request: Any, context: Any, *, unary: bool) -> Principal:
        principal = TRUSTED
        try:
            authenticator = self.security.authenticator
            if authenticator is not None:
                principal = authenticator(bearer_token(context.invocation_metadata()), _common_name(context))
            authorize(principal, rule, method, request)
            # Per-caller budgets keep one agent or client from starving the others; Unicron's
            # own services (the coordinator calling its planners) are not such callers.
            if principal.kind != Kind.SERVICE and not self._rates.allow(self.key(principal, context, rule, request)):
                raise ResourceExhausted(f"rate limit: more than {self.limits.rate_per_s:g} calls per second")
        except (InvalidArgument, Unauthenticated, PermissionDenied, ResourceExhausted) as exc:
            raise self.refuse(context, method, principal, exc) from None
        # Each call runs in its own contextvars context (grpc's servers do so: a thread's
        # call, an asyncio task), so the caller set here is seen by this call's servicer,
        # its stream, and nothing else.
        current_caller.set(principal)
        return principal

    def budget(self, context: Any) -> float | None:
        """The server's default deadline for a unary call that set none, else None."""
        return default_budget(context.time_remaining(), self.limits.default_deadline_s)

    def admit_message(self, method: str, rule: Rule | None, principal: Principal, request: Any, context: Any) -> None:
        """A later message of an admitted client stream: the policy for what it names (a node
        certificate speaks for its own node in every message), and the caller's rate."""
        try:
            authorize(principal, rule, method, request)
            if principal.kind != Kind.SERVICE and not self._rates.allow(self.key(principal, context, rule, request)):
                raise ResourceExhausted(f"rate limit: more than {self.limits.rate_per_s:g} messages per second")
        except (PermissionDenied, ResourceExhausted) as exc:
            raise self.refuse(context, method, principal, exc) from None

    def open_stream(self, method: str, rule: Rule | None, principal: Principal, request: Any, context: Any) -> str:
        """Counts the stream against its caller; returns the key to release it with."""
        key = self.key(principal, context, rule, request)
        if not self.streams.acquire(key):
            raise self.refuse(
                context,
                method,
                principal,
                ResourceExhausted(f"too many open streams ({self.limits.streams_per_caller} per caller)"),
            )
        return key

    @staticmethod
    def key(principal: Principal, context: Any, rule: Rule | None, request: Any) -> str:
        return caller_key(principal, context.peer(), rule, request)

    def refuse(self, context: Any, method: str, principal: Principal, exc: UnicronError) -> Refusal:
        code: grpc.StatusCode = _REFUSAL_CODES.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT)
        if self._log_limiter.allow(context.peer()):
            log.warning(
                "call refused",
                extra={
                    "method": method,
                    "code": code.name,
                    "reason": str(exc),
                    "peer": context.peer(),
                    "caller": principal.key if principal is not TRUSTED else "",
                },
            )
        return Refusal(code, str(exc))


class Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Guard(grpc.ServerInterceptor):
    """Admits each call of a threaded server before its servicer runs (see _Admission); the
    servicer never sees a refused call."""

    def __init__(self, security: ServerSecurity, max_workers: int) -> None:
        total = security.limits.max_streams
        if total is None:  # a quarter of the threads (2 to 32) stay free for unary calls
            total = max(1, max_workers - max(2, min(32, max_workers // 4)))
        self._admission = _Admission(security, total)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        admission = self._admission
        method: str = details.method
        rule = admission.rule(method)
        if handler is None or admission.exempt(rule):
            return handler

        def admit(request: Any, context: grpc.ServicerContext, unary: bool) -> Principal:
            try:
                return admission.admit(method, rule, request, context, unary=unary)
            except Refusal as refusal:
                context.abort(refusal.code, refusal.details)
                raise  # abort raises; this line only tells the type checker so

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                admit(request, context, True)
                budget = admission.budget(context)
                started = time.monotonic()
                reply = behavior(request, context)
                # A thread cannot be stopped midway: a call that set no deadline and ran past
                # the default gets what a client's own deadline would have given it.
                if budget is not None and time.monotonic() - started > budget:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _past_default(budget))
                return reply

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            client_stream = handler.stream_unary

            def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                admit(None, context, True)
                return client_stream(requests, context)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        server_stream = handler.unary_stream or handler.stream_stream
        assert server_stream is not None

        def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            named = None if handler.request_streaming else request
            principal = admit(named, context, False)
            try:
                key = admission.open_stream(method, rule, principal, named, context)
            except Refusal as refusal:
                context.abort(refusal.code, refusal.details)
            try:
                yield from server_stream(request, context)
            finally:
                admission.streams.release(key)

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                streaming, handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            streaming, handler.request_deserializer, handler.response_serializer
        )


class AsyncGuard(grpc.aio.ServerInterceptor):
    """The Guard of an asyncio server, whose servicers are coroutines (unary calls, server
    streams, bidirectional streams). Streams there hold no thread, so their cap is a bound
    on memory and file handles, not on threads."""

    def __init__(self, security: ServerSecurity, max_streams: int) -> None:
        self._admission = _Admission(security, max_streams)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        admission = self._admission
        method: str = details.method
        rule = admission.rule(method)
        if handler is None or admission.exempt(rule):
            return handler
        deserialize = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    _decoded(request)
                    admission.admit(method, rule, request, context, unary=True)
                except Refusal as refusal:
                    await context.abort(refusal.code, refusal.details)
                budget = admission.budget(context)
                if budget is None:
                    return await behavior(request, context)
                try:
                    return await asyncio.wait_for(behavior(request, context), budget)
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _past_default(budget))

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, handler.response_serializer)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._bidi(method, rule, handler.stream_stream), deserialize, handler.response_serializer
            )
        if handler.unary_stream is None:
            raise NotImplementedError(f"{method}: an asyncio server here serves no client-streaming calls")
        server_stream = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _, key = await _open_async_stream(admission, method, rule, request, context)
            try:
                async for reply in server_stream(request, context):
                    yield reply
            finally:
                admission.streams.release(key)

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, handler.response_serializer)

    def _bidi(
        self, method: str, rule: Rule | None, behavior: Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]
    ) -> Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]:
        """A bidirectional stream is admitted on its first message, which names whom it speaks
        for (a join-token agent's budget is its node's, as for its unary calls); each later
        message is checked against the policy and the caller's rate."""
        admission = self._admission

        async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            first = await anext(requests, None)
            if first is None:
                return  # closed before saying anything
            principal, key = await _open_async_stream(admission, method, rule, first, context)

            async def admitted() -> AsyncIterator[Any]:
                yield first
                async for request in requests:
                    try:
                        _decoded(request)
                        admission.admit_message(method, rule, principal, request, context)
                    except Refusal as refusal:
                        await context.abort(refusal.code, refusal.details)
                    yield request

            try:
                async for reply in behavior(admitted(), context):
                    yield reply
            finally:
                admission.streams.release(key)

        return stream_stream


async def _open_async_stream(
    admission: _Admission, method: str, rule: Rule | None, request: Any, context: grpc.aio.ServicerContext
) -> tuple[Principal, str]:
    """Admits a stream on its (first) request: the caller, and the key its stream counts
    under. A refusal aborts the call."""
    try:
        _decoded(request)
        principal = admission.admit(method, rule, request, context, unary=False)
        return principal, admission.open_stream(method, rule, principal, request, context)
    except Refusal as refusal:
        await context.abort(refusal.code, refusal.details)
        raise  # abort raises; this line only tells the type checker so


@dataclass(frozen=True)
class _Undecodable:
    error: str


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A request that does not parse reaches the guard, which answers INVALID_ARGUMENT
    (grpc.aio itself would answer UNKNOWN and log a traceback per bad message)."""
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return _Undecodable(f"{type(exc).__name__}: {exc}")

    return parse


def _decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message ({request.error})")


_REFUSAL_CODES: dict[type[UnicronError], grpc.StatusCode] = {
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def _past_default(budget: float) -> str:
    return f"the call set no deadline and ran past the server's default of {budget:g} s; set a deadline"


def _common_name(context: Any) -> str | None:
    names = context.auth_context().get("x509_common_name")
    return names[0].decode(errors="replace") if names else None
