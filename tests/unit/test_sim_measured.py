"""The simulator on measured ground: fitted transition lines, which action a change is, the
invariants every run keeps (and that they can fail), simulated jobs that pass the
coordinator's validation, and ETTR."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from unicron import jobspec
from unicron.errors import InvalidArgument
from unicron.v1 import common_pb2 as pb
from unicron_sim import invariants, model, runner, strategies, timings, traces, transitions
from unicron_sim.engine import Sim

TIMINGS = timings.Timings()  # built-in placeholder lines: independent of the committed fit
RATE = 1.0 / (8 * 3600.0)
GB = 1e9


def _config(**unicron: Any) -> strategies.StrategyConfig:
    return strategies.StrategyConfig(
        timings=TIMINGS, failure_rate_per_node_per_s=RATE, unicron=strategies.UnicronSettings(**unicron)
    )


# --- fitted lines --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixed", "per_byte", "size", "expected"),
    [
        (0.45, 0.0, 50 * GB, 0.45),  # a reattempt moves nothing
        (0.4, 1e-9, 50 * GB, 50.4),  # a peer copy of 50 GB at 1 GB/s
        (3.0, 2e-9, 50 * GB, 103.0),  # a checkpoint load at 0.5 GB/s
        (3.0, 2e-9, 0.0, 3.0),
    ],
)
def test_a_fitted_line_is_fixed_plus_per_byte(fixed: float, per_byte: float, size: float, expected: float) -> None:
    assert timings.Line(fixed, per_byte).seconds(size) == pytest.approx(expected)


@pytest.mark.parametrize(("world", "rendezvous"), [(2, 2 * 265 / 96_000), (1536, 1536 * 265 / 96_000), (96_000, 265.0)])
def test_the_rendezvous_term_grows_with_the_world(world: int, rendezvous: float) -> None:
    fit = timings.TransitionFit()
    line = fit.lines["grow"]
    assert fit.seconds("grow", 10 * GB, world) == pytest.approx(line.seconds(10 * GB) + rendezvous)


def test_the_committed_fit_has_every_action_and_loads() -> None:
    data = json.loads(timings.FIT_PATH.read_text())
    assert set(data) >= {"source", "measured", "actions"}
    assert set(data["actions"]) == set(timings.ACTIONS)
    fit = timings.load_fit()
    assert fit is not None and set(fit.lines) == set(timings.ACTIONS)
    assert all(line.fixed_s > 0 for line in fit.lines.values())


def _fit_dict(**changes: Any) -> dict[str, Any]:
    actions: dict[str, Any] = {a: {"fixed_s": 1.0, "per_byte_s": 0.0} for a in timings.ACTIONS}
    data: dict[str, Any] = {"source": "test", "measured": "now", "actions": actions}
    for key, value in changes.items():
        if key in timings.ACTIONS:
            actions[key] = value
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ([], "must be a JSON object"),
        ({"source": "x"}, "'actions' must be an object"),
        (_fit_dict(grow=None), "actions.grow is missing"),
        (_fit_dict(shrink={"fixed_s": -1.0, "per_byte_s": 0.0}), "actions.shrink.fixed_s must be a finite number >= 0"),
        (_fit_dict(reattempt={"fixed_s": "0.4", "per_byte_s": 0.0}), "actions.reattempt.fixed_s"),
        (_fit_dict(reattempt={"fixed_s": 0.4}), "actions.reattempt.per_byte_s"),
        ({**_fit_dict(), "actions": {**_fit_dict()["actions"], "teleport": {}}}, "unknown actions teleport"),
        (_fit_dict(rendezvous_per_rank_s="fast"), "rendezvous_per_rank_s must be a number"),
    ],
)
def test_a_bad_fit_names_the_field(data: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        timings.fit_from_dict(data)


def test_load_reads_the_fit_file_and_falls_back_when_absent(tmp_path: Path) -> None:
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(_fit_dict(source="bench")))
    loaded = timings.load(tmp_path, path)
    assert loaded.fit.source == "bench" and loaded.fit.lines["grow"].fixed_s == 1.0
    assert "bench" in loaded.sources["transition_fit"]
    absent = timings.load(tmp_path, tmp_path / "none.json")
    assert absent.fit.lines == timings.DEFAULT_LINES and "absent" in absent.sources["transition_fit"]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        timings.load(tmp_path, path)


# --- which action, what it costs -----------------------------------------------------------------


def _shape(tensor: int, pipeline: int) -> Any:
    return SimpleNamespace(tensor=tensor, pipeline=pipeline)


@pytest.mark.parametrize(
    ("tensor", "pipeline", "gpus", "kind", "reform", "action"),
    [
        (1, 1, 8, "reattempt", False, "reattempt"),
        (1, 1, 1, "restart", False, "restart_peer"),
        (1, 1, 8, "resize", False, "shrink"),
        (1, 1, 8, "migrate", False, "grow"),
        (1, 1, 8, "start", False, "checkpoint_restart"),
        (8, 1, 8, "reattempt", False, "reattempt"),
        (8, 1, 16, "restart", False, "restart_peer"),  # DP 2: the other replica holds the shard
        (8, 1, 8, "restart", False, "restart_snapshot"),  # DP 1: nobody else holds it
        (8, 16, 128, "restart", False, "restart_snapshot"),
        (8, 16, 128, "restart", True, "restart_peer"),
        (8, 16, 256, "resize", False, "shrink"),  # nodes keep their stages
        (8, 16, 256, "migrate", False, "grow"),
        (8, 16, 256, "start", True, "checkpoint_restart"),
    ],
)
def test_the_action_follows_the_jobs_shape(
    tensor: int, pipeline: int, gpus: int, kind: str, reform: bool, action: str
) -> None:
    assert transitions.action(_shape(tensor, pipeline), kind, gpus, reform) == action


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown transition kind"):
        transitions.action(_shape(1, 1), "teleport", 8)


def test_a_405b_jobs_transitions_cost_its_state_rendezvous_and_lost_work() -> None:
    job = next(j for j in model.workload(16_384).jobs if j.job_id.startswith("405b"))
    gpus = job.start_nodes * model.GPUS_PER_NODE
    per_rank = job.parameters / (8 * 16) * 16
    assert job.state_bytes_per_rank(gpus) == pytest.approx(per_rank)  # replicated: the same at every size
    assert 50 * GB < per_rank < 52 * GB
    fit = TIMINGS.fit
    step = job.iteration_s(gpus)
    rendezvous = gpus * timings.RENDEZVOUS_PER_RANK_S
    replica = job.tensor * job.pipeline  # the GPUs of one replica
    expected = {
        ("reattempt", gpus): 0.45 + rendezvous + 0.5 * step,
        ("migrate", gpus): 0.4 + 1e-9 * per_rank + rendezvous + 0.5 * step,
        ("restart", gpus): 0.4 + 1e-9 * per_rank + rendezvous + 0.5 * step,  # DP 12: from a peer
        ("start", gpus): 3.0 + 2e-9 * per_rank + rendezvous + job.checkpoint_interval / 2 * step,
    }
    for (kind, on), seconds in expected.items():
        assert transitions.seconds(job, kind, on, fit) == pytest.approx(seconds), kind
    # At DP 1 no peer would hold a lost shard: the snapshot.
    assert transitions.action(job, "restart", replica) == "restart_snapshot"
    # A checkpoint restart about half the 30-minute interval lost, plus the load.
    assert 900 < transitions.seconds(job, "start", gpus, fit) < 1200
    assert transitions.seconds(job, "migrate", 0, fit) == 0.0


# --- simulated jobs are jobs a user could submit -------------------------------------------------


@pytest.mark.parametrize("gpus", [128, 16_384, 100_000])
def test_every_simulated_job_passes_the_coordinators_validation(gpus: int) -> None:
    for job in model.workload(gpus).jobs:
        spec = jobspec.normalized(job.spec())
        assert jobspec.world_size(spec, job.max_dp) <= jobspec.MAX_WORLD_SIZE
        degrees = jobspec.data_parallel_degrees(spec)
        assert degrees == list(job.dps) and job.start_dp in degrees
        assert all(job.global_batch % dp == 0 for dp in degrees), job.job_id
        assert len(degrees) >= 2, f"{job.job_id} cannot shrink"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"start_dp": 7, "max_dp": 8}, "start_dp"),  # 7 does not split 240
        ({"min_dp": 7, "start_dp": 8, "max_dp": 8}, "min_dp"),
        ({"job_id": "d-1.3b"}, "spec.name"),  # the coordinator's name rule
        ({"pipeline": 4096, "start_dp": 8, "max_dp": 8}, "spec.parallelism"),  # over MAX_WORLD_SIZE
    ],
)
def test_a_simulated_job_the_coordinator_would_refuse_is_refused(changes: dict[str, Any], field: str) -> None:
    fields = dict(
        job_id="x-7b", weight=1.0, layers=32, hidden=4096, pipeline=1, min_dp=2, max_dp=4, start_dp=4, global_batch=240
    )
    with pytest.raises(InvalidArgument) as error:
        model.JobModel(**{**fields, **changes})
    assert error.value.field.endswith(field)


@pytest.mark.parametrize("gpus", [128, 16_384, 100_000])
def test_the_arrival_plan_keeps_every_job_at_its_start_size(gpus: int) -> None:
    """All strategies start alike only if Unicron's planner, placing the jobs as they arrive,
    puts them where the workload starts them."""
    cluster = model.workload(gpus)
    preset = next(p for p in traces.PRESETS.values() if p.gpus == gpus)
    config = strategies.StrategyConfig(timings=TIMINGS, failure_rate_per_node_per_s=preset.failure_rate_per_node_per_s)
    strategy = strategies.make("unicron", config)
    sim = Sim(cluster, strategy, 3600.0)
    strategy.start(sim)
    assert [len(j.nodes) for j in sim.jobs] == [j.start_nodes for j in cluster.jobs]
    assert "sized differently on arrival" not in sim.counters


# --- invariants ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("waf", "free", "ok"), [(1.0, 1.0, True), (0.5, 1.0, True), (1.0 + 1e-12, 1.0, True), (1.0116, 1.0, False)]
)
def test_no_strategy_trains_more_than_its_failure_free_run(waf: float, free: float, ok: bool) -> None:
    if ok:
        invariants.check_efficiency("s", waf, free)
    else:
        with pytest.raises(invariants.InvariantError, match="more than its failure-free run"):
            invariants.check_efficiency("s", waf, free)


@pytest.mark.parametrize(
    ("taken_out", "plans", "ok"),
    [
        ([], [], True),
        ([10.0], [10.0], True),
        ([10.0], [13.0], True),
        ([10.0, 20.0], [12.0], False),  # the second node out was never re-planned
        ([10.0], [9.0], False),  # a re-plan before the loss does not count
        ([10.0], [15.0], False),  # too late
        ([98.0], [], True),  # its re-plan would fall after the end
    ],
)
def test_every_node_taken_out_is_re_planned(taken_out: list[float], plans: list[float], ok: bool) -> None:
    def check() -> None:
        invariants.check_replans("s", taken_out, plans, bound_s=4.0, duration_s=100.0)

    if ok:
        check()
    else:
        with pytest.raises(invariants.InvariantError, match="not re-planned"):
            check()


@pytest.mark.parametrize(("ettr", "ok"), [(0.0, True), (0.99, True), (1.0, True), (1.01, False), (-0.1, False)])
def test_ettr_lies_in_zero_one(ettr: float, ok: bool) -> None:
    if ok:
        invariants.check_ettr("s", ettr)
    else:
        with pytest.raises(invariants.InvariantError, match="outside"):
            invariants.check_ettr("s", ettr)


def test_no_incident_costs_less_than_nothing() -> None:
    invariants.check_costs("s", [0.0, 5.0, -1e-12])
    with pytest.raises(invariants.InvariantError, match="less than nothing"):
        invariants.check_costs("s", [3.0, -2.0])


def test_a_run_that_skips_a_re_plan_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs on every simulation: a Unicron that forgets to re-plan fails loudly."""
    monkeypatch.setattr(strategies.Unicron, "_reconfigured", lambda self, sim: None)
    cluster = model.workload(128)
    trace = [traces.FailureEvent(100.0, 0, pb.FAILURE_KIND_ECC_ERROR, 600.0)]
    with pytest.raises(invariants.InvariantError, match=r"unicron: a node taken out at t=100\.000 s"):
        runner.simulate_one(cluster, trace, 3600.0, "unicron", _config())


def test_a_run_above_its_failure_free_reference_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """As meta-16k once did (efficiency 1.0116): a reference below what the run trained."""
    real = Sim.run

    def quieter(self: Sim, trace: Any) -> None:
        real(self, trace)
        if not trace:
            self.waf_seconds *= 0.9

    monkeypatch.setattr(Sim, "run", quieter)
    trace = [traces.FailureEvent(3000.0, 0, pb.FAILURE_KIND_CUDA_ERROR, 0.0)]
    with pytest.raises(invariants.InvariantError, match="megatron-cr: trained"):
        runner.simulate_one(model.workload(128), trace, 3600.0, "megatron-cr", _config())


# --- ETTR and re-plans in the results ------------------------------------------------------------


def test_ettr_is_the_gpu_weighted_share_of_time_trained() -> None:
    cluster = model.workload(128)
    quiet = runner.simulate_one(cluster, [], 3600.0, "megatron-cr", _config())
    assert quiet.ettr == 1.0
    # One NCCL timeout on job a (6 of 16 nodes): out for 68 minutes of a day.
    trace = [traces.FailureEvent(1000.0, 0, pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, 0.0)]
    result = runner.simulate_one(cluster, trace, traces.DAY_S, "megatron-cr", _config())
    assert result.ettr_by_job["a-13b"] == pytest.approx(1 - 68 * 60 / traces.DAY_S)
    assert result.ettr == pytest.approx(1 - 68 * 60 / traces.DAY_S * 6 / 16)


def test_unicron_re_plans_every_node_a_failure_took() -> None:
    cluster = model.workload(128)
    trace = [traces.FailureEvent(100.0 * (i + 1), i, pb.FAILURE_KIND_ECC_ERROR, 7200.0) for i in range(4)]
    result = runner.simulate_one(cluster, trace, 3600.0, "unicron", _config())
    assert result.nodes_taken_out == 4
    assert result.replans >= 1 + 4  # the arrival plan and one per node out
