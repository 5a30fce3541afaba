from __future__ import annotations

from services.coordinator import incidents
from unicron.v1 import common_pb2 as pb


def report(kind: int, source: int, first_seen: float, rank: int | None = None, job: str = "j") -> pb.FailureReport:
    out = pb.FailureReport(job_id=job, generation=1, node_id="n1", kind=kind, source=source, message="m")  # type: ignore[arg-type]
    if rank is not None:
        out.rank = rank
    out.first_seen.FromNanoseconds(int(first_seen * 1e9))
    return out


def build(*reports: pb.FailureReport, now: float = 100.0) -> pb.Incident:
    incident = None
    for r in reports:
        incident = incidents.merge(incident, r, now, "inc-1")
    assert incident is not None
    return incident


EXC = pb.DETECTION_SOURCE_EXCEPTION
EXIT = pb.DETECTION_SOURCE_PROCESS_SUPERVISION


def test_peer_errors_after_a_crash_join_the_crash_and_it_stays_the_root() -> None:
    crash = report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 10.0, rank=1)
    resets = [report(pb.FAILURE_KIND_CONNECTION_RESET, EXC, 10.2, rank=r) for r in (0, 2, 3)]
    incident = build(resets[0], crash, *resets[1:])
    assert incident.kind == pb.FAILURE_KIND_PROCESS_EXIT
    assert incident.severity == pb.SEVERITY_SEV2
    assert incident.recommended_action == "restart process"
    assert len(incident.reports) == 4
    assert incident.first_seen.ToNanoseconds() == 10_000_000_000
    assert incident.detected.ToNanoseconds() == 100_000_000_000
    assert "rank 1" in incident.summary


def test_a_ranks_exception_explains_its_own_exit() -> None:
    exited = report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 5.0, rank=2)
    exception = report(pb.FAILURE_KIND_ECC_ERROR, EXC, 5.1, rank=2)
    incident = build(exited, exception)
    assert incident.kind == pb.FAILURE_KIND_ECC_ERROR
    assert incident.severity == pb.SEVERITY_SEV1 and incident.recommended_action == "reconfigure"


def test_another_ranks_exception_does_not_explain_an_exit() -> None:
    exited = report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 5.0, rank=2)
    other = report(pb.FAILURE_KIND_CONNECTION_RESET, EXC, 5.1, rank=0)
    assert build(exited, other).kind == pb.FAILURE_KIND_PROCESS_EXIT


def test_a_lost_node_seen_late_is_still_the_earliest_cause() -> None:
    reset = report(pb.FAILURE_KIND_CONNECTION_RESET, EXC, 12.0, rank=0)
    lost = incidents.node_lost_report("n2", "j", 1, last_heartbeat=11.5, timeout_s=3.0)
    incident = build(reset, lost)
    assert incident.kind == pb.FAILURE_KIND_NODE_LOST and incident.node_id == "n2"


def test_keys_group_a_job_generation_and_keep_stragglers_apart() -> None:
    crash = report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 1.0, rank=1)
    hang = report(pb.FAILURE_KIND_TASK_HANG, pb.DETECTION_SOURCE_STATISTICAL, 1.0)
    slow = report(pb.FAILURE_KIND_STRAGGLER, pb.DETECTION_SOURCE_STATISTICAL, 1.0, rank=3)
    node = report(pb.FAILURE_KIND_DISK_FULL, pb.DETECTION_SOURCE_NODE_HEALTH, 1.0, job="")
    assert incidents.incident_key(crash) == incidents.incident_key(hang) == "job:j:1"
    assert incidents.incident_key(slow) == "job:j:1:straggler:3"
    assert incidents.incident_key(node) == "node:n1:FAILURE_KIND_DISK_FULL"


def test_incidents_close_after_the_merge_window() -> None:
    incident = build(report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 1.0, rank=0), now=100.0)
    assert incidents.is_open(incident, 100.0 + incidents.MERGE_WINDOW_S)
    assert not incidents.is_open(incident, 100.1 + incidents.MERGE_WINDOW_S)


def test_a_node_lost_again_after_it_came_back_is_a_new_incident() -> None:
    # A node-lost report's first_seen is the node's last heartbeat.
    first = build(report(pb.FAILURE_KIND_NODE_LOST, pb.DETECTION_SOURCE_HEARTBEAT, 1.0, job=""), now=4.0)
    assert incidents.is_open(first, 5.0, report(pb.FAILURE_KIND_NODE_LOST, pb.DETECTION_SOURCE_HEARTBEAT, 1.0, job=""))
    again = report(pb.FAILURE_KIND_NODE_LOST, pb.DETECTION_SOURCE_HEARTBEAT, 20.0, job="")
    assert not incidents.is_open(first, 24.0, again)


def test_reattempt_is_ruled_out_by_a_dead_rank_or_a_heavier_root() -> None:
    timeout = build(report(pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, pb.DETECTION_SOURCE_EXCEPTION, 1.0, rank=0))
    assert incidents.ranks_alive(timeout) and not incidents.needs_heavier_remedy(timeout)
    crash = build(
        report(pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, pb.DETECTION_SOURCE_EXCEPTION, 1.0, rank=0),
        report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 1.2, rank=3),
    )
    assert not incidents.ranks_alive(crash) and incidents.needs_heavier_remedy(crash)


def test_a_failure_after_the_remedy_began_is_a_new_incident_and_an_echo_is_not() -> None:
    incident = build(report(pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, pb.DETECTION_SOURCE_EXCEPTION, 1.0, rank=0))
    incident.remedy_started.FromNanoseconds(int(2.0 * 1e9))
    before = report(pb.FAILURE_KIND_SOFTWARE_ERROR, pb.DETECTION_SOURCE_EXCEPTION, 1.5, rank=1)
    after = report(pb.FAILURE_KIND_SOFTWARE_ERROR, pb.DETECTION_SOURCE_EXCEPTION, 2.5, rank=1)
    assert incidents.is_open(incident, 3.0, before)
    assert not incidents.is_open(incident, 3.0, after)
    # A network error of the same generation, however late, is how the failure (or its
    # remedy: the old group torn down, a node isolated) looks from a peer: it joins, and
    # never opens an incident of its own that a second remedy would answer.
    echo = report(pb.FAILURE_KIND_CONNECTION_RESET, pb.DETECTION_SOURCE_EXCEPTION, 2.5, rank=1)
    assert incidents.is_open(incident, 3.0, echo)
    # The reporting rank's own exit, however late, is the end of the failure it reported.
    assert incidents.is_open(incident, 3.0, report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 2.5, rank=0))
    assert not incidents.is_open(incident, 3.0, report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 2.5, rank=1))


def test_a_peers_reset_seen_first_is_explained_by_the_death_just_after() -> None:
    reset = report(pb.FAILURE_KIND_CONNECTION_RESET, EXC, 10.000, rank=0)
    death = report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 10.004, rank=1)
    assert build(reset, death).kind == pb.FAILURE_KIND_PROCESS_EXIT


def test_a_network_error_long_before_anything_else_is_its_own_cause() -> None:
    reset = report(pb.FAILURE_KIND_CONNECTION_RESET, EXC, 10.0, rank=0)
    later_exit = report(pb.FAILURE_KIND_PROCESS_EXIT, EXIT, 15.0, rank=0)
    assert build(reset, later_exit).kind == pb.FAILURE_KIND_CONNECTION_RESET


def test_a_lost_nodes_ranks_stay_gone_after_its_agent_is_back() -> None:
    reset = report(pb.FAILURE_KIND_CONNECTION_RESET, EXC, 10.0, rank=0)
    lost = report(pb.FAILURE_KIND_NODE_LOST, pb.DETECTION_SOURCE_HEARTBEAT, 9.0)
    assert incidents.lost_nodes(build(reset)) == set()
    assert incidents.lost_nodes(build(reset, lost)) == {"n1"}


def test_a_rank_with_an_error_of_its_own_is_replaced_and_its_peers_wait() -> None:
    # The rank that had the error waits alive for the decision, but its state is not trusted:
    # it counts as gone (replaced by a restart), the peers that saw their group break wait.
    own = report(pb.FAILURE_KIND_SOFTWARE_ERROR, EXC, 1.0, rank=2)
    echoes = [report(pb.FAILURE_KIND_CONNECTION_RESET, EXC, 1.1, rank=r) for r in (0, 1, 3)]
    incident = build(own, *echoes)
    assert incidents.waiting_and_gone(incident) == ({0, 1, 3}, {2})
    assert incident.kind == pb.FAILURE_KIND_SOFTWARE_ERROR and incident.severity == pb.SEVERITY_SEV2
    assert not incidents.ranks_alive(incident) and incidents.accounts_for_all(incident, 4)


def test_severity_is_the_coordinators_whatever_a_reporter_sent() -> None:
    sent = report(pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, EXC, 1.0, rank=0)
    sent.severity = pb.SEVERITY_SEV1
    incident = build(sent)
    assert incident.severity == pb.SEVERITY_SEV3 and incident.reports[0].severity == pb.SEVERITY_SEV3
