"""Trust and load, written once for every service: TLS and mutual TLS, who a caller is
(tokens and certificates), what each kind of caller may call, and the limits that keep one
peer from starving the others.

* Transport: every server serves TLS and asks for a client certificate signed by the
  cluster's CA (mutual TLS); every client verifies the server against that CA. Plaintext only
  when a service is started with `--plaintext`, which it says in a WARNING line at start.
* Who: a bearer token (`authorization: Bearer <token>` metadata) or, without one, the
  common name of the client certificate, `<kind>:<name>` (unicron.certs makes them):
  users hold tokens from the coordinator's tokens file (`admin: true` for admins), agents
  join with the cluster's join token or a certificate `node:<id>`, the coordinator calls the
  planner as `service:coordinator`, and a trainer holds a per-worker token its agent issued
  at launch (WorkerTokens), valid for its job, generation and rank only.
* What: POLICY maps every method to the kinds of caller it admits; a caller bound to a node
  may only speak for that node (the request's node_id). Ownership of jobs is the
  coordinator's (owner_scope). Refusals are UNAUTHENTICATED or PERMISSION_DENIED, logged,
  and happen before the servicer runs, so they change nothing.
* Limits: a deadline on every unary call, a token bucket per caller, a cap on the streams one
  caller holds open and on all streams together (on a threaded server each holds a thread),
  and the maximum message size (larger messages get RESOURCE_EXHAUSTED from gRPC itself).

The Guard interceptor (AsyncGuard on an asyncio server) does all of it; servicers read the
caller with `caller()`."""

from __future__ import annotations

import base64
import contextlib
import contextvars
import enum
import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import yaml

from unicron.config import require
from unicron.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated, UnicronError
from unicron.ratelimit import KeyedLimiter

log = logging.getLogger(__name__)

AUTH_METADATA = "authorization"
BEARER = "Bearer "
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A unary call with no deadline (gRPC reports one decades away) or one longer than this is
# refused: a forgotten timeout on a client must show at once, not as a thread held forever.
MAX_DEADLINE_S = 3600.0
# Refusals are logged at most this often per caller: a flood of bad calls is not a flood of lines.
REFUSAL_LOGS_PER_S = 1.0


class Kind(enum.StrEnum):
    USER = "user"  # a person or script with a user token
    NODE = "node"  # an agent with a certificate naming its node
    AGENT = "agent"  # an agent with the cluster's join token (any node id)
    SERVICE = "service"  # a Unicron service with its certificate (service:coordinator)
    WORKER = "worker"  # a trainer with the token its agent issued
    TRUSTED = "trusted"  # authentication is off: every caller is trusted


@dataclass(frozen=True)
class Principal:
    kind: Kind
    name: str = ""
    admin: bool = False

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"


# The caller of every call on a server that authenticates nobody (plaintext without tokens,
# in-process test servers): what every caller was before authentication existed.
TRUSTED = Principal(Kind.TRUSTED, "", admin=True)


# ---- tokens ---------------------------------------------------------------------------


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenBook:
    """The tokens a coordinator accepts, kept as sha256 digests: a lookup hashes first, so its
    time does not depend on how much of a guess was right."""

    by_digest: Mapping[str, Principal] = field(default_factory=dict)

    @staticmethod
    def parse(data: Any, source: str = "tokens_file") -> TokenBook:
        """From the tokens file's mapping: {join_token: str, users: [{name, token, admin}]}."""
        if not isinstance(data, dict):
            raise InvalidArgument(source, "must hold a mapping with join_token and users")
        entries: dict[str, Principal] = {}

        def add(token: object, principal: Principal, where: str) -> None:
            if not isinstance(token, str) or len(token) < 16:
                raise InvalidArgument(f"{source}.{where}", "must be a string of at least 16 characters")
            if _digest(token) in entries:
                raise InvalidArgument(f"{source}.{where}", "the same token is given twice")
            entries[_digest(token)] = principal

        unknown = sorted(set(data) - {"join_token", "users"})
        if unknown:
            raise InvalidArgument(f"{source}.{unknown[0]}", "unknown setting")
        if data.get("join_token"):
            add(data["join_token"], Principal(Kind.AGENT), "join_token")
        users = data.get("users") or []
        if not isinstance(users, list):
            raise InvalidArgument(f"{source}.users", "must be a list")
        for index, user in enumerate(users):
            where = f"users[{index}]"
            if not isinstance(user, dict) or not isinstance(user.get("name"), str) or not user["name"]:
                raise InvalidArgument(f"{source}.{where}.name", "is required")
            add(user.get("token"), Principal(Kind.USER, user["name"], admin=bool(user.get("admin"))), f"{where}.token")
        return TokenBook(entries)

    @staticmethod
    def load(path: str, source: str = "tokens_file") -> TokenBook:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidArgument(source, f"cannot read {path}: {exc}") from None
        return TokenBook.parse(data, source)

    def lookup(self, token: str) -> Principal | None:
        return self.by_digest.get(_digest(token))


def worker_name(job_id: str, generation: int, rank: int) -> str:
    return f"{job_id}/{generation}/{rank}"


class WorkerTokens:
    """Per-worker tokens an agent issues to the trainers it starts: `w1.<job>.<generation>.
    <rank>.<mac>`, the MAC keyed by a secret the agent never gives out, so a token proves one
    job, generation and rank and nothing else. Stateless: the agent keeps no list."""

    PREFIX = "w1"

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def _mac(self, body: str) -> str:
        return hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()

    def issue(self, job_id: str, generation: int, rank: int) -> str:
        job = base64.urlsafe_b64encode(job_id.encode()).decode().rstrip("=")
        body = f"{self.PREFIX}.{job}.{generation}.{rank}"
        return f"{body}.{self._mac(body)}"

    def lookup(self, token: str) -> Principal | None:
        parts = token.split(".")
        if len(parts) != 5 or parts[0] != self.PREFIX:
            return None
        body, mac = ".".join(parts[:4]), parts[4]
        if not hmac.compare_digest(self._mac(body), mac):
            return None
        try:
            job_id = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
            generation, rank = int(parts[2]), int(parts[3])
        except ValueError:
            return None
        return Principal(Kind.WORKER, worker_name(job_id, generation, rank))


# ---- authentication -------------------------------------------------------------------


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token of a call's metadata; "" for a malformed one, None for none."""
    for key, value in metadata or ():
        if key == AUTH_METADATA:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return text[len(BEARER) :].strip() if text.startswith(BEARER) else ""
    return None


def certificate_principal(common_name: str) -> Principal | None:
    """Who a client certificate names: `node:<id>` or `service:<name>`; None for other names
    (`client:<user>` only encrypts: users prove themselves with a token)."""
    kind, sep, name = common_name.partition(":")
    if not sep or not name:
        return None
    if kind == Kind.NODE:
        return Principal(Kind.NODE, name)
    if kind == Kind.SERVICE:
        return Principal(Kind.SERVICE, name)
    return None


TokenLookup = Callable[[str], Principal | None]


def authenticate(token: str | None, common_name: str | None, lookup: TokenLookup) -> Principal:
    """Who is calling: a token when one is sent (it must be valid: a bad token is not
    overlooked because a certificate came with it), else the certificate's name."""
    if token is not None:
        if not token:
            raise Unauthenticated("authorization: expected 'Bearer <token>'")
        principal = lookup(token)
        if principal is None:
            raise Unauthenticated("the token is not valid here")
        return principal
    if common_name:
        principal = certificate_principal(common_name)
        if principal is not None:
            return principal
    raise Unauthenticated("no credentials: send a token (authorization: Bearer ...) or a client certificate")


def any_of(*lookups: TokenLookup) -> TokenLookup:
    def lookup(token: str) -> Principal | None:
        return next((p for p in (look(token) for look in lookups) if p is not None), None)

    return lookup


# ---- authorization --------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """Who may call a method. `bound_field`: a caller bound to a node may only name that node
    in this request field."""

    kinds: frozenset[Kind]
    bound_field: str = ""
    public: bool = False  # no credentials needed (health checks, reflection)


PUBLIC = Rule(frozenset(), public=True)
_JOBS = Rule(frozenset({Kind.USER}))
_NODES = Rule(frozenset({Kind.NODE, Kind.AGENT}), bound_field="node_id")

# Every method of every Unicron server, by service or by method (a method's entry wins). A
# method in none of them is refused: a new RPC needs a line here before anyone can call it.
POLICY: Mapping[str, Rule] = {
    "/unicron.v1.JobService/": _JOBS,
    "/unicron.v1.NodeService/": _NODES,
    "/unicron.v1.PlannerService/": Rule(frozenset({Kind.SERVICE})),
    # The hello names the job, generation and rank: TrainerLink checks it against the token.
    "/unicron.v1.TrainerAgentService/": Rule(frozenset({Kind.WORKER})),
    "/grpc.health.v1.Health/": PUBLIC,
    "/grpc.reflection.v1alpha.ServerReflection/": PUBLIC,
    "/grpc.reflection.v1.ServerReflection/": PUBLIC,
}


def rule_for(policy: Mapping[str, Rule], method: str) -> Rule | None:
    if method in policy:
        return policy[method]
    service = method[: method.rfind("/") + 1]
    return policy.get(service)


def authorize(principal: Principal, rule: Rule | None, method: str, request: Any = None) -> None:
    """Raises PermissionDenied unless `principal` may make this call."""
    if principal.kind == Kind.TRUSTED:
        return
    if rule is None:
        raise PermissionDenied(f"{method} is not open to anyone")
    if rule.public:
        return
    if principal.kind not in rule.kinds:
        raise PermissionDenied(f"{principal.kind} {principal.name or '(unnamed)'} may not call {method}")
    if rule.bound_field and principal.kind == Kind.NODE and request is not None:
        named = getattr(request, rule.bound_field, None)
        if named is not None and named != principal.name:
            raise PermissionDenied(f"{rule.bound_field}: node {principal.name} may not speak for {named!r}")


def owner_scope(principal: Principal) -> str | None:
    """Whose jobs a caller sees and may change: None (all) for an admin, else their own."""
    return None if principal.admin else principal.name


_caller: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("unicron_caller", default=None)


def caller() -> Principal:
    """The authenticated caller of the call being served (set by the Guard). Outside a
    guarded call there is none, and nothing is allowed."""
    principal = _caller.get()
    if principal is None:
        raise Unauthenticated("no authenticated caller")
    return principal


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[None]:
    """Calls servicer code directly (tests, in-process tools) as `principal`."""
    token = _caller.set(principal)
    try:
        yield
    finally:
        _caller.reset(token)


# ---- limits ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Per caller (a user, a node, a worker; a connection when the caller is anonymous).
    rate_per_s: float = 200.0
    burst: float = 400.0
    # Streams held open: by one caller, and by all together. None: on a threaded server, where
    # each holds a thread, all but a quarter of its threads (2 to 32), so unary calls find
    # one; on an asyncio server the server's own bound (unicron.rpc.ASYNC_MAX_STREAMS).
    streams_per_caller: int = 8
    max_streams: int | None = None
    require_deadline: bool = True


class StreamGate:
    """Counts open streams per caller and in all, refusing past either cap."""

    def __init__(self, per_key: int, total: int) -> None:
        self._per_key = per_key
        self._total = total
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str) -> bool:
        with self._lock:
            held = self._open.get(key, 0)
            if held >= self._per_key or sum(self._open.values()) >= self._total:
                return False
            self._open[key] = held + 1
            return True

    def release(self, key: str) -> None:
        with self._lock:
            held = self._open.get(key, 0) - 1
            if held > 0:
                self._open[key] = held
            else:
                self._open.pop(key, None)


def caller_key(principal: Principal, peer: str, rule: Rule | None, request: Any) -> str:
    """Whose budget a call spends (rate, streams): a named caller's own; an unnamed one (a
    join-token agent, anyone when authentication is off) by the node it speaks for, else by
    its connection. Agents simulated in one process share connections, and a real node's
    agent is one node whatever connection it uses."""
    if principal.name:
        return principal.key
    bound = rule.bound_field if rule is not None else ""
    named = getattr(request, bound, None) if bound else None
    if isinstance(named, str) and named:
        return f"{principal.kind}:{bound}={named}"
    return f"{principal.kind}@{peer}"


def deadline_problem(time_remaining: float | None) -> str | None:
    """Why a unary call's deadline is refused, or None when it is fine."""
    if time_remaining is None or time_remaining > MAX_DEADLINE_S:
        return f"deadline: every call must set one (at most {MAX_DEADLINE_S:g} s)"
    return None


# ---- TLS material and configuration --------------------------------------------------


@dataclass(frozen=True)
class TLS:
    """PEM bytes: the CA that signs every peer (None on a client: the system's roots), this
    process's certificate and key (None on a client that shows no certificate)."""

    ca: bytes | None
    cert: bytes | None = None
    key: bytes | None = None


def read_pem(field_name: str, path: str, marker: str) -> bytes:
    """A PEM file's bytes; InvalidArgument naming the setting when unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(field_name, f"cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or marker.encode() not in data:
        raise InvalidArgument(field_name, f"{path} is not a PEM {marker.lower()}")
    return data


def load_tls(ca: str, cert: str, key: str, prefix: str = "tls_") -> TLS:
    return TLS(
        ca=read_pem(f"{prefix}ca", ca, "CERTIFICATE") if ca else None,
        cert=read_pem(f"{prefix}cert", cert, "CERTIFICATE") if cert else None,
        key=read_pem(f"{prefix}key", key, "PRIVATE KEY") if key else None,
    )


@dataclass(frozen=True)
class TLSConfig:
    """The settings every service shares (its config dataclass inherits them)."""

    # The cluster CA, and this process's certificate and key (serving and calling).
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # No TLS at all: only when asked for, and said loudly at start.
    plaintext: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Calls per second (and burst) one caller may make; streams one caller may hold open.
    rate_limit_per_s: float = 200.0
    rate_limit_burst: float = 400.0
    max_streams_per_caller: int = 8

    def __post_init__(self) -> None:
        if not self.plaintext:
            for name in ("tls_ca", "tls_cert", "tls_key"):
                require(bool(getattr(self, name)), name, "is required (make certs writes one), or run with --plaintext")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            require(not path or os.path.isfile(path), name, f"no such file: {path}")
        load_tls(self.tls_ca, self.tls_cert, self.tls_key)  # a file that is no PEM: named now
        require(
            bool(self.tls_cert) == bool(self.tls_key),
            "tls_key",
            "a certificate needs its key and a key its certificate",
        )
        require(self.max_message_bytes >= 1024, "max_message_bytes", "must be at least 1024")
        require(self.rate_limit_per_s > 0, "rate_limit_per_s", "must be positive")
        require(self.rate_limit_burst >= 1, "rate_limit_burst", "must be at least 1")
        require(self.max_streams_per_caller >= 1, "max_streams_per_caller", "must be at least 1")

    def tls(self) -> TLS | None:
        """The TLS material (None with --plaintext); InvalidArgument naming a bad file."""
        if self.plaintext:
            return None
        return load_tls(self.tls_ca, self.tls_cert, self.tls_key)

    def limits(self) -> Limits:
        return Limits(
            max_message_bytes=self.max_message_bytes,
            rate_per_s=self.rate_limit_per_s,
            burst=self.rate_limit_burst,
            streams_per_caller=self.max_streams_per_caller,
        )

    def client(self, token: str = "") -> ClientSecurity:
        """How this process calls other services: its own certificate, the same CA."""
        return ClientSecurity(self.tls(), token)


def server_security(config: TLSConfig, lookup: TokenLookup | None = None, certificates: bool = True) -> ServerSecurity:
    """A service's server security from its configuration: TLS unless --plaintext; callers
    authenticated by their token (with `lookup`) and by their certificate (unless not
    `certificates`). Plaintext with no tokens to check authenticates no one
    (ServerSecurity.warnings says so)."""
    tls = config.tls()
    if tls is None and lookup is None:
        return ServerSecurity(None, None, limits=config.limits())
    return ServerSecurity(tls, token_authenticator(lookup or _no_tokens, certificates), limits=config.limits())


def _no_tokens(_token: str) -> Principal | None:
    return None


def read_token_file(field_name: str, path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidArgument(field_name, f"cannot read {path}: {exc.strerror or exc}") from None
    if not token:
        raise InvalidArgument(field_name, f"{path} is empty")
    return token


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
            if unary and self.limits.require_deadline:
                problem = deadline_problem(context.time_remaining())
                if problem is not None:
                    raise InvalidArgument("deadline", problem.removeprefix("deadline: "))
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
        _caller.set(principal)
        return principal

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
                return behavior(request, context)

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
                return await behavior(request, context)

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


def _common_name(context: Any) -> str | None:
    names = context.auth_context().get("x509_common_name")
    return names[0].decode(errors="replace") if names else None


# ---- the client side --------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSecurity:
    """How a client calls: TLS (tls None: plaintext) and the token it sends, if any."""

    tls: TLS | None = None
    token: str = ""

    @staticmethod
    def plaintext(token: str = "") -> ClientSecurity:
        return ClientSecurity(None, token)

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> ClientSecurity:
        """The CLI's settings: UNICRON_TLS_CA, UNICRON_TLS_CERT, UNICRON_TLS_KEY (the client
        certificate, for a coordinator that asks for one), UNICRON_TOKEN or
        UNICRON_TOKEN_FILE, and UNICRON_PLAINTEXT=1 for a plaintext coordinator. With no CA
        the system's roots verify the coordinator."""
        env = os.environ if env is None else env
        token = env.get("UNICRON_TOKEN", "")
        if not token and env.get("UNICRON_TOKEN_FILE"):
            token = read_token_file("UNICRON_TOKEN_FILE", env["UNICRON_TOKEN_FILE"])
        if env.get("UNICRON_PLAINTEXT", "").lower() in ("1", "true", "yes", "on"):
            return ClientSecurity(None, token)
        tls = load_tls(env.get("UNICRON_TLS_CA", ""), env.get("UNICRON_TLS_CERT", ""), env.get("UNICRON_TLS_KEY", ""))
        if (tls.cert is None) != (tls.key is None):
            raise InvalidArgument("UNICRON_TLS_CERT", "a client certificate needs its key, and a key its certificate")
        return ClientSecurity(tls, token)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls.ca, private_key=self.tls.key, certificate_chain=self.tls.cert
        )


# In-process clients of a local cluster find its credentials by address
# (LocalCluster registers them), so `UnicronClient(cluster.coordinator)` works as it did.
_known: dict[str, ClientSecurity] = {}
_known_lock = threading.Lock()


def register_client_security(addresses: Sequence[str], security: ClientSecurity) -> None:
    with _known_lock:
        for address in addresses:
            _known[address] = security


def forget_client_security(addresses: Sequence[str]) -> None:
    with _known_lock:
        for address in addresses:
            _known.pop(address, None)


def client_security_for(address: str, env: Mapping[str, str] | None = None) -> ClientSecurity:
    """A registered local cluster's credentials for `address`, else the environment's."""
    with _known_lock:
        known = _known.get(address)
    return known if known is not None else ClientSecurity.from_env(env)


class _Metadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
):
    """Adds the token to every call, and a deadline to a unary call that has none."""

    def __init__(self, token: str, default_timeout_s: float) -> None:
        self._metadata = [(AUTH_METADATA, BEARER + token)] if token else []
        self._default_timeout_s = default_timeout_s

    def _details(self, details: Any, unary: bool) -> Any:
        timeout = details.timeout
        if unary and timeout is None:
            timeout = self._default_timeout_s
        if not self._metadata and timeout == details.timeout:
            return details
        return _CallDetails(
            details.method,
            timeout,
            [*(details.metadata or ()), *self._metadata],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, unary=True), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details, unary=True), requests)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, unary=False), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details, unary=False), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


def client_interceptor(token: str, default_timeout_s: float) -> grpc.UnaryUnaryClientInterceptor:
    return _Metadata(token, default_timeout_s)
