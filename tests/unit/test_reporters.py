"""A node reports only for the ranks its job's assignment places on it: the rule by a table,
and the whole coordinator on the in-memory store refusing a node that speaks for another's
rank, with nothing stored changed."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest

from services.coordinator import state
from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.memory_store import MemoryStore
from services.coordinator.reporters import check_reporter
from tests.unit.test_coordinator_core import NOW, Clock, InProcessPlanner, iterate, submit_and_place
from unicron.errors import InvalidArgument, PermissionDenied
from unicron.v1 import common_pb2 as pb
from unicron.v1 import node_service_pb2


def two_node_job(generation: int = 2) -> pb.Job:
    job = pb.Job(job_id="j", state=pb.JOB_STATE_RUNNING)
    job.assignment.generation, job.assignment.world_size = generation, 4
    job.assignment.workers.add(node_id="n1", ranks=[0, 1])
    job.assignment.workers.add(node_id="n2", ranks=[2, 3])
    return job


@pytest.mark.parametrize(
    ("node_id", "generation", "rank", "refused"),
    [
        ("n1", 2, 0, None),  # its own rank
        ("n2", 2, 3, None),
        ("n2", 2, 0, PermissionDenied),  # n1's rank
        ("n3", 2, 1, PermissionDenied),  # a node the job does not use
        ("n1", 2, None, None),  # a job-wide report from a node of the job
        ("n3", 2, None, PermissionDenied),  # ... from a node that hosts none of its ranks
        ("n1", 2, 4, InvalidArgument),  # a rank the generation does not have
        ("", 2, 0, InvalidArgument),  # no node named at all
        # A stale generation: the job keeps only its current assignment, and a stale report
        # only joins what is already open (today's behaviour, kept).
        ("n2", 1, 0, None),
        ("n3", 1, None, None),
    ],
)
def test_who_may_report_for_a_rank(
    node_id: str, generation: int, rank: int | None, refused: type[Exception] | None
) -> None:
    job = two_node_job()
    if refused is None:
        check_reporter(job, node_id, generation, rank, "rank")
    else:
        with pytest.raises(refused):
            check_reporter(job, node_id, generation, rank, "rank")


def test_a_refusal_names_the_field_or_the_node(caplog: pytest.LogCaptureFixture) -> None:
    job = two_node_job()
    with pytest.raises(InvalidArgument, match=r"reports\[3\]\.rank") as bad:
        check_reporter(job, "n1", 2, 9, "reports[3].rank")
    assert bad.value.field == "reports[3].rank"
    with caplog.at_level(logging.WARNING), pytest.raises(PermissionDenied, match="node n2 does not host rank 0"):
        check_reporter(job, "n2", 2, 0, "rank")
    (record,) = [r for r in caplog.records if r.name == "services.coordinator.reporters"]
    assert (vars(record)["node_id"], vars(record)["rank"]) == ("n2", 0)


# ---- the coordinator on the in-memory store ------------------------------------------------


@pytest.fixture
def cluster() -> tuple[Coordinator, MemoryStore, Clock]:
    store, clock = MemoryStore(), Clock()
    coordinator = Coordinator(store, InProcessPlanner(), Settings(), clock=clock)
    for node_id in ("n1", "n2", "n3"):
        coordinator.register_node(node_id, f"10.9.0.{node_id[-1]}:7000", 1, "rack-a")
    return coordinator, store, clock


def stored(store: MemoryStore) -> dict[str, Any]:
    """Everything the store holds (its streams too), to compare before and after."""
    held = {name: value for name, value in vars(store).items() if name not in ("_lock", "_streams")}
    return copy.deepcopy({**held, "streams": vars(store)["_streams"]._logs})


def placed(job: pb.Job) -> tuple[str, str, str]:
    """The node of rank 0, the node of rank 1, and the registered node the job does not use."""
    first, second = (next(w.node_id for w in job.assignment.workers if r in w.ranks) for r in (0, 1))
    return first, second, ({"n1", "n2", "n3"} - {first, second}).pop()


def progress(job: pb.Job, rank: int, iteration: int) -> node_service_pb2.IterationReport:
    return node_service_pb2.IterationReport(
        job_id=job.job_id, generation=job.assignment.generation, rank=rank, iteration=iteration, seconds=0.1
    )


def crash(job: pb.Job, node_id: str, rank: int | None) -> pb.FailureReport:
    report = pb.FailureReport(
        job_id=job.job_id,
        generation=job.assignment.generation,
        node_id=node_id,
        kind=pb.FAILURE_KIND_CUDA_ERROR,
        source=pb.DETECTION_SOURCE_EXCEPTION,
        message="CUDA error: an illegal memory access",
    )
    if rank is not None:
        report.rank = rank
    report.first_seen.FromNanoseconds(int(NOW * 1e9))
    return report


def exit_of(job: pb.Job, node_id: str, rank: int, code: int = 1) -> node_service_pb2.ReportWorkerExitRequest:
    return node_service_pb2.ReportWorkerExitRequest(
        node_id=node_id, job_id=job.job_id, generation=job.assignment.generation, rank=rank, exit_code=code
    )


def test_a_node_reporting_for_another_nodes_rank_is_refused_and_changes_nothing(
    cluster: tuple[Coordinator, MemoryStore, Clock],
) -> None:
    coordinator, store, clock = cluster
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 1, range(2))
    first, second, outsider = placed(job)
    clock.now += 1
    before = stored(store)
    refusals: list[Callable[[], object]] = [
        # Rank 0's progress from rank 1's node, alone and inside a batch with its own report.
        lambda: coordinator.report_progress(second, [progress(job, 0, 2)]),
        lambda: coordinator.report_progress(second, [progress(job, 1, 2), progress(job, 0, 2)]),
        lambda: coordinator.report_progress(outsider, [progress(job, 0, 2)]),
        # A failure of rank 0 from the other nodes, and a job-wide one from the outsider.
        lambda: coordinator.report_failure(second, crash(job, second, 0)),
        lambda: coordinator.report_failure(outsider, crash(job, outsider, 0)),
        lambda: coordinator.report_failure(outsider, crash(job, outsider, None)),
        # Exits: a failed one would restart the job, clean ones would end it.
        lambda: coordinator.report_worker_exit(exit_of(job, second, 0)),
        lambda: coordinator.report_worker_exit(exit_of(job, outsider, 0, code=0)),
    ]
    for refused in refusals:
        with pytest.raises(PermissionDenied):
            refused()
    assert stored(store) == before
    assert coordinator.list_incidents(job.job_id) == []
    # The node that hosts the rank is heard as before.
    coordinator.report_progress(first, [progress(job, 0, 2)])
    assert coordinator.get(job.job_id).progress.iteration == 2


def test_clean_exits_from_a_foreign_node_cannot_end_a_job(cluster: tuple[Coordinator, MemoryStore, Clock]) -> None:
    coordinator, _, _ = cluster
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 50, range(2))  # the last iteration
    first, second, _ = placed(job)
    coordinator.report_worker_exit(exit_of(job, first, 0, code=0))
    with pytest.raises(PermissionDenied):
        coordinator.report_worker_exit(exit_of(job, first, 1, code=0))  # rank 1 runs on `second`
    assert coordinator.get(job.job_id).state == state.RUNNING
    coordinator.report_worker_exit(exit_of(job, second, 1, code=0))
    assert coordinator.get(job.job_id).state == state.SUCCEEDED


def test_reports_of_an_older_generation_are_treated_as_before(cluster: tuple[Coordinator, MemoryStore, Clock]) -> None:
    """After a restart onto new places, the old generation's late reports still come from the
    nodes that hosted its ranks then: stale, not refused."""
    coordinator, _, clock = cluster
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 1, range(2))
    first, second, _ = placed(job)
    coordinator.report_failure(second, crash(job, second, 1))
    healed = coordinator.get(job.job_id)
    assert healed.state == state.RECOVERING and healed.assignment.generation == job.assignment.generation + 1
    clock.now += 1
    # Rank 0's iteration that the remedy overtook is still the job's true progress.
    coordinator.report_progress(first, [progress(job, 0, 2)])
    assert coordinator.get(job.job_id).progress.iteration == 2
    coordinator.report_worker_exit(exit_of(job, second, 1))  # stale: changes nothing
    late = crash(job, first, 0)
    late.kind = pb.FAILURE_KIND_CONNECTION_RESET
    assert coordinator.report_failure(first, late) is not None  # joins the open incident
    after = coordinator.get(job.job_id)
    assert after.assignment.generation == healed.assignment.generation and len(after.remedies) == 1
