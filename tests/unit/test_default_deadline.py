"""A unary call that sets no deadline is served under the server's default, on the threaded and
the asyncio server alike; one that runs past it gets DEADLINE_EXCEEDED, as a client's own
deadline would have given it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from unicron import rpc
from unicron.security import Limits, ServerSecurity

METHOD = "/unicron.test.Slow/Sleep"
DEFAULT_S = 0.4


def _identity(data: bytes) -> bytes:
    return data


def _register(asynchronous: bool) -> Any:
    """A handler that sleeps for the number of milliseconds its request names."""

    def sleep(request: bytes, _context: Any) -> bytes:
        time.sleep(int(request.decode()) / 1000)
        return b"done"

    async def sleep_async(request: bytes, _context: Any) -> bytes:
        await asyncio.sleep(int(request.decode()) / 1000)
        return b"done"

    handler = grpc.unary_unary_rpc_method_handler(
        sleep_async if asynchronous else sleep, request_deserializer=_identity, response_serializer=_identity
    )
    generic = grpc.method_handlers_generic_handler("unicron.test.Slow", {"Sleep": handler})

    def register(_servicer: Any, server: Any) -> None:
        server.add_generic_rpc_handlers((generic,))

    return register


@pytest.fixture(params=[False, True], ids=["threaded", "asyncio"])
def address(request: pytest.FixtureRequest) -> Iterator[str]:
    security = ServerSecurity(limits=Limits(default_deadline_s=DEFAULT_S))
    server = rpc.Server(bind="127.0.0.1:0", max_workers=4, security=security, asyncio=request.param)
    server.add(_register(request.param), None, "unicron.test.Slow")
    server.start()
    yield server.address
    server.stop()


def call(address: str, millis: int, timeout: float | None) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        stub = channel.unary_unary(METHOD, request_serializer=_identity, response_deserializer=_identity)
        try:
            stub(str(millis).encode(), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


def test_a_call_without_a_deadline_is_served(address: str) -> None:
    assert call(address, 10, None) == (grpc.StatusCode.OK, "")


def test_a_call_without_a_deadline_that_runs_past_the_default_is_deadline_exceeded(address: str) -> None:
    code, details = call(address, int(DEFAULT_S * 1000) + 400, None)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "default" in details and "set a deadline" in details


def test_a_call_with_its_own_longer_deadline_runs_past_the_default(address: str) -> None:
    assert call(address, int(DEFAULT_S * 1000) + 400, 10.0) == (grpc.StatusCode.OK, "")
