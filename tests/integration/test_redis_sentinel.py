"""The coordinator's store over a real replicated Redis: a primary, two replicas and three
sentinels (redis-server processes). A write is acknowledged only once a replica holds it; a
primary that cannot reach its replicas refuses writes; the coordinator waits, saying why, for
a group it cannot trust, and refuses a quorum that can never fail over."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from services.coordinator.lease import Lease, NotLeader, lease_client
from services.coordinator.redis_keys import job_key
from services.coordinator.redis_store import RedisStore
from unicron import redisutil
from unicron.errors import AlreadyExists, Unavailable
from unicron.redis_replication import NotReplicated
from unicron.service import EXIT_CONFIG
from unicron.v1 import common_pb2
from unicron_dev.redis_group import MASTER, RedisGroup

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def group(tmp_path: Path) -> Iterator[RedisGroup]:
    with RedisGroup(tmp_path / "group", min_replicas_max_lag_s=2) as started:
        yield started


def new_job(name: str) -> tuple[common_pb2.Job, common_pb2.JobEvent]:
    job = common_pb2.Job(job_id=f"job-{name}")
    job.spec.name = name
    return job, common_pb2.JobEvent(message="submitted")


def test_an_acknowledged_write_is_on_a_replica(group: RedisGroup) -> None:
    store = RedisStore(redisutil.connect(group.url, acks=1, wait_ms=2000))
    store.create_job(*new_job("a"))
    held = 0
    for replica in group.servers[1:]:
        mirror: Any = redis.Redis(replica.host, replica.port)
        assert mirror.info("replication")["role"] == "slave"
        held += int(mirror.exists(job_key("job-a")))
    # WAIT said at least one replica had it before create_job returned.
    assert held >= 1


def test_a_write_no_replica_holds_is_not_acknowledged_and_then_refused(group: RedisGroup) -> None:
    client = redisutil.connect(group.url, acks=1, wait_ms=300)
    store = RedisStore(client)
    store.create_job(*new_job("before"))
    for replica in group.servers[1:]:
        group.pause(replica)
    try:
        # Within min-replicas-max-lag the primary still takes the write: WAIT tells.
        with pytest.raises(NotReplicated, match="0 of the 2 replica"):
            store.create_job(*new_job("unreplicated"))
        time.sleep(3.5)  # past min-replicas-max-lag: the primary refuses writes itself
        with pytest.raises(Unavailable, match="min-replicas-to-write"):
            store.create_job(*new_job("refused"))
        # Reads go on: a standby or a tool can still look.
        assert store.get_job("before").spec.name == "before"
    finally:
        for replica in group.servers[1:]:
            group.resume(replica)


def test_a_lease_held_on_a_primary_cut_off_from_its_replicas_is_not_renewed(group: RedisGroup) -> None:
    lease = Lease(lease_client(group.url, ttl_s=3.0, acks=1), "c0", ttl_s=3.0)
    assert lease.try_acquire()
    assert lease.renew()
    for replica in group.servers[1:]:
        group.pause(replica)
    try:
        with pytest.raises(NotReplicated):
            lease.renew()
    finally:
        for replica in group.servers[1:]:
            group.resume(replica)
    store = RedisStore(redisutil.connect(group.url, acks=1), lease=lease)
    lease.holder = None  # as after a failover that lost the acquisition
    with pytest.raises(NotLeader):
        store.create_job(*new_job("fenced"))


def test_the_store_follows_a_failover(group: RedisGroup) -> None:
    store = RedisStore(redisutil.connect(group.url, acks=1, wait_ms=2000))
    store.create_job(*new_job("before"))
    old = group.kill_primary()
    group.wait_healthy(30, not_primary=old)
    deadline = time.monotonic() + 15
    while True:
        try:
            store.create_job(*new_job("after"))
            break
        except AlreadyExists:
            break  # an earlier try was applied but not acknowledged (its replicas were syncing)
        except Unavailable:
            assert time.monotonic() < deadline, "the store did not follow the failover"
            time.sleep(0.1)
    assert {job.spec.name for job in store.list_jobs()} == {"before", "after"}


def coordinator(url: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.coordinator",
            "--plaintext",
            "--redis-url",
            url,
            *extra,
            "--bind",
            f"127.0.0.1:{redisutil.free_port()}",
            "--metrics-bind",
            "",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def said_within(proc: subprocess.Popen[str], text: str, timeout_s: float = 20.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"never said {text!r}: {''.join(seen)[-2000:]}")


@pytest.mark.parametrize(
    ("where", "says"),
    [("sentinels-down", "no sentinel answers"), ("unknown-master", "no sentinel knows a master named 'elsewhere'")],
)
def test_a_coordinator_waits_as_a_standby_for_a_group_it_cannot_trust(group: RedisGroup, where: str, says: str) -> None:
    if where == "sentinels-down":
        url = f"redis+sentinel://127.0.0.1:{redisutil.free_port()},127.0.0.1:{redisutil.free_port()}/{MASTER}"
    else:
        url = group.url.replace(f"/{MASTER}", "/elsewhere")
    proc = coordinator(url)
    try:
        line = said_within(proc, "standby: waiting for Redis")
        assert says in line, line
        time.sleep(1.0)
        assert proc.poll() is None, "it must wait, not exit"
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0


def test_a_quorum_that_can_never_fail_over_is_refused_at_start(group: RedisGroup) -> None:
    for index in range(3):
        group.sentinel_client(index).execute_command("SENTINEL", "SET", MASTER, "quorum", "5")
    proc = coordinator(group.url)
    try:
        line = said_within(proc, "quorum")
        assert "quorum is 5 but the URL names 3 sentinel(s): it never fails over" in line, line
        assert proc.wait(timeout=15) == EXIT_CONFIG
        assert proc.stdout is not None and "Traceback" not in proc.stdout.read()
    finally:
        proc.kill()
