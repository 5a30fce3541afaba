"""unicron.ports: free ports below the kernel's ephemeral range, so that a client retrying its
connect before the server is up can never connect to itself."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from unicron import ports, redisutil


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    given = tmp_path / "range"
    given.write_text("40000\t50000\n")
    assert ports.ephemeral_range(given) == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL
    given.write_text("garbage\n")
    assert ports.ephemeral_range(given) == ports.DEFAULT_EPHEMERAL


def test_candidates_stay_below_the_range_and_off_the_rendezvous_ports() -> None:
    pool = ports.candidates((32768, 60999))
    assert min(pool) == ports.LOWEST and max(pool) == 32767
    assert not set(pool) & set(ports.RESERVED)
    assert ports.candidates((20000, 60999)) == []


def test_a_free_port_is_bindable_and_never_a_clients_source_port() -> None:
    low, high = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed
    assert redisutil.free_port is ports.free_port  # the servers of the tests take theirs here too


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        held = ports.free_port()
        holder.bind(("127.0.0.1", held))
        holder.listen()
        free = next(p for p in range(held + 1, 32768) if p not in ports.RESERVED)
        monkeypatch.setattr(ports, "candidates", lambda _range: [held, free])
        for seed in range(5):  # whichever the draw tries first
            monkeypatch.setattr(ports, "_issued", {})  # forget the last call's
            assert ports.free_port(rng=random.Random(seed)) == free


def test_the_kernels_choice_when_the_range_leaves_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST, 60999))
    port = ports.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_an_address_of_another_machine_is_an_error() -> None:
    """The coordinator tells a one-machine rendezvous from another host's this way."""
    with pytest.raises(OSError):
        ports.free_port("203.0.113.7")  # TEST-NET-3: no interface here has it


def test_a_port_handed_out_is_not_handed_out_again_before_its_server_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in CI: a cluster's metrics port and its coordinator's port were one, both drawn
    before either server bound. Two candidates, two calls, nothing bound: two ports."""
    first = ports.free_port()
    second = next(p for p in range(first + 1, 32768) if p not in ports.RESERVED)
    monkeypatch.setattr(ports, "candidates", lambda _range: [first, second])
    monkeypatch.setattr(ports, "_issued", {first: 0.0})
    monkeypatch.setattr(ports.time, "monotonic", lambda: 1.0)
    assert ports.free_port() == second
    # Once both are out, the kernel chooses; long after, they are drawn again.
    assert ports.free_port() not in {first, second}
    monkeypatch.setattr(ports.time, "monotonic", lambda: 1.0 + ports.REISSUE_AFTER_S)
    assert ports.free_port() in {first, second}
