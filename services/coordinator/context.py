"""What every part of the coordinator shares: its settings, its store, its clock, its
metrics, and the event that wakes the reconcile loop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.coordinator.ladder import LadderPolicy
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.priority import BUILT_IN, PriorityClasses
from services.coordinator.quotas import NONE, Quotas
from services.coordinator.store import Store
from unicron.monitor import MonitorSettings
from unicron.v1 import common_pb2


@dataclass(frozen=True)
class Settings:
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    reconcile_interval_s: float = 0.5
    failure_rate_per_node_per_s: float = 1.0 / (30 * 24 * 3600)
    plan_time_limit_s: float = 2.0
    monitor: MonitorSettings = field(default_factory=MonitorSettings)
    ladder: LadderPolicy = field(default_factory=LadderPolicy)
    # An agent acknowledges start and stop commands within this; a missed start is a failure.
    ack_timeout_s: float = 15.0
    # A remedy that brings back no iteration within this is a failed remedy (escalated).
    recovery_timeout_s: float = 180.0
    # A planner that is down or finds no plan is asked again after a backoff up to this.
    replan_backoff_max_s: float = 30.0
    # Restart only the dead ranks, and resize keeping the ranks on the nodes a job keeps, the
    # others keeping their state in place, when they can (off: stop and start every rank).
    reform_restarts: bool = True
    # The priority classes a job names (priority.py): its weight and whether it may be preempted.
    priority_classes: PriorityClasses = BUILT_IN
    # The teams' quotas (quotas.py); none: no team is limited.
    quotas: Quotas = NONE


@dataclass
class Context:
    store: Store
    settings: Settings
    clock: Callable[[], float]
    # When this coordinator started: a node silent since then is counted from here, not from
    # a heartbeat an older coordinator saved long ago.
    started_at: float
    metrics: CoordinatorMetrics | None = None
    # Set to run the next reconcile step now rather than after its interval.
    wake: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)

    def unreachable(self) -> frozenset[str]:
        """The nodes stored LOST: no agent there to ask to stop anything."""
        return unreachable(self.store.node_states())


def unreachable(states: Mapping[str, int]) -> frozenset[str]:
    """The LOST nodes of a view of every node's state: no agent there to ask to stop anything."""
    return frozenset(node_id for node_id, st in states.items() if st == common_pb2.NODE_STATE_LOST)
