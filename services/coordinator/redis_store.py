"""The coordinator's state in Redis, the `Store` protocol's real implementation: jobs,
nodes, per-job event logs and per-node command logs (Redis Streams). Every job write is a compare-and-set on the
job's version, and a write's events and commands commit in the same MULTI as the state they
follow from, so a crash between them is impossible.

Fencing (with a `lease`): every write that decides something (jobs, incidents, node states,
commands to agents) checks, after its WATCH and before its MULTI, that the coordinator
lease still holds this coordinator's token, and WATCHes the lease's fencing counter, which
every acquisition increments. A deposed coordinator therefore writes nothing: its check
fails (NotLeader), or its EXEC aborts because another coordinator acquired the lease in
between. Two coordinators can never both act. Writes that only record what an agent
reported (registration, heartbeats, progress, exit codes, events) are single commands
that stay unfenced: they are true whoever records them, and agents resend them to the
new leader anyway."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis

from services.coordinator.lease import NotLeader
from services.coordinator.redis_keys import (
    EVENT_FIELD,
    INCIDENTS_INDEX,
    JOBS_INDEX,
    NODES_INDEX,
    NODES_VERSION,
    PREFIX,
    commands_key,
    events_key,
    exits_key,
    heartbeat_key,
    incident_key,
    job_incidents_key,
    job_key,
    name_key,
    new_version,
    node_key,
    progress_key,
)
from services.coordinator.store import JobWrite, holds_its_name, storable
from unicron.errors import AlreadyExists, Conflict, NotFound, Unavailable
from unicron.redis_replication import barrier as replication_barrier
from unicron.redis_replication import unavailable_reply
from unicron.v1 import common_pb2, node_service_pb2

F = TypeVar("F", bound=Callable[..., Any])
Record = TypeVar("Record", common_pb2.Incident, common_pb2.Node)

CAS_ATTEMPTS = 20
# Between two attempts of a compare-and-set a writer waits a random share of this times the
# attempts so far: writers that collide once would otherwise collide again in lockstep, and
# under the GIL one of them can lose every round.
CAS_BACKOFF_S = 0.0005


def _attempts() -> Iterator[int]:
    for attempt in range(CAS_ATTEMPTS):
        if attempt:
            time.sleep(random.uniform(0, CAS_BACKOFF_S * attempt))
        yield attempt


def _parse_job(raw: bytes, progress: bytes | None) -> common_pb2.Job:
    return _with_progress(common_pb2.Job.FromString(raw), progress)


def _with_progress(job: common_pb2.Job, progress: bytes | None) -> common_pb2.Job:
    if progress is not None:
        job.progress.ParseFromString(progress)
    return job


def redis_errors(method: F) -> F:
    """Redis outages surface as Unavailable, which callers map to UNAVAILABLE; so do a write
    that replicas did not acknowledge in time (NotReplicated) and a replication refusal."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise Unavailable(f"state store unreachable: {exc}") from None
        except redis.ResponseError as exc:
            # A primary fenced off from its replicas, or one demoted by a failover: the write
            # was refused, and a retry (at the new primary) may succeed.
            reason = unavailable_reply(exc)
            if reason is None:
                raise
            raise Unavailable(f"state store: {reason}") from None

    return wrapper  # type: ignore[return-value]


class Fence(Protocol):
    """What the store needs of a lease (services.coordinator.lease.Lease is one)."""

    @property
    def watch_keys(self) -> tuple[str, ...]: ...

    def check(self, reader: Any) -> None:
        """Raises NotLeader unless the lease is still ours."""


@dataclass(frozen=True)
class _NodeCache:
    """The node records as read at one NODES_VERSION."""

    version: bytes | None
    records: list[bytes]
    states: dict[str, common_pb2.NodeState]


class RedisStore:
    """The Store (services.coordinator.store) in Redis."""

    def __init__(self, client: redis.Redis, *, lease: Fence | None = None) -> None:
        # Any: redis-py types every sync reply as `Awaitable | Any`, which helps no one here.
        self._redis: Any = client
        self._lease = lease
        self._nodes: _NodeCache | None = None

    def _watch(self, pipe: Any, *keys: str) -> None:
        """WATCHes keys and, when fenced, the lease's fencing counter, then checks the lease
        (NotLeader: write nothing). Call before reading what the transaction depends on."""
        if self._lease is None:
            pipe.watch(*keys)
            return
        pipe.watch(*keys, *self._lease.watch_keys)
        self._lease.check(pipe)

    def _fenced(self, write: Callable[[Any], None]) -> list[Any]:
        """One transaction of `write`'s commands, fenced by the lease when there is one;
        returns their replies."""
        if self._lease is None:
            with self._redis.pipeline(transaction=True) as pipe:
                write(pipe)
                return list(pipe.execute())
        for _ in _attempts():
            with self._redis.pipeline() as pipe:
                try:
                    self._watch(pipe)
                    pipe.multi()
                    write(pipe)
                    return list(pipe.execute())
                except redis.WatchError:
                    continue
        raise NotLeader("the coordinator lease keeps changing hands")

    def _edit_record(
        self,
        key: str,
        kind: type[Record],
        edit: Callable[[Record], None],
        what: str,
        also: Callable[[Any], object] | None = None,
    ) -> Record | None:
        """Compare-and-set edit of the one record at `key` (re-read when another writer got
        there first), with `also`'s writes in the same transaction; None when there is no
        such record."""
        for _ in _attempts():
            with self._redis.pipeline() as pipe:
                try:
                    self._watch(pipe, key)
                    raw = pipe.get(key)
                    if raw is None:
                        return None
                    record = kind.FromString(raw)
                    edit(record)
                    pipe.multi()
                    pipe.set(key, record.SerializeToString())
                    if also is not None:
                        also(pipe)
                    pipe.execute()
                    return record
                except redis.WatchError:
                    continue
        raise Conflict(f"{what}: too many concurrent updates")

    # ---- jobs -------------------------------------------------------------------------

    @redis_errors
    def create_job(self, job: common_pb2.Job, event: common_pb2.JobEvent) -> common_pb2.Job:
        """Stores a new job; ALREADY_EXISTS if its name is held by a job that has not ended.
        Atomic: name, job, index
        and first event are written together or not at all."""
        taken = name_key(job.spec.name)
        for _ in _attempts():
            with self._redis.pipeline() as pipe:
                try:
                    self._watch(pipe, taken)
                    existing = pipe.get(taken)
                    if existing is not None:
                        # Watched too: the holder ending (or not) between check and write is
                        # a concurrent change, and the check runs again.
                        pipe.watch(job_key(existing.decode()))
                        holder = pipe.get(job_key(existing.decode()))
                        if holder is None or holds_its_name(common_pb2.Job.FromString(holder)):
                            raise AlreadyExists(f"a job named {job.spec.name!r} already exists ({existing.decode()})")
                    job.version = 1
                    pipe.multi()
                    pipe.set(taken, job.job_id)
                    pipe.set(job_key(job.job_id), job.SerializeToString())
                    pipe.zadd(JOBS_INDEX, {job.job_id: job.created.ToNanoseconds()})
                    pipe.xadd(events_key(job.job_id), {EVENT_FIELD: event.SerializeToString()})
                    pipe.execute()
                    return job
                except redis.WatchError:
                    # The name was taken concurrently (the next check says so) or the lease
                    # changed hands (the next check says that).
                    continue
        raise AlreadyExists(f"a job named {job.spec.name!r} was submitted concurrently")

    @redis_errors
    def get_job(self, job_id: str) -> common_pb2.Job:
        if not storable(job_id):
            raise NotFound(f"no job with id or name {job_id!r}")
        # The record and its progress in one round trip: every progress report and every
        # remedy reads a job, and under load each round trip waits for the interpreter lock.
        raw, progress = self._redis.mget([job_key(job_id), progress_key(job_id)])
        if raw is None:
            by_name = self._redis.get(name_key(job_id))
            if by_name:
                raw, progress = self._redis.mget([job_key(by_name.decode()), progress_key(by_name.decode())])
        if raw is None:
            raise NotFound(f"no job with id or name {job_id!r}")
        return _parse_job(raw, progress)

    @redis_errors
    def list_jobs(self) -> list[common_pb2.Job]:
        ids = [raw.decode() for raw in self._redis.zrevrange(JOBS_INDEX, 0, -1)]
        if not ids:
            return []
        raws = self._redis.mget([job_key(i) for i in ids])
        progresses = self._redis.mget([progress_key(i) for i in ids])
        return [_parse_job(raw, progress) for raw, progress in zip(raws, progresses, strict=True) if raw is not None]

    @redis_errors
    def update_job(
        self,
        job_id: str,
        mutate: Callable[[common_pb2.Job], JobWrite | None],
    ) -> common_pb2.Job:
        """Compare-and-set: re-reads the job, applies mutate, writes it with version + 1
        unless another writer got there first, then retries. mutate returning None means
        'nothing to write'; exceptions it raises propagate and nothing is written. The job
        returned carries its progress, as get_job's does (progress is never written here)."""
        key = job_key(job_id)
        for _ in _attempts():
            with self._redis.pipeline() as pipe:
                try:
                    self._watch(pipe, key)
                    # Progress is read with the record (it is not watched: it never decides a
                    # write), one round trip fewer than reading it after.
                    raw, progress = pipe.mget([key, progress_key(job_id)])
                    if raw is None:
                        raise NotFound(f"no job with id {job_id!r}")
                    job = common_pb2.Job.FromString(raw)
                    write = mutate(job)
                    if write is None:
                        return _with_progress(job, progress)
                    job.version += 1
                    pipe.multi()
                    self._queue_write(pipe, job, write)
                    pipe.execute()
                    return _with_progress(job, progress)
                except redis.WatchError:
                    continue
        raise Conflict(f"job {job_id}: too many concurrent updates")

    @redis_errors
    def update_jobs(
        self, mutations: Mapping[str, Callable[[common_pb2.Job], JobWrite | None]]
    ) -> dict[str, common_pb2.Job]:
        """`update_job` for many jobs in one transaction: a re-plan that moves dozens of jobs
        after a burst of lost nodes pays a handful of round trips, not a handful per job."""
        ids = list(mutations)
        if not ids:
            return {}
        keys = [job_key(job_id) for job_id in ids]
        for _ in _attempts():
            with self._redis.pipeline() as pipe:
                try:
                    self._watch(pipe, *keys)
                    values = pipe.mget([*keys, *(progress_key(job_id) for job_id in ids)])
                    jobs: dict[str, common_pb2.Job] = {}
                    writes: dict[str, JobWrite] = {}
                    for i, job_id in enumerate(ids):
                        raw = values[i]
                        if raw is None:
                            raise NotFound(f"no job with id {job_id!r}")
                        jobs[job_id] = common_pb2.Job.FromString(raw)
                        write = mutations[job_id](jobs[job_id])
                        if write is None:
                            jobs[job_id] = common_pb2.Job.FromString(raw)
                        else:
                            jobs[job_id].version += 1
                            writes[job_id] = write
                    if writes:
                        pipe.multi()
                        for job_id, write in writes.items():
                            self._queue_write(pipe, jobs[job_id], write)
                        pipe.execute()
                    return {job_id: _with_progress(jobs[job_id], values[len(ids) + i]) for i, job_id in enumerate(ids)}
                except redis.WatchError:
                    continue
        raise Conflict(f"jobs {', '.join(ids[:3])}{' ...' if len(ids) > 3 else ''}: too many concurrent updates")

    @staticmethod
    def _queue_write(pipe: Any, job: common_pb2.Job, write: JobWrite) -> None:
        """A job's record, events and commands, queued in a transaction."""
        pipe.set(job_key(job.job_id), job.SerializeToString())
        for event in write.events:
            pipe.xadd(events_key(job.job_id), {EVENT_FIELD: event.SerializeToString()})
        for node_id, command in write.commands:
            pipe.xadd(commands_key(node_id), {EVENT_FIELD: command.SerializeToString()})

    @redis_errors
    def set_progress(self, job_id: str, progress: common_pb2.JobProgress, event: common_pb2.JobEvent) -> None:
        # Progress lives beside the job, not in it: it changes every iteration and must not
        # make state-changing writers lose their compare-and-set race.
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(progress_key(job_id), progress.SerializeToString())
            pipe.xadd(events_key(job_id), {EVENT_FIELD: event.SerializeToString()})
            pipe.execute()

    @redis_errors
    def append_event(self, job_id: str, event: common_pb2.JobEvent) -> None:
        self._redis.xadd(events_key(job_id), {EVENT_FIELD: event.SerializeToString()})

    @redis_errors
    def record_exit(self, job_id: str, generation: int, rank: int, exit_code: int) -> dict[int, int]:
        """Records a rank's exit code for a generation; returns all exits of that generation."""
        key = f"{exits_key(job_id)}:{generation}"
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, str(rank), str(exit_code))
            pipe.hgetall(key)
            _, exits = pipe.execute()
        return {int(r): int(c) for r, c in exits.items()}

    def last_event_id(self, job_id: str) -> str:
        return self._last_id(events_key(job_id))

    def read_events(self, job_id: str, after_id: str, block_ms: int) -> list[tuple[str, common_pb2.JobEvent]]:
        return [
            (event_id, common_pb2.JobEvent.FromString(payload))
            for event_id, payload in self._read_stream(events_key(job_id), after_id, block_ms)
        ]

    # ---- incidents --------------------------------------------------------------------

    @redis_errors
    def upsert_incident(
        self, key: str, update: Callable[[common_pb2.Incident | None], common_pb2.Incident]
    ) -> tuple[common_pb2.Incident, bool]:
        """Compare-and-set on the incident open under `key`: update(None) creates one,
        update(existing) extends it. Returns the stored incident and whether it is new."""
        return self.upsert_incidents({key: update})[0]

    @redis_errors
    def upsert_incidents(
        self, updates: Mapping[str, Callable[[common_pb2.Incident | None], common_pb2.Incident]]
    ) -> list[tuple[common_pb2.Incident, bool]]:
        """`upsert_incident` for many keys in one transaction (a rack that vanished opens a
        hundred node incidents: one append-only-file sync, a handful of round trips). Results
        in the order of `updates`."""
        keys = list(updates)
        if not keys:
            return []
        pointers = [f"{PREFIX}incidentkey:{key}" for key in keys]
        for _ in _attempts():
            with self._redis.pipeline() as pipe:
                try:
                    self._watch(pipe, *pointers)
                    ids = [raw.decode() if raw is not None else None for raw in pipe.mget(pointers)]
                    records = [incident_key(i) for i in ids if i is not None]
                    current: dict[str, common_pb2.Incident] = {}
                    if records:
                        # Edits by id (update_incident) write the record, not the pointer.
                        pipe.watch(*records)
                        for raw in pipe.mget(records):
                            if raw is not None:
                                incident = common_pb2.Incident.FromString(raw)
                                current[incident.incident_id] = incident
                    results = []
                    for key, incident_id in zip(keys, ids, strict=True):
                        existing = current.get(incident_id) if incident_id is not None else None
                        incident = updates[key](existing)
                        results.append((incident, existing is None or existing.incident_id != incident.incident_id))
                    pipe.multi()
                    for pointer, (incident, created) in zip(pointers, results, strict=True):
                        pipe.set(incident_key(incident.incident_id), incident.SerializeToString())
                        if created:
                            pipe.set(pointer, incident.incident_id)
                            score = incident.detected.ToNanoseconds()
                            pipe.zadd(INCIDENTS_INDEX, {incident.incident_id: score})
                            if incident.job_id:
                                pipe.zadd(job_incidents_key(incident.job_id), {incident.incident_id: score})
                    pipe.execute()
                    return results
                except redis.WatchError:
                    continue
        raise Conflict(f"incidents {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}: too many concurrent updates")

    @redis_errors
    def update_incident(
        self, incident_id: str, edit: Callable[[common_pb2.Incident], None]
    ) -> common_pb2.Incident | None:
        """Compare-and-set edit of one incident by id, whether or not it is still the open
        one under its key (a late edit must not overwrite what others wrote since). Returns
        what was stored; None when there is no such incident."""
        return self._edit_record(incident_key(incident_id), common_pb2.Incident, edit, f"incident {incident_id}")

    @redis_errors
    def get_incident(self, incident_id: str) -> common_pb2.Incident | None:
        raw = self._redis.get(incident_key(incident_id))
        return common_pb2.Incident.FromString(raw) if raw is not None else None

    @redis_errors
    def list_incidents(self, job_id: str = "", limit: int = 200) -> list[common_pb2.Incident]:
        index = job_incidents_key(job_id) if job_id else INCIDENTS_INDEX
        ids = [raw.decode() for raw in self._redis.zrevrange(index, 0, limit - 1)]
        raws = self._redis.mget([incident_key(i) for i in ids]) if ids else []
        return [common_pb2.Incident.FromString(raw) for raw in raws if raw is not None]

    # ---- nodes ------------------------------------------------------------------------

    @redis_errors
    def put_node(self, node: common_pb2.Node, now: float) -> str:
        """Stores a node and its heartbeat; returns the end of its command log."""
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(node_key(node.node_id), node.SerializeToString())
            pipe.sadd(NODES_INDEX, node.node_id)
            pipe.set(NODES_VERSION, new_version())
            pipe.set(heartbeat_key(node.node_id), repr(now))
            pipe.execute()
        return self.last_command_id(node.node_id)

    @redis_errors
    def get_node(self, node_id: str) -> common_pb2.Node | None:
        if not storable(node_id):
            return None
        raw = self._redis.get(node_key(node_id))
        return common_pb2.Node.FromString(raw) if raw is not None else None

    @redis_errors
    def list_nodes(self) -> list[common_pb2.Node]:
        """Every node's record (its last heartbeat is apart: `heartbeats`). The records are
        read again only when one was written since the last read (NODES_VERSION): the
        coordinator lists a thousand nodes several times a second, and they rarely change."""
        return [common_pb2.Node.FromString(raw) for raw in self._node_cache().records]

    @redis_errors
    def node_states(self) -> dict[str, common_pb2.NodeState]:
        """Every node's state, from the same cache as `list_nodes` without parsing a thousand
        records again: what a remedy's decision needs to know about the nodes."""
        return dict(self._node_cache().states)

    def _node_cache(self) -> _NodeCache:
        version = self._redis.get(NODES_VERSION)
        cached = self._nodes
        if cached is None or cached.version != version:
            ids = sorted(raw.decode() for raw in self._redis.smembers(NODES_INDEX))
            raws = [raw for raw in (self._redis.mget([node_key(i) for i in ids]) if ids else []) if raw]
            nodes = [common_pb2.Node.FromString(raw) for raw in raws]
            cached = self._nodes = _NodeCache(version, raws, {node.node_id: node.state for node in nodes})
        return cached

    @redis_errors
    def heartbeats(self, node_ids: Sequence[str]) -> dict[str, float]:
        """The last stored heartbeat (seconds) of each of these nodes that has one."""
        if not node_ids:
            return {}
        raws = self._redis.mget([heartbeat_key(node_id) for node_id in node_ids])
        return {node_id: float(raw) for node_id, raw in zip(node_ids, raws, strict=True) if raw is not None}

    @redis_errors
    def save_heartbeats(self, beats: Mapping[str, float]) -> None:
        """The last heartbeat of many nodes in one write. Heartbeats are soft state that the
        active coordinator keeps in memory: saving them in batches costs one append-only-file
        sync per batch instead of one per heartbeat (a thousand nodes beat a thousand times a
        second), and a coordinator taking over still starts from recent times."""
        if beats:
            self._redis.mset({heartbeat_key(node_id): repr(at) for node_id, at in beats.items()})

    def set_node_state(self, node_id: str, state: int, expected: int, now: float) -> bool:
        """Compare-and-set of a node's state; False if it was not `expected` any more."""
        return node_id in self.set_node_states([node_id], state, expected, now)

    @redis_errors
    def set_node_states(self, node_ids: Sequence[str], state: int, expected: int, now: float) -> list[str]:
        """Compare-and-set of many nodes' state in one transaction (one append-only-file sync
        for a rack that vanished, not one per node); returns the nodes that were `expected`
        and now are `state`. A node written meanwhile is read again, so a race is lost only
        to a real change of state (or, fenced, of the lease: NotLeader)."""
        keys = [node_key(node_id) for node_id in node_ids]
        if not keys:
            return []
        for _ in _attempts():
            with self._redis.pipeline() as pipe:
                try:
                    self._watch(pipe, *keys)
                    changed: list[tuple[str, common_pb2.Node]] = []
                    for node_id, raw in zip(node_ids, pipe.mget(keys), strict=True):
                        node = common_pb2.Node.FromString(raw) if raw is not None else None
                        if node is not None and node.state == expected:
                            node.state = state  # type: ignore[assignment]
                            node.state_since.FromNanoseconds(int(now * 1e9))
                            changed.append((node_id, node))
                    if not changed:
                        return []
                    pipe.multi()
                    for node_id, node in changed:
                        pipe.set(node_key(node_id), node.SerializeToString())
                    pipe.set(NODES_VERSION, new_version())
                    pipe.execute()
                    return [node_id for node_id, _ in changed]
                except redis.WatchError:
                    continue
        if self._lease is not None:
            raise NotLeader("the coordinator lease keeps changing hands")
        return []

    @redis_errors
    def set_node_cordoned(self, node_id: str, cordoned: bool) -> common_pb2.Node | None:
        """Compare-and-set of a node's cordon (a registration racing it is read again)."""
        if not storable(node_id):
            return None

        def cordon(node: common_pb2.Node) -> None:
            node.cordoned = cordoned

        return self._edit_record(
            node_key(node_id),
            common_pb2.Node,
            cordon,
            f"node {node_id}",
            also=lambda pipe: pipe.set(NODES_VERSION, new_version()),
        )

    @redis_errors
    def append_command(self, node_id: str, command: node_service_pb2.NodeCommand) -> str:
        payload = {EVENT_FIELD: command.SerializeToString()}
        command_id: bytes = self._fenced(lambda pipe: pipe.xadd(commands_key(node_id), payload))[0]
        return command_id.decode()

    def last_command_id(self, node_id: str) -> str:
        return self._last_id(commands_key(node_id))

    def read_commands(
        self, node_id: str, after_id: str, block_ms: int | None = None
    ) -> list[tuple[str, node_service_pb2.NodeCommand]]:
        """The node's commands after `after_id`; block_ms None: what is there now, no wait."""
        out = []
        for command_id, payload in self._read_stream(commands_key(node_id), after_id, block_ms):
            command = node_service_pb2.NodeCommand.FromString(payload)
            command.command_id = command_id
            out.append((command_id, command))
        return out

    @redis_errors
    def wait_for_commands(self, cursors: Mapping[str, str], block_ms: int) -> dict[str, str]:
        """Blocks until a command is appended for any of the nodes after its cursor (or
        `block_ms` passes); returns the nodes that got one, with their newest command id.
        One blocking read watches every node, instead of one per node."""
        if not cursors:
            return {}
        streams = {commands_key(node_id): cursor for node_id, cursor in cursors.items()}
        reply = self._redis.xread(streams, block=block_ms)
        newest: dict[str, str] = {}
        for key, entries in reply or []:
            if entries:
                node_id = key.decode().removeprefix(f"{PREFIX}node:").removesuffix(":commands")
                newest[node_id] = entries[-1][0].decode()
        return newest

    @redis_errors
    def barrier(self) -> None:
        replication_barrier(self._redis)

    # ---- helpers ----------------------------------------------------------------------

    @redis_errors
    def _last_id(self, stream: str) -> str:
        last = self._redis.xrevrange(stream, count=1)
        return last[0][0].decode() if last else "0-0"

    @redis_errors
    def _read_stream(self, key: str, after_id: str, block_ms: int | None) -> Iterator[tuple[str, bytes]]:
        reply = self._redis.xread({key: after_id}, block=block_ms, count=100)
        entries: Sequence[tuple[bytes, dict[bytes, bytes]]] = reply[0][1] if reply else []
        return iter([(entry_id.decode(), fields[EVENT_FIELD]) for entry_id, fields in entries])
