"""The Redis key layout of the coordinator's state (redis_store.RedisStore): one place that
names every key, so the keyspace can be read at a glance. Every key starts with PREFIX."""

from __future__ import annotations

import uuid

PREFIX = "unicron:"
JOBS_INDEX = PREFIX + "jobs"
NODES_INDEX = PREFIX + "nodes"
# Set anew by every write of a node's record (not of its heartbeat), so a reader can tell that
# the records it holds are still current from one small read. A random value, not a counter:
# a store emptied and filled again must not repeat one.
NODES_VERSION = PREFIX + "nodes:version"
INCIDENTS_INDEX = PREFIX + "incidents"
EVENT_FIELD = b"e"


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def name_key(name: str) -> str:
    return f"{PREFIX}jobname:{name}"


def progress_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:progress"


def exits_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:exits"


def events_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:events"


def incident_key(incident_id: str) -> str:
    return f"{PREFIX}incident:{incident_id}"


def job_incidents_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:incidents"


def new_version() -> str:
    return uuid.uuid4().hex


def node_key(node_id: str) -> str:
    return f"{PREFIX}node:{node_id}"


def heartbeat_key(node_id: str) -> str:
    return f"{PREFIX}node:{node_id}:heartbeat"


def commands_key(node_id: str) -> str:
    return f"{PREFIX}node:{node_id}:commands"
