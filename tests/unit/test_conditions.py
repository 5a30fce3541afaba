"""A job's conditions (checkpoints or snapshots failing) from its ranks' reports; the rank's
side that tells them (Durability); the checkpoint volume as a node health finding."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.agent.health import DiskCheck, default_checks
from services.coordinator import conditions
from services.coordinator.conditions import CHECKPOINTS_FAILING, SNAPSHOTS_FAILING
from unicron.trainer.durability import Durability
from unicron.v1 import common_pb2, node_service_pb2

NOW = 1_000.0
ENOSPC = "[Errno 28] No space left on device"


def report(
    rank: int = 0,
    checkpoint: tuple[str, int] = ("", 0),
    snapshot: tuple[str, int] = ("", 0),
    saved: tuple[int, int] = (0, 0),
) -> node_service_pb2.IterationReport:
    """`saved`: the iterations of the process's newest checkpoint and snapshot saves."""
    return node_service_pb2.IterationReport(
        job_id="j",
        rank=rank,
        iteration=12,
        checkpoint_error=checkpoint[0],
        checkpoint_failing_since=checkpoint[1],
        snapshot_error=snapshot[0],
        snapshot_failing_since=snapshot[1],
        checkpoint_saved_iteration=saved[0],
        snapshot_saved_iteration=saved[1],
    )


def held(kind: str, rank: int, since: int = 10, message: str = ENOSPC) -> common_pb2.JobCondition:
    return common_pb2.JobCondition(type=kind, rank=rank, since_iteration=since, message=message)


@pytest.mark.parametrize(
    ("before", "incoming", "after", "changes"),
    [
        # All well, and still: nothing to write.
        ([], report(), None, None),
        # A checkpoint fails: the condition begins, with the iteration of the first failure.
        (
            [],
            report(checkpoint=(ENOSPC, 10)),
            [(CHECKPOINTS_FAILING, 0, 10)],
            [f"checkpoints failing since iteration 10: {ENOSPC} (rank 0)"],
        ),
        # Failing on: no change (a write per iteration would be noise).
        ([held(CHECKPOINTS_FAILING, 0)], report(checkpoint=(ENOSPC, 10)), None, None),
        ([held(CHECKPOINTS_FAILING, 0)], report(checkpoint=("another text", 10)), None, None),
        # Saved again: cleared.
        ([held(CHECKPOINTS_FAILING, 0)], report(saved=(12, 0)), [], ["checkpoints saved again (rank 0)"]),
        # A process that has not tried yet (restarted, moved to another node) has no news:
        # the condition stays (it was once cleared by the silence, then raised again).
        ([held(CHECKPOINTS_FAILING, 0)], report(), None, None),
        ([held(SNAPSHOTS_FAILING, 0)], report(saved=(12, 0)), None, None),
        # Only the rank that reported a condition clears it.
        ([held(SNAPSHOTS_FAILING, 3)], report(rank=0, saved=(12, 12)), None, None),
        ([held(SNAPSHOTS_FAILING, 3)], report(rank=3, saved=(0, 11)), [], ["snapshots saved again (rank 3)"]),
        # Both at once.
        (
            [],
            report(rank=1, checkpoint=("disk", 4), snapshot=("tmpfs", 5)),
            [(CHECKPOINTS_FAILING, 1, 4), (SNAPSHOTS_FAILING, 1, 5)],
            [
                "checkpoints failing since iteration 4: disk (rank 1)",
                "snapshots failing since iteration 5: tmpfs (rank 1)",
            ],
        ),
    ],
)
def test_update(
    before: list[common_pb2.JobCondition],
    incoming: node_service_pb2.IterationReport,
    after: list[tuple[str, int, int]] | None,
    changes: list[str] | None,
) -> None:
    result = conditions.update(before, incoming, NOW)
    if after is None:
        assert result is None
        return
    assert result is not None
    assert [(c.type, c.rank, c.since_iteration) for c in result.conditions] == after
    assert result.changes == changes
    for condition in result.conditions:
        if condition.type not in {c.type for c in before}:
            assert condition.since.ToNanoseconds() == int(NOW * 1e9)


def test_a_long_error_is_cut() -> None:
    result = conditions.update([], report(checkpoint=("x" * 5000, 2)), NOW)
    assert result is not None and len(result.conditions[0].message) == conditions.MAX_MESSAGE_CHARS


def test_durability_tells_a_run_of_failures_until_a_save_succeeds() -> None:
    durability = Durability()
    out = node_service_pb2.IterationReport()
    durability.fill(out)
    assert (out.checkpoint_error, out.checkpoint_failing_since, out.checkpoint_saved_iteration) == ("", 0, 0)
    durability.checkpointed(10, ENOSPC)
    durability.checkpointed(20, ENOSPC)
    durability.snapshotted(15, "read-only file system")
    durability.fill(out)
    assert (out.checkpoint_error, out.checkpoint_failing_since) == (ENOSPC, 10)
    assert (out.snapshot_error, out.snapshot_failing_since) == ("read-only file system", 15)
    assert (out.checkpoint_saved_iteration, out.snapshot_saved_iteration) == (0, 0)
    durability.checkpointed(30, "")
    durability.fill(out)
    assert (out.checkpoint_error, out.checkpoint_failing_since, out.checkpoint_saved_iteration) == ("", 0, 30)
    assert out.snapshot_error
    durability.checkpointed(40, ENOSPC)
    durability.fill(out)
    assert (out.checkpoint_error, out.checkpoint_failing_since, out.checkpoint_saved_iteration) == (ENOSPC, 40, 30)


def test_a_full_checkpoint_volume_is_a_finding_of_its_own_kind() -> None:
    full = DiskCheck(
        "/ckpt", usage=lambda _path: (100 << 30, 100 << 30, 0), kind=common_pb2.FAILURE_KIND_CHECKPOINT_STORAGE
    )
    (finding,) = full.run()
    assert finding.kind == common_pb2.FAILURE_KIND_CHECKPOINT_STORAGE and finding.check == "disk:/ckpt"


def test_the_checkpoint_volume_is_checked_apart_only_when_it_is_another_file_system(tmp_path: Path) -> None:
    names = [getattr(c, "name", "") for c in default_checks(str(tmp_path), str(tmp_path / "checkpoints"))]
    assert names.count(f"disk:{tmp_path}") == 1 and not any("checkpoints" in n for n in names)
    other = [
        c for c in default_checks(str(tmp_path), "/dev/shm/unicron-ckpt") if getattr(c, "name", "").endswith("-ckpt")
    ]
    assert [c.kind for c in other if isinstance(c, DiskCheck)] == [common_pb2.FAILURE_KIND_CHECKPOINT_STORAGE]
