"""The job API client across a coordinator failover: with several coordinators, a read that
finds none answering is sent again until a standby serves (FAILOVER_S); a write, or a client
of one coordinator, fails at once with the one-line error."""

from __future__ import annotations

import grpc
import pytest

from unicron import client as client_module
from unicron.client import ClientError, UnicronClient
from unicron.security import ClientSecurity
from unicron.v1 import common_pb2, job_service_pb2


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses"


class Stub:
    """Unreachable for the first `down` calls, then answering."""

    def __init__(self, down: int) -> None:
        self.down, self.calls = down, 0

    def _answer(self, reply: object) -> object:
        self.calls += 1
        if self.calls <= self.down:
            raise Unavailable()
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
