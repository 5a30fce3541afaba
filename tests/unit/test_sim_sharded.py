"""Distributed-optimizer jobs in the simulator: what each transition moves and from where, the
fallbacks when a rank and its buddy are lost together, the buddy copies' cost charged, and the
llama3-405b preset's checkpoint-restart calibrated on Meta's published figure."""

from __future__ import annotations

from typing import Any

import pytest

import unicron_sim as sim
from unicron import jobspec
from unicron.errors import InvalidArgument
from unicron.v1 import common_pb2 as pb
from unicron_sim import llama3, model, runner, sharded, strategies, timings, traces, transitions

TIMINGS = timings.Timings()  # built-in placeholder lines: independent of the committed fit
FIT = TIMINGS.fit
PEER = FIT.lines["restart_peer"].per_byte_s


def _job(dp: int = 4, pipeline: int = 2, replication: int = 0, distributed: bool = True) -> model.JobModel:
    layers, hidden = model.SHAPES["7b"]
    return model.JobModel(
        "j",
        1.0,
        layers,
        hidden,
        pipeline=pipeline,
        min_dp=1,
        max_dp=dp,
        start_dp=dp,
        global_batch=240,
        distributed_optimizer=distributed,
        replication=replication,
    )


def _gpus(job: model.JobModel, dp: int) -> int:
    return job.tensor * job.pipeline * dp


# --- bytes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_slice_gradients_and_shard_are_the_coordinators_state(dp: int) -> None:
    job = _job(dp=8)
    gpus = _gpus(job, dp)
    per_rank = job.parameters / (job.tensor * job.pipeline)
    assert job.slice_bytes_per_rank == pytest.approx(2 * per_rank)
    assert job.shard_bytes_per_rank(gpus) == pytest.approx(12 * per_rank / dp)
    training = jobspec.normalized(job.spec()).training
    assert training.distributed_optimizer and training.precision == "bf16"
    # The 4 bytes of fp32 gradients between them are recomputed, never moved.
    assert job.state_bytes_per_rank(gpus) == pytest.approx(
        job.slice_bytes_per_rank + 4 * per_rank + job.shard_bytes_per_rank(gpus)
    )


@pytest.mark.parametrize(
    ("old", "new", "most"),
    [
        (4, 4, 0.0),
        (4, 2, 0.5),  # the second new rank held none of its range
        (2, 4, 0.25),  # the new ranks receive their whole range; the kept ones less
        (3, 2, 1 / 3),  # the second held [1/3, 2/3) of its [1/2, 1)
        (128, 127, 1 / 127 - 1 / (128 * 127)),  # the last kept rank held a sliver of its new range
    ],
)
def test_a_reshard_receives_only_the_ranges_a_rank_will_own(old: int, new: int, most: float) -> None:
    assert sharded.reshard_fraction(old, new) == pytest.approx(most)


@pytest.mark.parametrize(
    ("position", "dp", "pp", "buddy"), [(0, 4, 2, 6), (1, 4, 2, 7), (2, 4, 2, 0), (5, 4, 2, 3), (1, 2, 1, 0)]
)
def test_a_nodes_buddy_is_its_stage_one_replica_before(position: int, dp: int, pp: int, buddy: int) -> None:
    assert sharded.buddy_position(position, dp, pp) == buddy


# --- where the lost shards come from -------------------------------------------------------------


@pytest.mark.parametrize(
    ("replication", "dp", "lost", "source"),
    [
        (0, 4, {}, "live"),
        (0, 4, {2: False}, "buddy"),  # node of replica 1 lost, replica 0's node holds its copy
        (2, 4, {2: False, 5: False}, "buddy"),  # different stages: each buddy lives
        (0, 4, {2: False, 0: False}, "checkpoint"),  # a rank and its buddy lost together
        (0, 4, {2: True, 0: True}, "snapshot"),  # ... but both nodes live: their snapshots
        (0, 4, {2: True, 0: False}, "checkpoint"),
        (1, 4, {2: False}, "checkpoint"),  # no copies, the node gone
        (1, 4, {2: True}, "snapshot"),  # no copies, the node lives
        (0, 1, {0: True}, "snapshot"),  # no other replica to hold a copy
    ],
)
def test_the_shard_source_follows_what_was_lost(replication: int, dp: int, lost: dict[int, bool], source: str) -> None:
    job = _job(dp=dp, replication=replication)
    assert sharded.shard_source(job, _gpus(job, dp), lost) == source


# --- what each change moves and costs ------------------------------------------------------------


def test_a_restart_moves_the_slice_from_a_peer_and_the_shard_from_the_buddy() -> None:
    job = _job()
    gpus = _gpus(job, 4)
    moved = sharded.moves(job, "restart", gpus, gpus, "buddy")
    assert moved.action == "restart_peer" and moved.lost_iterations == 0.5
    assert moved.bytes == {"slice": job.slice_bytes_per_rank, "buddy": job.shard_bytes_per_rank(gpus)}
    expected = (
        FIT.lines["restart_peer"].fixed_s
        + PEER * (job.slice_bytes_per_rank + job.shard_bytes_per_rank(gpus))
        + FIT.rendezvous_s(gpus)
        + 0.5 * job.iteration_s(gpus)
    )
    assert transitions.seconds(job, "restart", gpus, FIT, before=gpus, source="buddy") == pytest.approx(expected)
    # A third of what the same job's restart moves with a replicated optimizer (16 bytes a parameter).
    assert moved.total_bytes < _job(distributed=False).state_bytes_per_rank(gpus) / 3


@pytest.mark.parametrize(
    ("kind", "old", "new", "source", "action", "pieces"),
    [
        ("migrate", 4, 4, "buddy", "grow", {"slice", "buddy"}),  # a spare replaces a lost node
        ("migrate", 2, 4, "live", "grow", {"slice", "reshard"}),  # grows onto repaired nodes
        ("resize", 4, 2, "buddy", "shrink", {"reshard"}),  # kept ranks reshard from memory
        ("resize", 4, 2, "checkpoint", "checkpoint_restart", {"checkpoint"}),
        ("resize", 4, 2, "snapshot", "checkpoint_restart", {"checkpoint"}),  # a snapshot holds the old layout
        ("restart", 4, 4, "snapshot", "restart_snapshot", {"snapshot"}),
        ("start", 0, 4, "live", "checkpoint_restart", {"checkpoint"}),
        ("reattempt", 4, 4, "live", "reattempt", set()),
    ],
)
def test_each_change_moves_what_it_needs(
    kind: str, old: int, new: int, source: str, action: str, pieces: set[str]
) -> None:
    job = _job()
    moved = sharded.moves(job, kind, _gpus(job, old), _gpus(job, new), source)
    assert moved.action == action
    assert set(moved.bytes) == pieces


def test_a_shrink_moves_the_resharded_bytes_only() -> None:
    job = _job()
    before, after = _gpus(job, 4), _gpus(job, 2)
    moved = sharded.moves(job, "resize", before, after, "buddy")
    assert moved.bytes["reshard"] == pytest.approx(0.5 * job.shard_bytes_per_rank(_gpus(job, 1)))
    seconds = transitions.seconds(job, "resize", after, FIT, before=before, source="buddy")
    assert seconds == pytest.approx(
        FIT.lines["shrink"].fixed_s
        + PEER * moved.bytes["reshard"]
        + FIT.rendezvous_s(after)
        + 0.5 * job.iteration_s(after)
    )


def test_the_fallbacks_lose_the_snapshot_or_checkpoint_interval() -> None:
    job = _job()
    gpus = _gpus(job, 4)
    step = job.iteration_s(gpus)
    held = job.state_bytes_per_rank(gpus)
    snapshot = transitions.seconds(job, "restart", gpus, FIT, before=gpus, source="snapshot")
    assert snapshot == pytest.approx(FIT.seconds("restart_snapshot", held, gpus) + model.SNAPSHOT_EVERY / 2 * step)
    checkpoint = transitions.seconds(job, "migrate", gpus, FIT, before=gpus, source="checkpoint")
    assert checkpoint == pytest.approx(
        FIT.seconds("checkpoint_restart", held, gpus) + job.checkpoint_interval / 2 * step
    )
    buddy = transitions.seconds(job, "migrate", gpus, FIT, before=gpus, source="buddy")
    assert buddy < snapshot < checkpoint


def test_a_replicated_job_is_priced_as_before() -> None:
    job = _job(distributed=False)
    gpus = _gpus(job, 4)
    assert transitions.seconds(job, "restart", gpus, FIT, source="checkpoint") == pytest.approx(
        FIT.seconds("restart_peer", job.state_bytes_per_rank(gpus), gpus) + 0.5 * job.iteration_s(gpus)
    )


# --- the copies' cost ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replication", "dp", "overlapped", "copies"),
    [(0, 4, False, True), (2, 4, False, True), (1, 4, False, False), (0, 1, False, False), (0, 4, True, True)],
)
def test_the_copies_cost_memory_and_iteration_time(replication: int, dp: int, overlapped: bool, copies: bool) -> None:
    job = _job(dp=dp, replication=replication)
    gpus = _gpus(job, dp)
    settings = sharded.BuddySettings(device_to_host_bytes_per_s=40e9, network_bytes_per_s=20e9, overlapped=overlapped)
    shard = job.shard_bytes_per_rank(gpus)
    assert sharded.memory_bytes(job, gpus) == pytest.approx(2 * shard if copies else 0.0)
    copy = shard / 40e9 + shard / 20e9 if copies and not overlapped else 0.0
    assert sharded.copy_s(job, gpus, settings) == pytest.approx(copy)
    step = job.iteration_s(gpus)
    assert sharded.effective_share(job, gpus, settings) == pytest.approx(step / (step + copy))


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_buddy_bandwidths_are_refused(value: float) -> None:
    with pytest.raises(ValueError, match="network_bytes_per_s"):
        sharded.BuddySettings(network_bytes_per_s=value)


def _config(**unicron: Any) -> strategies.StrategyConfig:
    return strategies.StrategyConfig(
        timings=TIMINGS,
        failure_rate_per_node_per_s=traces.meta_rate_per_node(),
        checkpoint=llama3.checkpoint_settings(),
        unicron=strategies.UnicronSettings(**unicron),
    )


LLAMA = llama3.cluster(traces.PRESETS["llama3-405b"].gpus)


def test_unicron_charges_the_copies_in_waf_and_training_time() -> None:
    """With no failure, Unicron trains all the time but the copies' share of each iteration."""
    slow = sharded.BuddySettings(network_bytes_per_s=1e9)  # a slow network makes it visible
    result = runner.simulate_one(LLAMA, [], 3600.0, "unicron", _config(buddy=slow))
    job = LLAMA.jobs[0]
    share = sharded.effective_share(job, job.start_nodes * model.GPUS_PER_NODE, slow)
    assert 0.9 < share < 0.99
    assert result.ettr == pytest.approx(share)
    assert result.waf_seconds == pytest.approx(LLAMA.failure_free_waf() * 3600.0 * share)
    cr = runner.simulate_one(LLAMA, [], 3600.0, "megatron-cr", _config(buddy=slow))
    assert cr.ettr == pytest.approx(1.0)  # keeps no copies, pays nothing


def _ecc(t: float, node: int) -> traces.FailureEvent:
    return traces.FailureEvent(t, node, pb.FAILURE_KIND_ECC_ERROR, 7200.0)


@pytest.mark.parametrize(
    ("trace", "replication", "source"),
    [
        ([_ecc(1000.0, 16)], 0, "buddy"),
        ([_ecc(1000.0, 16), _ecc(1001.0, 17)], 0, "buddy"),  # another stage: both buddies live
        # Node 0 held node 16's copy: lost before the move from it ended, the re-plan falls back.
        ([_ecc(1000.0, 16), _ecc(1001.0, 0)], 0, "checkpoint"),
        ([_ecc(1000.0, 16)], 1, "checkpoint"),  # no copies: the node's snapshot went with it
    ],
)
def test_a_lost_node_heals_from_its_buddy_unless_lost_together(
    trace: list[traces.FailureEvent], replication: int, source: str
) -> None:
    cluster = llama3.cluster(traces.PRESETS["llama3-405b"].gpus, replication=replication)
    result = runner.simulate_one(cluster, trace, 4 * 3600.0, "unicron", _config())
    assert result.counters.get(f"shards from {source}", 0) >= 1, result.counters
    if source == "buddy":
        assert "shards from checkpoint" not in result.counters
    job = cluster.jobs[0]
    gpus = job.start_nodes * model.GPUS_PER_NODE
    lost_s = (1.0 - result.ettr) * 4 * 3600.0
    if source == "buddy":
        assert lost_s < 300.0  # detection, the move onto a spare, half an iteration
    else:
        assert lost_s > job.checkpoint_interval / 2 * job.iteration_s(gpus)  # the checkpoint's recompute


# --- the llama3-405b preset ----------------------------------------------------------------------


def test_the_calibration_spends_what_metas_ninety_percent_leaves() -> None:
    budget = 0.10 * 54 * traces.DAY_S / 419
    assert llama3.LOST_PER_INTERRUPTION_S == pytest.approx(budget)
    assert 18 * 60 < budget < 19 * 60
    settings = llama3.checkpoint_settings()
    total = llama3.mean_detection_s() + settings.requeue_s + settings.setup_s + settings.recompute_s
    assert total == pytest.approx(budget)
    assert 20 * 60 < settings.checkpoint_interval_s < 30 * 60
    assert 40 < llama3.mean_detection_s() < 90  # hangs at the 10-minute timeout, the rest at the poll


def test_the_llama3_preset_is_one_405b_job_on_16384_gpus() -> None:
    (job,) = LLAMA.jobs
    assert (job.tensor, job.pipeline, job.start_dp) == (8, 16, 128)
    assert job.start_nodes * model.GPUS_PER_NODE == 16_384
    assert job.global_batch * model.SEQ_LENGTH == 2048 * 8192  # 16M tokens
    assert 400e9 < job.parameters < 415e9
    assert job.distributed_optimizer and job.buddy_copies
    assert LLAMA.nodes - job.start_nodes == traces.LLAMA3_SPARE_NODES
    jobspec.normalized(job.spec())


def test_checkpoint_restart_on_the_llama3_preset_lands_near_metas_figure() -> None:
    outcome = sim.run(sim.Scenario(preset="llama3-405b", strategies=("megatron-cr",)))
    hits = sum(1 for e in outcome.trace if e.node < llama3.JOB_NODES)
    assert 380 < hits < 460  # about 419 on the job's nodes
    (result,) = outcome.results
    assert result.ettr == pytest.approx(0.90, abs=0.015)


def test_a_scenario_refuses_a_bad_replication() -> None:
    with pytest.raises(InvalidArgument, match="replication"):
        sim.Scenario(preset="llama3-405b", replication=3)


@pytest.mark.parametrize(("preset", "sharded_jobs"), [("high-failure-128", False), ("meta-16k", True)])
def test_presets_say_whether_their_jobs_shard_the_optimizer(preset: str, sharded_jobs: bool) -> None:
    cluster, *_ = sim.prepare(sim.Scenario(preset=preset, days=0.01))
    assert {j.distributed_optimizer for j in cluster.jobs} == {sharded_jobs}
    off, *_ = sim.prepare(sim.Scenario(preset=preset, days=0.01, distributed_optimizer=False))
    assert not any(j.distributed_optimizer for j in off.jobs)
