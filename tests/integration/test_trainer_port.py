"""An agent's trainers reach it on a port of their own that asks for no client certificate:
they check the agent against the CA and prove who they are by their worker token, and hold
no key of the node's. Real gRPC servers over TLS with a development CA."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import pytest

from services.agent.supervisor import WorkerKey
from services.agent.trainer_link import LinkHandlers, TrainerLink
from tests.integration.test_security import secure_server
from unicron import certs, rpc
from unicron.security import TLS, ClientSecurity, WorkerTokens
from unicron.v1 import trainer_service_pb2, trainer_service_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.DevPKI:
    return certs.create_dev_pki(tmp_path_factory.mktemp("pki"), nodes=["n1"], users=certs.parse_users("alice"))


@pytest.fixture
def agent_server(pki: certs.DevPKI) -> Iterator[tuple[rpc.Server, str, WorkerTokens]]:
    """The agent's server as services/agent/__main__.py makes it: mutual TLS on its main
    address, and the trainer port beside it."""
    tokens = WorkerTokens()
    link = TrainerLink(
        "n1",
        LinkHandlers(
            is_known=lambda key: key == WorkerKey("job-1", 1, 0),
            on_iteration=lambda key, report: None,
            on_error=lambda key, error: None,
            on_fault_fired=lambda key, fired: None,
        ),
    )
    server = secure_server(pki, pki.nodes["n1"], lookup=tokens.lookup, certificates=False)
    trainer_address = server.add_port("127.0.0.1:0", client_certificates=False)
    server.add(
        trainer_service_pb2_grpc.add_TrainerAgentServiceServicer_to_server, link, "unicron.v1.TrainerAgentService"
    )
    server.start()
    yield server, trainer_address, tokens
    server.stop()


def hello(address: str, security: ClientSecurity, rank: int) -> tuple[grpc.StatusCode, str]:
    """Says hello as job-1 generation 1 `rank` at `address`; the first answer, or the refusal."""
    stub = trainer_service_pb2_grpc.TrainerAgentServiceStub(rpc.channel(address, security))
    outbox: queue.Queue[trainer_service_pb2.ConnectRequest | None] = queue.Queue()
    greeting = trainer_service_pb2.TrainerHello(job_id="job-1", generation=1, rank=rank)
    outbox.put(trainer_service_pb2.ConnectRequest(hello=greeting))
    responses = stub.Connect(iter(outbox.get, None), timeout=10)
    try:
        return grpc.StatusCode.OK, next(responses).WhichOneof("message") or ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    finally:
        outbox.put(None)
        responses.cancel()


def test_a_trainer_with_the_ca_alone_reaches_its_agent_by_token(
    agent_server: tuple[rpc.Server, str, WorkerTokens], pki: certs.DevPKI
) -> None:
    server, trainer_address, tokens = agent_server
    assert trainer_address != server.address and trainer_address.startswith("127.0.0.1:")
    ca_only = TLS(ca=pki.ca.read_bytes())
    trainer = ClientSecurity(ca_only, tokens.issue("job-1", 1, 0))
    assert hello(trainer_address, trainer, rank=0) == (grpc.StatusCode.OK, "welcome")
    # The token still says who it is: none, or another rank's, is refused as before.
    assert hello(trainer_address, ClientSecurity(ca_only), rank=0)[0] == grpc.StatusCode.UNAUTHENTICATED
    other = ClientSecurity(ca_only, tokens.issue("job-1", 1, 1))
    assert hello(trainer_address, other, rank=0)[0] == grpc.StatusCode.PERMISSION_DENIED
    # The main address keeps mutual TLS: without a certificate the handshake fails.
    assert hello(server.address, trainer, rank=0)[0] == grpc.StatusCode.UNAVAILABLE


def test_the_trainer_port_checks_the_agent(
    agent_server: tuple[rpc.Server, str, WorkerTokens], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A trainer verifies whom it talks to: an agent certificate from another CA is refused."""
    _, trainer_address, tokens = agent_server
    stranger = certs.create_dev_pki(tmp_path_factory.mktemp("other"), nodes=["n1"], users=certs.parse_users("bob"))
    trainer = ClientSecurity(TLS(ca=stranger.ca.read_bytes()), tokens.issue("job-1", 1, 0))
    assert hello(trainer_address, trainer, rank=0)[0] == grpc.StatusCode.UNAVAILABLE
