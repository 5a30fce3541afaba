"""The lease's decisions (pure, clock as a parameter) and the multi-address gRPC target."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from services.coordinator.lease import (
    Decision,
    Holder,
    LeaseKeeper,
    NotLeader,
    Renewal,
    after_renewal,
    renew_interval,
    trusted_until,
)
from unicron import errors, rpc

TTL = 3.0


@pytest.mark.parametrize(
    ("outcome", "now", "last_renewed_at", "expected"),
    [
        # Renewed just now: next renewal a third of the TTL later.
        (Renewal.RENEWED, 100.0, 100.0, Decision(False, wait_s=1.0)),
        # Renewed, but the call took 0.4 s: the next one is due 0.6 s later.
        (Renewal.RENEWED, 100.4, 100.0, Decision(False, wait_s=0.6)),
        # A renewal that took longer than the interval: renew again at once.
        (Renewal.RENEWED, 101.5, 100.0, Decision(False, wait_s=0.0)),
        # Lost to another holder: step down whatever the clock says.
        (Renewal.LOST, 100.0, 100.0, Decision(True, "the lease is held by another coordinator or expired")),
        (Renewal.LOST, 100.1, 99.9, Decision(True, "the lease is held by another coordinator or expired")),
        # Redis did not answer, little time passed: retry soon (TTL/15).
        (Renewal.UNREACHABLE, 101.0, 100.0, Decision(False, wait_s=0.2)),
        # ...but never past the moment the lease can no longer be trusted (0.9 x TTL).
        (Renewal.UNREACHABLE, 102.6, 100.0, Decision(False, wait_s=0.1)),
        # Unreachable up to that moment: step down before anyone else may take the lease.
        (Renewal.UNREACHABLE, 102.7, 100.0, Decision(True, "Redis unreachable for 2.7s (lease TTL 3s)")),
        (Renewal.UNREACHABLE, 110.0, 100.0, Decision(True, "Redis unreachable for 10.0s (lease TTL 3s)")),
    ],
)
def test_after_renewal(outcome: Renewal, now: float, last_renewed_at: float, expected: Decision) -> None:
    decision = after_renewal(outcome, now, last_renewed_at, TTL)
    assert decision.step_down == expected.step_down
    assert decision.reason == expected.reason
    assert decision.wait_s == pytest.approx(expected.wait_s)


def test_timing_constants() -> None:
    assert renew_interval(3.0) == 1.0
    assert trusted_until(10.0, 3.0) == pytest.approx(12.7)
    assert trusted_until(10.0, 3.0) < 10.0 + 3.0  # steps down before the lease can expire


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        (b"7 abc host:12@127.0.0.1:5000", Holder(7, "abc", "host:12@127.0.0.1:5000")),
        ("12 tok an identity with spaces", Holder(12, "tok", "an identity with spaces")),
        (b"3 tok", Holder(3, "tok", "")),
        (b"garbage", None),
        (b"x tok id", None),
    ],
)
def test_holder_decode(raw: bytes | str | None, expected: Holder | None) -> None:
    assert Holder.decode(raw) == expected
    if expected is not None:
        assert Holder.decode(expected.encode()) == expected


def test_not_leader_is_unavailable() -> None:
    # UNAVAILABLE at the gRPC edge, so agents and clients retry (and reach the new leader).
    assert rpc.status_for(NotLeader("x")).name == "UNAVAILABLE"


# ---- the keeper, with a fake lease and a fake clock ------------------------------------------


class FakeLease:
    def __init__(self, results: list[bool | Exception], step: float = 0.0) -> None:
        self.results = results
        self.ttl_s = TTL
        self.now = 1000.0
        self.step = step  # how long each renew call takes
        self.acquired_at = self.now
        self.lost = threading.Event()

    def clock(self) -> float:
        return self.now

    def renew(self) -> bool:
        self.now += self.step
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


def test_keeper_ticks() -> None:
    fake = FakeLease([True, redis.ConnectionError("down"), redis.TimeoutError("slow"), True, False])
    keeper = LeaseKeeper(fake, on_lost=lambda _: None)  # type: ignore[arg-type]
    keeper.last_renewed_at = fake.acquired_at

    fake.now = 1001.0
    assert keeper.tick() == Decision(False, wait_s=1.0)
    assert keeper.last_renewed_at == 1001.0
    fake.now = 1002.0
    assert not keeper.tick().step_down  # unreachable 1 s: keep trying
    assert keeper.last_renewed_at == 1001.0
    fake.now = 1003.8
    decision = keeper.tick()  # unreachable 2.8 s > 0.9 x TTL
    assert decision.step_down and "unreachable" in decision.reason
    fake.now = 1004.0
    assert keeper.tick() == Decision(False, wait_s=1.0)  # Redis back, the lease still ours: renewed
    assert keeper.tick().step_down  # refused: another holder


def test_keeper_steps_down_at_once_when_a_write_was_refused() -> None:
    fake = FakeLease([True])
    keeper = LeaseKeeper(fake, on_lost=lambda _: None)  # type: ignore[arg-type]
    fake.lost.set()
    decision = keeper.tick()
    assert decision.step_down and "refused" in decision.reason
    assert fake.results == [True]  # did not even try to renew


def test_keeper_thread_calls_on_lost_once() -> None:
    fake = FakeLease([False])
    fake.ttl_s = 0.3
    lost: list[str] = []
    keeper = LeaseKeeper(fake, on_lost=lost.append)  # type: ignore[arg-type]
    keeper.start()
    assert keeper._thread is not None
    keeper._thread.join(timeout=2)
    assert len(lost) == 1 and "another" in lost[0]


# ---- several addresses in one gRPC target ----------------------------------------------------


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("localhost:50051", "localhost:50051"),  # one address: as it is, as before
        ("dns:///coordinator:50051", "dns:///coordinator:50051"),
        ("127.0.0.1:1,127.0.0.1:2", "ipv4:127.0.0.1:1,127.0.0.1:2"),
        (" 127.0.0.1:1 , 10.0.0.2:2 ,", "ipv4:127.0.0.1:1,10.0.0.2:2"),
        ("localhost:1,127.0.0.1:2", "ipv4:127.0.0.1:1,127.0.0.1:2"),
        ("[::1]:1,[::1]:2", "ipv6:[::1]:1,[::1]:2"),
    ],
)
def test_target(address: str, target: str) -> None:
    assert rpc.target(address) == target


@pytest.mark.parametrize("address", ["127.0.0.1:1,127.0.0.1", "127.0.0.1:1,:2", "127.0.0.1:1,[::1]:2"])
def test_bad_target(address: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        rpc.target(address)


class BlockedLease:
    """A lease whose renewals never answer (a Redis client stuck rediscovering a master)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.clock = time.monotonic
        self.acquired_at = time.monotonic()
        self.lost = threading.Event()
        self.released = threading.Event()

    def renew(self) -> bool:
        self.released.wait(30)
        return True


def test_a_renewal_that_never_answers_stops_the_holder_when_the_lease_ends() -> None:
    lease = BlockedLease(ttl_s=0.6)
    lost: list[str] = []
    said = threading.Event()

    def on_lost(why: str) -> None:
        lost.append(why)
        said.set()

    keeper = LeaseKeeper(lease, on_lost=on_lost)  # type: ignore[arg-type]
    keeper.start()
    try:
        assert said.wait(5.0), "the holder kept acting while its renewal hung"
        waited = time.monotonic() - lease.acquired_at
        assert 0.5 <= waited < 2.0, waited
        assert lost == [lost[0]] and "no renewal answered" in lost[0], lost
    finally:
        lease.released.set()
        keeper.stop()
    time.sleep(0.1)
    assert len(lost) == 1  # the renewal that answered late says nothing more
