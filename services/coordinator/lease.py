"""The coordinator's leader lease in Redis: one active coordinator, any number of standbys.

The lease is one key, `unicron:coordinator:lease`, whose value names the holder:
`<fence> <token> <identity>`, with a time to live (3 s by default). A coordinator that
finds it absent takes it and, in the same atomic step, increments the fencing counter
`unicron:coordinator:fence`; so every acquisition has a larger fence than the one before.
The holder renews the lease every third of the TTL, only while the value is still its own
(compare-and-set in a Lua script). A clean shutdown deletes it (again only if its own), so a
standby takes over at once; a crashed holder's lease simply expires.

Fencing: the store checks, inside every state-changing transaction, that the lease still
holds this coordinator's token, and WATCHes the fencing counter, so a write prepared by a
coordinator that was deposed before its EXEC is aborted (see `Store`). A lease that is lost
(renewal refused, a fenced write refused, or Redis unreachable for longer than the lease
can be trusted) makes the process stop at once with `EXIT_LEASE_LOST`: its supervisor
restarts it, and it comes back as a standby.

The decisions (when to renew, when to step down) are pure functions of the clock."""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from unicron import redisutil
from unicron.errors import Unavailable
from unicron.redis_replication import NotReplicated

log = logging.getLogger(__name__)

LEASE_KEY = "unicron:coordinator:lease"
FENCE_KEY = "unicron:coordinator:fence"
DEFAULT_TTL_S = 3.0
RENEWALS_PER_TTL = 3
# A holder that could not renew stops acting once this share of the TTL has passed since the
# last renewal that succeeded was sent: before any other coordinator can have taken over.
STEP_DOWN_FRACTION = 0.9
# How often a standby looks for a free lease, and how soon a failed renewal is retried.
STANDBY_POLL_PER_TTL = 15
# The exit status of a coordinator that lost its lease (EX_TEMPFAIL: restart me).
EXIT_LEASE_LOST = 75

_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local fence = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], fence .. ' ' .. ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[3])
return fence
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class NotLeader(Unavailable):
    """This coordinator does not hold the lease (any more): it must not write. UNAVAILABLE,
    so clients retry, and reach the coordinator that does."""


@dataclass(frozen=True)
class Holder:
    """Who holds the lease: the value of the lease key."""

    fence: int
    token: str
    identity: str

    def encode(self) -> str:
        return f"{self.fence} {self.token} {self.identity}"

    @classmethod
    def decode(cls, raw: bytes | str | None) -> Holder | None:
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else raw
        parts = text.split(" ", 2)
        if len(parts) < 2 or not parts[0].isdigit():
            return None
        return cls(int(parts[0]), parts[1], parts[2] if len(parts) == 3 else "")


def lease_client(
    url: str, ttl_s: float = DEFAULT_TTL_S, tls: redisutil.RedisTLS | None = None, acks: int = 0
) -> redis.Redis:
    """A connection for the lease alone, with timeouts short enough that a hung Redis is
    noticed well within the TTL (the store's connection waits up to 5 s). With `acks`, an
    acquisition or renewal counts only once that many replicas hold it: a primary cut off
    from its replicas cannot keep a coordinator in office past the TTL."""
    timeout = max(0.1, ttl_s / 6)
    return redisutil.connect(
        url, tls, timeout_s=timeout, connect_timeout_s=timeout, acks=acks, wait_ms=max(1, int(timeout * 800))
    )


def read_holder(client: redis.Redis, key: str = LEASE_KEY) -> Holder | None:
    """The current holder of the lease, or None when it is free (for tools and tests)."""
    return Holder.decode(client.get(key))  # type: ignore[arg-type]


# ---- decisions: pure, the clock is a parameter -------------------------------------------


class Renewal(enum.Enum):
    RENEWED = "renewed"
    LOST = "lost"  # the key no longer holds our value: another holder, or it expired
    UNREACHABLE = "unreachable"  # Redis did not answer


@dataclass(frozen=True)
class Decision:
    step_down: bool
    reason: str = ""
    wait_s: float = 0.0  # until the next renewal attempt


def renew_interval(ttl_s: float) -> float:
    return ttl_s / RENEWALS_PER_TTL


def retry_interval(ttl_s: float) -> float:
    return ttl_s / STANDBY_POLL_PER_TTL


def trusted_until(last_renewed_at: float, ttl_s: float) -> float:
    """Until when the holder may act without a new renewal. `last_renewed_at` is when the
    last renewal that succeeded was *sent*: Redis started the TTL later than that."""
    return last_renewed_at + ttl_s * STEP_DOWN_FRACTION


def after_renewal(outcome: Renewal, now: float, last_renewed_at: float, ttl_s: float) -> Decision:
    """What the holder does after a renewal attempt (last_renewed_at already updated when it
    succeeded): step down, or try again in wait_s."""
    if outcome is Renewal.LOST:
        return Decision(True, "the lease is held by another coordinator or expired")
    deadline = trusted_until(last_renewed_at, ttl_s)
    if outcome is Renewal.RENEWED:
        return Decision(False, wait_s=max(0.0, min(last_renewed_at + renew_interval(ttl_s), deadline) - now))
    if now >= deadline:
        return Decision(True, f"Redis unreachable for {now - last_renewed_at:.1f}s (lease TTL {ttl_s:g}s)")
    return Decision(False, wait_s=max(0.0, min(retry_interval(ttl_s), deadline - now)))


# ---- the lease ---------------------------------------------------------------------------


class Lease:
    """One coordinator's view of the lease: take it, keep it, give it back, and check it
    inside the store's transactions (the `Fence` the store expects)."""

    def __init__(
        self,
        client: redis.Redis,
        identity: str,
        ttl_s: float = DEFAULT_TTL_S,
        key: str = LEASE_KEY,
        fence_key: str = FENCE_KEY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if not identity.strip():
            raise ValueError("identity must not be blank")
        self._redis: Any = client
        self.identity = identity
        self.ttl_s = ttl_s
        self.key = key
        self.fence_key = fence_key
        self.clock = clock
        self.holder: Holder | None = None
        self.acquired_at = 0.0
        self.lost = threading.Event()
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    @property
    def fence(self) -> int:
        return self.holder.fence if self.holder else 0

    @property
    def watch_keys(self) -> tuple[str, ...]:
        """What a fenced transaction WATCHes: the counter every acquisition increments. Not
        the lease key itself, which every renewal touches (and would abort writes for nothing)."""
        return (self.fence_key,)

    def try_acquire(self) -> bool:
        """Takes the lease if it is free (raises redis errors)."""
        token = uuid.uuid4().hex
        sent = self.clock()
        keys, args = [self.key, self.fence_key], [token, self.identity, self.ttl_ms]
        fence = int(self._replicated(self._acquire, keys, args, every_replica=True))
        if fence == 0:
            return False
        self.holder = Holder(fence, token, self.identity)
        self.acquired_at = sent
        self.lost.clear()
        return True

    def wait_acquire(self, stop: threading.Event, poll_s: float | None = None) -> bool:
        """Blocks until the lease is ours (True) or `stop` is set (False)."""
        poll = retry_interval(self.ttl_s) if poll_s is None else poll_s
        warned = False
        while not stop.is_set():
            try:
                if self.try_acquire():
                    return True
                warned = False
            except (redis.RedisError, NotReplicated) as exc:
                if not warned:
                    log.warning("cannot reach Redis for the coordinator lease", extra={"error": str(exc)})
                    warned = True
            stop.wait(poll)
        return False

    def renew(self) -> bool:
        """Extends the lease while it is still ours; False when it is not (raises redis errors)."""
        if self.holder is None:
            return False
        return bool(self._replicated(self._renew, [self.key], [self.holder.encode(), self.ttl_ms], every_replica=False))

    def _replicated(self, script: Any, keys: list[str], args: list[Any], every_replica: bool) -> Any:
        """A lease script's reply, in a transaction: a client that waits for replicas
        (unicron.redis_replication) returns it only once they hold what it wrote. An
        acquisition waits for every replica, so that its fence survives any failover; a
        renewal for one (lost in a failover, the lease only ends sooner, and the fence
        check refuses the holder's writes then)."""
        with self._redis.pipeline() as pipe:
            pipe.every_replica = every_replica
            script(keys=keys, args=args, client=pipe)
            return pipe.execute()[0]

    def release(self) -> bool:
        """Gives the lease back (only if still ours), so a standby takes over at once."""
        holder, self.holder = self.holder, None
        if holder is None:
            return False
        try:
            return bool(self._release(keys=[self.key], args=[holder.encode()]))
        except redis.RedisError as exc:
            log.warning("could not release the coordinator lease; it expires by itself", extra={"error": str(exc)})
            return False

    def check(self, reader: Any) -> None:
        """Raises NotLeader unless the lease still holds our value. `reader` is a pipeline
        in WATCH mode (or a client): what the store's transactions call before MULTI."""
        holder = self.holder
        raw = reader.get(self.key)
        if holder is not None and raw is not None and raw.decode() == holder.encode():
            return
        self.lost.set()
        current = Holder.decode(raw)
        who = f"held by {current.identity or current.token} (fence {current.fence})" if current else "free"
        raise NotLeader(f"this coordinator does not hold the coordinator lease (it is {who})")


class LeaseKeeper:
    """Renews a held lease every TTL/3 on its own thread; calls `on_lost(reason)` once, at
    once, when the lease is lost or can no longer be trusted (then stops)."""

    def __init__(self, lease: Lease, on_lost: Callable[[str], None]) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self.last_renewed_at = lease.acquired_at
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost_once = threading.Lock()
        self._lost_said = False

    def start(self) -> None:
        self.last_renewed_at = self.lease.acquired_at
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)
        self._thread.start()
        # A renewal can block far past the lease (a Sentinel client rediscovering the master
        # behind a partition took 10 s): the holder must stop when the lease can no longer
        # be trusted, not when Redis answers. Seen: a cut-off coordinator still answered
        # heartbeats 3.4 s after a standby took over, and the standby declared those nodes lost.
        threading.Thread(target=self._watch, name="lease-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.lease.lost.set()  # wakes the thread
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def tick(self) -> Decision:
        """One renewal attempt and its decision."""
        if self.lease.lost.is_set():
            return Decision(True, "a write was refused: the lease is no longer ours")
        sent = self.lease.clock()
        try:
            outcome = Renewal.RENEWED if self.lease.renew() else Renewal.LOST
        except (redis.RedisError, NotReplicated):
            outcome = Renewal.UNREACHABLE
        if outcome is Renewal.RENEWED:
            self.last_renewed_at = sent
        return after_renewal(outcome, self.lease.clock(), self.last_renewed_at, self.lease.ttl_s)

    def _run(self) -> None:
        wait_s = renew_interval(self.lease.ttl_s)
        while True:
            self.lease.lost.wait(wait_s)
            if self._stop.is_set():
                return
            decision = self.tick()
            if self._stop.is_set():
                return
            if decision.step_down:
                self._lose(decision.reason)
                return
            wait_s = decision.wait_s

    def _watch(self) -> None:
        while not self._stop.is_set():
            now = self.lease.clock()
            decision = after_renewal(Renewal.UNREACHABLE, now, self.last_renewed_at, self.lease.ttl_s)
            if decision.step_down:
                ttl = self.lease.ttl_s
                self._lose(f"no renewal answered for {now - self.last_renewed_at:.1f}s (lease TTL {ttl:g}s)")
                return
            self._stop.wait(trusted_until(self.last_renewed_at, self.lease.ttl_s) - now)

    def _lose(self, reason: str) -> None:
        """`on_lost`, once, from whichever thread sees it first."""
        with self._lost_once:
            if self._lost_said or self._stop.is_set():
                return
            self._lost_said = True
        self.on_lost(reason)
