"""A node reports only for its own ranks, on the real coordinator over mutual TLS with a real
Redis: a second node's credentials (its certificate, or the join token naming it) reporting
progress, a failure or an exit for the first node's rank get PERMISSION_DENIED and nothing
in Redis changes; the first node's own reports go through."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis

from tests.integration.test_job_api import snapshot, tiny_spec
from tests.integration.test_security import SecurePlane, as_node, code_of, leaf_tls, make_plane
from unicron import certs
from unicron.security import ClientSecurity
from unicron.v1 import common_pb2, node_service_pb2, node_service_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.DevPKI:
    return certs.create_dev_pki(tmp_path_factory.mktemp("pki"), nodes=["n1", "n2"], users=certs.parse_users("alice"))


@pytest.fixture
def plane(pki: certs.DevPKI, redis_client: redis.Redis) -> Iterator[SecurePlane]:
    made = make_plane(pki, redis_client)
    yield made
    made.server.stop()
    made.planner.stop()


def job_on_n1(plane: SecurePlane) -> common_pb2.Job:
    """A running job of two ranks, both on n1 (n2 registers after it is placed)."""
    plane.register("n1")
    with plane.client("alice") as alice:
        job = alice.submit(tiny_spec(data=2))
    plane.coordinator.reconcile_once()
    plane.register("n2")
    with plane.client("alice") as alice:
        job = alice.get(job.job_id)
    assert [(w.node_id, list(w.ranks)) for w in job.assignment.workers] == [("n1", [0, 1])]
    return job


def requests_for_rank_0(
    job: common_pb2.Job, node_id: str
) -> list[Callable[[node_service_pb2_grpc.NodeServiceStub], object]]:
    generation = job.assignment.generation
    iteration = node_service_pb2.IterationReport(
        job_id=job.job_id, generation=generation, rank=0, iteration=1, loss=4.0, seconds=0.5
    )
    failure = common_pb2.FailureReport(
        job_id=job.job_id,
        generation=generation,
        rank=0,
        node_id=node_id,
        kind=common_pb2.FAILURE_KIND_CUDA_ERROR,
        source=common_pb2.DETECTION_SOURCE_EXCEPTION,
        message="CUDA error: an illegal memory access",
    )
    exit_request = node_service_pb2.ReportWorkerExitRequest(
        node_id=node_id, job_id=job.job_id, generation=generation, rank=0, exit_code=0
    )
    return [
        lambda stub: stub.ReportProgress(
            node_service_pb2.ReportProgressRequest(node_id=node_id, reports=[iteration]), timeout=5
        ),
        lambda stub: stub.ReportFailure(
            node_service_pb2.ReportFailureRequest(node_id=node_id, report=failure), timeout=5
        ),
        lambda stub: stub.ReportWorkerExit(exit_request, timeout=5),
    ]


def test_a_second_node_cannot_report_for_the_first_nodes_rank(plane: SecurePlane) -> None:
    job = job_on_n1(plane)
    n2 = plane.nodes(as_node(plane.pki, "n2"))
    # The join token names no node: it may claim n2, and the assignment is what refuses it.
    joined = plane.nodes(ClientSecurity(leaf_tls(plane.pki, plane.pki.clients["alice"]), plane.pki.join_token))
    before = snapshot(plane.redis)
    for stub in (n2, joined):
        for call in requests_for_rank_0(job, "n2"):
            assert code_of(functools.partial(call, stub)) == grpc.StatusCode.PERMISSION_DENIED
    # Naming n1 with n2's certificate is refused by the guard, before the coordinator.
    for call in requests_for_rank_0(job, "n1"):
        assert code_of(functools.partial(call, n2)) == grpc.StatusCode.PERMISSION_DENIED
    assert snapshot(plane.redis) == before
    # n1 speaks for its own rank.
    n1 = plane.nodes(as_node(plane.pki, "n1"))
    report_progress = requests_for_rank_0(job, "n1")[0]
    assert code_of(lambda: report_progress(n1)) == grpc.StatusCode.OK
    with plane.client("alice") as alice:
        assert alice.get(job.job_id).progress.iteration == 1
