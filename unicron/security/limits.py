"""The limits that keep one peer from starving the others: message size, deadlines, a rate
per caller, streams per caller and in all."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from unicron.security.identity import Principal
from unicron.security.policy import Rule

log = logging.getLogger(__name__)


DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Most generic clients (grpcurl, a plain generated stub) set no deadline: such a unary call is
# served as if it had set this one, so that a forgotten timeout never holds the server's work
# forever, and the client is served rather than refused. A deadline further off than
# MAX_DEADLINE_S (gRPC reports "none" as one decades away) counts as none.
DEFAULT_DEADLINE_S = 60.0
MAX_DEADLINE_S = 3600.0


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
    # What a unary call without a deadline may run for; None: as long as it takes (only for
    # in-process servers in tests).
    default_deadline_s: float | None = DEFAULT_DEADLINE_S


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


def default_budget(time_remaining: float | None, default_s: float | None) -> float | None:
    """The seconds a server gives a unary call that set no deadline of its own (the default),
    or None when the call's own deadline governs (or no default applies)."""
    if time_remaining is not None and time_remaining <= MAX_DEADLINE_S:
        return None
    return default_s
