"""One contract, two stores: every test runs on the Redis store (a real redis-server) and on
the in-memory store the coordinator's unit tests use, so those tests prove what production
does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from services.coordinator.memory_store import MemoryStore
from services.coordinator.redis_store import RedisStore
from services.coordinator.store import JobWrite, Store
from unicron.errors import AlreadyExists, NotFound
from unicron.v1 import common_pb2, node_service_pb2

pytestmark = pytest.mark.integration


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        yield RedisStore(request.getfixturevalue("redis_client"))


def new_job(job_id: str, name: str, created_s: float = 1.0) -> tuple[common_pb2.Job, common_pb2.JobEvent]:
    job = common_pb2.Job(job_id=job_id, spec=common_pb2.JobSpec(name=name), state=common_pb2.JOB_STATE_PENDING)
    job.created.FromNanoseconds(int(created_s * 1e9))
    return job, common_pb2.JobEvent(job_id=job_id, message="submitted")


def a_command(node_id: str) -> node_service_pb2.NodeCommand:
    return node_service_pb2.NodeCommand(stop_workers=node_service_pb2.StopWorkers(job_id=f"job-on-{node_id}"))


def opens(incident_id: str, summary: str, job_id: str = "", detected_s: float = 1.0):  # type: ignore[no-untyped-def]
    def update(current: common_pb2.Incident | None) -> common_pb2.Incident:
        if current is not None:
            current.summary += f"; {summary}"
            return current
        incident = common_pb2.Incident(incident_id=incident_id, summary=summary, job_id=job_id)
        incident.detected.FromNanoseconds(int(detected_s * 1e9))
        return incident

    return update


# ---- jobs ---------------------------------------------------------------------------------


def test_a_job_is_found_by_id_and_by_name_and_names_are_unique(store: Store) -> None:
    created = store.create_job(*new_job("j1", "alpha"))
    assert created.version == 1
    assert store.get_job("j1").spec.name == "alpha"
    assert store.get_job("alpha").job_id == "j1"
    with pytest.raises(AlreadyExists):
        store.create_job(*new_job("j2", "alpha"))
    with pytest.raises(NotFound):
        store.get_job("j2")
    with pytest.raises(NotFound):
        store.get_job("j1:events")  # no id reaches another record's key
    assert [event.message for _, event in store.read_events("j1", "0-0", block_ms=0)] == ["submitted"]


def test_a_name_is_free_again_once_its_job_ended(store: Store) -> None:
    store.create_job(*new_job("j1", "alpha"))

    def cancel(job: common_pb2.Job) -> JobWrite:
        job.state = common_pb2.JOB_STATE_CANCELLED
        return JobWrite([])

    store.update_job("j1", cancel)
    store.create_job(*new_job("j2", "alpha", created_s=2.0))
    assert store.get_job("alpha").job_id == "j2"  # the name finds the new job
    assert store.get_job("j1").state == common_pb2.JOB_STATE_CANCELLED  # the old one, by its id
    with pytest.raises(AlreadyExists):
        store.create_job(*new_job("j3", "alpha"))  # j2 has not ended


def test_jobs_are_listed_newest_first(store: Store) -> None:
    for job_id, created in [("j1", 1.0), ("j2", 3.0), ("j3", 2.0)]:
        store.create_job(*new_job(job_id, f"name-{job_id}", created))
    assert [job.job_id for job in store.list_jobs()] == ["j2", "j3", "j1"]


def test_an_update_writes_the_job_its_events_and_commands_together(store: Store) -> None:
    store.create_job(*new_job("j1", "alpha"))
    before = store.last_command_id("n1")

    def mutate(job: common_pb2.Job) -> JobWrite:
        job.state = common_pb2.JOB_STATE_SCHEDULED
        return JobWrite([common_pb2.JobEvent(job_id="j1", message="placed")], [("n1", a_command("n1"))])

    updated = store.update_job("j1", mutate)
    assert (updated.version, updated.state) == (2, common_pb2.JOB_STATE_SCHEDULED)
    assert store.get_job("j1").state == common_pb2.JOB_STATE_SCHEDULED
    events = [event.message for _, event in store.read_events("j1", "0-0", block_ms=0)]
    assert events == ["submitted", "placed"]
    commands = store.read_commands("n1", before)
    assert len(commands) == 1 and commands[0][1].command_id == commands[0][0]
    assert store.last_command_id("n1") == commands[0][0]


def test_an_update_that_writes_nothing_or_raises_changes_nothing(store: Store) -> None:
    store.create_job(*new_job("j1", "alpha"))

    def nothing(job: common_pb2.Job) -> None:
        job.state = common_pb2.JOB_STATE_FAILED
        return None

    def refuse(job: common_pb2.Job) -> JobWrite:
        job.state = common_pb2.JOB_STATE_FAILED
        raise ValueError("no")

    assert store.update_job("j1", nothing).version == 1
    with pytest.raises(ValueError):
        store.update_job("j1", refuse)
    stored = store.get_job("j1")
    assert (stored.version, stored.state) == (1, common_pb2.JOB_STATE_PENDING)
    assert len(store.read_events("j1", "0-0", block_ms=0)) == 1
    with pytest.raises(NotFound):
        store.update_job("nope", nothing)


def test_many_jobs_update_in_one_write_or_not_at_all(store: Store) -> None:
    store.create_job(*new_job("j1", "alpha"))
    store.create_job(*new_job("j2", "beta"))
    store.create_job(*new_job("j3", "gamma"))

    def place(job: common_pb2.Job) -> JobWrite:
        job.state = common_pb2.JOB_STATE_SCHEDULED
        return JobWrite([common_pb2.JobEvent(job_id=job.job_id, message="placed")])

    def nothing(job: common_pb2.Job) -> None:
        job.state = common_pb2.JOB_STATE_FAILED
        return None

    def refuse(job: common_pb2.Job) -> JobWrite:
        raise ValueError("no")

    updated = store.update_jobs({"j1": place, "j2": place, "j3": nothing})
    assert [(updated[j].version, updated[j].state) for j in ("j1", "j2", "j3")] == [
        (2, common_pb2.JOB_STATE_SCHEDULED),
        (2, common_pb2.JOB_STATE_SCHEDULED),
        (1, common_pb2.JOB_STATE_PENDING),
    ]
    assert [e.message for _, e in store.read_events("j2", "0-0", block_ms=0)] == ["submitted", "placed"]
    with pytest.raises(ValueError):
        store.update_jobs({"j3": place, "j1": refuse})
    with pytest.raises(NotFound):
        store.update_jobs({"j3": place, "nope": place})
    assert (store.get_job("j3").version, store.get_job("j1").version) == (1, 2)
    assert store.update_jobs({}) == {}


def test_concurrent_updates_each_apply_once(store: Store) -> None:
    store.create_job(*new_job("j1", "alpha"))

    def bump(job: common_pb2.Job) -> JobWrite:
        job.replans += 1
        return JobWrite()

    threads = [threading.Thread(target=lambda: [store.update_job("j1", bump) for _ in range(20)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    job = store.get_job("j1")
    assert (job.replans, job.version) == (80, 81)


def test_progress_lives_beside_the_job(store: Store) -> None:
    store.create_job(*new_job("j1", "alpha"))
    store.set_progress("j1", common_pb2.JobProgress(iteration=7), common_pb2.JobEvent(message="iteration 7"))
    assert store.get_job("j1").progress.iteration == 7
    assert store.get_job("j1").version == 1  # a progress write never loses a job's race
    updated = store.update_job("j1", lambda job: JobWrite())
    assert updated.progress.iteration == 7 and store.list_jobs()[0].progress.iteration == 7


def test_exits_are_kept_per_generation(store: Store) -> None:
    assert store.record_exit("j1", 1, 0, 0) == {0: 0}
    assert store.record_exit("j1", 1, 1, -9) == {0: 0, 1: -9}
    assert store.record_exit("j1", 2, 0, 1) == {0: 1}


def test_reading_events_waits_for_the_next_one(store: Store) -> None:
    store.create_job(*new_job("j1", "alpha"))
    cursor = store.last_event_id("j1")
    assert store.last_event_id("nobody") == "0-0"
    started = time.monotonic()
    assert store.read_events("j1", cursor, block_ms=100) == []
    assert time.monotonic() - started >= 0.09
    threading.Timer(0.1, lambda: store.append_event("j1", common_pb2.JobEvent(message="later"))).start()
    read = store.read_events("j1", cursor, block_ms=5000)
    assert [event.message for _, event in read] == ["later"]
    assert store.last_event_id("j1") == read[0][0] != cursor


def test_reads_are_copies(store: Store) -> None:
    store.create_job(*new_job("j1", "alpha"))
    store.get_job("j1").state = common_pb2.JOB_STATE_FAILED
    store.list_jobs()[0].state = common_pb2.JOB_STATE_FAILED
    assert store.get_job("j1").state == common_pb2.JOB_STATE_PENDING


# ---- incidents ----------------------------------------------------------------------------


def test_many_incidents_in_one_write_create_and_extend(store: Store) -> None:
    store.upsert_incident("node:a", opens("inc-a", "a lost"))
    recorded = store.upsert_incidents({"node:b": opens("inc-b", "b lost"), "node:a": opens("inc-x", "a again")})
    assert [(incident.incident_id, created) for incident, created in recorded] == [("inc-b", True), ("inc-a", False)]
    assert store.get_incident("inc-a").summary == "a lost; a again"  # type: ignore[union-attr]
    assert sorted(i.incident_id for i in store.list_incidents()) == ["inc-a", "inc-b"]
    assert store.upsert_incidents({}) == []


def test_a_failing_incident_update_writes_none_of_them(store: Store) -> None:
    def refuse(_current: common_pb2.Incident | None) -> common_pb2.Incident:
        raise ValueError("no")

    with pytest.raises(ValueError):
        store.upsert_incidents({"node:b": opens("inc-b", "b lost"), "node:c": refuse})
    assert store.list_incidents() == []


def test_a_new_incident_under_a_key_replaces_the_closed_one(store: Store) -> None:
    store.upsert_incident("job:j1", opens("inc-1", "first", job_id="j1", detected_s=1.0))
    incident, created = store.upsert_incident("job:j1", lambda _old: opens("inc-2", "second", "j1", 2.0)(None))
    assert created and incident.incident_id == "inc-2"
    store.upsert_incident("job:j2", opens("inc-3", "other", job_id="j2", detected_s=3.0))
    assert [i.incident_id for i in store.list_incidents("j1")] == ["inc-2", "inc-1"]
    assert [i.incident_id for i in store.list_incidents()] == ["inc-3", "inc-2", "inc-1"]
    assert [i.incident_id for i in store.list_incidents(limit=1)] == ["inc-3"]


def test_an_incident_is_edited_by_id(store: Store) -> None:
    store.upsert_incident("job:j1", opens("inc-1", "first"))

    def edit(incident: common_pb2.Incident) -> None:
        incident.action_taken = "restart"

    assert store.update_incident("inc-1", edit).action_taken == "restart"  # type: ignore[union-attr]
    assert store.get_incident("inc-1").action_taken == "restart"  # type: ignore[union-attr]
    assert store.update_incident("inc-404", edit) is None
    assert store.get_incident("inc-404") is None


# ---- nodes and commands -------------------------------------------------------------------


def test_nodes_their_states_and_heartbeats(store: Store) -> None:
    for node_id in ("n2", "n1"):
        store.put_node(common_pb2.Node(node_id=node_id, slots=2, state=common_pb2.NODE_STATE_READY), now=10.0)
    assert [node.node_id for node in store.list_nodes()] == ["n1", "n2"]
    assert store.get_node("n3") is None and store.get_node("n1:heartbeat") is None
    assert store.heartbeats(["n1", "n3"]) == {"n1": 10.0}
    store.save_heartbeats({"n1": 12.5})
    assert store.heartbeats(["n1", "n2"]) == {"n1": 12.5, "n2": 10.0}
    lost, ready = common_pb2.NODE_STATE_LOST, common_pb2.NODE_STATE_READY
    assert store.set_node_states(["n1", "n2", "n3"], lost, expected=ready, now=20.0) == ["n1", "n2"]
    assert not store.set_node_state("n1", lost, expected=ready, now=21.0)
    assert store.node_states() == {"n1": lost, "n2": lost}
    assert store.get_node("n1").state_since.ToNanoseconds() == 20 * 10**9  # type: ignore[union-attr]


def test_commands_are_read_after_a_cursor_and_waited_for(store: Store) -> None:
    end = store.put_node(common_pb2.Node(node_id="n1", slots=1), now=1.0)
    assert end == store.last_command_id("n1")
    first = store.append_command("n1", a_command("n1"))
    assert [command_id for command_id, _ in store.read_commands("n1", end)] == [first]
    assert store.read_commands("n1", first) == []
    assert store.wait_for_commands({"n1": first, "n2": "0-0"}, block_ms=50) == {}
    threading.Timer(0.1, lambda: store.append_command("n2", a_command("n2"))).start()
    woken = store.wait_for_commands({"n1": first, "n2": "0-0"}, block_ms=5000)
    assert list(woken) == ["n2"] and woken["n2"] == store.last_command_id("n2")


@pytest.mark.parametrize("name", ["memory", "redis"])
def test_both_stores_are_stores(name: str, redis_client: redis.Redis) -> None:
    made: Store = MemoryStore() if name == "memory" else RedisStore(redis_client)
    missing = [attr for attr in Store.__dict__ if not attr.startswith("_") and not hasattr(made, attr)]
    assert missing == []
