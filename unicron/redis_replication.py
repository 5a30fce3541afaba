"""Redis replicated under Sentinel, and writes that are acknowledged only once a replica has
them.

A ``redis+sentinel://`` URL (``rediss+sentinel://`` over mutual TLS, to the sentinels and the
data nodes alike) names the sentinels and the master's name, not a server:
``redis+sentinel://[:password@]host:port[,host:port...]/<master name>[/<db>]``. The client
asks the sentinels where the primary is, and asks again when it fails over (redis-py's
Sentinel support: a demoted primary's READONLY answer drops the connection).

Acknowledged means replicated: a client made with ``acks`` > 0 (`ReplicatedRedis`) follows
every transaction with ``WAIT`` on the same connection for every replica the primary has at
that moment (``ROLE``), and at least ``acks``, so the transaction's writes are on them before
the caller hears of success, and under Sentinel asks the sentinels whether the server is
still the primary (`SentinelView`); when either fails, the caller gets `NotReplicated`
(UNAVAILABLE), not the result. The write may still be on the
primary, and may survive a failover or not: nobody was told it succeeded, so nobody acted on
it. Single commands outside a transaction (heartbeats, agents' events) are not waited for:
they are reports that their senders repeat."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
from redis.client import Pipeline

from unicron.errors import InvalidArgument, Unavailable

SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
DEFAULT_WAIT_MS = 1000
# The key a barrier writes: any write, once replicated, proves every earlier one is.
BARRIER_KEY = "unicron:replication:barrier"


class NotReplicated(Unavailable):
    """A write reached the primary but not enough replicas in time: not acknowledged."""


@dataclass(frozen=True)
class SentinelURL:
    """What a ``redis+sentinel://`` URL names."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    password: str | None = None
    username: str | None = None
    tls: bool = False


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEMES)


def parse_sentinel_url(url: str) -> SentinelURL:
    """The sentinels, master name and database of a ``redis+sentinel://`` URL
    (InvalidArgument, naming what is wrong, when it is not one)."""
    scheme, _, rest = url.partition("://")
    if scheme not in ("redis+sentinel", "rediss+sentinel"):
        raise InvalidArgument("redis_url", f"a Sentinel URL starts redis+sentinel:// or rediss+sentinel://: {url!r}")
    credentials, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    parts = [part for part in path.split("/") if part]
    if not parts:
        raise InvalidArgument("redis_url", f"{url!r} names no master: redis+sentinel://HOST:PORT,.../MASTER[/DB]")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise InvalidArgument("redis_url", f"{url!r}: after the sentinels comes /MASTER and an optional /DB number")
    sentinels = tuple(_address(entry, url) for entry in hosts.split(","))
    if len(set(sentinels)) != len(sentinels):
        raise InvalidArgument("redis_url", f"{url!r} names a sentinel twice")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    return SentinelURL(
        sentinels=sentinels,
        master=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        password=unquote(password) or None,
        username=unquote(username) or None,
        tls=scheme == "rediss+sentinel",
    )


def _address(entry: str, url: str) -> tuple[str, int]:
    host, _, port = entry.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument("redis_url", f"{url!r}: sentinel {entry!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


# A replica the sentinels have not heard from for this long (or never: an old primary just
# listed as a replica of the new one) is not waited for, declared down or not yet. Sentinels
# ask replicas for INFO only every 10 s while the primary is well (SENTINEL_INFO_PERIOD), so a
# healthy replica's `info-refresh` runs up to 10 s: at 3 s, most writes waited for one
# replica while two were up, and a promotion of the other lost them (the flapping link lost 15
# and 16 acknowledged writes in 15 and 10 repeats of bench-failover; the promoted replica was
# 11 KB behind the one that had acknowledged them).
REPLICA_SILENT_MS = 15_000


def _up(replica: dict[str, Any]) -> bool:
    """Whether a sentinel holds a replica to be up, so that it may promote it: not declared
    down, its link not broken, and heard from lately."""
    if replica.get("is_sdown") or replica.get("is_odown") or replica.get("is_disconnected"):
        return False
    return int(replica.get("info-refresh", 0)) < REPLICA_SILENT_MS


class SentinelView:
    """What the sentinels say of the group, asked before a write is acknowledged.

    A primary that was failed over while cut off takes writes again when it comes back, until
    the sentinels demote it, and a replica that still follows it acknowledges them; and a
    replica being promoted has already left the primary for up to a second before the
    sentinels name it. Writes acknowledged in either window are lost. So a write counts only
    when a majority of the sentinels answers and the one with the newest configuration (the
    highest config epoch: it names a promoted replica as soon as the promotion is confirmed)
    names the server written to, and when every replica any sentinel holds to be up has the
    write: a replica that left without being declared down is one being promoted. Each
    answer is kept `ttl_s`: a dead replica stops being waited for once the sentinels declare
    it down (their down-after time), plus that."""

    def __init__(self, url: SentinelURL, sentinel_kwargs: dict[str, Any], ttl_s: float = 0.25) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self._sentinels = [redis.Redis(host, port, **sentinel_kwargs) for host, port in url.sentinels]
        self._lock = threading.Lock()
        self._asked_at = -math.inf
        self._answer: tuple[tuple[str, int] | None, int, int] = (None, 0, 0)

    def _ask(self) -> tuple[tuple[str, int] | None, int, int]:
        """The primary the sentinel with the newest configuration (the highest config epoch)
        names, how many sentinels answered, and the most replicas any of them holds to be up. A
        sentinel that has not heard of a failover yet names the old primary under an older
        epoch: it is outvoted, not waited for."""
        best: tuple[int, tuple[str, int]] | None = None
        answered = up_most = 0
        for sentinel in self._sentinels:
            try:
                where = sentinel.sentinel_get_master_addr_by_name(self.url.master)
                state: dict[str, Any] = sentinel.sentinel_master(self.url.master)
                known = sentinel.sentinel_slaves(self.url.master)
            except redis.RedisError:
                continue
            if not where:
                continue
            answered += 1
            address = (where[0].decode() if isinstance(where[0], bytes) else str(where[0]), int(where[1]))
            # The most any sentinel holds up: whichever leads a failover promotes from its own
            # view, which need not be the newest-epoch one's.
            up_most = max(up_most, sum(1 for r in known if _up(r)))
            epoch = int(state.get("config-epoch", 0))
            if best is None or epoch > best[0]:
                best = (epoch, address)
        if best is None:
            return None, 0, 0
        return best[1], answered, up_most

    def answer(self) -> tuple[tuple[str, int] | None, int, int]:
        with self._lock:
            now = time.monotonic()
            if now - self._asked_at > self.ttl_s:
                self._answer, self._asked_at = self._ask(), now
            return self._answer

    def replicas_up(self) -> int:
        return self.answer()[2]

    def disagrees(self, host: str, port: int) -> str | None:
        """Why (host, port) may not be the primary any more; None when every answering
        sentinel of a majority names it."""
        named, answered, _ = self.answer()
        if named is None or answered * 2 <= len(self._sentinels):
            return f"{answered} of {len(self._sentinels)} sentinels answer: the primary cannot be confirmed"
        if named != (host, int(port)):
            return f"the sentinels name {named[0]}:{named[1]} as the primary, not {host}:{port}"
        return None


class WaitingPipeline(Pipeline):
    """A pipeline whose transactions return only once `acks` replicas have their writes (and,
    under Sentinel, the sentinels still name the server written to as the primary)."""

    acks = 0
    wait_ms = DEFAULT_WAIT_MS
    view: SentinelView | None = None
    # False: `acks` replicas are enough (a lease renewal: losing one in a failover only ends
    # the lease sooner), though the sentinels must still name the server.
    every_replica = True

    def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        replies = super()._execute_transaction(connection, commands, raise_on_error)
        if self.acks > 0:
            # Every replica the primary has now, and at least `acks`: Sentinel promotes the
            # replica it last saw furthest along, which may not be the one that was, so a
            # write on one replica alone can be lost by a failover.
            connection.send_command("ROLE")
            role = self.parse_response(connection, "ROLE")
            connected = len(role[2]) if len(role) > 2 and isinstance(role[2], list) else 0
            up = self.view.replicas_up() if self.view is not None else 0
            needed = max(self.acks, connected, up) if self.every_replica else self.acks
            # On the same connection: WAIT waits for what this connection wrote.
            connection.send_command("WAIT", needed, self.wait_ms)
            replicated = int(self.parse_response(connection, "WAIT"))
            if replicated < needed:
                raise NotReplicated(
                    f"a write reached the Redis primary but {replicated} of the {needed} replica(s) it needs "
                    f"within {self.wait_ms} ms: not acknowledged"
                )
            stale = self.view.disagrees(connection.host, connection.port) if self.view is not None else None
            if stale is not None:
                # The next command asks the sentinels where the primary is.
                connection.disconnect()
                raise NotReplicated(f"a write reached a Redis server that may no longer be the primary: {stale}")
        return list(replies)


class ReplicatedRedis(redis.Redis):
    """redis.Redis whose transactions (``pipeline()``) wait for `acks` replicas, and under
    Sentinel (`view`) for the sentinels' word that the server is still the primary."""

    acks = 0
    wait_ms = DEFAULT_WAIT_MS
    view: SentinelView | None = None

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        pipe = WaitingPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.acks, pipe.wait_ms, pipe.view = self.acks, self.wait_ms, self.view
        return pipe


def barrier(client: redis.Redis) -> None:
    """Returns once everything written to the primary so far is on the replicas a
    `ReplicatedRedis` waits for (NotReplicated when not in time); at once for any other
    client. What is read from the primary may not be replicated yet: a reader that acts on
    it (the command feed, before an agent is told) passes a barrier first."""
    if getattr(client, "acks", 0) <= 0:
        return
    with client.pipeline(transaction=True) as pipe:
        pipe.set(BARRIER_KEY, repr(time.time()))
        pipe.execute()


def unavailable_reply(exc: redis.ResponseError) -> str | None:
    """What a Redis error answer means when it is the replication's doing (a primary fenced
    off from its replicas, a demoted primary, a replica cut off from its primary), else None."""
    text = str(exc)
    if "NOREPLICAS" in text:
        return "the Redis primary cannot reach enough replicas and refuses writes (min-replicas-to-write)"
    if "READONLY" in text:
        return "this Redis is a replica now: the primary has failed over"
    if "MASTERDOWN" in text:
        return "this Redis replica has lost its primary"
    return None


def master_state(url: SentinelURL, sentinel_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The master's record as the first answering sentinel has it (Unavailable when no
    sentinel answers or none knows the master's name: either may change, so a caller waits)."""
    unknown = []
    errors = []
    for host, port in url.sentinels:
        client = redis.Redis(host, port, **sentinel_kwargs)
        try:
            masters: dict[str, Any] = client.sentinel_masters()
        except redis.RedisError as exc:
            errors.append(f"{host}:{port} ({exc})")
            continue
        finally:
            client.close()
        if url.master in masters:
            return masters[url.master]
        unknown.append(f"{host}:{port}")
    if unknown:
        raise Unavailable(f"no sentinel knows a master named {url.master!r} (asked {', '.join(unknown)})")
    raise Unavailable(f"no sentinel answers: {'; '.join(errors)}")


def quorum_problem(state: dict[str, Any], named: int) -> str | None:
    """Why a master's sentinel quorum is a mistake (pure): larger than the sentinels the URL
    names (it never declares the primary down), or below 1."""
    quorum = int(state.get("quorum", 0))
    if quorum < 1:
        return "the sentinels' quorum is below 1"
    if quorum > named:
        return f"the sentinels' quorum is {quorum} but the URL names {named} sentinel(s): it never fails over"
    return None


def watching_problem(state: dict[str, Any]) -> str | None:
    """Why the group cannot fail over yet (pure): fewer sentinels know of each other than its
    quorum (they find each other within seconds of starting)."""
    quorum = int(state.get("quorum", 0))
    watching = int(state.get("num-other-sentinels", 0)) + 1
    if quorum > watching:
        return f"{watching} sentinel(s) watch the master so far, fewer than its quorum of {quorum}"
    return None


def replication_problem(info: dict[str, Any], acks: int, max_lag_s: int = 10) -> str | None:
    """Why writes cannot be acknowledged now (pure, from the primary's ``INFO replication``):
    fewer replicas online and at most `max_lag_s` behind than the `acks` each write waits for."""
    if acks <= 0:
        return None
    if info.get("role") not in (None, "master"):
        return "the Redis the sentinels name as primary says it is a replica"
    replicas = [value for key, value in info.items() if key.startswith("slave") and isinstance(value, dict)]
    current = [r for r in replicas if r.get("state") == "online" and int(r.get("lag", 0)) <= max_lag_s]
    if len(current) < acks:
        behind = len(replicas) - len(current)
        return f"writes wait for {acks} replica(s) but the primary has {len(current)} current" + (
            f" ({behind} behind or not online)" if behind else ""
        )
    return None
