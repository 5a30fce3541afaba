"""The `Store` in memory: the same contract as the Redis store, for tests of the coordinator
that need no Redis. One lock makes every write atomic; records are kept serialized, so a
caller can change nothing stored through what it wrote or read. No fencing: one process
holds it, there is no other coordinator to depose."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from services.coordinator.store import IncidentUpdate, JobMutation, JobWrite, holds_its_name, storable
from unicron.errors import AlreadyExists, NotFound
from unicron.v1 import common_pb2, node_service_pb2

M = TypeVar("M", common_pb2.Job, common_pb2.Incident, common_pb2.Node)

READ_COUNT = 100  # what one stream read returns at most, as the Redis store's XREAD


def _stream_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class _Streams:
    """Append-only logs with ids `<ms>-<seq>` that only grow, as Redis Streams have."""

    def __init__(self, changed: threading.Condition) -> None:
        self._logs: dict[str, list[tuple[str, bytes]]] = {}
        self._last = (0, 0)
        self._changed = changed

    def append(self, name: str, payload: bytes) -> str:
        ms = int(time.time() * 1000)
        self._last = (ms, 0) if ms > self._last[0] else (self._last[0], self._last[1] + 1)
        entry_id = f"{self._last[0]}-{self._last[1]}"
        self._logs.setdefault(name, []).append((entry_id, payload))
        self._changed.notify_all()
        return entry_id

    def last(self, name: str) -> str:
        entries = self._logs.get(name)
        return entries[-1][0] if entries else "0-0"

    def after(self, name: str, after_id: str) -> list[tuple[str, bytes]]:
        cursor = _stream_key(after_id)
        return [entry for entry in self._logs.get(name, []) if _stream_key(entry[0]) > cursor][:READ_COUNT]


class MemoryStore:
    def __init__(self) -> None:
        self._lock = threading.Condition(threading.RLock())
        self._jobs: dict[str, bytes] = {}
        self._created: dict[str, int] = {}  # job id -> created (ns), the list order
        self._names: dict[str, str] = {}
        self._progress: dict[str, bytes] = {}
        self._exits: dict[tuple[str, int], dict[int, int]] = {}
        self._incidents: dict[str, bytes] = {}
        self._incident_keys: dict[str, str] = {}  # incident key -> id of the one stored under it
        self._detected: dict[str, tuple[int, str]] = {}  # incident id -> (detected ns, job id)
        self._nodes: dict[str, bytes] = {}
        self._beats: dict[str, float] = {}
        self._streams = _Streams(self._lock)

    # ---- jobs -------------------------------------------------------------------------

    def create_job(self, job: common_pb2.Job, event: common_pb2.JobEvent) -> common_pb2.Job:
        with self._lock:
            existing = self._names.get(job.spec.name)
            if existing is not None and holds_its_name(common_pb2.Job.FromString(self._jobs[existing])):
                raise AlreadyExists(f"a job named {job.spec.name!r} already exists ({existing})")
            job.version = 1
            self._names[job.spec.name] = job.job_id
            self._jobs[job.job_id] = job.SerializeToString()
            self._created[job.job_id] = job.created.ToNanoseconds()
            self._streams.append(f"events:{job.job_id}", event.SerializeToString())
            return job

    def get_job(self, job_id: str) -> common_pb2.Job:
        with self._lock:
            raw = self._jobs.get(job_id) if storable(job_id) else None
            if raw is None and storable(job_id) and job_id in self._names:
                raw = self._jobs.get(self._names[job_id])
            if raw is None:
                raise NotFound(f"no job with id or name {job_id!r}")
            return self._with_progress(common_pb2.Job.FromString(raw))

    def list_jobs(self) -> list[common_pb2.Job]:
        with self._lock:
            # Newest first, ties by id descending: the order of the Redis store's sorted set.
            order = sorted(self._created, key=lambda i: (self._created[i], i), reverse=True)
            return [self._with_progress(common_pb2.Job.FromString(self._jobs[i])) for i in order]

    def update_job(self, job_id: str, mutate: JobMutation) -> common_pb2.Job:
        with self._lock:
            raw = self._jobs.get(job_id)
            if raw is None:
                raise NotFound(f"no job with id {job_id!r}")
            job = common_pb2.Job.FromString(raw)
            write = mutate(job)
            if write is None:
                return self._with_progress(common_pb2.Job.FromString(raw))
            self._commit(job, write)
            return self._with_progress(job)

    def update_jobs(self, mutations: Mapping[str, JobMutation]) -> dict[str, common_pb2.Job]:
        with self._lock:
            missing = [job_id for job_id in mutations if job_id not in self._jobs]
            if missing:
                raise NotFound(f"no job with id {missing[0]!r}")
            jobs = {job_id: common_pb2.Job.FromString(self._jobs[job_id]) for job_id in mutations}
            writes = {job_id: mutate(jobs[job_id]) for job_id, mutate in mutations.items()}
            out = {}
            for job_id, write in writes.items():
                if write is None:
                    out[job_id] = self._with_progress(common_pb2.Job.FromString(self._jobs[job_id]))
                else:
                    self._commit(jobs[job_id], write)
                    out[job_id] = self._with_progress(jobs[job_id])
            return out

    def _commit(self, job: common_pb2.Job, write: JobWrite) -> None:
        job.version += 1
        # Serialize everything first: a message that cannot be must leave nothing written.
        payloads = [event.SerializeToString() for event in write.events]
        commands = [(node_id, command.SerializeToString()) for node_id, command in write.commands]
        self._jobs[job.job_id] = job.SerializeToString()
        for payload in payloads:
            self._streams.append(f"events:{job.job_id}", payload)
        for node_id, payload in commands:
            self._streams.append(f"commands:{node_id}", payload)

    def _with_progress(self, job: common_pb2.Job) -> common_pb2.Job:
        progress = self._progress.get(job.job_id)
        if progress is not None:
            job.progress.ParseFromString(progress)
        return job

    def set_progress(self, job_id: str, progress: common_pb2.JobProgress, event: common_pb2.JobEvent) -> None:
        with self._lock:
            self._progress[job_id] = progress.SerializeToString()
            self._streams.append(f"events:{job_id}", event.SerializeToString())

    def append_event(self, job_id: str, event: common_pb2.JobEvent) -> None:
        with self._lock:
            self._streams.append(f"events:{job_id}", event.SerializeToString())

    def record_exit(self, job_id: str, generation: int, rank: int, exit_code: int) -> dict[int, int]:
        with self._lock:
            exits = self._exits.setdefault((job_id, generation), {})
            exits[rank] = exit_code
            return dict(exits)

    def last_event_id(self, job_id: str) -> str:
        with self._lock:
            return self._streams.last(f"events:{job_id}")

    def read_events(self, job_id: str, after_id: str, block_ms: int) -> list[tuple[str, common_pb2.JobEvent]]:
        entries = self._read(f"events:{job_id}", after_id, block_ms)
        return [(entry_id, common_pb2.JobEvent.FromString(payload)) for entry_id, payload in entries]

    # ---- incidents --------------------------------------------------------------------

    def upsert_incident(self, key: str, update: IncidentUpdate) -> tuple[common_pb2.Incident, bool]:
        return self.upsert_incidents({key: update})[0]

    def upsert_incidents(self, updates: Mapping[str, IncidentUpdate]) -> list[tuple[common_pb2.Incident, bool]]:
        with self._lock:
            results = []
            for key, update in updates.items():
                incident_id = self._incident_keys.get(key)
                raw = self._incidents.get(incident_id) if incident_id is not None else None
                existing = common_pb2.Incident.FromString(raw) if raw is not None else None
                incident = update(existing)
                results.append((incident, existing is None or existing.incident_id != incident.incident_id))
            for key, (incident, created) in zip(updates, results, strict=True):
                self._incidents[incident.incident_id] = incident.SerializeToString()
                if created:
                    self._incident_keys[key] = incident.incident_id
                    self._detected[incident.incident_id] = (incident.detected.ToNanoseconds(), incident.job_id)
            return [(_copy(incident), created) for incident, created in results]

    def update_incident(
        self, incident_id: str, edit: Callable[[common_pb2.Incident], None]
    ) -> common_pb2.Incident | None:
        with self._lock:
            raw = self._incidents.get(incident_id)
            if raw is None:
                return None
            incident = common_pb2.Incident.FromString(raw)
            edit(incident)
            self._incidents[incident_id] = incident.SerializeToString()
            return incident

    def get_incident(self, incident_id: str) -> common_pb2.Incident | None:
        with self._lock:
            raw = self._incidents.get(incident_id)
            return common_pb2.Incident.FromString(raw) if raw is not None else None

    def list_incidents(self, job_id: str = "", limit: int = 200) -> list[common_pb2.Incident]:
        with self._lock:
            ids = [i for i, (_, job) in self._detected.items() if not job_id or job == job_id]
            ids.sort(key=lambda i: (self._detected[i][0], i), reverse=True)
            return [common_pb2.Incident.FromString(self._incidents[i]) for i in ids[:limit]]

    # ---- nodes ------------------------------------------------------------------------

    def put_node(self, node: common_pb2.Node, now: float) -> str:
        with self._lock:
            self._nodes[node.node_id] = node.SerializeToString()
            self._beats[node.node_id] = now
            return self._streams.last(f"commands:{node.node_id}")

    def get_node(self, node_id: str) -> common_pb2.Node | None:
        with self._lock:
            raw = self._nodes.get(node_id) if storable(node_id) else None
            return common_pb2.Node.FromString(raw) if raw is not None else None

    def list_nodes(self) -> list[common_pb2.Node]:
        with self._lock:
            return [common_pb2.Node.FromString(self._nodes[i]) for i in sorted(self._nodes)]

    def node_states(self) -> dict[str, common_pb2.NodeState]:
        return {node.node_id: node.state for node in self.list_nodes()}

    def heartbeats(self, node_ids: Sequence[str]) -> dict[str, float]:
        with self._lock:
            return {node_id: self._beats[node_id] for node_id in node_ids if node_id in self._beats}

    def save_heartbeats(self, beats: Mapping[str, float]) -> None:
        with self._lock:
            self._beats.update(beats)

    def set_node_state(self, node_id: str, state: int, expected: int, now: float) -> bool:
        return node_id in self.set_node_states([node_id], state, expected, now)

    def set_node_states(self, node_ids: Sequence[str], state: int, expected: int, now: float) -> list[str]:
        with self._lock:
            changed = []
            for node_id in node_ids:
                node = self.get_node(node_id)
                if node is not None and node.state == expected:
                    node.state = state  # type: ignore[assignment]
                    node.state_since.FromNanoseconds(int(now * 1e9))
                    self._nodes[node_id] = node.SerializeToString()
                    changed.append(node_id)
            return changed

    def set_node_cordoned(self, node_id: str, cordoned: bool) -> common_pb2.Node | None:
        with self._lock:
            node = self.get_node(node_id)
            if node is None:
                return None
            node.cordoned = cordoned
            self._nodes[node_id] = node.SerializeToString()
            return node

    # ---- commands ---------------------------------------------------------------------

    def append_command(self, node_id: str, command: node_service_pb2.NodeCommand) -> str:
        with self._lock:
            return self._streams.append(f"commands:{node_id}", command.SerializeToString())

    def last_command_id(self, node_id: str) -> str:
        with self._lock:
            return self._streams.last(f"commands:{node_id}")

    def read_commands(
        self, node_id: str, after_id: str, block_ms: int | None = None
    ) -> list[tuple[str, node_service_pb2.NodeCommand]]:
        out = []
        for command_id, payload in self._read(f"commands:{node_id}", after_id, block_ms):
            command = node_service_pb2.NodeCommand.FromString(payload)
            command.command_id = command_id
            out.append((command_id, command))
        return out

    def barrier(self) -> None:
        """Nothing to wait for: memory has no replicas."""

    def wait_for_commands(self, cursors: Mapping[str, str], block_ms: int) -> dict[str, str]:
        def newest() -> dict[str, str]:
            names = {node_id: f"commands:{node_id}" for node_id in cursors}
            return {
                node_id: self._streams.last(name)
                for node_id, name in names.items()
                if self._streams.after(name, cursors[node_id])
            }

        with self._lock:
            self._lock.wait_for(lambda: bool(newest()), timeout=block_ms / 1000)
            return newest()

    def _read(self, name: str, after_id: str, block_ms: int | None) -> list[tuple[str, bytes]]:
        with self._lock:
            if block_ms:
                self._lock.wait_for(lambda: bool(self._streams.after(name, after_id)), timeout=block_ms / 1000)
            return self._streams.after(name, after_id)


def _copy(message: M) -> M:
    return type(message).FromString(message.SerializeToString())
