"""Fuzzing every RPC of the coordinator (JobService, NodeService) with generated and
adversarial messages and with raw bytes, against a seeded cluster over a real Redis: a
proper status, no hang, a healthy server, and a rejected call changes nothing stored."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.strategies import requests, resolve, token
from tests.integration.test_job_api import tiny_spec
from unicron.v1 import common_pb2, job_service_pb2, logs_pb2, node_service_pb2

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

RPCS = harness.catalog(job_service_pb2, node_service_pb2)
JOBS = "/unicron.v1.JobService/"
NODES = "/unicron.v1.NodeService/"

J, N, C, L = job_service_pb2, node_service_pb2, common_pb2, logs_pb2


def _report(**fields: object) -> N.IterationReport:
    defaults: dict[str, object] = dict(job_id=token("job"), generation=1, rank=0, iteration=2, seconds=0.1, loss=4.0)
    defaults.update(fields)
    return N.IterationReport(**defaults)  # type: ignore[arg-type]


# Valid requests against the seeded cluster, which the fuzzing mutates.
SEEDS: dict[str, list[Message]] = {
    JOBS + "SubmitJob": [J.SubmitJobRequest(spec=tiny_spec("fuzz-new", data=1))],
    JOBS + "GetJob": [J.GetJobRequest(job_id=token("job")), J.GetJobRequest(job_id=token("job_name"))],
    JOBS + "ListJobs": [J.ListJobsRequest(states=[C.JOB_STATE_RUNNING, C.JOB_STATE_CANCELLED])],
    JOBS + "ListQueue": [J.ListQueueRequest()],
    JOBS + "ListQuotas": [J.ListQuotasRequest()],
    JOBS + "CancelJob": [J.CancelJobRequest(job_id=token("job"), reason="fuzz")],
    JOBS + "WatchJob": [
        J.WatchJobRequest(job_id=token("job")),
        J.WatchJobRequest(job_id=token("job"), after_event_id=token("event")),
        J.WatchJobRequest(job_id=token("done_job")),
    ],
    JOBS + "ListNodes": [J.ListNodesRequest()],
    JOBS + "ListIncidents": [J.ListIncidentsRequest(job_id=token("job"))],
    JOBS + "InjectFault": [
        J.InjectFaultRequest(job_id=token("job"), fault=C.Fault(kind=C.FAULT_KIND_CRASH, rank=0)),
        J.InjectFaultRequest(
            job_id=token("job"),
            fault=C.Fault(kind=C.FAULT_KIND_EXCEPTION, rank=0, exception_kind=C.FAILURE_KIND_CUDA_ERROR),
        ),
    ],
    JOBS + "GetCluster": [J.GetClusterRequest()],
    JOBS + "StreamLogs": [
        J.StreamLogsRequest(job_id=token("job"), rank=1, tail_lines=5),
        J.StreamLogsRequest(job_id=token("done_job"), follow=True, streams=[L.LOG_STREAM_STDERR]),
    ],
    JOBS + "DrainNode": [J.DrainNodeRequest(node_id=token("node"))],
    JOBS + "UncordonNode": [J.UncordonNodeRequest(node_id=token("node"))],
    NODES + "RegisterNode": [N.RegisterNodeRequest(node_id="n3", address="127.0.0.1:7003", slots=2)],
    NODES + "Heartbeat": [N.HeartbeatRequest(node_id=token("node"))],
    NODES + "StreamHeartbeats": [N.StreamHeartbeatsRequest(node_id=token("node"))],
    NODES + "ReportProgress": [N.ReportProgressRequest(node_id=token("node"), reports=[_report(), _report(rank=1)])],
    NODES + "ReportFailure": [
        N.ReportFailureRequest(
            node_id=token("node"),
            report=C.FailureReport(
                job_id=token("job"),
                generation=1,
                rank=1,
                node_id=token("node"),
                kind=C.FAILURE_KIND_CONNECTION_RESET,
                severity=C.SEVERITY_SEV3,
                source=C.DETECTION_SOURCE_EXCEPTION,
                message="fuzz",
            ),
        )
    ],
    NODES + "ReportWorkerExit": [
        N.ReportWorkerExitRequest(node_id=token("node"), job_id=token("job"), generation=1, rank=0, exit_code=1)
    ],
    NODES + "ReportFaultInjected": [
        N.ReportFaultInjectedRequest(node_id=token("node"), job_id=token("job"), fault=C.Fault(kind=C.FAULT_KIND_CRASH))
    ],
    NODES + "StreamCommands": [
        N.StreamCommandsRequest(node_id=token("node")),
        N.StreamCommandsRequest(node_id=token("node"), after_command_id="0-0"),
    ],
    NODES + "AckCommand": [
        N.AckCommandRequest(
            node_id=token("node"), command_id=token("command"), job_id=token("job"), generation=1, ok=True
        )
    ],
}


def test_every_rpc_has_seeds() -> None:
    assert sorted(SEEDS) == sorted(RPCS)


def calls() -> st.SearchStrategy[harness.Call]:
    return st.sampled_from(sorted(RPCS)).flatmap(
        lambda path: requests(RPCS[path].request.DESCRIPTOR, SEEDS[path]).map(
            lambda message: harness.Call(path, message)
        )
    )


@harness.fuzz_settings(len(RPCS) * harness.EXAMPLES_PER_RPC)
@given(call=calls())
# Regressions, each once INTERNAL: an id naming another record's key (a stream, a heartbeat)...
@example(call=harness.Call(JOBS + "GetJob", J.GetJobRequest(job_id=token("job") + ":events")))
@example(
    call=harness.Call(NODES + "RegisterNode", N.RegisterNodeRequest(node_id="n1:heartbeat", address="h:1", slots=1))
)
@example(call=harness.Call(NODES + "StreamCommands", N.StreamCommandsRequest(node_id="n1:commands")))
# ... a cursor that is not a stream id ...
@example(call=harness.Call(JOBS + "WatchJob", J.WatchJobRequest(job_id=token("job"), after_event_id="not-an-id")))
@example(
    call=harness.Call(NODES + "StreamCommands", N.StreamCommandsRequest(node_id=token("node"), after_command_id="x"))
)
# ... an unknown fault kind or detection source, and times out of a Timestamp's range.
@example(
    call=harness.Call(
        NODES + "ReportFailure",
        N.ReportFailureRequest(
            node_id=token("node"),
            report=C.FailureReport(job_id=token("job"), kind=C.FAILURE_KIND_PROCESS_EXIT, source=77),  # type: ignore[arg-type]
        ),
    )
)
@example(
    call=harness.Call(
        NODES + "ReportFaultInjected",
        N.ReportFaultInjectedRequest(node_id=token("node"), job_id=token("job"), fault=C.Fault(kind=-5)),  # type: ignore[arg-type]
    )
)
@example(
    call=harness.Call(
        NODES + "ReportFaultInjected",
        N.ReportFaultInjectedRequest(
            node_id=token("node"),
            job_id=token("job"),
            fault=C.Fault(kind=C.FAULT_KIND_CRASH),
            injected={"seconds": -(2**63)},
        ),
    )
)
@example(
    call=harness.Call(
        NODES + "ReportFailure",
        N.ReportFailureRequest(
            node_id=token("node"),
            report=C.FailureReport(
                job_id=token("job"), generation=1, kind=C.FAILURE_KIND_PROCESS_EXIT, first_seen={"seconds": 2**40}
            ),
        ),
    )
)
@example(
    call=harness.Call(
        NODES + "ReportWorkerExit",
        N.ReportWorkerExitRequest(
            node_id=token("node"), job_id=token("job"), generation=1, exit_code=1, exited={"nanos": -1}
        ),
    )
)
def test_fuzzed_messages(coordinator_target: harness.Target, call: harness.Call) -> None:
    request = resolve(call.request, coordinator_target.known)
    coordinator_target.call(call.path, [request])


# Hand-picked adversarial requests: the empty request of every RPC, unknown ids, ids that
# look like paths or like other keys of the store, negative and huge numbers, duplicates.
ADVERSARIAL: list[tuple[str, Message]] = [
    *[(path, rpc.request()) for path, rpc in sorted(RPCS.items())],
    (JOBS + "GetJob", J.GetJobRequest(job_id="job-19700101-deadbeef")),
    (JOBS + "GetJob", J.GetJobRequest(job_id="../" + token("job"))),
    (JOBS + "GetJob", J.GetJobRequest(job_id=token("job") + ":progress")),
    (JOBS + "GetJob", J.GetJobRequest(job_id=token("job") + ":events")),
    (JOBS + "GetJob", J.GetJobRequest(job_id=token("job") + ":incidents")),
    (JOBS + "CancelJob", J.CancelJobRequest(job_id=token("done_job"))),
    (JOBS + "CancelJob", J.CancelJobRequest(job_id=token("job") + ":events")),
    (JOBS + "WatchJob", J.WatchJobRequest(job_id=token("job"), after_event_id="not-an-id")),
    (JOBS + "WatchJob", J.WatchJobRequest(job_id=token("job"), after_event_id="-1")),
    (JOBS + "WatchJob", J.WatchJobRequest(job_id=token("job") + ":events")),
    (JOBS + "ListJobs", J.ListJobsRequest(states=[-1, 999, C.JOB_STATE_RUNNING, C.JOB_STATE_RUNNING])),  # type: ignore[list-item]
    (JOBS + "ListIncidents", J.ListIncidentsRequest(job_id="*")),
    (JOBS + "DrainNode", J.DrainNodeRequest(node_id="n9")),
    (JOBS + "DrainNode", J.DrainNodeRequest(node_id="n1:heartbeat")),
    (JOBS + "UncordonNode", J.UncordonNodeRequest(node_id="../n1")),
    (JOBS + "InjectFault", J.InjectFaultRequest(job_id=token("job"), fault=C.Fault(kind=99))),  # type: ignore[arg-type]
    (JOBS + "InjectFault", J.InjectFaultRequest(job_id=token("job"), fault=C.Fault(kind=C.FAULT_KIND_CRASH, rank=7))),
    (
        JOBS + "InjectFault",
        J.InjectFaultRequest(job_id=token("job"), fault=C.Fault(kind=C.FAULT_KIND_SLOW, delay_seconds=float("nan"))),
    ),
    (JOBS + "InjectFault", J.InjectFaultRequest(job_id=token("done_job"), fault=C.Fault(kind=C.FAULT_KIND_CRASH))),
    (JOBS + "SubmitJob", J.SubmitJobRequest(spec=tiny_spec("fuzz-running", data=1))),  # duplicate name
    (JOBS + "SubmitJob", J.SubmitJobRequest(spec=tiny_spec("fuzz-huge", data=4000))),  # over capacity
    (NODES + "RegisterNode", N.RegisterNodeRequest(node_id="n9", address="nohost", slots=1)),
    (NODES + "RegisterNode", N.RegisterNodeRequest(node_id="n9", address="127.0.0.1:1", slots=0)),
    (NODES + "RegisterNode", N.RegisterNodeRequest(node_id="n1:heartbeat", address="127.0.0.1:1", slots=1)),
    (NODES + "RegisterNode", N.RegisterNodeRequest(node_id="n1:commands", address="127.0.0.1:1", slots=1)),
    (NODES + "RegisterNode", N.RegisterNodeRequest(node_id="../n1", address="127.0.0.1:1", slots=1)),
    (NODES + "Heartbeat", N.HeartbeatRequest(node_id="n9")),
    (NODES + "StreamHeartbeats", N.StreamHeartbeatsRequest(node_id="n9")),
    (NODES + "StreamHeartbeats", N.StreamHeartbeatsRequest(node_id="")),
    (NODES + "StreamCommands", N.StreamCommandsRequest(node_id="n9")),
    (NODES + "StreamCommands", N.StreamCommandsRequest(node_id=token("node"), after_command_id="garbage")),
    (NODES + "StreamCommands", N.StreamCommandsRequest(node_id="n1:heartbeat")),
    (NODES + "StreamCommands", N.StreamCommandsRequest(node_id="n1:commands")),
    (NODES + "ReportProgress", N.ReportProgressRequest(node_id=token("node"), reports=[_report(seconds=-1.0)])),
    (NODES + "ReportProgress", N.ReportProgressRequest(node_id=token("node"), reports=[_report(iteration=0)])),
    (
        NODES + "ReportProgress",
        N.ReportProgressRequest(node_id=token("node"), reports=[_report(), _report(job_id="x")]),
    ),
    (NODES + "ReportProgress", N.ReportProgressRequest(node_id=token("node"), reports=[_report(rank=2**32 - 1)])),
    (NODES + "ReportProgress", N.ReportProgressRequest(node_id=token("node"), reports=[_report()] * 30)),
    (NODES + "ReportProgress", N.ReportProgressRequest(node_id=token("node"), reports=[_report(iteration=2**64 - 1)])),
    (
        NODES + "ReportFailure",
        N.ReportFailureRequest(node_id=token("node"), report=C.FailureReport(job_id=token("job"), kind=9999)),  # type: ignore[arg-type]
    ),
    (
        NODES + "ReportFailure",
        N.ReportFailureRequest(
            node_id=token("node"), report=C.FailureReport(node_id="n2", kind=C.FAILURE_KIND_ECC_ERROR)
        ),
    ),
    (
        NODES + "ReportFailure",
        N.ReportFailureRequest(node_id="n9", report=C.FailureReport(kind=C.FAILURE_KIND_ECC_ERROR)),
    ),
    (
        NODES + "ReportFailure",
        N.ReportFailureRequest(
            node_id=token("node"), report=C.FailureReport(job_id="job-nope", kind=C.FAILURE_KIND_PROCESS_EXIT)
        ),
    ),
    (NODES + "ReportWorkerExit", N.ReportWorkerExitRequest(node_id=token("node"), job_id="job-nope", exit_code=1)),
    (
        NODES + "ReportWorkerExit",
        N.ReportWorkerExitRequest(node_id=token("node"), job_id=token("job"), generation=1, rank=2**32 - 1, signal=-9),
    ),
    (
        NODES + "ReportFaultInjected",
        N.ReportFaultInjectedRequest(node_id=token("node"), job_id=token("job"), fault=C.Fault(kind=-5)),  # type: ignore[arg-type]
    ),
    (NODES + "AckCommand", N.AckCommandRequest(node_id=token("node"), job_id="job-nope", generation=1, ok=True)),
    (NODES + "AckCommand", N.AckCommandRequest(node_id=token("node"), job_id=token("job"), generation=2**64 - 1)),
]


@pytest.mark.parametrize(
    ("path", "request_"), ADVERSARIAL, ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, _) in enumerate(ADVERSARIAL)]
)
def test_adversarial_messages(coordinator_target: harness.Target, path: str, request_: Message) -> None:
    coordinator_target.call(path, [resolve(request_, coordinator_target.known)])


# ---- raw bytes --------------------------------------------------------------------------


@harness.fuzz_settings(len(RPCS) * max(2, harness.EXAMPLES_PER_RPC // 2))
@given(call=harness.raw_calls(RPCS, SEEDS))
def test_raw_bytes(coordinator_target: harness.Target, call: harness.RawCall) -> None:
    coordinator_target.call(call.path, [call.payload(coordinator_target.known)], raw=True)


def test_exits_of_ranks_outside_the_job_do_not_end_it(coordinator_target: harness.Target) -> None:
    """Regression: an exit reported for a rank the job does not have was counted, so one
    clean exit of rank 0 and one of a made-up rank 'finished' a job of two ranks whose
    rank 1 still ran."""
    known = coordinator_target.known

    def exit_of(rank: int) -> harness.Outcome:
        request = N.ReportWorkerExitRequest(node_id=known["node"], job_id=known["job"], generation=1, rank=rank)
        return coordinator_target.call(NODES + "ReportWorkerExit", [request])

    try:
        assert exit_of(0).ok
        refused = exit_of(7)
        assert refused.code.name == "INVALID_ARGUMENT" and "rank" in refused.details, refused
        job = coordinator_target.call(JOBS + "GetJob", [J.GetJobRequest(job_id=known["job"])]).responses[0].job
        assert job.state == C.JOB_STATE_RUNNING, job.reason
    finally:
        coordinator_target.dirty = True  # rank 0's exit was recorded: back to the baseline next
