"""Trace-driven cluster simulator: the project's real decision code (the severity ladder, the
coordinator's request building, the CP-SAT planner) over a modeled cluster, side by side with
models of the systems the Unicron paper compares with. See bench/README.md ("Simulator")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from unicron.errors import InvalidArgument
from unicron_sim import llama3, model, timings, traces
from unicron_sim import strategies as strategy
from unicron_sim.runner import RunResult, simulate


@dataclass(frozen=True)
class Scenario:
    """One cluster and trace: a preset, optionally resized, re-timed or replaced by a trace file."""

    preset: str = "high-failure-128"
    gpus: int | None = None  # default: the preset's
    days: float | None = None  # default: the preset's
    seed: int = 0
    trace_file: Path | None = None
    failure_rate_per_node_per_s: float | None = None  # default: the preset's, or the file's
    repair_mean_s: float | None = None
    strategies: tuple[str, ...] = strategy.STRATEGIES
    unicron: strategy.UnicronSettings = field(default_factory=strategy.UnicronSettings)
    elastic: strategy.ElasticSettings = field(default_factory=strategy.ElasticSettings)
    # The large jobs under Megatron's distributed optimizer (None: the preset's), and their
    # training.replication (0: the default, buddy copies on; 1: none).
    distributed_optimizer: bool | None = None
    replication: int = 0

    def __post_init__(self) -> None:
        if self.preset not in traces.PRESETS:
            raise InvalidArgument("preset", f"unknown preset {self.preset!r}; known: {', '.join(traces.PRESETS)}")
        unknown = [s for s in self.strategies if s not in strategy.STRATEGIES]
        if unknown or not self.strategies:
            raise InvalidArgument(
                "strategies", f"unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(strategy.STRATEGIES)}"
            )
        if self.replication not in (0, 1, 2):
            raise InvalidArgument("replication", f"must be 1 (no buddy copy) or 2 (one), got {self.replication}")
        if self.days is not None and not self.days > 0:
            raise InvalidArgument("days", "must be > 0")
        for name in ("failure_rate_per_node_per_s", "repair_mean_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise InvalidArgument(name, "must be >= 0")


@dataclass
class Outcome:
    scenario: Scenario
    cluster: model.ClusterModel
    trace: list[traces.FailureEvent]
    duration_s: float
    failure_rate_per_node_per_s: float
    timings: timings.Timings
    results: list[RunResult]


def prepare(scenario: Scenario) -> tuple[model.ClusterModel, list[traces.FailureEvent], float, float]:
    """The cluster, the trace, its duration and the failure rate the coordinator is told.
    Reads and checks a trace file completely before anything is simulated."""
    preset = traces.PRESETS[scenario.preset]
    gpus = scenario.gpus or preset.gpus
    sharded = preset.distributed_optimizer if scenario.distributed_optimizer is None else scenario.distributed_optimizer
    if preset.workload == "llama3-405b":
        cluster = llama3.cluster(gpus, sharded, scenario.replication)
    else:
        cluster = model.workload(gpus, sharded, scenario.replication)
    days = scenario.days if scenario.days is not None else preset.days
    if scenario.trace_file is not None:
        trace = traces.load_csv(scenario.trace_file, cluster.nodes)
        duration = days * traces.DAY_S
        if scenario.days is None and trace:
            duration = max(duration, trace[-1].time_s)
        rate = scenario.failure_rate_per_node_per_s
        if rate is None:
            rate = traces.observed_rate(trace, cluster.nodes, duration)
        return cluster, trace, duration, rate
    config = traces.TraceConfig(
        nodes=cluster.nodes,
        days=days,
        failure_rate_per_node_per_s=(
            preset.failure_rate_per_node_per_s
            if scenario.failure_rate_per_node_per_s is None
            else scenario.failure_rate_per_node_per_s
        ),
        repair_mean_s=preset.repair_mean_s if scenario.repair_mean_s is None else scenario.repair_mean_s,
        mix=preset.mix,
        seed=scenario.seed,
    )
    return cluster, traces.generate(config), config.duration_s, config.failure_rate_per_node_per_s


def run(scenario: Scenario, results_dir: Path = timings.RESULTS_DIR, samples: int = 200) -> Outcome:
    cluster, trace, duration, rate = prepare(scenario)
    measured = timings.load(results_dir)
    # The llama3-405b preset's checkpoint-restart is calibrated on Meta's published figures.
    calibrated = traces.PRESETS[scenario.preset].workload == "llama3-405b"
    config = strategy.StrategyConfig(
        timings=measured,
        failure_rate_per_node_per_s=rate,
        checkpoint=llama3.checkpoint_settings() if calibrated else strategy.CheckpointSettings(),
        unicron=scenario.unicron,
        elastic=scenario.elastic,
        seed=scenario.seed,
    )
    results = simulate(cluster, trace, duration, scenario.strategies, config, samples)
    return Outcome(scenario, cluster, trace, duration, rate, measured, results)


def strategy_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of strategy names (checked by ``Scenario``)."""
    return tuple(s.strip() for s in text.split(",") if s.strip())


__all__ = ["Outcome", "RunResult", "Scenario", "prepare", "run", "strategy_names"]
