"""The namespace hosts themselves (unicron_dev/netns.py): they reach each other and the
harness over the bridge, each fault does what it says and heals, and nothing is left."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from unicron_dev import netns

pytestmark = pytest.mark.cluster


@pytest.fixture
def network() -> Iterator[netns.Network]:
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    net = netns.Network(["a", "b"]).create()
    yield net
    net.destroy()


def listen(host: netns.Host, port: int = 7777) -> subprocess.Popen[bytes]:
    code = (
        "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        f"s.bind(('{host.address}',{port}))\ns.listen(64)\nwhile True: s.accept()[0].close()"
    )
    server = subprocess.Popen(host.argv([sys.executable, "-c", code]))
    time.sleep(0.3)
    return server


def reaches(source: netns.Host, target: netns.Host, port: int = 7777, timeout_s: float = 1.0) -> bool:
    code = f"import socket\ns=socket.create_connection(('{target.address}',{port}),timeout={timeout_s})"
    return subprocess.run(source.argv([sys.executable, "-c", code]), capture_output=True).returncode == 0


def qdiscs(host: netns.Host) -> str:
    return subprocess.run(host.argv(["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True, text=True).stdout


def test_hosts_reach_each_other_and_faults_heal(network: netns.Network) -> None:
    a, b, harness = network.hosts["a"], network.hosts["b"], network.hosts[netns.HARNESS]
    server = listen(b)
    try:
        assert reaches(a, b) and reaches(harness, b)
        network.link_down("b")
        assert not reaches(a, b)
        network.heal("b")
        assert reaches(a, b)
        network.rate_limit("b", "1mbit")
        assert (
            "tbf"
            in subprocess.run(b.argv(["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True, text=True).stdout
        )
        network.heal("b")
        assert (
            "tbf"
            not in subprocess.run(b.argv(["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True, text=True).stdout
        )
        network.cut(["a"], ["b"])
        assert not reaches(a, b) and reaches(harness, b)  # only a and b are parted
        network.heal("a")
        assert reaches(a, b)
        network.loss("b", 0.6)
        reached = sum(reaches(a, b, timeout_s=0.3) for _ in range(12))
        assert reached < 12  # a connection needs every packet of its handshake through
        network.heal("b")
        assert reaches(a, b)
        # The root namespace's rules are never touched.
        root = subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout
        assert "DROP" not in root and "statistic" not in root
    finally:
        server.kill()
        server.wait()


def test_nothing_is_left_and_a_killed_runs_leftovers_are_removed() -> None:
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    net = netns.Network(["x"]).create()
    made = [n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}")]
    assert len(made) == 2  # the host and the switch
    net.destroy()
    assert not [n for n in netns.namespaces() if n in made]
    # What a run killed before its cleanup leaves: namespaces of a pid that is gone.
    ghost = subprocess.Popen(["true"])
    ghost.wait()
    subprocess.run(["ip", "netns", "add", f"{netns.PREFIX}{ghost.pid}-h1"], check=True)
    assert f"{netns.PREFIX}{ghost.pid}-h1" in netns.remove_stale()
    assert f"{netns.PREFIX}{ghost.pid}-h1" not in netns.namespaces()
