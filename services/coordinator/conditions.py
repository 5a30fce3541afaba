"""A job's conditions: what is wrong with it that is not a failure. Its checkpoints or
snapshots fail (a full volume, a permission) while it trains on; the ranks say so on every
iteration report until a save succeeds again (unicron/trainer/durability.py). `update` is the
pure rule: the conditions a report implies, and the words of each change."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from unicron.v1 import common_pb2, node_service_pb2

CHECKPOINTS_FAILING = "checkpoints_failing"
SNAPSHOTS_FAILING = "snapshots_failing"
# What each condition is called in its messages.
NOUN = {CHECKPOINTS_FAILING: "checkpoints", SNAPSHOTS_FAILING: "snapshots"}
MAX_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class Update:
    """The job's conditions after a report, and one line per condition that began or cleared."""

    conditions: list[common_pb2.JobCondition]
    changes: list[str]


def _said(report: node_service_pb2.IterationReport) -> dict[str, tuple[str, int]]:
    """What the report says is failing: type -> (error, since iteration)."""
    out = {}
    if report.checkpoint_error:
        out[CHECKPOINTS_FAILING] = (report.checkpoint_error, report.checkpoint_failing_since)
    if report.snapshot_error:
        out[SNAPSHOTS_FAILING] = (report.snapshot_error, report.snapshot_failing_since)
    return out


def _saved(report: node_service_pb2.IterationReport) -> set[str]:
    """The conditions the report says this process has since saved through (a save succeeded
    and none failed after it). A process that has not tried yet (restarted, moved) says neither."""
    out = set()
    if report.checkpoint_saved_iteration and not report.checkpoint_error:
        out.add(CHECKPOINTS_FAILING)
    if report.snapshot_saved_iteration and not report.snapshot_error:
        out.add(SNAPSHOTS_FAILING)
    return out


def describe(condition: common_pb2.JobCondition) -> str:
    """A condition in words: "checkpoints failing since iteration 10: No space left on device"."""
    noun = NOUN.get(condition.type, condition.type)
    return f"{noun} failing since iteration {condition.since_iteration}: {condition.message}"


def update(
    conditions: Sequence[common_pb2.JobCondition], report: node_service_pb2.IterationReport, now: float
) -> Update | None:
    """The conditions after `report`, or None when it changes none. A condition belongs to
    the rank that reported it: only that rank's report of a save clears it (rank 0 speaks for
    every checkpoint; each rank for its own snapshots). A condition already held keeps its
    first time and iteration; a new error text for it is not a change worth a write."""
    said, saved = _said(report), _saved(report)
    kept: list[common_pb2.JobCondition] = []
    changes: list[str] = []
    held = set()
    for condition in conditions:
        held.add(condition.type)
        if condition.rank == report.rank and condition.type in saved:
            changes.append(f"{NOUN.get(condition.type, condition.type)} saved again (rank {report.rank})")
            continue
        kept.append(condition)
    for kind, (error, since) in said.items():
        if kind in held:
            continue
        condition = common_pb2.JobCondition(
            type=kind, message=error[:MAX_MESSAGE_CHARS], since_iteration=since, rank=report.rank
        )
        condition.since.FromNanoseconds(int(now * 1e9))
        kept.append(condition)
        changes.append(f"{describe(condition)} (rank {report.rank})")
    if not changes:
        return None
    return Update(kept, changes)
