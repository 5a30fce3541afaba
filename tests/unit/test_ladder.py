"""The severity ladder as a table of cases: no servers, the clock passed in."""

from __future__ import annotations

import pytest

from services.coordinator.ladder import Decision, LadderPolicy, choose
from unicron.v1 import common_pb2 as pb

NOW = 10_000.0
POLICY = LadderPolicy(attempts_per_remedy=2, window_s=600.0, max_remedies=5)


def attempts(*items: tuple[int, float]) -> list[pb.RemedyAttempt]:
    out = []
    for remedy, ago in items:
        attempt = pb.RemedyAttempt(remedy=remedy)  # type: ignore[arg-type]
        attempt.started.FromNanoseconds(int((NOW - ago) * 1e9))
        out.append(attempt)
    return out


RE, RS, RC = pb.REMEDY_REATTEMPT, pb.REMEDY_RESTART, pb.REMEDY_RECONFIGURE

CASES = [
    # (name, kind, past, ranks_alive, expected remedy or None)
    ("sev3 first", pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, [], True, RE),
    ("sev3 with a dead rank restarts", pb.FAILURE_KIND_CONNECTION_RESET, [], False, RS),
    ("sev2 first", pb.FAILURE_KIND_PROCESS_EXIT, [], True, RS),
    ("sev1 first", pb.FAILURE_KIND_NODE_LOST, [], True, RC),
    ("hang restarts", pb.FAILURE_KIND_TASK_HANG, [], True, RS),
    ("missed ack restarts", pb.FAILURE_KIND_TRANSITION_TIMEOUT, [], True, RS),
    ("sev3 after one reattempt", pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, attempts((RE, 10)), True, RE),
    ("sev3 after two reattempts", pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, attempts((RE, 20), (RE, 10)), True, RS),
    ("old attempts are forgotten", pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, attempts((RE, 900), (RE, 700)), True, RE),
    ("sev2 after two restarts", pb.FAILURE_KIND_PROCESS_EXIT, attempts((RS, 30), (RS, 10)), True, RC),
    (
        "sev3 climbs two rungs",
        pb.FAILURE_KIND_NETWORK_ERROR,
        attempts((RE, 40), (RE, 30), (RS, 20), (RS, 10)),
        True,
        RC,  # reattempt and restart used up, reconfigure is next
    ),
    ("sev1 after two reconfigures fails", pb.FAILURE_KIND_NODE_LOST, attempts((RC, 20), (RC, 10)), True, None),
    (
        "too many remedies fail the job",
        pb.FAILURE_KIND_PROCESS_EXIT,
        attempts((RE, 50), (RS, 40), (RE, 30), (RC, 20), (RS, 10)),
        True,
        None,
    ),
    ("a straggler has no remedy", pb.FAILURE_KIND_STRAGGLER, [], True, None),
]


@pytest.mark.parametrize(("name", "kind", "past", "alive", "expected"), CASES, ids=[c[0] for c in CASES])
def test_ladder(name: str, kind: int, past: list[pb.RemedyAttempt], alive: bool, expected: int | None) -> None:
    decision = choose(kind, past, NOW, POLICY, ranks_alive=alive)
    assert isinstance(decision, Decision)
    assert decision.remedy == expected, decision.reason
    assert decision.reason


def test_nothing_restarts_in_place_on_a_node_that_is_not_ready() -> None:
    decision = choose(pb.FAILURE_KIND_PROCESS_EXIT, [], NOW, POLICY, placement_ready=False)
    assert decision.remedy == RC and "not ready" in decision.reason
    decision = choose(pb.FAILURE_KIND_CONNECTION_RESET, [], NOW, POLICY, placement_ready=False)
    assert decision.remedy == RC


def test_reasons_explain_escalation() -> None:
    decision = choose(pb.FAILURE_KIND_PROCESS_EXIT, attempts((RS, 30), (RS, 10)), NOW, POLICY)
    assert "restart process already tried 2x" in decision.reason
    assert "escalating to reconfigure" in decision.reason
    failed = choose(pb.FAILURE_KIND_NODE_LOST, attempts((RC, 20), (RC, 10)), NOW, POLICY)
    assert "no heavier remedy left" in failed.reason


def test_policy_is_validated() -> None:
    with pytest.raises(Exception, match="attempts_per_remedy"):
        LadderPolicy(attempts_per_remedy=0)
