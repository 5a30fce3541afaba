"""The coordinator's pure parts by tables of cases (intake, remedies, the plan step, the
re-plan schedule), and the whole coordinator on the in-memory store with the real solver
in-process: no Redis, no gRPC, the clock in the test's hands."""

from __future__ import annotations

import pytest

from services.coordinator import decide, incidents, intake, ladder, links, remedies, replan, state
from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.memory_store import MemoryStore
from services.coordinator.reports import learned_throughput
from services.planner import solver
from services.planner.server import Limits, request_from_proto, result_to_proto
from unicron import jobspec
from unicron.v1 import common_pb2 as pb
from unicron.v1 import node_service_pb2, planner_service_pb2

NOW = 1_800_000_000.0
RESET, EXIT, SOFTWARE = pb.FAILURE_KIND_CONNECTION_RESET, pb.FAILURE_KIND_PROCESS_EXIT, pb.FAILURE_KIND_SOFTWARE_ERROR
EXCEPTION, SUPERVISION = pb.DETECTION_SOURCE_EXCEPTION, pb.DETECTION_SOURCE_PROCESS_SUPERVISION


def report(kind: int, rank: int, source: int = EXCEPTION, generation: int = 1) -> pb.FailureReport:
    out = pb.FailureReport(job_id="j", generation=generation, rank=rank, node_id="n1", kind=kind, source=source)  # type: ignore[arg-type]
    out.first_seen.FromNanoseconds(int(NOW * 1e9))
    return out


def incident_of(*reports: pb.FailureReport, remedy: int = pb.REMEDY_UNSPECIFIED) -> pb.Incident:
    incident = None
    for r in reports:
        incident = incidents.merge(incident, r, NOW, "inc-1")
    assert incident is not None
    incident.remedy = remedy  # type: ignore[assignment]
    return incident


# ---- intake -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reports", "remedy", "created", "world", "route"),
    [
        # A network error alone waits for the peers (or the rank whose death it echoes).
        ([report(RESET, 0)], pb.REMEDY_UNSPECIFIED, True, 2, intake.Route.HOLD),
        # Every rank accounted for: decide at once.
        ([report(RESET, 0), report(EXIT, 1, SUPERVISION)], pb.REMEDY_UNSPECIFIED, False, 2, intake.Route.RESPOND),
        # A rank's own error is no echo: decide at once.
        ([report(SOFTWARE, 0)], pb.REMEDY_UNSPECIFIED, True, 2, intake.Route.RESPOND),
        # A reattempt under way, and a rank's exit shows it cannot work: decide again.
        ([report(RESET, 0), report(EXIT, 1, SUPERVISION)], pb.REMEDY_REATTEMPT, False, 2, intake.Route.RESPOND),
        # A restart under way: the late reports only join it.
        ([report(RESET, 0), report(EXIT, 1, SUPERVISION)], pb.REMEDY_RESTART, False, 2, intake.Route.IGNORE),
        ([report(pb.FAILURE_KIND_STRAGGLER, 1)], pb.REMEDY_UNSPECIFIED, True, 2, intake.Route.IGNORE),
    ],
)
def test_what_a_recorded_report_does(
    reports: list[pb.FailureReport], remedy: int, created: bool, world: int, route: intake.Route
) -> None:
    verdict = intake.route(incident_of(*reports, remedy=remedy), created, world)
    assert verdict.route == route and verdict.reason


HANG = pb.FAILURE_KIND_TASK_HANG
STATISTICAL = pb.DETECTION_SOURCE_STATISTICAL


@pytest.mark.parametrize(
    ("silent", "route"),
    [
        (frozenset(), intake.Route.RESPOND),  # a hang of its own: restart it
        (frozenset({"n1"}), intake.Route.HOLD),  # a node of the job is silent: its verdict first
    ],
)
def test_a_hang_waits_for_a_silent_nodes_heartbeat_verdict(silent: frozenset[str], route: intake.Route) -> None:
    hang = report(HANG, 0, STATISTICAL)
    assert intake.route(incident_of(hang), True, 2, silent).route == route


def test_a_held_hang_is_decided_once_its_node_beats_or_is_lost() -> None:
    held = incident_of(report(HANG, 0, STATISTICAL))
    assert not intake.hold_is_over(held, NOW + 1.0, frozenset({"n1"}), heartbeat_timeout_s=3.0)
    assert intake.hold_is_over(held, NOW + 1.0, frozenset(), heartbeat_timeout_s=3.0)  # it beat again
    assert intake.hold_is_over(held, NOW + 4.0, frozenset({"n1"}), heartbeat_timeout_s=3.0)  # the bound
    # The node's loss, when it joins, is the root cause, whichever was seen first.
    lost = report(pb.FAILURE_KIND_NODE_LOST, 0, pb.DETECTION_SOURCE_HEARTBEAT)
    lost.ClearField("rank")
    lost.first_seen.FromNanoseconds(int((NOW + 0.5) * 1e9))
    assert incident_of(report(HANG, 0, STATISTICAL), lost).kind == pb.FAILURE_KIND_NODE_LOST


def test_a_hang_waits_for_every_nodes_account() -> None:
    named = report(HANG, 0, STATISTICAL)
    named.unreachable_peers.append("n2")
    assert intake.route(incident_of(named), True, 2, accounts_pending=True).route == intake.Route.HOLD
    held = incident_of(named)
    assert not intake.hold_is_over(held, NOW + links.LINK_HOLD_S / 2, accounts_pending=True)
    assert intake.hold_is_over(held, NOW + links.LINK_HOLD_S / 2, accounts_pending=False)  # all in
    assert intake.hold_is_over(held, NOW + links.LINK_HOLD_S, accounts_pending=True)  # the bound


def test_a_held_incident_is_decided_after_its_hold() -> None:
    held = incident_of(report(RESET, 0))
    assert not intake.hold_is_over(held, NOW + incidents.DECISION_HOLD_S / 2)
    assert intake.hold_is_over(held, NOW + incidents.DECISION_HOLD_S)
    held.remedy = pb.REMEDY_REATTEMPT
    assert not intake.hold_is_over(held, NOW + 1)


def test_a_late_report_joins_an_open_incident_but_opens_none() -> None:
    update = intake.merge_update(report(RESET, 0), NOW, create=False)
    with pytest.raises(intake.NoOpenIncident):
        update(None)
    joined = update(incident_of(report(EXIT, 1, SUPERVISION)))
    assert len(joined.reports) == 2 and joined.incident_id == "inc-1"
    opened = intake.merge_update(report(RESET, 0), NOW, new_id=lambda: "inc-new")(None)
    assert opened.incident_id == "inc-new" and opened.traceparent


# ---- remedies -----------------------------------------------------------------------------


def running_job(world: int = 2, generation: int = 1) -> pb.Job:
    job = pb.Job(job_id="j", spec=jobspec.with_defaults(jobspec.spec_from_dict({"name": "j"})), state=state.RUNNING)
    job.assignment.generation = generation
    job.assignment.world_size = world
    job.assignment.master_addr, job.assignment.master_port = "127.0.0.1", 29500
    job.assignment.workers.add(node_id="n1", ranks=list(range(world)))
    job.workers.append(state.new_worker("n1", generation, NOW - 10, 0, "started"))
    state.move_worker(job.workers[0], state.WORKER_RUNNING, NOW - 9, "running")
    return job


def inputs(job: pb.Job, remedy: int | None) -> remedies.Inputs:
    assignment = None
    if remedy == pb.REMEDY_REATTEMPT:
        assignment = remedies.reattempt_assignment(job, NOW, master_port=29777)
    elif remedy == pb.REMEDY_RESTART:
        assignment = pb.Assignment()
        assignment.CopyFrom(job.assignment)
        assignment.generation += 1
    return remedies.Inputs(NOW, 15.0, frozenset(), True, assignment)


@pytest.mark.parametrize(
    ("remedy", "reports", "job_state", "generation", "commands"),
    [
        # Same ranks, same places, a new group on a new port: one reform command.
        (pb.REMEDY_REATTEMPT, [report(RESET, 0), report(RESET, 1)], state.RECOVERING, 2, ["reform"]),
        # Rank 1 died, rank 0 waits: rank 1 alone restarts, in a reform.
        (pb.REMEDY_RESTART, [report(RESET, 0), report(EXIT, 1, SUPERVISION)], state.RECOVERING, 2, ["reform"]),
        # Both gone: stop and start every rank.
        (
            pb.REMEDY_RESTART,
            [report(EXIT, 0, SUPERVISION), report(EXIT, 1, SUPERVISION)],
            state.RECOVERING,
            2,
            ["stop_workers", "start_workers"],
        ),
        # The re-plan moves the job: no command yet, the generation stays.
        (pb.REMEDY_RECONFIGURE, [report(pb.FAILURE_KIND_ECC_ERROR, 0)], state.RECOVERING, 1, []),
        # The ladder gave up: the job fails, its ranks are stopped.
        (None, [report(SOFTWARE, 0)], state.FAILED, 1, ["stop_workers"]),
    ],
)
def test_a_remedy_is_one_write(
    remedy: int | None, reports: list[pb.FailureReport], job_state: int, generation: int, commands: list[str]
) -> None:
    job = running_job()
    incident = incident_of(*reports)
    written = remedies.write(job, incident, ladder.Decision(remedy, "as the table says"), inputs(job, remedy))
    assert written is not None
    assert job.state == job_state and job.assignment.generation == generation
    assert [command.WhichOneof("command") for _, command in written.commands] == commands
    # Only a stop that ends the job frees its snapshots; a restart needs them.
    ended = [c.stop_workers.job_ended for _, c in written.commands if c.WhichOneof("command") == "stop_workers"]
    assert ended == [job_state == state.FAILED] * len(ended)
    assert len(job.remedies) == (0 if remedy is None else 1)
    if remedy == pb.REMEDY_REATTEMPT:
        assert job.assignment.master_port == 29777 and job.remedies[0].generation == 2
    assert all(command.traceparent == incident.traceparent for _, command in written.commands if remedy)


def test_a_remedy_for_a_generation_that_is_over_writes_nothing() -> None:
    job = running_job(generation=3)
    decision = ladder.Decision(pb.REMEDY_REATTEMPT, "old news")
    assert remedies.write(job, incident_of(report(RESET, 0)), decision, inputs(job, pb.REMEDY_REATTEMPT)) is None
    assert job.state == state.RUNNING and not job.remedies


def test_a_regroup_without_its_assignment_is_refused() -> None:
    job = running_job()
    with pytest.raises(ValueError, match="next assignment"):
        remedies.write(job, incident_of(report(RESET, 0)), ladder.Decision(pb.REMEDY_RESTART, "x"), inputs(job, None))


# ---- the plan step ------------------------------------------------------------------------


def next_assignment(job: pb.Job, slots: dict[str, int]) -> pb.Assignment:
    nodes = {n: pb.Node(node_id=n, address=f"10.0.0.{i + 1}:7000", slots=4) for i, n in enumerate(sorted(slots))}
    assignment = decide.assignment_for(job.spec, slots, nodes, job.assignment.generation + 1)
    assignment.master_port = 29600
    return assignment


@pytest.mark.parametrize(
    ("kind", "job_state", "rank_map", "after", "commands"),
    [
        # One command per node of the new assignment (n1 and n2).
        ("start", state.PENDING, None, state.SCHEDULED, ["start_workers", "start_workers"]),
        ("start", state.RUNNING, None, state.RUNNING, None),  # no longer pending: nothing
        ("pause", state.RUNNING, None, state.PENDING, ["stop_workers"]),
        ("move", state.RUNNING, None, state.RECOVERING, ["stop_workers", "start_workers", "start_workers"]),
        ("move", state.RUNNING, {0: 0}, state.RECOVERING, ["reform", "reform"]),
        ("move", state.CANCELLED, None, state.CANCELLED, None),
    ],
)
def test_a_plan_change_is_one_write(
    kind: str, job_state: int, rank_map: dict[int, int] | None, after: int, commands: list[str] | None
) -> None:
    job = running_job(world=1)
    job.state = job_state  # type: ignore[assignment]
    slots = {} if kind == "pause" else {"n1": 1, "n2": 1}
    change = decide.Change("j", kind, slots, "the solver's reason")
    assignment = None if kind == "pause" else next_assignment(job, slots)
    given = replan.StepInputs(NOW, "a test", 15.0, frozenset(), assignment, rank_map)
    written = replan.change_write(job, change, given)
    assert job.state == after
    if commands is None:
        assert written is None
        return
    assert written is not None
    assert [command.WhichOneof("command") for _, command in written.commands] == commands
    if kind != "pause":
        assert job.assignment.master_port == 29600 and job.assignment.generation == 2


def test_the_schedule_backs_off_and_forgets_on_success() -> None:
    schedule = replan.Schedule(backoff_max_s=4.0)
    assert schedule.wanted([], []) == ""
    schedule.want("node n1 joined")
    schedule.want("a job was cancelled")
    assert schedule.wanted([], []) == "node n1 joined" and schedule.due(NOW)
    delays = [schedule.failed("node n1 joined", NOW) for _ in range(4)]
    assert delays == [1.0, 2.0, 4.0, 4.0]
    assert not schedule.due(NOW + 3.9) and schedule.due(NOW + 4.0)
    schedule.done()
    assert schedule.reason == "" and schedule.failed("again", NOW) == 1.0
    assert replan.Schedule(4.0).wanted([pb.Job(state=state.PENDING)], []) == "pending jobs"


# ---- the whole coordinator on the in-memory store -----------------------------------------


class InProcessPlanner:
    """The real solver, called in this process instead of over gRPC."""

    def __init__(self) -> None:
        self.calls = 0

    def plan(self, request: planner_service_pb2.PlanRequest) -> planner_service_pb2.PlanResponse:
        self.calls += 1
        return result_to_proto(solver.plan(request_from_proto(request, Limits(max_jobs=16, max_nodes=16))))


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cluster() -> tuple[Coordinator, MemoryStore, Clock]:
    store, clock = MemoryStore(), Clock()
    coordinator = Coordinator(store, InProcessPlanner(), Settings(), clock=clock)
    for node_id in ("n1", "n2"):
        coordinator.register_node(node_id, f"10.9.0.{node_id[-1]}:7000", 1, "rack-a")
    return coordinator, store, clock


def submit_and_place(coordinator: Coordinator, data: int = 2, name: str = "tiny") -> pb.Job:
    spec = jobspec.spec_from_dict(
        {
            "name": name,
            "program": {"entry_point": "examples.gpt.train:main"},
            "parallelism": {"data": data, "min_data": 1},
            "training": {"iterations": 50, "global_batch_size": 12},
        }
    )
    job = coordinator.submit(spec)
    coordinator.reconcile_once()
    return coordinator.get(job.job_id)


def iterate(coordinator: Coordinator, job: pb.Job, iteration: int, ranks: range) -> None:
    for rank in ranks:
        node_id = next(w.node_id for w in job.assignment.workers if rank in w.ranks)
        coordinator.report_progress(
            node_id,
            [
                node_service_pb2.IterationReport(
                    job_id=job.job_id, generation=job.assignment.generation, rank=rank, iteration=iteration, seconds=0.1
                )
            ],
        )


def fall_silent(coordinator: Coordinator, clock: Clock, silent: str, nodes: tuple[str, ...]) -> None:
    """Four seconds in which every node but `silent` beats: past the heartbeat timeout."""
    for _ in range(4):
        clock.now += 1.0
        for node_id in nodes:
            if node_id != silent:
                coordinator.heartbeat(node_id)
        coordinator.reconcile_once()


def test_a_job_is_placed_runs_and_heals_without_redis(cluster: tuple[Coordinator, MemoryStore, Clock]) -> None:
    coordinator, store, clock = cluster
    job = submit_and_place(coordinator)
    assert job.state == state.SCHEDULED and job.assignment.world_size == 2
    iterate(coordinator, job, 1, range(2))
    assert coordinator.get(job.job_id).state == state.RUNNING
    # Rank 1 dies; rank 0 reports the reset it saw: every rank is accounted for, so rank 1
    # alone restarts, at once.
    exit_request = node_service_pb2.ReportWorkerExitRequest(
        node_id=job.assignment.workers[1].node_id, job_id=job.job_id, generation=1, rank=1, exit_code=1
    )
    reset = report(RESET, 0)
    reset.job_id, reset.node_id = job.job_id, job.assignment.workers[0].node_id
    coordinator.report_failure(reset.node_id, reset)
    coordinator.report_worker_exit(exit_request)
    healed = coordinator.get(job.job_id)
    assert healed.state == state.RECOVERING and healed.assignment.generation == 2
    assert [r.remedy for r in healed.remedies] == [pb.REMEDY_RESTART]
    reform = [c for _, c in store.read_commands(healed.assignment.workers[1].node_id, "0-0") if c.HasField("reform")]
    assert reform and reform[-1].reform.assignment.generation == 2
    clock.now += 1
    iterate(coordinator, healed, 2, range(2))
    resumed = coordinator.get(job.job_id)
    assert resumed.state == state.RUNNING and resumed.remedies[0].HasField("resumed")
    (incident,) = coordinator.list_incidents(job.job_id)
    assert incident.remedy == pb.REMEDY_RESTART and incident.HasField("resumed")


def test_a_lost_node_is_replanned_away_without_redis(cluster: tuple[Coordinator, MemoryStore, Clock]) -> None:
    coordinator, _, clock = cluster
    coordinator.register_node("n3", "10.9.0.3:7000", 1, "rack-b")
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 1, range(2))
    lost = job.assignment.workers[0].node_id
    fall_silent(coordinator, clock, lost, ("n1", "n2", "n3"))
    moved = coordinator.get(job.job_id)
    assert lost not in decide.nodes_of(moved) and moved.assignment.world_size == 2
    assert moved.state == state.RECOVERING and moved.assignment.generation > job.assignment.generation
    assert {i.kind for i in coordinator.list_incidents()} == {pb.FAILURE_KIND_NODE_LOST}


def test_a_vanished_rack_opens_one_incident_per_job_and_moves_them_all(
    cluster: tuple[Coordinator, MemoryStore, Clock],
) -> None:
    """Four nodes of one rack vanish in one reconcile step: each of the jobs placed there gets
    one incident holding a report per node it lost (written together), and one re-plan moves
    them all to the other rack; a job that had ended opens nothing."""
    coordinator, _, clock = cluster
    for i in range(3, 9):
        coordinator.register_node(f"n{i}", f"10.9.0.{i}:7000", 1, "rack-b" if i > 4 else "rack-a")
    jobs = [submit_and_place(coordinator, name=f"tiny-{i}") for i in range(3)]
    for job in jobs:
        iterate(coordinator, job, 1, range(2))
    ended = jobs[2]
    coordinator.cancel(ended.job_id, "done with it")
    lost = set(decide.nodes_of(jobs[0])) | set(decide.nodes_of(jobs[1])) | set(decide.nodes_of(ended))
    assert len(lost) == 6  # one node per rank: every node of the cluster but two
    survivors = {f"n{i}" for i in range(1, 9)} - lost
    for _ in range(4):
        clock.now += 1.0
        for node_id in survivors:
            coordinator.heartbeat(node_id)
        coordinator.reconcile_once()
    by_job: dict[str, list[pb.Incident]] = {}
    for incident in coordinator.list_incidents():
        if incident.job_id:
            by_job.setdefault(incident.job_id, []).append(incident)
    assert set(by_job) == {jobs[0].job_id, jobs[1].job_id}
    for job in jobs[:2]:
        (incident,) = by_job[job.job_id]
        assert incident.kind == pb.FAILURE_KIND_NODE_LOST and incident.remedy == pb.REMEDY_RECONFIGURE
        assert {r.node_id for r in incident.reports} == set(decide.nodes_of(job))
    moved = [coordinator.get(job.job_id) for job in jobs[:2]]
    assert all(set(decide.nodes_of(job)) <= survivors for job in moved if job.assignment.world_size)
    assert any(job.assignment.generation > 1 for job in moved)


def test_a_peers_network_error_after_a_reconfigure_began_heals_nothing_twice(
    cluster: tuple[Coordinator, MemoryStore, Clock],
) -> None:
    """An ECC error isolates rank 0's node (a reconfigure, same generation until the re-plan);
    rank 1 then sees its peer go (a reset). The reset joins the incident: it must not open a
    second one whose remedy would isolate rank 1's healthy node too."""
    coordinator, _, clock = cluster
    coordinator.register_node("n3", "10.9.0.3:7000", 1, "rack-b")
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 1, range(2))
    (bad, peer) = (w.node_id for w in job.assignment.workers)
    ecc = report(pb.FAILURE_KIND_ECC_ERROR, 0, pb.DETECTION_SOURCE_NODE_HEALTH)
    ecc.job_id, ecc.node_id = job.job_id, bad
    coordinator.report_failure(bad, ecc)
    assert [r.remedy for r in coordinator.get(job.job_id).remedies] == [pb.REMEDY_RECONFIGURE]
    clock.now += 0.5
    echo = report(RESET, 1)
    echo.job_id, echo.node_id = job.job_id, peer
    echo.first_seen.FromNanoseconds(int(clock.now * 1e9))
    joined = coordinator.report_failure(peer, echo)
    clock.now += 1.0
    coordinator.reconcile_once()
    moved = coordinator.get(job.job_id)
    assert [r.remedy for r in moved.remedies] == [pb.REMEDY_RECONFIGURE]
    (incident,) = coordinator.list_incidents(job.job_id)
    assert joined is not None and joined.incident_id == incident.incident_id and len(incident.reports) == 2
    states = {n.node_id: n.state for n in coordinator.nodes()}
    assert states[bad] == pb.NODE_STATE_ISOLATED and states[peer] == pb.NODE_STATE_READY
    assert bad not in decide.nodes_of(moved) and moved.assignment.generation == 2


def test_a_job_that_stops_because_a_host_went_silent_is_not_restarted_onto_it(
    cluster: tuple[Coordinator, MemoryStore, Clock],
) -> None:
    """Rank 1's agent reports a hang 1.6 s after rank 0's host went silent (its heartbeats
    stopped): the hang waits; the host is lost at the heartbeat timeout and its loss is the
    incident's root cause: one reconfigure, no restart onto the lost host."""
    coordinator, _, clock = cluster
    coordinator.register_node("n3", "10.9.0.3:7000", 1, "rack-b")
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 1, range(2))
    (silent, peer) = (w.node_id for w in job.assignment.workers)
    spare = ({"n1", "n2", "n3"} - {silent, peer}).pop()

    def beat(seconds: float) -> None:
        clock.now += seconds
        coordinator.heartbeat(peer)
        coordinator.heartbeat(spare)

    beat(1.6)
    hang = report(HANG, 1, STATISTICAL)
    hang.job_id, hang.node_id = job.job_id, peer
    hang.first_seen.FromNanoseconds(int(clock.now * 1e9))
    coordinator.report_failure(peer, hang)
    coordinator.reconcile_once()
    assert coordinator.get(job.job_id).remedies == []  # held
    for _ in range(4):
        beat(0.5)
        coordinator.reconcile_once()
    moved = coordinator.get(job.job_id)
    assert [r.remedy for r in moved.remedies] == [pb.REMEDY_RECONFIGURE]
    (incident,) = coordinator.list_incidents(job.job_id)
    assert incident.kind == pb.FAILURE_KIND_NODE_LOST and silent not in decide.nodes_of(moved)


def test_a_job_stalled_by_a_host_cut_off_from_its_peers_moves_on_without_it(
    cluster: tuple[Coordinator, MemoryStore, Clock],
) -> None:
    """Four ranks on four nodes, all beating; the job stalls and every agent reports the hang
    with which peers its agent reaches: one node reaches none, the others all but it. That node
    is isolated and the job reconfigures without it, instead of restarting in place onto the
    same broken links."""
    coordinator, _, clock = cluster
    for node_id in ("n3", "n4", "n5"):
        coordinator.register_node(node_id, f"10.9.0.{node_id[-1]}:7000", 1, "rack-b")
    job = submit_and_place(coordinator, data=4)
    iterate(coordinator, job, 1, range(4))
    order = [next(w.node_id for w in job.assignment.workers if r in w.ranks) for r in range(4)]
    assert all(w.address for w in job.assignment.workers)  # where the agents probe each other
    cut = order[3]
    for i, node_id in enumerate(order):
        clock.now += 0.05
        hang = report(HANG, i, STATISTICAL)
        hang.ClearField("rank")
        hang.job_id, hang.node_id = job.job_id, node_id
        others = [n for n in order if n != node_id]
        blocked = set(others) if node_id == cut else {cut}
        hang.unreachable_peers.extend(n for n in others if n in blocked)
        hang.reachable_peers.extend(n for n in others if n not in blocked)
        coordinator.report_failure(node_id, hang)
        if i < 3:
            assert coordinator.get(job.job_id).remedies == []  # waits for every node's account
    moved = coordinator.get(job.job_id)
    assert [r.remedy for r in moved.remedies] == [pb.REMEDY_RECONFIGURE], moved.remedies
    states = {n.node_id: n.state for n in coordinator.nodes()}
    assert states[cut] == pb.NODE_STATE_ISOLATED
    assert all(states[n] == pb.NODE_STATE_READY for n in order[:3])
    coordinator.reconcile_once()
    assert cut not in decide.nodes_of(coordinator.get(job.job_id))


@pytest.mark.parametrize(
    ("before", "size", "flops", "after"),
    [
        ({}, 2, 10.0, {2: 10.0}),  # the first measurement is taken as it is
        ({2: 10.0}, 2, 20.0, {2: 12.0}),  # later ones move the mean by a fifth
        ({2: 10.0}, 1, 4.0, {2: 10.0, 1: 4.0}),  # each size on its own
        ({2: 10.0}, 2, 0.0, {2: 10.0}),  # a report without FLOPs teaches nothing
        ({2: 10.0}, 2, float("nan"), {2: 10.0}),
        ({}, 0, 5.0, {}),
    ],
)
def test_learned_throughput(before: dict[int, float], size: int, flops: float, after: dict[int, float]) -> None:
    assert learned_throughput(before, size, flops) == pytest.approx(after)


def test_a_placement_says_why_and_the_plan_uses_the_measured_throughput(
    cluster: tuple[Coordinator, MemoryStore, Clock],
) -> None:
    coordinator, _store, clock = cluster
    job = submit_and_place(coordinator)
    placed = job.history[-1].reason
    assert placed.startswith("placed on ") and "FLOP/s by size 1: " in placed and "assumed" in placed
    for iteration in (1, 2, 3):
        clock.now += 1
        for rank in range(job.assignment.world_size):
            node_id = next(w.node_id for w in job.assignment.workers if rank in w.ranks)
            first = iteration == 1
            coordinator.report_progress(
                node_id,
                [
                    node_service_pb2.IterationReport(
                        job_id=job.job_id,
                        generation=job.assignment.generation,
                        rank=rank,
                        iteration=iteration,
                        seconds=0.5,
                        flops=1e9 * iteration,
                        state_source="fresh" if first else "",
                    )
                ],
            )
    learned = coordinator.get(job.job_id)
    size = job.assignment.world_size
    # The first iteration (warm-up) is left out: 4e9, then 4e9 + 0.2 x (6e9 - 4e9).
    assert dict(learned.progress.measured_flops_per_second) == pytest.approx({size: 4.4e9})
    request = decide.plan_request([learned], [], 0.0, 1.0)
    assert dict(request.jobs[0].measured_throughput) == pytest.approx({size: 4.4e9})


def test_a_re_plan_before_the_first_measurement_keeps_the_size_it_cannot_judge() -> None:
    """Seen in CI: the first report (warm-up, never measured) gives the job's size; a re-plan
    before the next report judged its ranks as the reference GPU, for which a small model is
    all all-reduce, and shrank a 2-rank job on an idle cluster to 1 rank ("10x faster")."""
    store, clock = MemoryStore(), Clock()
    coordinator = Coordinator(store, InProcessPlanner(), Settings(), clock=clock)
    for i in (1, 2):
        coordinator.register_node(f"n{i}", f"10.9.0.{i}:7000", 2, "rack-a")
    spec = jobspec.spec_from_dict(
        {
            "name": "tiny",
            "program": {"entry_point": "examples.gpt.train:main"},
            "parallelism": {"data": 2, "min_data": 1},
            "training": {"iterations": 50, "global_batch_size": 8},
        }
    )
    job = coordinator.submit(spec)
    coordinator.reconcile_once()
    job = coordinator.get(job.job_id)
    assert job.assignment.world_size == 2
    first = node_service_pb2.IterationReport(
        job_id=job.job_id, generation=1, rank=0, iteration=1, seconds=0.5, flops=5.8e7, tokens=256, state_source="fresh"
    )
    coordinator.report_progress(job.assignment.workers[0].node_id, [first])
    assert decide.estimate_of(coordinator.get(job.job_id))[0] > 0  # its size is known now
    coordinator.replanner.want("another job's event")
    clock.now += 0.1
    for i in (1, 2):
        coordinator.heartbeat(f"n{i}")
    coordinator.reconcile_once()
    kept = coordinator.get(job.job_id)
    assert kept.state == state.RUNNING and kept.assignment.world_size == 2, kept.history[-1].reason


def test_failing_checkpoints_show_as_a_condition_until_one_is_saved(
    cluster: tuple[Coordinator, MemoryStore, Clock],
) -> None:
    coordinator, store, clock = cluster
    job = submit_and_place(coordinator)

    def rank0(iteration: int, error: str = "", since: int = 0, saved: int = 0) -> None:
        clock.now += 1
        node_id = next(w.node_id for w in job.assignment.workers if 0 in w.ranks)
        coordinator.report_progress(
            node_id,
            [
                node_service_pb2.IterationReport(
                    job_id=job.job_id,
                    generation=job.assignment.generation,
                    rank=0,
                    iteration=iteration,
                    seconds=0.1,
                    checkpoint_error=error,
                    checkpoint_failing_since=since,
                    checkpoint_saved_iteration=saved,
                )
            ],
        )

    rank0(1)
    rank0(11, "[Errno 28] No space left on device", 10)
    failing = coordinator.get(job.job_id)
    assert [(c.type, c.since_iteration) for c in failing.conditions] == [("checkpoints_failing", 10)]
    version = failing.version
    rank0(12, "[Errno 28] No space left on device", 10)
    assert coordinator.get(job.job_id).version == version  # failing on writes nothing
    rank0(13)  # no error, but no save either (a restarted rank): no news
    assert coordinator.get(job.job_id).version == version
    rank0(21, saved=20)
    assert not coordinator.get(job.job_id).conditions
    said = [e.message for _, e in store.read_events(job.job_id, "0-0", 0) if e.type == pb.JOB_EVENT_TYPE_CONDITION]
    assert said == [
        "checkpoints failing since iteration 10: [Errno 28] No space left on device (rank 0)",
        "checkpoints saved again (rank 0)",
    ]


def test_a_finished_job_lists_no_worker_as_running(cluster: tuple[Coordinator, MemoryStore, Clock]) -> None:
    coordinator, _, _ = cluster
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 50, range(2))
    assert {w.state for w in coordinator.get(job.job_id).workers} == {pb.WORKER_STATE_RUNNING}
    for worker in job.assignment.workers:
        for rank in worker.ranks:
            coordinator.report_worker_exit(
                node_service_pb2.ReportWorkerExitRequest(
                    node_id=worker.node_id, job_id=job.job_id, generation=1, rank=rank, exit_code=0, last_iteration=50
                )
            )
    ended = coordinator.get(job.job_id)
    assert ended.state == state.SUCCEEDED
    assert {w.state for w in ended.workers} == {pb.WORKER_STATE_STOPPED}
    assert ended.workers[0].history[-1].reason == "the ranks finished"


@pytest.mark.parametrize(
    ("last", "iteration", "tokens"),
    [
        ((0, 0), 1, 1024),  # the first report
        ((5, 5120), 6, 6144),  # the next
        ((5, 5120), 7, 7168),  # iteration 6's report was lost: it counts as 7's
        ((7, 7168), 4, 4096),  # rolled back to a checkpoint at 3: 4..7 count once
        ((7, 7168), 7, 7168),  # a redone last iteration
    ],
)
def test_each_iteration_s_tokens_count_once(last: tuple[int, int], iteration: int, tokens: int) -> None:
    from services.coordinator.reports import tokens_through

    assert tokens_through(*last, iteration, 1024) == tokens
