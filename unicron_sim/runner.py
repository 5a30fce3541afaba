"""One simulation per strategy over the same cluster and trace; what each earned and lost, checked
against the invariants every run must keep (``invariants``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from unicron_sim import invariants, strategies
from unicron_sim.engine import Incident, Sim
from unicron_sim.model import GPUS_PER_NODE, ClusterModel
from unicron_sim.traces import FailureEvent


@dataclass
class RunResult:
    strategy: str
    duration_s: float
    waf_seconds: float
    failure_free_waf_seconds: float  # the same strategy's run over an empty trace
    incidents: list[Incident]
    timeline: list[tuple[float, float]]  # (t, WAF-seconds accumulated until t)
    counters: dict[str, int]
    failures: int
    failures_ignored: int
    wall_s: float
    planner: dict[str, Any] = field(default_factory=dict)
    ettr_by_job: dict[str, float] = field(default_factory=dict)
    job_gpus: dict[str, int] = field(default_factory=dict)  # at the start, ETTR's weights
    nodes_taken_out: int = 0

    @property
    def ettr(self) -> float:
        """Effective training time ratio: the share of the wall time the jobs trained (at any
        size; lost and recomputed work counts as down), weighted by the GPUs each started on."""
        total = sum(self.job_gpus.values())
        if not total:
            return 0.0
        return sum(self.ettr_by_job[j] * g for j, g in self.job_gpus.items()) / total

    @property
    def replans(self) -> int:
        """Re-plans of the whole cluster (planner calls), for strategies that make them."""
        return int(self.planner.get("calls", 0))

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
    """One strategy's run, and its failure-free run for reference; raises
    ``invariants.InvariantError`` when the run breaks an invariant."""
    chosen = strategies.make(strategy, config)
    sim = Sim(cluster, chosen, duration_s, samples)
    started = time.perf_counter()
    sim.run(trace)
    wall = time.perf_counter() - started
    # The reference: the same strategy over no failure (for Unicron, the jobs where its
    # arrival plan puts them).
    quiet = Sim(cluster, strategies.make(strategy, config), duration_s, samples=1)
    quiet.run([])
    planner: dict[str, Any] = {}
    plan_times: list[float] = []
    if isinstance(chosen, strategies.Unicron) and chosen.planner is not None:
        stats = chosen.planner.stats
        plan_times = stats.times
        planner = {
            "calls": stats.calls,
            "seconds": round(stats.seconds, 3),
            "max_seconds": round(stats.max_seconds, 4),
            "statuses": dict(stats.statuses),
            "request_nodes_max": stats.request_nodes_max,
        }
    result = RunResult(
        strategy=strategy,
        duration_s=duration_s,
        waf_seconds=sim.waf_seconds,
        failure_free_waf_seconds=quiet.waf_seconds,
        incidents=sim.incidents,
        timeline=sim.timeline,
        counters=dict(sorted(sim.counters.items())),
        failures=sim.failures_seen,
        failures_ignored=sim.failures_ignored,
        wall_s=wall,
        planner=planner,
        ettr_by_job={j.job_id: j.up_s / duration_s if duration_s else 0.0 for j in sim.jobs},
        job_gpus={j.job_id: j.start_nodes * GPUS_PER_NODE for j in cluster.jobs},
        nodes_taken_out=len(sim.taken_out),
    )
    invariants.check_efficiency(strategy, result.waf_seconds, result.failure_free_waf_seconds)
    invariants.check_ettr(strategy, result.ettr)
    invariants.check_costs(strategy, [i.detection_ws + i.transition_ws + i.sub_healthy_ws for i in sim.incidents])
    if chosen.replans_on_node_loss:
        bound = strategies.sev1_detection_bound_s(sim, config.timings)
        invariants.check_replans(strategy, sim.taken_out, plan_times, bound, duration_s)
    return result


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
