"""Job events: the one way the coordinator builds an entry of a job's event log."""

from __future__ import annotations

from unicron.v1 import common_pb2

EventType = common_pb2.JobEventType


def event(job: common_pb2.Job, kind: int, now: float, message: str, **fields: object) -> common_pb2.JobEvent:
    out = common_pb2.JobEvent(job_id=job.job_id, type=kind, state=job.state, message=message, **fields)  # type: ignore[arg-type]
    out.time.FromNanoseconds(int(now * 1e9))
    return out
