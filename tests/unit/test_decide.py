from __future__ import annotations

import pytest

from services.coordinator import decide, state
from unicron import jobspec
from unicron.v1 import common_pb2, planner_service_pb2


def node(node_id: str, beat: float, node_state: int = common_pb2.NODE_STATE_READY, slots: int = 4) -> common_pb2.Node:
    out = common_pb2.Node(node_id=node_id, address=f"10.0.0.{len(node_id)}:1", slots=slots, state=node_state)  # type: ignore[arg-type]
    out.last_heartbeat.FromNanoseconds(int(beat * 1e9))
    return out


@pytest.mark.parametrize(
    ("beat", "node_state", "lost"),
    [
        (99.0, common_pb2.NODE_STATE_READY, False),  # 1 s ago
        (97.0, common_pb2.NODE_STATE_READY, False),  # exactly the timeout: not yet
        (96.9, common_pb2.NODE_STATE_READY, True),
        (10.0, common_pb2.NODE_STATE_LOST, False),  # already lost: not lost again
    ],
)
def test_lost_nodes(beat: float, node_state: int, lost: bool) -> None:
    assert decide.lost_nodes(100.0, [node("n", beat, node_state)], timeout_s=3.0) == (["n"] if lost else [])


def test_a_restarted_coordinator_gives_nodes_a_full_timeout() -> None:
    silent_since_outage = node("n", 50.0)
    assert decide.lost_nodes(100.0, [silent_since_outage], timeout_s=3.0, observing_since=98.0) == []
    assert decide.lost_nodes(101.5, [silent_since_outage], timeout_s=3.0, observing_since=98.0) == ["n"]


def spec(tensor: int = 1, data: int = 2) -> common_pb2.JobSpec:
    return jobspec.with_defaults(jobspec.spec_from_dict({"parallelism": {"tensor": tensor, "data": data}}))


def test_assignment_keeps_tp_groups_contiguous_per_node() -> None:
    nodes = {"a": node("a", 0), "bb": node("bb", 0)}
    assignment = decide.assignment_for(spec(tensor=2, data=3), {"a": 2, "bb": 4}, nodes, generation=3)
    assert [(w.node_id, list(w.ranks)) for w in assignment.workers] == [("bb", [0, 1, 2, 3]), ("a", [4, 5])]
    assert assignment.world_size == 6 and assignment.data_parallel == 3 and assignment.generation == 3
    assert assignment.master_addr == "10.0.0.2"


def test_plan_request_lets_running_jobs_move_and_marks_hit_ones() -> None:
    running = common_pb2.Job(job_id="r", spec=spec(), state=state.RUNNING)
    running.assignment.workers.add(node_id="a", ranks=[0, 1])
    moving = common_pb2.Job(job_id="m", spec=spec(), state=state.RECOVERING)
    moving.assignment.workers.add(node_id="b", ranks=[0, 1])
    pending = common_pb2.Job(job_id="p", spec=spec(), state=state.PENDING)
    done = common_pb2.Job(job_id="d", spec=spec(), state=state.SUCCEEDED)
    nodes = [node("a", 0), node("b", 0, common_pb2.NODE_STATE_LOST)]
    jobs_in = [running, moving, pending, done]
    hit = decide.hit_jobs(jobs_in, nodes)
    assert hit == {"m"}
    request = decide.plan_request(jobs_in, nodes, 1e-6, 1.0, hit)
    jobs = {j.job_id: j for j in request.jobs}
    assert set(jobs) == {"r", "m", "p"}
    assert not jobs["r"].pinned and dict(jobs["r"].current) == {"a": 2} and not jobs["r"].hit_by_failure
    assert not jobs["r"].preemptible  # running jobs are paused only when their spec allows it
    assert jobs["m"].hit_by_failure and dict(jobs["m"].current) == {"b": 2}
    assert jobs["p"].preemptible and not jobs["p"].pinned and not jobs["p"].current
    assert [n.healthy for n in request.nodes] == [True, False]


def _job_on_a(job_state: int, remedy: int = 0, generation: int = 0, resumed: bool = False) -> common_pb2.Job:
    job = common_pb2.Job(job_id="j", spec=spec(), state=job_state)  # type: ignore[arg-type]
    job.assignment.workers.add(node_id="a", ranks=[0, 1])
    if remedy:
        attempt = job.remedies.add(remedy=remedy, generation=generation)
        if resumed:
            attempt.resumed.FromSeconds(1)
    return job


@pytest.mark.parametrize(
    ("job", "node_state", "hit"),
    [
        (_job_on_a(state.RUNNING), common_pb2.NODE_STATE_READY, False),
        (_job_on_a(state.RUNNING), common_pb2.NODE_STATE_LOST, True),
        (_job_on_a(state.RUNNING), common_pb2.NODE_STATE_ISOLATED, True),
        (_job_on_a(state.SUCCEEDED), common_pb2.NODE_STATE_LOST, False),
        # A reconfiguration waits for the re-plan, even when its node is back (agent restarted).
        (_job_on_a(state.RECOVERING, common_pb2.REMEDY_RECONFIGURE), common_pb2.NODE_STATE_READY, True),
        # ... but not once the re-plan gave it a generation, or training resumed.
        (_job_on_a(state.RECOVERING, common_pb2.REMEDY_RECONFIGURE, generation=3), common_pb2.NODE_STATE_READY, False),
        (_job_on_a(state.RECOVERING, common_pb2.REMEDY_RESTART, generation=3), common_pb2.NODE_STATE_READY, False),
        (_job_on_a(state.RUNNING, common_pb2.REMEDY_RECONFIGURE, resumed=True), common_pb2.NODE_STATE_READY, False),
    ],
)
def test_hit_jobs(job: common_pb2.Job, node_state: int, hit: bool) -> None:
    assert decide.hit_jobs([job], [node("a", 0, node_state)]) == ({"j"} if hit else set())


def _plan(*plans: tuple[str, dict[str, int]]) -> planner_service_pb2.PlanResponse:
    reply = planner_service_pb2.PlanResponse(status=planner_service_pb2.SOLVE_STATUS_OPTIMAL)
    for job_id, slots in plans:
        reply.jobs.add(job_id=job_id, slots_by_node=slots, size=sum(slots.values()), reason="why")
    return reply


def test_plan_changes_start_move_pause_keep() -> None:
    def job(job_id: str, job_state: int, slots: dict[str, int]) -> common_pb2.Job:
        out = common_pb2.Job(job_id=job_id, spec=spec(), state=job_state)  # type: ignore[arg-type]
        rank = 0
        for node_id, count in slots.items():
            out.assignment.workers.add(node_id=node_id, ranks=range(rank, rank + count))
            rank += count
        return out

    jobs = [
        job("kept", state.RUNNING, {"a": 2}),
        job("hit", state.RECOVERING, {"b": 2}),
        job("shrunk", state.RUNNING, {"c": 4}),
        job("paused", state.RUNNING, {"d": 2}),
        job("started", state.PENDING, {}),
        job("waiting", state.PENDING, {}),
    ]
    reply = _plan(
        ("kept", {"a": 2}),
        ("hit", {"e": 2}),
        ("shrunk", {"c": 2, "e": 0}),
        ("paused", {}),
        ("started", {"d": 2}),
        ("waiting", {}),
    )
    changes = {c.job_id: c for c in decide.plan_changes(jobs, reply, hit={"hit"})}
    assert {k: c.kind for k, c in changes.items()} == {
        "hit": "move",
        "shrunk": "move",
        "paused": "pause",
        "started": "start",
    }
    assert changes["shrunk"].slots == {"c": 2}


def test_overdue_workers_and_stalled_recoveries() -> None:
    job = common_pb2.Job(job_id="j", spec=spec(), state=state.RECOVERING)
    job.assignment.generation = 2
    job.workers.append(state.new_worker("a", 2, now=10.0, deadline=20.0, reason="start"))
    job.workers.append(state.new_worker("b", 1, now=10.0, deadline=15.0, reason="old generation"))
    attempt = job.remedies.add(remedy=common_pb2.REMEDY_RESTART, generation=2)
    attempt.started.FromSeconds(10)
    assert decide.overdue_workers(19.0, [job]) == []
    assert decide.overdue_workers(21.0, [job]) == [("j", "a")]
    assert decide.stalled_recoveries(100.0, [job], 120.0) == []
    assert decide.stalled_recoveries(131.0, [job], 120.0) == ["j"]
    attempt.resumed.FromSeconds(40)
    assert decide.stalled_recoveries(131.0, [job], 120.0) == []


def test_used_slots_counts_active_jobs_only() -> None:
    active = common_pb2.Job(job_id="x", state=state.RUNNING)
    active.assignment.workers.add(node_id="a", ranks=[0, 1])
    ended = common_pb2.Job(job_id="y", state=state.FAILED)
    ended.assignment.workers.add(node_id="a", ranks=[0])
    assert decide.used_slots([active, ended]) == {"a": 2}


def placed(job_id: str, generation: int, **ranks: list[int]) -> common_pb2.Job:
    job = common_pb2.Job(job_id=job_id, spec=spec(), state=state.RUNNING)
    job.assignment.generation = generation
    for node_id, node_ranks in ranks.items():
        job.assignment.workers.add(node_id=node_id, ranks=node_ranks)
    job.assignment.world_size = sum(len(r) for r in ranks.values())
    return job


@pytest.mark.parametrize(
    ("waiting", "gone", "unreachable", "expected"),
    [
        ({0, 1, 3}, {2}, set(), {0: 0, 1: 1, 3: 3}),  # rank 2 died, its peers wait: keep them
        # Rank 3 has not answered: its collective breaks as its peers leave the old group.
        ({0, 1}, {2}, set(), {0: 0, 1: 1, 3: 3}),
        ({0, 1, 2, 3}, set(), set(), None),  # nobody died: a reattempt's business
        (set(), {0, 1, 2, 3}, set(), None),  # nobody left to share the state
        # Node b cannot be reached: its ranks are gone, and rank 1 must have answered, since
        # a live rank behind b could hold its collective until the timeout.
        ({0, 1}, set(), {"b"}, {0: 0, 1: 1}),
        ({0}, set(), {"b"}, None),
    ],
)
def test_survivor_map(
    waiting: set[int], gone: set[int], unreachable: set[str], expected: dict[int, int] | None
) -> None:
    job = placed("j", 1, a=[0, 1], b=[2, 3])
    new = placed("j", 2, a=[0, 1], b=[2, 3]).assignment
    assert decide.survivor_map(job, new, waiting, gone, frozenset(unreachable)) == expected


def test_survivor_map_keeps_model_parallel_ranks_with_their_shards() -> None:
    job = placed("j", 1, a=[0, 1], b=[2, 3])
    job.spec.parallelism.tensor = 2  # DP 2: ranks 0 and 2 hold tensor shard 0, 1 and 3 shard 1
    assert decide.survivor_map(job, job.assignment, {0, 1, 3}, {2}) == {0: 0, 1: 1, 3: 3}
    shrunk = placed("j", 2, b=[0, 1]).assignment  # node a lost: b's ranks go on as the one replica
    assert decide.survivor_map(job, shrunk, {2, 3}, {0, 1}) == {2: 0, 3: 1}


def _pipelined(**ranks: list[int]) -> common_pb2.Job:
    job = placed("j", 1, **ranks)
    job.spec.parallelism.pipeline = 2
    return job


@pytest.mark.parametrize(
    ("old", "slots", "order", "kept"),
    [
        # PP 2 x DP 2 -> DP 1: z, y held stage 0 and x, w stage 1; y and w stay. By name w
        # would come first and take stage 0: both would hold the wrong shard.
        ({"z": [0], "y": [1], "x": [2], "w": [3]}, {"y": 1, "w": 1}, ["y", "w"], {1: 0, 3: 1}),
        # DP 1 -> 2: each stage keeps its node and gains a new one.
        ({"a": [0], "b": [1]}, {"a": 1, "b": 1, "c": 1, "d": 1}, ["a", "c", "b", "d"], {0: 0, 1: 2}),
        # Two ranks a node: the node keeps its stage, the new one takes the other.
        ({"a": [0, 1], "b": [2, 3]}, {"b": 2, "c": 2}, ["c", "b"], {2: 2, 3: 3}),
    ],
)
def test_a_model_parallel_job_resized_keeps_each_node_on_its_pipeline_stage(
    old: dict[str, list[int]], slots: dict[str, int], order: list[str], kept: dict[int, int]
) -> None:
    job = _pipelined(**old)
    nodes = {n: node(n, 0) for n in "abcdwxyz"}
    new = decide.assignment_for(job.spec, slots, nodes, 2, job.assignment)
    assert [w.node_id for w in new.workers] == order
    assert decide.kept_in_place(job, new, set()) == kept


def test_a_rank_is_not_kept_where_the_new_layout_gives_it_another_shard() -> None:
    job = _pipelined(a=[0], b=[1], c=[2], d=[3])  # a, b: stage 0; c, d: stage 1
    swapped = placed("j", 2, c=[0], a=[1]).assignment  # c now stage 0, a stage 1
    assert decide.kept_in_place(job, swapped, set()) is None


def test_a_shrink_after_a_node_is_isolated_keeps_the_survivors_renumbered() -> None:
    job = placed("j", 1, a=[0], b=[1], c=[2])
    shrunk = placed("j", 2, b=[0], c=[1]).assignment  # node a isolated, ranks renumbered
    assert decide.survivor_map(job, shrunk, {1, 2}, {0}) == {1: 0, 2: 1}


@pytest.mark.parametrize(
    ("new_ranks", "expected"),
    [
        ({"a": [0], "b": [1], "c": [2]}, {0: 0, 1: 1}),  # grow onto c: a and b stay, c starts
        ({"b": [0]}, {1: 0}),  # shrink off a: b goes on as rank 0
        ({"a": [0, 1], "b": [2, 3]}, {0: 0, 1: 2}),  # more ranks per node
        ({"c": [0], "d": [1]}, None),  # moved off every node it had: nothing kept
    ],
)
def test_live_map_keeps_a_healthy_jobs_ranks_on_the_nodes_it_keeps(
    new_ranks: dict[str, list[int]], expected: dict[int, int] | None
) -> None:
    job = placed("j", 1, a=[0], b=[1])
    assert decide.live_map(job, placed("j", 2, **new_ranks).assignment) == expected


def test_live_map_only_for_a_job_that_is_simply_training() -> None:
    job = placed("j", 1, a=[0], b=[1])
    job.state = state.RECOVERING
    assert decide.live_map(job, placed("j", 2, a=[0]).assignment) is None
    job.state = state.RUNNING
    assert decide.live_map(job, placed("j", 2, a=[0]).assignment) == {0: 0}


def test_a_joining_rank_fetches_its_own_shard_of_the_state_from_a_peer() -> None:
    job = common_pb2.Job(job_id="j", spec=spec(), state=state.PENDING)
    job.spec.parallelism.tensor, job.spec.parallelism.pipeline = 2, 2
    job.spec.estimate.parameters, job.spec.estimate.tokens_per_step = 1.5e6, 512
    (plan_job,) = decide.plan_request([job], [node("a", 0)], 1e-6, 1.0).jobs
    assert plan_job.estimate.parameters == 1.5e6 and plan_job.estimate.tokens_per_step == 512
    whole = 1.5e6 * jobspec.STATE_BYTES_PER_PARAMETER
    assert plan_job.transition.state_bytes == pytest.approx(whole / 4)
    assert plan_job.transition.bandwidth_bytes_per_second == jobspec.STATE_TRANSFER_BYTES_PER_S


@pytest.mark.parametrize(
    ("declared", "iteration", "tokens", "flops_per_s", "seconds", "want"),
    [
        ((2e6, 1e4), 0, 0, 0.0, 0.0, (2e6, 1e4)),  # declared in the spec
        ((0.0, 0.0), 4, 4096, 6e9 * 1024 / 0.5, 0.5, (1e9, 1024)),  # measured by the iterations
        ((0.0, 0.0), 0, 0, 0.0, 0.0, (0.0, 0.0)),  # neither: the planner's per-slot rate
    ],
)
def test_estimate_is_declared_or_measured(
    declared: tuple[float, float], iteration: int, tokens: int, flops_per_s: float, seconds: float, want: tuple
) -> None:
    job = common_pb2.Job(job_id="j", spec=spec())
    job.spec.estimate.parameters, job.spec.estimate.tokens_per_step = declared
    job.progress.iteration, job.progress.tokens = iteration, tokens
    job.progress.flops_per_second, job.progress.iteration_seconds = flops_per_s, seconds
    assert decide.estimate_of(job) == pytest.approx(want)


def _rendezvous(addr: str, port: int, job_state: int = common_pb2.JOB_STATE_RUNNING) -> common_pb2.Job:
    job = common_pb2.Job(state=job_state)  # type: ignore[arg-type]
    job.assignment.master_addr, job.assignment.master_port = addr, port
    return job


@pytest.mark.parametrize(
    ("jobs", "exclude", "expected"),
    [
        ([], 0, 29500),
        ([_rendezvous("10.0.0.1", 29500)], 0, 29501),  # taken on that host
        ([_rendezvous("10.0.0.2", 29500)], 0, 29500),  # another host's port is no concern
        ([_rendezvous("10.0.0.1", 29500, common_pb2.JOB_STATE_SUCCEEDED)], 0, 29500),  # ended: free again
        ([_rendezvous("10.0.0.1", 29501)], 29500, 29502),  # the job's own old port is not reused
    ],
)
def test_unused_rendezvous_port(jobs: list[common_pb2.Job], exclude: int, expected: int) -> None:
    assert decide.unused_rendezvous_port("10.0.0.1", jobs, exclude=exclude) == expected


def test_no_rendezvous_port_left() -> None:
    jobs = [_rendezvous("10.0.0.1", 29500), _rendezvous("10.0.0.1", 29501)]
    assert decide.unused_rendezvous_port("10.0.0.1", jobs, ports=range(29500, 29502)) is None


def test_a_quiet_node_keeps_its_ranks_and_takes_no_new_ones() -> None:
    running = common_pb2.Job(job_id="r", spec=spec(), state=state.RUNNING)
    running.assignment.workers.add(node_id="a", ranks=[0])
    nodes = [node("a", 0), node("b", 0), node("c", 0)]
    request = decide.plan_request([running], nodes, 1e-6, 1.0, quiet=["a", "b"])
    assert {n.node_id: n.slots for n in request.nodes} == {"a": 1, "b": 0, "c": 4}
    assert all(n.healthy for n in request.nodes)  # nothing must move off them yet


def test_hit_jobs_may_pause_when_no_plan_keeps_them_running() -> None:
    request = planner_service_pb2.PlanRequest()
    request.jobs.add(job_id="hit", hit_by_failure=True)
    request.jobs.add(job_id="hit-pinned", hit_by_failure=True, pinned=True)
    request.jobs.add(job_id="hit-preemptible", hit_by_failure=True, preemptible=True)
    request.jobs.add(job_id="healthy")
    relaxed = decide.hit_jobs_may_pause(request)
    assert relaxed is not None
    assert {job.job_id: job.preemptible for job in relaxed.jobs} == {
        "hit": True,
        "hit-pinned": False,
        "hit-preemptible": True,
        "healthy": False,
    }
    assert not request.jobs[0].preemptible  # the original request is left as it was
    del request.jobs[0]
    assert decide.hit_jobs_may_pause(request) is None  # nothing to relax: the answer stands


@pytest.mark.parametrize(
    ("precision", "optimizer", "per_parameter"),
    [("", "", 16), ("fp32", "adam", 16), ("bf16", "adam", 18), ("fp16", "adam", 18), ("bf16", "sgd", 14)],
)
def test_state_bytes_follow_the_jobs_precision_and_optimizer(
    precision: str, optimizer: str, per_parameter: int
) -> None:
    job = common_pb2.Job(job_id="j", spec=spec(), state=state.PENDING)
    job.spec.training.precision, job.spec.training.optimizer = precision, optimizer
    job.spec.estimate.parameters, job.spec.estimate.tokens_per_step = 1e6, 512
    (plan_job,) = decide.plan_request([job], [node("a", 0)], 1e-6, 1.0).jobs
    assert plan_job.transition.state_bytes == pytest.approx(1e6 * per_parameter)


@pytest.mark.parametrize(("precision", "min_data", "per_parameter"), [("bf16", 1, 18), ("bf16", 4, 9), ("fp32", 2, 12)])
def test_distributed_optimizer_state_bytes_are_sharded_over_data_parallel(
    precision: str, min_data: int, per_parameter: float
) -> None:
    job = common_pb2.Job(job_id="j", spec=spec(), state=state.PENDING)
    job.spec.training.precision, job.spec.training.distributed_optimizer = precision, True
    job.spec.parallelism.min_data, job.spec.parallelism.max_data = min_data, max(min_data, 4)
    job.spec.estimate.parameters, job.spec.estimate.tokens_per_step = 1e6, 512
    (plan_job,) = decide.plan_request([job], [node("a", 0)], 1e-6, 1.0).jobs
    # bf16: parameters 2 + gradients 4 + (main 4 + moments 8) / DP; fp32: 4 + 4 + 8 / DP.
    assert plan_job.transition.state_bytes == pytest.approx(1e6 * per_parameter)


def _waiting(tensor: int, data: int, min_data: int = 0) -> common_pb2.Job:
    job = common_pb2.Job(job_id="waits", state=state.PENDING)
    job.spec.parallelism.tensor, job.spec.parallelism.data, job.spec.parallelism.min_data = tensor, data, min_data
    return job


def _running(job_id: str, slots: dict[str, int]) -> common_pb2.Job:
    job = common_pb2.Job(job_id=job_id, state=state.RUNNING)
    for node_id, count in slots.items():
        job.assignment.workers.add(node_id=node_id, ranks=list(range(count)))
    return job


@pytest.mark.parametrize(
    ("job", "others", "reason"),
    [
        # Four slots in use of eight: a job of six waits, saying for what.
        (
            _waiting(1, 6),
            [_running("a", {"n1": 3, "n2": 1})],
            "waiting for 6 free slots (tensor 1 x pipeline 1 x data 6): 4 free now",
        ),
        # Three free slots on n1 and one on n2 hold one group of 2: a TP 2 x DP 2 job waits.
        (
            _waiting(2, 2),
            [_running("a", {"n1": 1, "n2": 3})],
            "waiting for 4 free slots (tensor 2 x pipeline 1 x data 2, in tensor-parallel groups of 2 on one node):"
            " 2 free now",
        ),
        # Its smallest size counts, and when that fits the planner's reason is given.
        (
            _waiting(1, 8, min_data=2),
            [_running("a", {"n1": 2, "n2": 2})],
            "waiting: 4 slots are free (2 needed) but the planner left the job out (lower priority)",
        ),
    ],
)
def test_a_waiting_job_says_what_it_waits_for(job: common_pb2.Job, others: list[common_pb2.Job], reason: str) -> None:
    nodes = [node("n1", 0.0), node("n2", 0.0), node("n3", 0.0, common_pb2.NODE_STATE_LOST)]
    assert decide.waiting_reason(job, nodes, decide.used_slots(others), "lower priority") == reason
