"""Strategies over small clusters: failure-free WAF, the real ladder and planner in the loop,
determinism, the node-group mapping, and the checkpoint-restart model's arithmetic."""

from __future__ import annotations

from typing import Any

import pytest

from services.coordinator import ladder
from services.planner import solver
from unicron.v1 import common_pb2 as pb
from unicron_sim import model, planning, runner, strategies, timings, traces
from unicron_sim.engine import Sim

CLUSTER = model.workload(128)
TIMINGS = timings.Timings()  # the documented defaults: tests do not depend on bench results
RATE = 1.0 / (8 * 3600.0)


def _config(**unicron: Any) -> strategies.StrategyConfig:
    return strategies.StrategyConfig(
        timings=TIMINGS, failure_rate_per_node_per_s=RATE, unicron=strategies.UnicronSettings(**unicron)
    )


def _trace(days: float = 1.0, seed: int = 0) -> list[traces.FailureEvent]:
    return traces.generate(traces.TraceConfig(CLUSTER.nodes, days, RATE, repair_mean_s=7200.0, seed=seed))


@pytest.mark.parametrize("name", strategies.STRATEGIES)
def test_no_failures_gives_each_strategy_its_failure_free_waf(name: str) -> None:
    result = runner.simulate_one(CLUSTER, [], 3600.0, name, _config())
    assert result.waf_seconds == pytest.approx(result.failure_free_waf_seconds, rel=1e-12)
    assert result.incidents == []
    factor = strategies.make(name, _config()).factor
    assert result.failure_free_waf_seconds == pytest.approx(CLUSTER.failure_free_waf() * factor * 3600.0)


def test_unicron_is_at_least_the_ablation_and_ahead_of_checkpoint_restart() -> None:
    trace = _trace()
    results = {r.strategy: r for r in runner.simulate(CLUSTER, trace, traces.DAY_S, strategies.STRATEGIES, _config())}
    unicron = results["unicron"].waf_seconds
    assert unicron >= results["unicron-alone"].waf_seconds
    assert all(unicron > r.waf_seconds for name, r in results.items() if name != "unicron")
    assert 0 < results["megatron-cr"].efficiency < results["unicron"].efficiency <= 1.0


def test_unicron_calls_the_ladder_and_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"choose": 0, "plan": 0}
    choose, plan = ladder.choose, solver.plan

    def counted_choose(*args: Any, **kwargs: Any) -> ladder.Decision:
        calls["choose"] += 1
        return choose(*args, **kwargs)

    def counted_plan(*args: Any, **kwargs: Any) -> Any:
        calls["plan"] += 1
        return plan(*args, **kwargs)

    monkeypatch.setattr(ladder, "choose", counted_choose)
    monkeypatch.setattr(solver, "plan", counted_plan)
    trace = _trace(0.5)
    result = runner.simulate_one(CLUSTER, trace, traces.DAY_S / 2, "unicron", _config())
    remedies = sum(v for k, v in result.counters.items() if k.startswith("remedy "))
    hardware = sum(1 for e in trace if traces.is_hardware(e.kind))
    assert calls["choose"] == remedies > 0
    # One more: the arrival plan of the failure-free reference run.
    assert calls["plan"] == result.planner["calls"] + 1
    assert result.planner["calls"] >= hardware > 0
    assert result.counters.get("remedy reconfigure", 0) > 0


def test_escalation_reaches_the_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remedies that always fail make the ladder escalate reattempt -> restart -> reconfigure."""
    seen: list[int | None] = []
    choose = ladder.choose

    def spy(*args: Any, **kwargs: Any) -> ladder.Decision:
        decision = choose(*args, **kwargs)
        seen.append(decision.remedy)
        return decision

    monkeypatch.setattr(ladder, "choose", spy)
    trace = [traces.FailureEvent(100.0, 0, pb.FAILURE_KIND_LINK_FLAPPING, 600.0)]
    config = _config(remedy_failure={"reattempt": 0.999, "restart": 0.999})
    runner.simulate_one(CLUSTER, trace, 3600.0, "unicron", config)
    assert seen[:5] == [pb.REMEDY_REATTEMPT] * 2 + [pb.REMEDY_RESTART] * 2 + [pb.REMEDY_RECONFIGURE]


def test_simulation_is_deterministic() -> None:
    trace = _trace(seed=5)
    first = runner.simulate(CLUSTER, trace, traces.DAY_S, ["unicron", "megatron-cr"], _config())
    second = runner.simulate(CLUSTER, trace, traces.DAY_S, ["unicron", "megatron-cr"], _config())
    assert [r.waf_seconds for r in first] == [r.waf_seconds for r in second]
    assert first[0].counters == second[0].counters


def test_grouped_and_per_node_requests_plan_the_same() -> None:
    strategy = strategies.make("unicron", _config())
    for down in ([0], [0, 6, 7], [2, 9, 10, 15]):
        plans = []
        for grouped in (True, False):
            s = Sim(CLUSTER, strategy, 3600.0)
            for node in down:
                s.take_out(node, 600.0)
            planner = planning.Planner(CLUSTER.jobs, RATE, group_nodes=grouped)
            moves = planner.plan(s)
            assert moves is not None
            plans.append(sorted((m.job.job_id, len(m.nodes), m.kind, m.transition) for m in moves))
            for m in moves:
                assert not any(s.down[n] for n in m.nodes)
        assert plans[0] == plans[1], down


def test_checkpoint_restart_pays_the_papers_recovery_path() -> None:
    """One NCCL timeout: the job is out for timeout + requeue + setup + recompute (68 min)."""
    trace = [traces.FailureEvent(1000.0, 0, pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, 0.0)]
    result = runner.simulate_one(CLUSTER, trace, traces.DAY_S, "megatron-cr", _config())
    job = CLUSTER.jobs[0]
    lost = job.waf(job.start_nodes * model.GPUS_PER_NODE) * 68 * 60
    assert result.failure_free_waf_seconds - result.waf_seconds == pytest.approx(lost)
    (incident,) = result.incidents
    assert incident.detection_ws == pytest.approx(job.waf(job.start_nodes * 8) * 1800)
    assert incident.transition_ws == pytest.approx(job.waf(job.start_nodes * 8) * 38 * 60)


def test_checkpoint_restart_waits_for_the_repair_without_spares() -> None:
    trace = [traces.FailureEvent(1000.0, 0, pb.FAILURE_KIND_ECC_ERROR, 7200.0)]
    result = runner.simulate_one(CLUSTER, trace, traces.DAY_S, "megatron-cr", _config())
    job = CLUSTER.jobs[0]
    out = 7200.0 + strategies.CheckpointSettings().resubmit_s
    lost = job.waf(job.start_nodes * model.GPUS_PER_NODE) * out
    assert result.failure_free_waf_seconds - result.waf_seconds == pytest.approx(lost)


def test_ablation_shrinks_alone_and_grows_back() -> None:
    trace = [traces.FailureEvent(1000.0, 4, pb.FAILURE_KIND_ECC_ERROR, 3600.0)]
    result = runner.simulate_one(CLUSTER, trace, traces.DAY_S, "unicron-alone", _config())
    assert result.counters["shrink"] == 1 and result.counters["grow back"] == 1
    assert [i.kind for i in result.incidents] == ["ecc_error", "replan"]
    assert result.incidents[0].sub_healthy_ws > 0
