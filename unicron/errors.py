"""Domain errors. Core code raises these and knows nothing of gRPC; the servicer edge maps
each to its status code (unicron.rpc), and the CLI prints its message as one line."""

from __future__ import annotations


class UnicronError(Exception):
    """Base of every error that is the caller's to fix, not a bug."""


class InvalidArgument(UnicronError):
    """A request field is malformed or out of range; `field` is its dotted path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(UnicronError):
    pass


class AlreadyExists(UnicronError):
    pass


class FailedPrecondition(UnicronError):
    """Valid request, but the system is not in a state that allows it."""


class Unavailable(UnicronError):
    """A dependency (Redis, a planner replica, an agent) cannot be reached."""


class ResourceExhausted(UnicronError):
    pass


class Conflict(UnicronError):
    """An optimistic-concurrency write lost a race; the caller re-reads and retries."""


class Unauthenticated(UnicronError):
    """The caller did not prove who it is (no credentials, or ones that are not valid)."""


class PermissionDenied(UnicronError):
    """The caller is known but may not make this call."""
