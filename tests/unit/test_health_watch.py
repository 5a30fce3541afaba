"""HealthWatch: each finding reported once while it holds; a node isolated for a shortage
(disk, memory) registers again once every check has passed for long enough; a hardware
finding never returns it so."""

from __future__ import annotations

import pytest

from services.agent.health import HealthFinding
from services.agent.health_watch import HealthWatch
from unicron.v1 import common_pb2 as pb

DISK = HealthFinding(pb.FAILURE_KIND_DISK_FULL, "disk:/var", "under 1.00 GiB", {})
MEMORY = HealthFinding(pb.FAILURE_KIND_HOST_MEMORY_LOW, "memory", "200 MiB available", {})
ECC = HealthFinding(pb.FAILURE_KIND_ECC_ERROR, "nvml", "GPU 3: double-bit ECC error", {})


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        # All well: nothing to report, nothing to return from.
        ([(0, []), (100, [])], [([], False), ([], False)]),
        # A full disk: reported once while it holds; clear for 60 s, the node registers again.
        (
            [(0, [DISK]), (5, [DISK]), (10, []), (65, []), (70, []), (200, [])],
            [([DISK], False), ([], False), ([], False), ([], False), ([], True), ([], False)],
        ),
        # It fails again before the 60 s are up: the wait starts over, and the new finding is
        # reported again (it had cleared).
        (
            [(0, [MEMORY]), (10, []), (50, [MEMORY]), (60, []), (100, []), (120, [])],
            [([MEMORY], False), ([], False), ([MEMORY], False), ([], False), ([], False), ([], True)],
        ),
        # An ECC event is seen by one run only: its absence after says nothing, and the node
        # waits for a repair by hand, even when a full disk beside it clears.
        (
            [(0, [ECC, DISK]), (5, []), (100, []), (1000, [])],
            [([ECC, DISK], False), ([], False), ([], False), ([], False)],
        ),
    ],
)
def test_observe(
    runs: list[tuple[float, list[HealthFinding]]], expected: list[tuple[list[HealthFinding], bool]]
) -> None:
    watch = HealthWatch(return_after_s=60)
    got = []
    for now, findings in runs:
        verdict = watch.observe(findings, now)
        got.append((verdict.report, verdict.register_again))
    assert got == expected


def test_returning_at_once_when_asked() -> None:
    watch = HealthWatch(return_after_s=0)
    assert not watch.observe([DISK], 0).register_again
    assert watch.observe([], 1).register_again
