"""Test hosts as Linux network namespaces on one bridge, and the faults a real network has.

Every host is a namespace (`uc<pid>-<host>`) with one interface, `eth0`, the end of a veth
pair whose other end is a port of a bridge. The bridge lives in a namespace of its own (the
switch), so the root namespace keeps its rules untouched; the harness itself (the test
process, in the root namespace) reaches the hosts through one more veth, as the host named
`harness`. No namespace has a default route: nothing leaves these namespaces for anywhere
else. Everything made is removed on `destroy()`, also when a test fails or is interrupted;
what a killed run left behind (its pid is gone) is removed by the next `create()`.

Faults, each undone by `heal(host)`:
- `link_down` / `link_up`: the cable pulled (the host's eth0 down);
- `flap`: down and up every `period_s` for `duration_s`, on a thread;
- `loss`: a share of the host's packets dropped (iptables `statistic`, in its namespace);
- `rate_limit`: its egress held to a rate (tc `tbf`);
- `cut`: no traffic between two sets of hosts (iptables in each namespace of the first set),
  for partitions.

Needs root, iproute2, and iptables for `loss` and `cut` (`make test-cluster` installs it).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PREFIX = "uc"
SWITCH = "sw"
BRIDGE = "br0"
HARNESS = "harness"
# A /24 no real network of this machine uses (checked at create()).
DEFAULT_SUBNET = "10.213.7.0/24"


class NetworkError(RuntimeError):
    pass


@dataclass(frozen=True)
class Host:
    name: str
    netns: str  # "" for the harness, which is the root namespace
    address: str
    interface: str = "eth0"

    def argv(self, command: Sequence[str]) -> list[str]:
        """`command` run inside this host's namespace."""
        return list(command) if not self.netns else ["ip", "netns", "exec", self.netns, *command]


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(command)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def available() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot add a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Removes the namespaces (and kills the processes in them) of runs whose process is gone."""
    removed = []
    for name in namespaces():
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        owner = name[len(PREFIX) : name.index("-")]
        if owner.isdigit() and not _alive(int(owner)):
            _kill_inside(name)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str) -> None:
    pids = _run("ip", "netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@dataclass
class Network:
    """Hosts by name, each with an address of `subnet`; the harness is .1."""

    host_names: Sequence[str]
    subnet: str = DEFAULT_SUBNET
    hosts: dict[str, Host] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)
    _flaps: dict[str, threading.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(set(self.host_names)) != len(self.host_names) or HARNESS in self.host_names:
            raise ValueError(f"host names must be unique and not {HARNESS!r}: {list(self.host_names)}")
        too_long = [n for n in self.host_names if len(n) > 8 or not n.isalnum()]
        if too_long:
            raise ValueError(f"host names must be at most 8 letters or digits (interface names): {too_long}")

    def _netns(self, name: str) -> str:
        return f"{PREFIX}{os.getpid()}-{name}"

    # ---- lifecycle ----------------------------------------------------------------------

    def create(self) -> Network:
        why = available()
        if why is not None:
            raise NetworkError(why)
        remove_stale()
        net = ipaddress.ip_network(self.subnet)
        self._check_unused(net)
        addresses = [str(a) for a in net.hosts()]
        try:
            switch = self._add_netns(SWITCH)
            _run("ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge")
            _run("ip", "-n", switch, "link", "set", BRIDGE, "up")
            self.hosts[HARNESS] = Host(HARNESS, "", addresses[0], interface=f"{PREFIX}{os.getpid()}")
            self._plug(self.hosts[HARNESS], switch, net.prefixlen)
            for i, name in enumerate(self.host_names, start=1):
                host = Host(name, self._add_netns(name), addresses[i])
                self.hosts[name] = host
                self._plug(host, switch, net.prefixlen)
        except BaseException:
            self.destroy()
            raise
        return self

    def _check_unused(self, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> None:
        for line in _run("ip", "-o", "addr", "show").stdout.splitlines():
            parts = line.split()
            if "inet" in parts:
                found = ipaddress.ip_interface(parts[parts.index("inet") + 1])
                if found.network.overlaps(net):
                    raise NetworkError(f"{self.subnet} overlaps {found} of this machine ({parts[1]})")

    def _add_netns(self, name: str) -> str:
        netns = self._netns(name)
        _run("ip", "netns", "add", netns)
        self._made.append(netns)
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        return netns

    def _plug(self, host: Host, switch: str, prefixlen: int) -> None:
        """A veth from the host's eth0 (or the harness's interface) to a bridge port."""
        port = f"p-{host.name}"[:15]
        if host.netns:
            _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        else:
            # The harness end stays in the root namespace; it goes when the switch does.
            _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", host.interface, "netns", "1")
        _run("ip", "-n", switch, "link", "set", port, "master", BRIDGE)
        _run("ip", "-n", switch, "link", "set", port, "up")
        self._ip(host, "addr", "add", f"{host.address}/{prefixlen}", "dev", host.interface)
        self._ip(host, "link", "set", host.interface, "up")

    def _ip(self, host: Host, *args: str) -> None:
        _run(*(["ip", "-n", host.netns] if host.netns else ["ip"]), *args)

    def destroy(self) -> None:
        for stop in self._flaps.values():
            stop.set()
        for netns in reversed(self._made):
            _kill_inside(netns)
            _run("ip", "netns", "del", netns, check=False)
        self._made.clear()
        harness = self.hosts.get(HARNESS)
        if harness is not None:
            _run("ip", "link", "del", harness.interface, check=False)  # gone with the switch already

    def __enter__(self) -> Network:
        return self.create()

    def __exit__(self, *_: object) -> None:
        self.destroy()

    # ---- faults -------------------------------------------------------------------------

    def link_down(self, name: str) -> None:
        host = self.hosts[name]
        self._ip(host, "link", "set", host.interface, "down")

    def link_up(self, name: str) -> None:
        host = self.hosts[name]
        self._ip(host, "link", "set", host.interface, "up")

    def flap(self, name: str, period_s: float = 1.5, duration_s: float = 10.0) -> threading.Thread:
        """Down and up every `period_s` for `duration_s` (then up), on a thread."""
        stop = self._flaps[name] = threading.Event()

        def run() -> None:
            end = time.monotonic() + duration_s
            while not stop.is_set() and time.monotonic() < end:
                self.link_down(name)
                stop.wait(period_s / 2)
                self.link_up(name)
                stop.wait(period_s / 2)
            self.link_up(name)

        thread = threading.Thread(target=run, name=f"flap-{name}", daemon=True)
        thread.start()
        return thread

    def loss(self, name: str, share: float) -> None:
        """Drops `share` (0-1) of the packets the host sends and receives."""
        if not 0 < share < 1:
            raise ValueError(f"share must be in (0, 1), got {share}")
        for chain in ("INPUT", "OUTPUT"):
            self._iptables(name, "-A", chain, "-m", "statistic", "--mode", "random", "--probability", f"{share}")

    def rate_limit(self, name: str, rate: str = "1mbit") -> None:
        """Holds the host's egress to `rate` (tc token bucket)."""
        host = self.hosts[name]
        self._tc(
            host,
            "qdisc",
            "replace",
            "dev",
            host.interface,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "32kbit",
            "latency",
            "400ms",
        )

    def cut(self, names: Iterable[str], others: Iterable[str]) -> None:
        """No packet between any host of `names` and any of `others`, either way."""
        for name in names:
            for other in others:
                address = self.hosts[other].address
                self._iptables(name, "-A", "INPUT", "-s", address, "-j", "DROP", drop=False)
                self._iptables(name, "-A", "OUTPUT", "-d", address, "-j", "DROP", drop=False)

    def heal(self, name: str) -> None:
        """Undoes every fault of the host: link up, rules and queueing gone."""
        stop = self._flaps.pop(name, None)
        if stop is not None:
            stop.set()
        host = self.hosts[name]
        self.link_up(name)
        if shutil.which("iptables") is not None:
            _run(*host.argv(["iptables", "-F"]), check=False)
        self._tc(host, "qdisc", "del", "dev", host.interface, "root", check=False)

    def _iptables(self, name: str, *rule: str, drop: bool = True) -> None:
        host = self.hosts[name]
        if not host.netns:
            raise NetworkError("the harness runs in the root namespace, whose rules are never touched")
        if shutil.which("iptables") is None:
            raise NetworkError("needs iptables (apt-get install iptables)")
        _run(*host.argv(["iptables", *rule, *(["-j", "DROP"] if drop else [])]))

    def _tc(self, host: Host, *args: str, check: bool = True) -> None:
        if not host.netns:
            raise NetworkError("the harness's own link is never shaped")
        _run(*host.argv(["tc", *args]), check=check)
