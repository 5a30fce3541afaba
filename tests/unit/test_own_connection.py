"""Channels to one address share one TCP connection, except a channel made with
`own_connection` (the agent's heartbeats): the server sees its calls come from another port."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from unicron import rpc


def _identity(data: bytes) -> bytes:
    return data


def _register(_servicer: Any, server: Any) -> None:
    import grpc

    def peer(_request: bytes, context: Any) -> bytes:
        return str(context.peer()).encode()

    handler = grpc.unary_unary_rpc_method_handler(peer, request_deserializer=_identity, response_serializer=_identity)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("unicron.test.Peer", {"Who": handler}),))


@pytest.fixture
def address() -> Iterator[str]:
    server = rpc.Server(bind="127.0.0.1:0", max_workers=2)
    server.add(_register, None, "unicron.test.Peer")
    server.start()
    yield server.address
    server.stop()


def _peer(channel: Any) -> str:
    who = channel.unary_unary("/unicron.test.Peer/Who", request_serializer=_identity, response_deserializer=_identity)
    return bytes(who(b"", timeout=10)).decode()


def test_a_channel_of_its_own_gets_a_connection_of_its_own(address: str) -> None:
    shared_a, shared_b = rpc.channel(address), rpc.channel(address)
    own = rpc.channel(address, own_connection=True)
    try:
        assert _peer(shared_a) == _peer(shared_b)
        assert _peer(own) != _peer(shared_a)
    finally:
        for channel in (shared_a, shared_b, own):
            channel.close()
