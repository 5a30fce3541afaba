"""Redis replicated under Sentinel, and writes that are acknowledged only once a replica has
them.

A ``redis+sentinel://`` URL (``rediss+sentinel://`` over mutual TLS, to the sentinels and the
data nodes alike) names the sentinels and the master's name, not a server:
``redis+sentinel://[:password@]host:port[,host:port...]/<master name>[/<db>]``. The client
asks the sentinels where the primary is, and asks again when it fails over (redis-py's
Sentinel support: a demoted primary's READONLY answer drops the connection).

Acknowledged means replicated: a client made with ``acks`` > 0 (`ReplicatedRedis`) follows
every transaction with ``WAIT acks wait_ms`` on the same connection, so the transaction's
writes are on that many replicas before the caller hears of success; when they are not, the
caller gets `NotReplicated` (UNAVAILABLE), not the result. The write may still be on the
primary, and may survive a failover or not: nobody was told it succeeded, so nobody acted on
it. Single commands outside a transaction (heartbeats, agents' events) are not waited for:
they are reports that their senders repeat."""

from __future__ import annotations

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


class WaitingPipeline(Pipeline):
    """A pipeline whose transactions return only once `acks` replicas have their writes."""

    acks = 0
    wait_ms = DEFAULT_WAIT_MS

    def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        replies = super()._execute_transaction(connection, commands, raise_on_error)
        if self.acks > 0:
            # On the same connection: WAIT waits for what this connection wrote.
            connection.send_command("WAIT", self.acks, self.wait_ms)
            replicated = int(self.parse_response(connection, "WAIT"))
            if replicated < self.acks:
                raise NotReplicated(
                    f"a write reached the Redis primary but {replicated} of the {self.acks} replica(s) it needs "
                    f"within {self.wait_ms} ms: not acknowledged"
                )
        return list(replies)


class ReplicatedRedis(redis.Redis):
    """redis.Redis whose transactions (``pipeline()``) wait for `acks` replicas."""

    acks = 0
    wait_ms = DEFAULT_WAIT_MS

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        pipe = WaitingPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.acks, pipe.wait_ms = self.acks, self.wait_ms
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
    """Why a master's sentinel quorum cannot work (pure): a quorum larger than the sentinels
    that watch it never declares the primary down, so it never fails over."""
    quorum = int(state.get("quorum", 0))
    watching = int(state.get("num-other-sentinels", 0)) + 1
    if quorum > watching:
        return f"the sentinels' quorum is {quorum} but {watching} sentinel(s) watch the master: it never fails over"
    if quorum > named:
        return f"the sentinels' quorum is {quorum} but the URL names only {named} sentinel(s)"
    if quorum < 1:
        return "the sentinels' quorum is below 1"
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
