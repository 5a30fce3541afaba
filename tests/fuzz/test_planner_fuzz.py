"""Fuzzing the planner's RPCs (Plan, Explain) with generated, mutated and adversarial
requests and with raw bytes: a proper status within the deadline and a healthy server. The
planner stores nothing, so there is no state to compare."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.strategies import requests
from unicron.v1 import planner_service_pb2 as P

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

RPCS = harness.catalog(P)
PLAN = "/unicron.v1.PlannerService/Plan"
EXPLAIN = "/unicron.v1.PlannerService/Explain"


def _situation() -> P.PlanRequest:
    return P.PlanRequest(
        nodes=[P.PlanNode(node_id="n1", slots=4, healthy=True), P.PlanNode(node_id="n2", slots=4, healthy=True)],
        jobs=[
            P.PlanJob(
                job_id="a",
                weight=1.0,
                tensor_parallel=1,
                pipeline_parallel=1,
                min_data_parallel=1,
                max_data_parallel=4,
                current={"n1": 2},
                estimate=P.ThroughputEstimate(parameters=1e6, tokens_per_step=4096),
            ),
            P.PlanJob(
                job_id="b",
                weight=2.0,
                tensor_parallel=2,
                pipeline_parallel=1,
                min_data_parallel=1,
                max_data_parallel=2,
                throughput={2: 1e12, 4: 1.9e12},
                hit_by_failure=True,
                preemptible=True,
            ),
        ],
        failure_rate_per_node_per_second=1e-6,
        time_limit_seconds=1.0,
        seed=1,
    )


SEEDS: dict[str, list[Message]] = {
    PLAN: [_situation()],
    EXPLAIN: [
        P.ExplainRequest(
            request=_situation(),
            plan=[
                P.JobPlan(job_id="a", slots_by_node={"n1": 2}, size=2),
                P.JobPlan(job_id="b", slots_by_node={"n2": 4}, size=4),
            ],
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


def _with(**fields: object) -> P.PlanRequest:
    request = _situation()
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def _job_with(**fields: object) -> P.PlanRequest:
    request = _situation()
    for name, value in fields.items():
        if isinstance(value, Message):
            getattr(request.jobs[0], name).CopyFrom(value)
        else:
            setattr(request.jobs[0], name, value)
    return request


@harness.fuzz_settings(len(RPCS) * harness.EXAMPLES_PER_RPC * 2)
@given(call=calls())
# A solve is bounded by its own time limit, however large the request asks for.
@example(call=harness.Call(PLAN, _with(time_limit_seconds=1e308)))
@example(call=harness.Call(PLAN, _with(time_limit_seconds=float("nan"))))
@example(call=harness.Call(PLAN, _with(failure_rate_per_node_per_second=float("inf"))))
# Regressions: a seed beyond CP-SAT's int32 (INTERNAL), finite inputs whose product is not
# (weight x throughput x horizon: NaN coefficients, INTERNAL), a DP range of four billion
# sizes (a hang building the model), the same in Explain.
@example(call=harness.Call(PLAN, _with(max_changed_jobs=2**32 - 1, seed=2**32 - 1)))
@example(call=harness.Call(PLAN, _job_with(weight=1e308)))
@example(call=harness.Call(PLAN, _job_with(estimate=P.ThroughputEstimate(parameters=1e308, tokens_per_step=1e308))))
@example(
    call=harness.Call(
        PLAN, _job_with(transition=P.TransitionCosts(state_bytes=1e308, bandwidth_bytes_per_second=1e-300))
    )
)
@example(call=harness.Call(PLAN, _job_with(max_data_parallel=2**32 - 1)))
@example(call=harness.Call(EXPLAIN, P.ExplainRequest(request=_job_with(weight=1e308))))
def test_fuzzed_messages(planner_target: harness.Target, call: harness.Call) -> None:
    planner_target.call(call.path, [call.request])


@harness.fuzz_settings(len(RPCS) * harness.EXAMPLES_PER_RPC)
@given(call=harness.raw_calls(RPCS, SEEDS))
def test_raw_bytes(planner_target: harness.Target, call: harness.RawCall) -> None:
    planner_target.call(call.path, [call.payload({})], raw=True)
