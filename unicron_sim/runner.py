"""One simulation per strategy over the same cluster and trace; what each earned and lost."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from unicron_sim import strategies
from unicron_sim.engine import Incident, Sim
from unicron_sim.model import ClusterModel
from unicron_sim.traces import FailureEvent


@dataclass
class RunResult:
    strategy: str
    duration_s: float
    waf_seconds: float
    failure_free_waf_seconds: float  # the strategy's WAF x duration with no failure
    incidents: list[Incident]
    timeline: list[tuple[float, float]]  # (t, WAF-seconds accumulated until t)
    counters: dict[str, int]
    failures: int
    failures_ignored: int
    wall_s: float
    planner: dict[str, Any] = field(default_factory=dict)

    @property
    def efficiency(self) -> float:
        """Achieved over failure-free WAF-seconds of this strategy."""
        return self.waf_seconds / self.failure_free_waf_seconds if self.failure_free_waf_seconds else 0.0

    def cost_split(self) -> dict[str, float]:
        """WAF-seconds lost to failures, by phase (the coordinator's cost model)."""
        failures = [i for i in self.incidents if i.kind != "replan"]
        replans = [i for i in self.incidents if i.kind == "replan"]
        return {
            "incidents": float(len(failures)),
            "detection_ws": sum(i.detection_ws for i in failures),
            "transition_ws": sum(i.transition_ws for i in failures),
            "sub_healthy_ws": sum(i.sub_healthy_ws for i in failures),
            "replans": float(len(replans)),
            "replan_transition_ws": sum(i.transition_ws + i.detection_ws for i in replans),
            "replan_sub_healthy_ws": sum(i.sub_healthy_ws for i in replans),
        }


def simulate_one(
    cluster: ClusterModel,
    trace: Sequence[FailureEvent],
    duration_s: float,
    strategy: str,
    config: strategies.StrategyConfig,
    samples: int = 200,
) -> RunResult:
    chosen = strategies.make(strategy, config)
    sim = Sim(cluster, chosen, duration_s, samples)
    started = time.perf_counter()
    sim.run(trace)
    wall = time.perf_counter() - started
    planner: dict[str, Any] = {}
    if isinstance(chosen, strategies.Unicron) and chosen.planner is not None:
        stats = chosen.planner.stats
        planner = {
            "calls": stats.calls,
            "seconds": round(stats.seconds, 3),
            "max_seconds": round(stats.max_seconds, 4),
            "statuses": dict(stats.statuses),
            "request_nodes_max": stats.request_nodes_max,
        }
    return RunResult(
        strategy=strategy,
        duration_s=duration_s,
        waf_seconds=sim.waf_seconds,
        failure_free_waf_seconds=cluster.failure_free_waf() * chosen.factor * duration_s,
        incidents=sim.incidents,
        timeline=sim.timeline,
        counters=dict(sorted(sim.counters.items())),
        failures=sim.failures_seen,
        failures_ignored=sim.failures_ignored,
        wall_s=wall,
        planner=planner,
    )


def simulate(
    cluster: ClusterModel,
    trace: Sequence[FailureEvent],
    duration_s: float,
    names: Sequence[str],
    config: strategies.StrategyConfig,
    samples: int = 200,
) -> list[RunResult]:
    """Each strategy in turn, each from the same start; results in the order given."""
    return [simulate_one(cluster, trace, duration_s, name, config, samples) for name in names]
