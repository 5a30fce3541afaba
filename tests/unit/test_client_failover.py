"""The job API client across a coordinator failover: with several coordinators, a read that
finds none answering is sent again until a standby serves (FAILOVER_S); a write, or a client
of one coordinator, fails at once with the one-line error."""

from __future__ import annotations

import grpc
import pytest

from unicron import client as client_module
from unicron import rpc
from unicron.client import ClientError, UnicronClient
from unicron.security import ClientSecurity
from unicron.v1 import common_pb2, job_service_pb2


class Unavailable(grpc.RpcError):
    said = "failed to connect to all addresses"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self.said


class StoreFailingOver(Unavailable):
    """What a coordinator says itself while its Redis fails over."""

    said = "state store unreachable: Error 111 connecting to 10.0.0.3:6379. Connection refused."

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return rpc.ANSWERED


class Stub:
    """Unreachable for the first `down` calls, then answering."""

    def __init__(self, down: int, error: type[Unavailable] = Unavailable) -> None:
        self.down, self.calls, self.error = down, 0, error

    def _answer(self, reply: object) -> object:
        self.calls += 1
        if self.calls <= self.down:
            raise self.error()
        return reply

    def GetJob(self, request: object, timeout: float) -> object:
        return self._answer(job_service_pb2.GetJobResponse(job=common_pb2.Job(job_id="j1")))

    def CancelJob(self, request: object, timeout: float) -> object:
        return self._answer(job_service_pb2.CancelJobResponse())


def client_of(address: str, stub: Stub, monkeypatch: pytest.MonkeyPatch) -> UnicronClient:
    monkeypatch.setattr(client_module, "FAILOVER_RETRY_S", 0.01)
    client = UnicronClient(address, timeout_s=1.0, security=ClientSecurity())
    client._stub = stub  # type: ignore[assignment]
    return client


def test_a_read_waits_out_a_failover_between_coordinators(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = Stub(down=3)
    with client_of("127.0.0.1:1,127.0.0.1:2", stub, monkeypatch) as client:
        assert client.get("j1").job_id == "j1"
    assert stub.calls == 4


def test_a_read_gives_up_after_the_failover_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "FAILOVER_S", 0.05)
    with client_of("127.0.0.1:1,127.0.0.1:2", Stub(down=10_000), monkeypatch) as client:
        with pytest.raises(ClientError, match="cannot reach the coordinator"):
            client.get("j1")


@pytest.mark.parametrize(("address", "write"), [("127.0.0.1:1", False), ("127.0.0.1:1,127.0.0.1:2", True)])
def test_one_coordinator_or_a_write_fails_at_once(address: str, write: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    stub = Stub(down=1)
    with client_of(address, stub, monkeypatch) as client:
        with pytest.raises(ClientError, match="cannot reach the coordinator"):
            client.cancel("j1") if write else client.get("j1")
    assert stub.calls == 1


def test_a_read_waits_out_its_coordinators_redis_failing_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with one coordinator: it answers UNAVAILABLE itself, in its own words."""
    stub = Stub(down=3, error=StoreFailingOver)
    with client_of("127.0.0.1:1", stub, monkeypatch) as client:
        assert client.get("j1").job_id == "j1"
    assert stub.calls == 4


def test_a_write_refused_by_a_failing_over_store_says_so_and_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = Stub(down=1, error=StoreFailingOver)
    with client_of("127.0.0.1:1", stub, monkeypatch) as client:
        with pytest.raises(ClientError, match="is unavailable: state store unreachable: Error 111") as caught:
            client.cancel("j1")
    assert "is it running" not in str(caught.value)
    assert stub.calls == 1
