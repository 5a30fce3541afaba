"""The coordinator lease and the store's fencing against a real Redis, and a client channel
over several coordinator addresses failing over from a dead server to a live one."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.coordinator.lease import FENCE_KEY, LEASE_KEY, Holder, Lease, LeaseKeeper, NotLeader, read_holder
from services.coordinator.redis_store import RedisStore
from services.coordinator.store import JobWrite
from unicron import rpc
from unicron.redisutil import free_port
from unicron.v1 import common_pb2, node_service_pb2
from unicron_dev.localcluster import ROOT, tiny_gpt

pytestmark = pytest.mark.integration


def new_lease(client: redis.Redis, name: str, ttl_s: float = 3.0) -> Lease:
    return Lease(client, f"{name}@127.0.0.1:{free_port()}", ttl_s=ttl_s)


def test_one_holder_and_the_fence_grows(redis_client: redis.Redis) -> None:
    a, b = new_lease(redis_client, "a"), new_lease(redis_client, "b")
    assert a.try_acquire()
    assert not b.try_acquire()
    assert read_holder(redis_client) == a.holder
    assert a.renew() and not b.renew()
    first = a.fence
    assert first >= 1
    assert a.release()
    assert read_holder(redis_client) is None
    assert not a.renew()  # released: nothing to renew
    assert b.try_acquire()  # at once after a release
    assert b.fence == first + 1
    assert not a.release()  # not ours: left alone
    assert read_holder(redis_client) == b.holder


def test_an_expired_lease_goes_to_the_next_and_the_old_holder_cannot_renew(redis_client: redis.Redis) -> None:
    a, b = new_lease(redis_client, "a", ttl_s=0.3), new_lease(redis_client, "b", ttl_s=0.3)
    assert a.try_acquire()
    time.sleep(0.4)
    assert b.try_acquire()
    assert not a.renew()
    assert b.fence == a.fence + 1


def test_renewal_keeps_the_lease_past_its_ttl(redis_client: redis.Redis) -> None:
    a, b = new_lease(redis_client, "a", ttl_s=0.3), new_lease(redis_client, "b", ttl_s=0.3)
    assert a.try_acquire()
    lost: list[str] = []
    keeper = LeaseKeeper(a, on_lost=lost.append)
    keeper.start()
    time.sleep(1.0)
    assert not b.try_acquire()
    keeper.stop()
    assert lost == []


def test_a_stolen_lease_is_noticed_within_a_renewal(redis_client: redis.Redis) -> None:
    a = new_lease(redis_client, "a", ttl_s=0.6)
    assert a.try_acquire()
    lost: list[str] = []
    keeper = LeaseKeeper(a, on_lost=lost.append)
    keeper.start()
    steal(redis_client)
    started = time.monotonic()
    while not lost:
        assert time.monotonic() - started < 1.0, "stolen lease not noticed"
        time.sleep(0.01)
    assert "another" in lost[0]


def test_wait_acquire_takes_over_when_released_and_stops_on_request(redis_client: redis.Redis) -> None:
    a, b = new_lease(redis_client, "a"), new_lease(redis_client, "b")
    assert a.try_acquire()
    stop = threading.Event()
    stop.set()
    assert not b.wait_acquire(stop)
    timer = threading.Timer(0.3, a.release)
    timer.start()
    started = time.monotonic()
    assert b.wait_acquire(threading.Event(), poll_s=0.05)
    assert time.monotonic() - started < 1.0
    timer.join()


def steal(client: redis.Redis, ttl_ms: int = 60_000) -> Holder:
    """What another coordinator's acquisition leaves in Redis."""
    thief = Holder(int(client.incr(FENCE_KEY)), "thief", "thief@elsewhere")  # type: ignore[arg-type]
    client.set(LEASE_KEY, thief.encode(), px=ttl_ms)
    return thief


# ---- fencing in the store ---------------------------------------------------------------------


def snapshot(client: redis.Redis) -> dict[bytes, Any]:
    keys = sorted(k for k in client.keys("*") if k not in (LEASE_KEY.encode(), FENCE_KEY.encode()))  # type: ignore[union-attr]
    return {k: client.dump(k) for k in keys}


def new_job(name: str) -> tuple[common_pb2.Job, common_pb2.JobEvent]:
    job = common_pb2.Job(job_id=f"job-{name}", spec=tiny_gpt(name), state=common_pb2.JOB_STATE_PENDING)
    job.created.FromNanoseconds(time.time_ns())
    return job, common_pb2.JobEvent(job_id=job.job_id, message="submitted")


def bump(job: common_pb2.Job) -> JobWrite:
    job.reason = "bumped"
    command = node_service_pb2.NodeCommand(stop_workers=node_service_pb2.StopWorkers(job_id=job.job_id))
    return JobWrite([common_pb2.JobEvent(job_id=job.job_id, message="bumped")], [("node-a", command)])


def fenced_store(client: redis.Redis) -> tuple[RedisStore, Lease]:
    lease = new_lease(client, "me")
    assert lease.try_acquire()
    return RedisStore(client, lease=lease), lease


def test_the_leader_writes_as_before(redis_client: redis.Redis) -> None:
    store, _ = fenced_store(redis_client)
    job, submitted = new_job("leader")
    store.create_job(job, submitted)
    assert store.update_job(job.job_id, bump).version == 2
    node = common_pb2.Node(node_id="node-a", address="127.0.0.1:1", slots=2, state=common_pb2.NODE_STATE_READY)
    store.put_node(node, time.time())
    assert store.set_node_state("node-a", common_pb2.NODE_STATE_LOST, expected=common_pb2.NODE_STATE_READY, now=1.0)
    assert store.append_command("node-a", node_service_pb2.NodeCommand()) != ""
    incident = common_pb2.Incident(incident_id="inc-1", job_id=job.job_id)
    assert store.upsert_incident("k", lambda _: incident) == (incident, True)
    stored = store.update_incident("inc-1", lambda current: setattr(current, "summary", "edited"))
    assert stored is not None and stored.summary == "edited"


FencedWrite = Callable[[RedisStore], object]
WRITES: dict[str, FencedWrite] = {
    "create_job": lambda s: s.create_job(*new_job("second")),
    "update_job": lambda s: s.update_job("job-first", bump),
    "set_node_state": lambda s: s.set_node_state(
        "node-a", common_pb2.NODE_STATE_LOST, expected=common_pb2.NODE_STATE_READY, now=1.0
    ),
    "upsert_incident": lambda s: s.upsert_incident("k", lambda _: common_pb2.Incident(incident_id="inc-1")),
    "upsert_incidents": lambda s: s.upsert_incidents({"k": lambda _: common_pb2.Incident(incident_id="inc-1")}),
    "update_incident": lambda s: s.update_incident("inc-1", lambda current: None),
    "append_command": lambda s: s.append_command("node-a", node_service_pb2.NodeCommand()),
}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("how", ["stolen", "expired", "released"])
def test_a_deposed_coordinator_writes_nothing(redis_client: redis.Redis, write: str, how: str) -> None:
    store, lease = fenced_store(redis_client)
    store.create_job(*new_job("first"))
    node = common_pb2.Node(node_id="node-a", address="127.0.0.1:1", slots=2, state=common_pb2.NODE_STATE_READY)
    store.put_node(node, time.time())
    if how == "stolen":
        steal(redis_client)
    elif how == "expired":
        redis_client.delete(LEASE_KEY)
    else:
        lease.release()
    before = snapshot(redis_client)
    with pytest.raises(NotLeader):
        WRITES[write](store)
    assert snapshot(redis_client) == before
    assert lease.lost.is_set()  # the keeper steps down at once


def test_a_write_prepared_before_another_acquisition_is_aborted(redis_client: redis.Redis) -> None:
    """The check passed, then the lease expired and another coordinator took it before EXEC:
    the fencing counter it incremented aborts the transaction, and the retry is refused."""
    store, _ = fenced_store(redis_client)
    store.create_job(*new_job("first"))
    before = snapshot(redis_client)
    calls = 0

    def mutate(job: common_pb2.Job) -> JobWrite:
        nonlocal calls
        calls += 1
        if calls == 1:
            redis_client.delete(LEASE_KEY)  # expired
            assert new_lease(redis_client, "next").try_acquire()
        return bump(job)

    with pytest.raises(NotLeader):
        store.update_job("job-first", mutate)
    assert calls == 1
    assert snapshot(redis_client) == before


def test_renewals_do_not_abort_writes(redis_client: redis.Redis) -> None:
    store, lease = fenced_store(redis_client)
    store.create_job(*new_job("first"))
    calls = 0

    def mutate(job: common_pb2.Job) -> JobWrite:
        nonlocal calls
        calls += 1
        assert lease.renew()
        return bump(job)

    assert store.update_job("job-first", mutate).version == 2
    assert calls == 1


def test_a_store_without_a_lease_is_not_fenced(redis_client: redis.Redis) -> None:
    steal(redis_client)
    store = RedisStore(redis_client)
    store.create_job(*new_job("first"))
    assert store.update_job("job-first", bump).version == 2


# ---- a channel over several addresses ---------------------------------------------------------


def serving_health(port: int) -> rpc.Server:
    server = rpc.Server(bind=f"127.0.0.1:{port}", max_workers=4, grace_s=0)
    server.start()
    return server


def check(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_check(stub: health_pb2_grpc.HealthStub, timeout_s: float) -> float:
    started = time.monotonic()
    while not check(stub):
        assert time.monotonic() - started < timeout_s, f"no server answered within {timeout_s}s"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_channel_over_two_addresses_follows_the_active_server() -> None:
    """A standby does not listen: calls fall through to the active one; when the active
    dies and the standby starts serving, the same channel reconnects to it by itself."""
    first, second = free_port(), free_port()
    active = serving_health(second)
    channel = rpc.channel(f"127.0.0.1:{first},127.0.0.1:{second}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        assert wait_check(stub, 2.0) < 1.0
        active.stop()  # the active dies; for a while no one serves
        time.sleep(0.5)
        assert not check(stub)
        standby = serving_health(first)  # the standby took over
        try:
            took = wait_check(stub, 5.0)
            assert took < 2.0, f"reconnected after {took:.2f}s"  # CHANNEL_OPTIONS: backoff <= 1 s
            assert rpc.wait_ready(f"127.0.0.1:{first},127.0.0.1:{second}", timeout_s=1.0)
            standby.stop()
            back = serving_health(second)  # and back again
            try:
                assert wait_check(stub, 5.0) < 2.0
            finally:
                back.stop()
        finally:
            standby.stop()
    finally:
        channel.close()


def test_a_server_slow_to_answer_the_handshake_is_waited_for() -> None:
    """A busy server's HTTP/2 SETTINGS may come late (a loaded machine, a process paused for
    a moment): the connection attempt waits for it instead of failing the call at once."""
    port = free_port()
    code = f"from unicron import rpc; s = rpc.Server(bind='127.0.0.1:{port}', max_workers=4); s.start(); s.wait()"
    server = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        assert rpc.wait_ready(f"127.0.0.1:{port}", timeout_s=30)
        server.send_signal(signal.SIGSTOP)  # accepts TCP connections, answers nothing
        resume = threading.Timer(1.0, server.send_signal, [signal.SIGCONT])
        resume.start()
        with rpc.channel(f"127.0.0.1:{port},127.0.0.1:{free_port()}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        resume.join()
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
