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
caller with `caller()`.

The parts: `identity` (kinds of caller, tokens, authentication, the current caller),
`policy` (who may call what, ownership), `limits`, `tls` (the PEM material), `guard` (the
server interceptor), `client` (how a client calls), `settings` (what every service's
configuration shares). Nothing here is global: a client's credentials are passed to it."""

from __future__ import annotations

from unicron.security.client import ClientSecurity, client_interceptor
from unicron.security.guard import AsyncGuard, Authenticator, Guard, Refusal, ServerSecurity, token_authenticator
from unicron.security.identity import (
    AUTH_METADATA,
    BEARER,
    TRUSTED,
    Kind,
    Principal,
    TokenBook,
    TokenLookup,
    WorkerTokens,
    acting_as,
    any_of,
    authenticate,
    bearer_token,
    caller,
    certificate_principal,
    new_token,
    read_token_file,
    worker_name,
)
from unicron.security.limits import (
    DEFAULT_DEADLINE_S,
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_DEADLINE_S,
    Limits,
    StreamGate,
    caller_key,
    default_budget,
)
from unicron.security.policy import POLICY, PUBLIC, Rule, authorize, owner_scope, rule_for
from unicron.security.settings import TLSConfig, server_security
from unicron.security.tls import TLS, load_tls, read_pem

__all__ = [
    "AUTH_METADATA",
    "BEARER",
    "DEFAULT_DEADLINE_S",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_DEADLINE_S",
    "POLICY",
    "PUBLIC",
    "TLS",
    "TRUSTED",
    "AsyncGuard",
    "Authenticator",
    "ClientSecurity",
    "Guard",
    "Kind",
    "Limits",
    "Principal",
    "Refusal",
    "Rule",
    "ServerSecurity",
    "StreamGate",
    "TLSConfig",
    "TokenBook",
    "TokenLookup",
    "WorkerTokens",
    "acting_as",
    "any_of",
    "authenticate",
    "authorize",
    "bearer_token",
    "caller",
    "caller_key",
    "certificate_principal",
    "client_interceptor",
    "default_budget",
    "load_tls",
    "new_token",
    "owner_scope",
    "read_pem",
    "read_token_file",
    "rule_for",
    "server_security",
    "token_authenticator",
    "worker_name",
]
