"""Fuzzing the agent's TrainerAgentService (Connect, the one RPC trainers call) with
generated and adversarial streams and with raw bytes: the agent answers a proper status or
an in-band `rejected` with a proper code, ends the stream when the trainer does, stays
healthy, and a refused message changes nothing: neither the agent's trainers nor what the
coordinator stores. The trainer itself serves no RPC (it only calls its agent), so this is
the last server."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
from google.protobuf import text_format
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.conftest import AgentUnderTest
from tests.fuzz.strategies import messages, mutations, resolve, token
from unicron.v1 import common_pb2 as C
from unicron.v1 import node_service_pb2 as N
from unicron.v1 import trainer_service_pb2 as T

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

CONNECT = "/unicron.v1.TrainerAgentService/Connect"
# Stands for the running trainer's job: its hello and iteration reports get that trainer's
# generation and rank too.
OWN = token("own")
# A stream ends this long after the trainer closes its side, or the agent is stuck.
STREAM_END_S = 5.0
# How long reports the agent accepted take to reach the coordinator (a 0.2 s batch).
FORWARD_S = 0.3
FORWARDED = ("iteration", "error", "fault_fired")


def _hello() -> T.ConnectRequest:
    return T.ConnectRequest(hello=T.TrainerHello(job_id=OWN, pid=1234))


def _iteration(**fields: object) -> T.ConnectRequest:
    report: dict[str, object] = dict(job_id=OWN, iteration=1, loss=3.0, seconds=0.1, compute_seconds=0.05)
    report.update(fields)
    return T.ConnectRequest(iteration=N.IterationReport(**report))  # type: ignore[arg-type]


SEEDS = [
    _iteration(),
    T.ConnectRequest(error=T.TrainerError(kind=C.FAILURE_KIND_SOFTWARE_ERROR, message="boom", iteration=1)),
    T.ConnectRequest(fault_fired=T.FaultFired(fault=C.Fault(kind=C.FAULT_KIND_SLOW, delay_seconds=0.1))),
    T.ConnectRequest(finished=T.TrainerFinished(iterations=3)),
    _hello(),
]


@dataclass(frozen=True)
class Stream:
    """What the fuzzed trainer sends: a first message (the running trainer's hello, or a
    fuzzed one) and at most one more, then it closes its side."""

    first: T.ConnectRequest | None
    then: T.ConnectRequest | None

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        text = " | ".join(
            "-" if m is None else text_format.MessageToString(m, as_one_line=True) for m in (self.first, self.then)
        )
        printer.text(f"Stream({text})")  # type: ignore[attr-defined]


_ANY = messages(T.ConnectRequest.DESCRIPTOR)
_SEEDED = st.sampled_from(SEEDS).flatmap(mutations)


def streams() -> st.SearchStrategy[Stream]:
    first = st.one_of(st.just(_hello()), st.just(_hello()), _ANY, st.sampled_from([_hello()]).flatmap(mutations))
    then = st.one_of(st.none(), _ANY, _SEEDED, _SEEDED, st.sampled_from(SEEDS))
    return st.builds(Stream, first, then)


def _own(message: T.ConnectRequest, key: tuple[str, int, int]) -> T.ConnectRequest:
    """The message with OWN resolved: the running trainer's job, generation and rank."""
    job_id, generation, rank = key
    out = resolve(message, {"own": job_id, "job": job_id})
    kind = message.WhichOneof("message")
    if kind == "hello" and message.hello.job_id == OWN:
        out.hello.generation, out.hello.rank = generation, rank
    if kind == "iteration" and message.iteration.job_id == OWN:
        out.iteration.generation, out.iteration.rank = generation, rank
    return out


def agent_state(env: AgentUnderTest) -> tuple[object, ...]:
    """What the agent shows of itself: its trainers, and the registry file it keeps of them."""
    registry = env.work_dir / "trainers.json"
    content = json.loads(registry.read_text()) if registry.exists() else None
    trainers = sorted((k.job_id, k.generation, k.rank) for k in env.agent.supervisor.running())
    return tuple(trainers), json.dumps(content, sort_keys=True)


def settle(env: AgentUnderTest, quiet_s: float = 0.3, limit_s: float = 10.0) -> None:
    """Waits until neither the agent nor the stored state changes for quiet_s (after an
    accepted report, a remedy may restart trainers and acknowledge commands)."""
    keyspace = env.target.keyspace
    assert keyspace is not None
    deadline = time.monotonic() + limit_s
    last = (agent_state(env), keyspace.snapshot())
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = (agent_state(env), keyspace.snapshot())
        if now == last:
            return
        last = now


def run_stream(env: AgentUnderTest, stream: Stream, *, raw_first: bytes | None = None) -> None:
    target = env.target
    keyspace = target.keyspace
    assert keyspace is not None
    key = env.running_key()
    sent: list[T.ConnectRequest | bytes] = []
    if raw_first is not None:
        sent.append(raw_first)
    elif stream.first is not None:
        sent.append(_own(stream.first, key))
    if stream.then is not None:
        then = _own(stream.then, key)
        sent.append(then.SerializeToString() if raw_first is not None else then)
    before = (agent_state(env), keyspace.snapshot())
    outcome = harness.invoke(target.channel, target.rpcs[CONNECT], sent, raw=raw_first is not None, read_s=STREAM_END_S)
    context = f"Connect with {harness.describe(sent)}"
    assert not outcome.cancelled_by_us, f"the agent kept the stream open after the trainer closed it: {context}"
    harness.check_status(outcome, raw=raw_first is not None, context=context)
    harness.check_healthy(target.channel, "agent")
    rejected = [r.rejected for r in outcome.responses if isinstance(r, T.ConnectResponse) and r.HasField("rejected")]
    for refusal in rejected:
        assert refusal.code in harness.REJECTED_CODES, f"improper code in {refusal} for {context}"
    kind = stream.then.WhichOneof("message") if stream.then is not None else None
    welcomed = outcome.ok and any(isinstance(r, T.ConnectResponse) and r.HasField("welcome") for r in outcome.responses)
    accepted = welcomed and not rejected and kind in FORWARDED
    if accepted:
        # Whatever it set off (a remedy restarts trainers) must be over before the next
        # example, and the coordinator must have taken what the agent accepted.
        settle(env)
        failures = env.forward_failures.messages
        assert not failures, f"the agent accepted {context} but the coordinator did not take it: {failures}"
        return
    # Refused, or nothing that is forwarded (a hello alone, `finished`): nothing may change,
    # here or, once a batch of reports would have gone out, at the coordinator.
    if kind in FORWARDED:
        time.sleep(FORWARD_S)
    after = (agent_state(env), keyspace.snapshot())
    assert after[0] == before[0], f"{context} ({outcome}, {rejected}) changed the agent's trainers"
    assert after[1] == before[1], (
        f"{context} ({outcome}, {rejected}) changed the stored state: {harness.diff(before[1], after[1])}"
    )


@harness.fuzz_settings(2 * harness.EXAMPLES_PER_RPC)
@given(stream=streams())
# Regressions: a trainer's error of kind UNSPECIFIED, a fired fault of an unknown kind, or a
# time out of range, was accepted and forwarded to the coordinator, which refused it: the
# trainer never knew ...
@example(stream=Stream(_hello(), T.ConnectRequest(error=T.TrainerError(message="no kind"))))
@example(
    stream=Stream(
        _hello(),
        T.ConnectRequest(error=T.TrainerError(kind=C.FAILURE_KIND_CUDA_ERROR, first_seen={"seconds": -(2**62)})),
    )
)
@example(stream=Stream(_hello(), T.ConnectRequest(fault_fired=T.FaultFired(fault=C.Fault(kind=99)))))  # type: ignore[arg-type]
@example(stream=Stream(_hello(), T.ConnectRequest(fault_fired=T.FaultFired(injected={"seconds": 2**62}))))
# ... and iteration reports the coordinator refuses, taking the rest of their batch (other
# trainers' reports) with them.
@example(stream=Stream(_hello(), _iteration(flops=float("nan"))))
@example(stream=Stream(_hello(), _iteration(iteration=0)))
def test_fuzzed_streams(agent_target: AgentUnderTest, stream: Stream) -> None:
    run_stream(agent_target, stream)


ADVERSARIAL = [
    Stream(None, None),  # opened and closed with nothing said
    Stream(T.ConnectRequest(), None),
    Stream(_iteration(), None),  # a report before the hello
    Stream(T.ConnectRequest(hello=T.TrainerHello(job_id="job-nope")), _iteration()),
    Stream(T.ConnectRequest(hello=T.TrainerHello(job_id=OWN + ":events")), None),
    Stream(T.ConnectRequest(hello=T.TrainerHello(job_id="../" + OWN)), None),
    Stream(_hello(), _hello()),  # a second hello
    Stream(_hello(), _iteration(job_id="job-other")),  # about another trainer
    Stream(_hello(), _iteration(seconds=-1.0)),
    Stream(_hello(), _iteration(seconds=float("nan"))),
    Stream(_hello(), _iteration(iteration=0)),
    Stream(_hello(), T.ConnectRequest(error=T.TrainerError(kind=-3))),  # type: ignore[arg-type]
    Stream(_hello(), T.ConnectRequest(finished=T.TrainerFinished(iterations=2**64 - 1))),
]


@pytest.mark.parametrize("stream", ADVERSARIAL, ids=[str(i) for i in range(len(ADVERSARIAL))])
def test_adversarial_streams(agent_target: AgentUnderTest, stream: Stream) -> None:
    run_stream(agent_target, stream)


@harness.fuzz_settings(harness.EXAMPLES_PER_RPC)
@given(data=st.binary(max_size=256), then=st.one_of(st.none(), st.sampled_from(SEEDS)))
def test_raw_bytes(agent_target: AgentUnderTest, data: bytes, then: T.ConnectRequest | None) -> None:
    """Arbitrary bytes as the first message (a valid one may follow)."""
    run_stream(agent_target, Stream(None, then), raw_first=data)
