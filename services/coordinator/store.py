"""What the coordinator needs of its state: the `Store` protocol, and the values both stores
share. Two implementations keep one contract (tests/integration/test_store_contract.py):
`redis_store.RedisStore`, the real one, fenced by the coordinator lease, and
`memory_store.MemoryStore`, for unit tests of the coordinator's decisions without Redis.

The contract, in short: every job write is a compare-and-set on the job's version, and the
events and commands a write implies commit with it or not at all; a `mutate` or `update`
callback that raises writes nothing and its exception propagates; a callback may be run
more than once (the Redis store retries it after a lost race), so it must do no I/O and
take every value it needs (ports, maps of ranks) from its caller. Reads return copies:
changing what a read returned changes nothing stored."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from unicron.v1 import common_pb2, node_service_pb2


@dataclass
class JobWrite:
    """What one compare-and-set job update writes besides the job itself."""

    events: list[common_pb2.JobEvent] = field(default_factory=list)
    commands: list[tuple[str, node_service_pb2.NodeCommand]] = field(default_factory=list)


JobMutation = Callable[[common_pb2.Job], JobWrite | None]
IncidentUpdate = Callable[[common_pb2.Incident | None], common_pb2.Incident]


class Store(Protocol):
    # ---- jobs: NotFound for an unknown id; a job is found by its id or its name ----------
    def create_job(self, job: common_pb2.Job, event: common_pb2.JobEvent) -> common_pb2.Job:
        """Stores a new job at version 1 with its first event; AlreadyExists when its name
        is held by a job that has not ended (``holds_its_name``)."""

    def get_job(self, job_id: str) -> common_pb2.Job: ...

    def list_jobs(self) -> list[common_pb2.Job]:
        """Newest first."""

    def update_job(self, job_id: str, mutate: JobMutation) -> common_pb2.Job:
        """Compare-and-set: mutate(current) returns what else to write (None: nothing), the
        job is written at version + 1. Returns the job as stored, with its progress."""

    def update_jobs(self, mutations: Mapping[str, JobMutation]) -> dict[str, common_pb2.Job]:
        """`update_job` for many jobs as one compare-and-set: every write or none (a mutate
        that raises, or an unknown job, writes nothing). Returns each job as stored."""

    def set_progress(self, job_id: str, progress: common_pb2.JobProgress, event: common_pb2.JobEvent) -> None:
        """Progress is kept beside the job: writing it never loses a job's compare-and-set."""

    def append_event(self, job_id: str, event: common_pb2.JobEvent) -> None: ...

    def record_exit(self, job_id: str, generation: int, rank: int, exit_code: int) -> dict[int, int]:
        """Records a rank's exit; returns every exit of that generation."""

    def last_event_id(self, job_id: str) -> str:
        """The newest event's id, "0-0" when there is none."""

    def read_events(self, job_id: str, after_id: str, block_ms: int) -> list[tuple[str, common_pb2.JobEvent]]:
        """Events after `after_id`, waiting up to block_ms for one."""

    # ---- incidents: one open incident per key (incidents.incident_key) -------------------
    def upsert_incident(self, key: str, update: IncidentUpdate) -> tuple[common_pb2.Incident, bool]:
        """update(open incident or None) is stored; returns it and whether it is new."""

    def upsert_incidents(self, updates: Mapping[str, IncidentUpdate]) -> list[tuple[common_pb2.Incident, bool]]:
        """Many upserts in one write: all or none."""

    def update_incident(
        self, incident_id: str, edit: Callable[[common_pb2.Incident], None]
    ) -> common_pb2.Incident | None:
        """Compare-and-set edit by id; None when there is no such incident."""

    def get_incident(self, incident_id: str) -> common_pb2.Incident | None: ...

    def list_incidents(self, job_id: str = "", limit: int = 200) -> list[common_pb2.Incident]:
        """A job's incidents (or all), the latest detected first."""

    # ---- nodes --------------------------------------------------------------------------
    def put_node(self, node: common_pb2.Node, now: float) -> str:
        """Stores a node and its heartbeat; returns the end of its command log."""

    def get_node(self, node_id: str) -> common_pb2.Node | None: ...

    def list_nodes(self) -> list[common_pb2.Node]:
        """By node id; their last heartbeats are apart (`heartbeats`)."""

    def node_states(self) -> dict[str, common_pb2.NodeState]: ...

    def heartbeats(self, node_ids: Sequence[str]) -> dict[str, float]: ...

    def save_heartbeats(self, beats: Mapping[str, float]) -> None: ...

    def set_node_state(self, node_id: str, state: int, expected: int, now: float) -> bool:
        """Compare-and-set of a node's state; False if it was not `expected`."""

    def set_node_states(self, node_ids: Sequence[str], state: int, expected: int, now: float) -> list[str]:
        """Many compare-and-sets in one write; returns the nodes that changed."""

    def set_node_cordoned(self, node_id: str, cordoned: bool) -> common_pb2.Node | None:
        """Compare-and-set of a node's cordon; the node as stored, None when there is none."""

    # ---- commands to agents: a log per node ----------------------------------------------
    def append_command(self, node_id: str, command: node_service_pb2.NodeCommand) -> str: ...

    def last_command_id(self, node_id: str) -> str: ...

    def read_commands(
        self, node_id: str, after_id: str, block_ms: int | None = None
    ) -> list[tuple[str, node_service_pb2.NodeCommand]]:
        """Commands after `after_id` (block_ms None: no wait), each with its command_id."""

    def wait_for_commands(self, cursors: Mapping[str, str], block_ms: int) -> dict[str, str]:
        """Waits for a command after any node's cursor; returns those nodes' newest ids."""

    def barrier(self) -> None:
        """Returns once everything read so far is as durable as an acknowledged write (on the
        replicas writes wait for); Unavailable when it is not in time. What an agent is told
        passes one first: it may have been read before its writer's wait ended."""


_ENDED = frozenset({common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED})


def holds_its_name(job: common_pb2.Job) -> bool:
    """Whether a job keeps its name from a new submission: until it ended. A user resubmits
    ``my-run`` after a cancel; the ended job stays reachable by its id, the name then finds
    the new one."""
    return job.state not in _ENDED


def storable(identifier: str) -> bool:
    """Whether an id can name a stored record. ':' separates the parts of keys, so an id that
    holds one would name another record's key (`<job>:events`, `<node>:heartbeat`); no id
    the coordinator hands out or accepts has one."""
    return ":" not in identifier


_STREAM_ID = re.compile(r"^([0-9]{1,20})(?:-([0-9]{1,20}))?$")


def valid_stream_id(value: str) -> bool:
    """Whether value is an event or command id (`<ms>-<seq>`, or `<ms>`) that Redis accepts."""
    match = _STREAM_ID.match(value)
    return match is not None and all(int(part) < 2**64 for part in match.groups() if part is not None)


def new_job_id() -> str:
    return f"job-{time.strftime('%Y%m%d')}-{uuid.uuid4().hex[:8]}"


def new_incident_id() -> str:
    return f"inc-{uuid.uuid4().hex[:10]}"
