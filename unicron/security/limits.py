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
# A unary call with no deadline (gRPC reports one decades away) or one longer than this is
# refused: a forgotten timeout on a client must show at once, not as a thread held forever.
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
