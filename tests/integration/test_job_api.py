"""The public job API against a real Redis: happy paths, and bad input that must get the
right status code and leave Redis exactly as it was."""

from __future__ import annotations

import threading

import grpc
import pytest
import redis

from tests.integration.conftest import ControlPlane
from unicron import jobspec
from unicron.client import ClientError
from unicron.v1 import common_pb2, job_service_pb2, job_service_pb2_grpc, node_service_pb2

pytestmark = pytest.mark.integration


def tiny_spec(name: str = "tiny", data: int = 2) -> common_pb2.JobSpec:
    return jobspec.spec_from_dict(
        {
            "name": name,
            "program": {"entry_point": "examples.gpt.train:main", "args": ["--hidden-size", "32"]},
            "parallelism": {"data": data},
            "training": {"iterations": 3, "global_batch_size": 4},
        }
    )


def register(plane: ControlPlane, node_id: str, slots: int = 2) -> node_service_pb2.RegisterNodeResponse:
    return plane.node_stub().RegisterNode(
        node_service_pb2.RegisterNodeRequest(node_id=node_id, address=f"127.0.0.1:{7000 + slots}", slots=slots),
        timeout=5,
    )


def snapshot(client: redis.Redis) -> dict[bytes, bytes | None]:
    """Every key with its serialized value: equal snapshots mean nothing was written."""
    keys: list[bytes] = client.keys("*")  # type: ignore[assignment]
    return {key: client.dump(key) for key in sorted(keys)}  # type: ignore[misc]


def test_submit_get_list_cancel(control_plane: ControlPlane) -> None:
    register(control_plane, "n1")
    with control_plane.client() as client:
        job = client.submit(tiny_spec())
        assert job.state == common_pb2.JOB_STATE_PENDING
        assert job.spec.parallelism.tensor == 1  # defaults filled in by the server
        assert client.get(job.job_id).job_id == job.job_id
        assert client.get("tiny").job_id == job.job_id  # by name too
        assert [j.job_id for j in client.list_jobs()] == [job.job_id]
        cancelled = client.cancel(job.job_id, "test")
        assert cancelled.state == common_pb2.JOB_STATE_CANCELLED
        assert [c.state for c in cancelled.history] == [common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_CANCELLED]
        assert cancelled.version == 2


BAD_SPECS = [
    ({"name": "Bad Name"}, "spec.name"),
    ({"name": ""}, "spec.name"),
    ({"program": {"entry_point": "no colon"}}, "spec.program.entry_point"),
    ({"program": {"entry_point": "", "command": []}}, "spec.program"),
    ({"program": {"command": ["python"]}}, "spec.program"),  # and the entry point: two programs
    ({"program": {"env": {"UNICRON_TRAINER_RANK": "3"}}}, "spec.program.env[UNICRON_TRAINER_RANK]"),
    ({"estimate": {"parameters": -1.0}}, "spec.estimate.parameters"),
    ({"training": {"lr_decay_style": "stepwise"}}, "spec.training.lr_decay_style"),
    ({"training": {"adam_beta2": 1.5}}, "spec.training.adam_beta2"),
    ({"training": {"optimizer": "lamb"}}, "spec.training.optimizer"),
    ({"parallelism": {"data": 0}}, "spec.parallelism.data"),
    ({"parallelism": {"data": 2, "min_data": 3, "max_data": 4}}, "spec.parallelism.data"),
    ({"training": {"iterations": 0}}, "spec.training.iterations"),
    ({"training": {"global_batch_size": 3}}, "spec.training.global_batch_size"),
    ({"weight": -1.0}, "spec.weight"),
]


@pytest.mark.parametrize(("change", "field"), BAD_SPECS)
def test_bad_spec_is_invalid_argument_and_writes_nothing(control_plane: ControlPlane, change: dict, field: str) -> None:
    register(control_plane, "n1")
    spec = tiny_spec()
    for key, value in change.items():
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                target = getattr(spec, key)
                if isinstance(sub_value, list):
                    del getattr(target, sub_key)[:]
                    getattr(target, sub_key).extend(sub_value)
                elif isinstance(sub_value, dict):
                    getattr(target, sub_key).update(sub_value)
                else:
                    setattr(target, sub_key, sub_value)
        else:
            setattr(spec, key, value)
    before = snapshot(control_plane.redis)
    with control_plane.client() as client, pytest.raises(ClientError) as error:
        client.submit(spec)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(error.value).startswith(field)
    assert snapshot(control_plane.redis) == before


def test_missing_spec_is_invalid_argument(control_plane: ControlPlane) -> None:
    stub = job_service_pb2_grpc.JobServiceStub(grpc.insecure_channel(control_plane.address))
    with pytest.raises(grpc.RpcError) as error:
        stub.SubmitJob(job_service_pb2.SubmitJobRequest(), timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec" in (error.value.details() or "")


def test_duplicate_name_is_already_exists(control_plane: ControlPlane) -> None:
    register(control_plane, "n1")
    with control_plane.client() as client:
        client.submit(tiny_spec())
        before = snapshot(control_plane.redis)
        with pytest.raises(ClientError) as error:
            client.submit(tiny_spec())
    assert error.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert snapshot(control_plane.redis) == before


def test_concurrent_duplicates_store_exactly_one(control_plane: ControlPlane) -> None:
    register(control_plane, "n1")
    outcomes: list[str] = []

    def submit() -> None:
        with control_plane.client() as client:
            try:
                client.submit(tiny_spec("raced"))
                outcomes.append("ok")
            except ClientError as exc:
                outcomes.append(exc.code.name)

    threads = [threading.Thread(target=submit) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("ok") == 1
    assert outcomes.count("ALREADY_EXISTS") == 5
    with control_plane.client() as client:
        assert len(client.list_jobs()) == 1


def test_more_slots_than_exist_is_failed_precondition(control_plane: ControlPlane) -> None:
    register(control_plane, "n1", slots=2)
    before = snapshot(control_plane.redis)
    with control_plane.client() as client, pytest.raises(ClientError) as error:
        client.submit(tiny_spec(data=4))
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "4 slots" in str(error.value) and "has 2" in str(error.value)
    assert snapshot(control_plane.redis) == before


def test_a_tensor_parallel_group_no_node_holds_is_failed_precondition(control_plane: ControlPlane) -> None:
    """TP 3 on 2-slot nodes would wait forever, though 4 slots are free: refused at submit."""
    register(control_plane, "n1", slots=2)
    register(control_plane, "n2", slots=3)
    before = snapshot(control_plane.redis)
    with control_plane.client() as client:
        spec = tiny_spec(data=1)
        spec.parallelism.tensor = 4
        with pytest.raises(ClientError) as error:
            client.submit(spec)
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert str(error.value).startswith("parallelism.tensor: a tensor-parallel group of 4 ranks must fit")
        assert "the largest node has 3 slots" in str(error.value)
        # 5 slots, but only 2 + 2 of them in whole groups of 2.
        spec.parallelism.tensor, spec.parallelism.data = 2, 3
        spec.training.global_batch_size = 6
        with pytest.raises(ClientError) as error:
            client.submit(spec)
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "has 4 across 2 nodes in whole tensor-parallel groups of 2" in str(error.value), str(error.value)
        assert snapshot(control_plane.redis) == before


def test_a_name_is_used_again_once_its_job_ended(control_plane: ControlPlane) -> None:
    register(control_plane, "n1")
    with control_plane.client() as client:
        first = client.submit(tiny_spec("my-run"))
        with pytest.raises(ClientError) as error:
            client.submit(tiny_spec("my-run"))
        assert error.value.code == grpc.StatusCode.ALREADY_EXISTS
        client.cancel("my-run")
        second = client.submit(tiny_spec("my-run"))
        assert second.job_id != first.job_id
        assert client.get("my-run").job_id == second.job_id
        assert client.get(first.job_id).state == common_pb2.JOB_STATE_CANCELLED


def test_an_image_no_node_runs_is_failed_precondition(control_plane: ControlPlane) -> None:
    stub = control_plane.node_stub()
    for node_id, image in (("n1", "unicron:1.0"), ("n2", "")):
        stub.RegisterNode(
            node_service_pb2.RegisterNodeRequest(node_id=node_id, address="127.0.0.1:7001", slots=2, image=image),
            timeout=5,
        )
    spec = tiny_spec(data=2)
    spec.program.image = "team/llm:7"
    before = snapshot(control_plane.redis)
    with control_plane.client() as client:
        with pytest.raises(ClientError) as error:
            client.submit(spec)
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "program.image" in str(error.value) and "'unicron:1.0'" in str(error.value)
        assert snapshot(control_plane.redis) == before
        # The image one node runs: the job fits that node's slots alone.
        spec.program.image = "unicron:1.0"
        assert client.submit(spec).state == common_pb2.JOB_STATE_PENDING
        spec.name, spec.parallelism.data, spec.training.global_batch_size = "wider", 4, 8
        with pytest.raises(ClientError) as error:
            client.submit(spec)
        assert "4 slots" in str(error.value) and "has 2 across 1 nodes" in str(error.value), str(error.value)


@pytest.mark.parametrize("call", ["get", "cancel"])
def test_unknown_job_is_not_found(control_plane: ControlPlane, call: str) -> None:
    before = snapshot(control_plane.redis)
    with control_plane.client() as client, pytest.raises(ClientError) as error:
        getattr(client, call)("job-nope")
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    assert snapshot(control_plane.redis) == before


def test_cancel_finished_job_is_failed_precondition(control_plane: ControlPlane) -> None:
    register(control_plane, "n1")
    with control_plane.client() as client:
        job = client.submit(tiny_spec())
        client.cancel(job.job_id)
        before = snapshot(control_plane.redis)
        with pytest.raises(ClientError) as error:
            client.cancel(job.job_id)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert snapshot(control_plane.redis) == before


def test_empty_job_id_is_invalid_argument(control_plane: ControlPlane) -> None:
    with control_plane.client() as client, pytest.raises(ClientError) as error:
        client.get("")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_redis_down_is_unavailable(control_plane: ControlPlane, redis_server) -> None:  # type: ignore[no-untyped-def]
    redis_server.stop()
    try:
        with control_plane.client() as client, pytest.raises(ClientError) as error:
            client.list_jobs()
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        redis_server.start()


def test_watch_streams_snapshot_then_events_until_final(control_plane: ControlPlane) -> None:
    register(control_plane, "n1")
    with control_plane.client() as client:
        job = client.submit(tiny_spec())
        events = client.watch(job.job_id)
        first = next(events)
        assert first.type == common_pb2.JOB_EVENT_TYPE_SNAPSHOT
        assert first.job.job_id == job.job_id
        client.cancel(job.job_id, "stop watching")
        rest = list(events)  # the stream ends by itself at the final state
    assert rest[-1].type == common_pb2.JOB_EVENT_TYPE_STATE_CHANGED
    assert rest[-1].state == common_pb2.JOB_STATE_CANCELLED
    assert "stop watching" in rest[-1].message


def test_watch_resumes_after_event_id(control_plane: ControlPlane) -> None:
    register(control_plane, "n1")
    with control_plane.client() as client:
        job = client.submit(tiny_spec())
        snapshot_event = next(client.watch(job.job_id))
        client.cancel(job.job_id)
        resumed = list(client.watch(job.job_id, after_event_id=snapshot_event.event_id))
    assert [e.state for e in resumed] == [common_pb2.JOB_STATE_CANCELLED]
