"""What the agent does with each run of its health checks (health.py): which findings to
report, and when its node has recovered from them. `HealthWatch.observe` is the pure rule,
the clock passed in.

A (kind, check) pair is reported when it appears and again only after it disappeared from a
run. A node isolated for a shortage of its own (a full disk, low memory) returns by itself:
once every check has passed for `return_after_s`, the agent registers again, as a restarted
agent would (the coordinator's word for a repaired node). A hardware finding (ECC, NVLink,
XID, a lost GPU) never returns the node so: an event is seen by one run only, so its
absence from the next says nothing, and hardware is repaired by hand (the agent restarted,
or `unicron uncordon`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.agent.health import HealthFinding
from unicron.v1 import common_pb2

# Shortages that pass: what frees the disk or the memory needs no repair of the node.
PASSING = frozenset({common_pb2.FAILURE_KIND_DISK_FULL, common_pb2.FAILURE_KIND_HOST_MEMORY_LOW})


@dataclass(frozen=True)
class Verdict:
    """What one run of the checks calls for."""

    report: list[HealthFinding]
    register_again: bool = False


@dataclass
class HealthWatch:
    return_after_s: float
    seen: set[tuple[common_pb2.FailureKind, str]] = field(default_factory=set)
    # Kinds reported since the node last (re)registered for them, and since when every
    # check has passed (None: a check still fails, or nothing is waiting to clear).
    reported: set[common_pb2.FailureKind] = field(default_factory=set)
    clear_since: float | None = None

    def observe(self, findings: Iterable[HealthFinding], now: float) -> Verdict:
        findings = list(findings)
        current = {(f.kind, f.check) for f in findings}
        report = [f for f in findings if (f.kind, f.check) not in self.seen]
        self.seen = current
        self.reported.update(f.kind for f in report)
        if current or not self.reported or not self.reported <= PASSING:
            self.clear_since = None
            return Verdict(report)
        self.clear_since = now if self.clear_since is None else self.clear_since
        if now - self.clear_since < self.return_after_s:
            return Verdict(report)
        self.reported, self.clear_since = set(), None
        return Verdict(report, register_again=True)
