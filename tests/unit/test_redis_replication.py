"""Sentinel URLs, and the pure checks the coordinator makes of a replicated Redis before it
acts on it."""

from __future__ import annotations

from typing import Any

import pytest

from services.coordinator.__main__ import CoordinatorConfig
from unicron import redis_replication
from unicron.errors import InvalidArgument
from unicron.redis_replication import (
    SentinelURL,
    parse_sentinel_url,
    quorum_problem,
    replication_problem,
    unavailable_reply,
    watching_problem,
)
from unicron.redisutil import redacted


def test_a_sentinel_url_names_the_sentinels_the_master_and_the_database() -> None:
    assert parse_sentinel_url("redis+sentinel://a:26379,b:26380/unicron") == SentinelURL(
        (("a", 26379), ("b", 26380)), "unicron"
    )
    got = parse_sentinel_url("rediss+sentinel://user:p%40ss@10.0.0.1:1,[::1]:2/main/3")
    assert got == SentinelURL((("10.0.0.1", 1), ("::1", 2)), "main", 3, "p@ss", "user", tls=True)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://a:1,b:2", "names no master"),
        ("redis+sentinel://a:1/", "names no master"),
        ("redis+sentinel://a/m", "is not HOST:PORT"),
        ("redis+sentinel://a:99999/m", "is not HOST:PORT"),
        ("redis+sentinel://a:1,a:1/m", "names a sentinel twice"),
        ("redis+sentinel://a:1/m/x", "optional /DB number"),
        ("redis+sentinel://a:1/m/0/extra", "optional /DB number"),
        ("redis://a:1/0", "a Sentinel URL starts"),
    ],
)
def test_a_bad_sentinel_url_is_refused_naming_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says) as caught:
        parse_sentinel_url(url)
    assert caught.value.field == "redis_url"


def test_the_coordinator_config_takes_sentinel_urls_and_waits_for_one_replica_by_default() -> None:
    sentinel = CoordinatorConfig(plaintext=True, redis_url="redis+sentinel://a:1,b:2,c:3/unicron")
    assert sentinel.acks == 1
    assert CoordinatorConfig(plaintext=True).acks == 0
    assert CoordinatorConfig(plaintext=True, redis_url="redis+sentinel://a:1/u", redis_acks=2).acks == 2
    with pytest.raises(InvalidArgument, match="redis_url"):
        CoordinatorConfig(plaintext=True, redis_url="redis+sentinel://a:1")
    with pytest.raises(InvalidArgument, match="redis_acks"):
        CoordinatorConfig(plaintext=True, redis_acks=-2)
    with pytest.raises(InvalidArgument, match="redis_wait_ms"):
        CoordinatorConfig(plaintext=True, redis_wait_ms=0)
    with pytest.raises(InvalidArgument, match="redis_url"):
        CoordinatorConfig(plaintext=True, redis_url="rediss+sentinel://a:1/u")


@pytest.mark.parametrize(
    ("state", "named", "problem"),
    [
        ({"quorum": 2, "num-other-sentinels": 2}, 3, None),
        ({"quorum": 3, "num-other-sentinels": 1}, 3, None),  # still finding each other: wait
        ({"quorum": 4, "num-other-sentinels": 2}, 3, "names 3 sentinel(s): it never fails over"),
        ({"quorum": 0, "num-other-sentinels": 2}, 3, "below 1"),
    ],
)
def test_a_quorum_that_can_never_fail_over_is_a_mistake(state: dict[str, Any], named: int, problem: str | None) -> None:
    said = quorum_problem(state, named)
    assert (said is None) if problem is None else (problem in (said or ""))


def test_sentinels_still_finding_each_other_are_waited_for() -> None:
    assert "fewer than its quorum of 2" in (watching_problem({"quorum": 2, "num-other-sentinels": 0}) or "")
    assert watching_problem({"quorum": 2, "num-other-sentinels": 2}) is None


def replica(state: str = "online", lag: int = 0) -> dict[str, Any]:
    return {"ip": "10.0.0.2", "port": 6379, "state": state, "offset": 10, "lag": lag}


@pytest.mark.parametrize(
    ("info", "acks", "problem"),
    [
        ({"role": "master", "slave0": replica(), "slave1": replica()}, 1, None),
        ({"role": "master"}, 0, None),
        ({"role": "master"}, 1, "has 0 current"),
        ({"role": "master", "slave0": replica(lag=30)}, 1, "1 behind or not online"),
        ({"role": "master", "slave0": replica("wait_bgsave")}, 1, "1 behind or not online"),
        ({"role": "master", "slave0": replica()}, 2, "wait for 2 replica(s) but the primary has 1"),
        ({"role": "slave"}, 1, "says it is a replica"),
    ],
)
def test_writes_wait_only_where_enough_replicas_are_current(
    info: dict[str, Any], acks: int, problem: str | None
) -> None:
    said = replication_problem(info, acks)
    assert (said is None) if problem is None else (problem in (said or ""))


def test_replication_refusals_are_told_apart_from_other_errors() -> None:
    import redis

    assert "min-replicas" in (unavailable_reply(redis.ResponseError("NOREPLICAS Not enough good replicas")) or "")
    assert "failed over" in (unavailable_reply(redis.ReadOnlyError("READONLY You can't write")) or "")
    assert unavailable_reply(redis.ResponseError("WRONGTYPE Operation against a key")) is None


def test_passwords_never_reach_a_log() -> None:
    assert redacted("redis://:secret@h:1/0") == "redis://:***@h:1/0"
    assert redacted("rediss+sentinel://u:secret@a:1,b:2/m") == "rediss+sentinel://u:***@a:1,b:2/m"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize(
    ("replica", "up"),
    [
        ({"info-refresh": 9_500}, True),  # healthy: sentinels ask for INFO every 10 s
        ({"info-refresh": 400, "is_sdown": True}, False),
        ({"info-refresh": 400, "is_odown": True}, False),
        ({"info-refresh": 400, "is_disconnected": True}, False),
        ({"info-refresh": 1_765_000_000_000}, False),  # never heard: an old primary just listed
    ],
)
def test_which_replicas_a_write_waits_for(replica: dict[str, object], up: bool) -> None:
    assert redis_replication._up(replica) is up
