"""The node registry: registrations, heartbeats (soft state, kept in memory and saved in
batches) and the command streams agents read."""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator

from services.coordinator import decide
from services.coordinator.command_feed import CommandFeed, CommandStream
from services.coordinator.context import Context
from services.coordinator.store import valid_stream_id
from unicron.errors import AlreadyExists, InvalidArgument, NotFound
from unicron.v1 import common_pb2, node_service_pb2

log = logging.getLogger(__name__)

# Node names as hosts and Kubernetes nodes have them; never ':' (the store's key separator)
# nor '/'.
NODE_ID_PATTERN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


def host_of(address: str) -> str:
    """The host of a host:port address, brackets of an IPv6 literal removed."""
    return address.rpartition(":")[0].strip("[]")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def registration_conflict(
    node_id: str, address: str, nodes: Iterable[common_pb2.Node], now: float, timeout_s: float
) -> str | None:
    """Why a registration must be refused, or None. One node per host: a live node (not
    LOST, heard within the heartbeat timeout) keeps its host, and its id, until it is lost.
    A node id registering from another host while its first host still beats is two agents
    under one name; a node registering a host another live node holds has taken that
    node's address. Loopback hosts are exempt: on one machine every agent shares one."""
    host = host_of(address)
    if _loopback(host):
        return None
    for node in nodes:
        silent_s = now - node.last_heartbeat.ToNanoseconds() / 1e9
        if node.state == common_pb2.NODE_STATE_LOST or silent_s > timeout_s:
            continue
        theirs = host_of(node.address)
        if node.node_id == node_id and theirs != host:
            return (
                f"node {node_id} is registered from {node.address} and beat {silent_s:.1f}s ago; "
                f"refusing it from {address} (one agent per node id)"
            )
        if node.node_id != node_id and theirs == host:
            return f"address {address}: host {host} is node {node.node_id}'s, which beat {silent_s:.1f}s ago"
    return None


class NodeRegistry:
    def __init__(self, ctx: Context, joined: Callable[[str], None]) -> None:
        """`joined(reason)` is told of a node that joined or came back (a re-plan may use it)."""
        self._ctx = ctx
        self._joined = joined
        # Heartbeats are soft state, kept here and saved in one write per reconcile step
        # (save_heartbeats): the newest of memory and the store counts.
        self._beats: dict[str, float] = {}
        self._unsaved: dict[str, float] = {}
        self._lock = threading.Lock()
        # Nodes stored LOST (as the last reconcile step saw them): a heartbeat from one is
        # answered "unknown", so its agent registers again and the node is READY again (its
        # trainers were re-planned away; a LOST node its agent still heartbeats for would stay
        # out of every plan otherwise).
        self._lost: set[str] = set()
        self.feed = CommandFeed(ctx.store)

    def register(
        self,
        node_id: str,
        address: str,
        slots: int,
        failure_domain: str,
        fault_injection: bool = False,
        image: str = "",
    ) -> tuple[common_pb2.Node, str]:
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        if not NODE_ID_PATTERN.match(node_id):
            raise InvalidArgument(
                "node_id", f"{node_id!r} must be letters, digits, '.', '_' and '-', at most 253 characters"
            )
        if not address or ":" not in address:
            raise InvalidArgument("address", f"must be host:port, got {address!r}")
        if slots <= 0:
            raise InvalidArgument("slots", "must be positive")
        store, now = self._ctx.store, self._ctx.clock()
        # Listed lazily: a loopback registration (every agent on one machine) needs no list, and
        # listing a thousand nodes per registration, each one invalidating the node cache, kept
        # 1,000 simulated agents from registering within 5 s (bench-load-steps).
        listed = self._nodes_lazily()
        conflict = registration_conflict(node_id, address, listed, now, self._ctx.settings.heartbeat_timeout_s)
        if conflict is not None:
            log.warning("registration refused", extra={"node_id": node_id, "address": address, "why": conflict})
            raise AlreadyExists(conflict)
        previous = store.get_node(node_id)
        node = common_pb2.Node(
            node_id=node_id,
            address=address,
            slots=slots,
            state=common_pb2.NODE_STATE_READY,
            failure_domain=failure_domain,
            fault_injection=fault_injection,
            image=image,
        )
        if previous is not None:
            node.registered.CopyFrom(previous.registered)
            # A drain is the operator's: an agent restarted for the maintenance keeps it.
            node.cordoned = previous.cordoned
        else:
            node.registered.FromNanoseconds(int(now * 1e9))
        if previous is not None and previous.state == common_pb2.NODE_STATE_READY:
            node.state_since.CopyFrom(previous.state_since)
        else:
            node.state_since.FromNanoseconds(int(now * 1e9))
        node.last_heartbeat.FromNanoseconds(int(now * 1e9))
        last_command = store.put_node(node, now)
        with self._lock:  # registering is a heartbeat: an older one heard before must not count
            self._beats[node_id] = now
            self._lost.discard(node_id)
        log.info("node registered", extra={"node_id": node_id, "address": address, "slots": slots})
        if previous is None or previous.state != common_pb2.NODE_STATE_READY or previous.slots != slots:
            self._joined(f"node {node_id} joined")
        return node, last_command

    def strays(
        self, node_id: str, running: Iterable[node_service_pb2.JobGeneration]
    ) -> list[node_service_pb2.JobGeneration]:
        """Of the generations a registering node says it runs, those the coordinator no
        longer runs there (`decide.is_stray`): the node must kill them before anything else."""
        jobs: dict[str, common_pb2.Job | None] = {}
        found = []
        for index, item in enumerate(running):
            if not item.job_id:
                raise InvalidArgument(f"running[{index}].job_id", "is required")
            if item.job_id not in jobs:
                try:
                    jobs[item.job_id] = self._ctx.store.get_job(item.job_id)
                except NotFound:
                    jobs[item.job_id] = None
            if decide.is_stray(node_id, jobs[item.job_id], item.generation):
                found.append(item)
        if found:
            log.warning(
                "a registering node runs ranks written off: it kills them",
                extra={"node_id": node_id, "strays": [f"{item.job_id}@{item.generation}" for item in found]},
            )
        return found

    def _nodes_lazily(self) -> Iterator[common_pb2.Node]:
        """`nodes()`, listed only once iterated."""
        yield from self.nodes()

    def heartbeat(self, node_id: str) -> bool:
        """Records a heartbeat; False when the node is unknown or LOST (it must register again)."""
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        # Only a node this coordinator has not heard yet is looked up.
        if self.heartbeat_if_seen(node_id):
            return True
        stored = self._ctx.store.get_node(node_id)
        if stored is None or stored.state == common_pb2.NODE_STATE_LOST:
            return False
        now = self._ctx.clock()
        with self._lock:
            self._beats[node_id] = self._unsaved[node_id] = now
        return True

    def heartbeat_if_seen(self, node_id: str) -> bool:
        """Records a heartbeat of a node this coordinator has heard before, touching no
        store (so it may run on the server's event loop); False: call `heartbeat`."""
        with self._lock:
            if node_id not in self._beats or node_id in self._lost:
                return False
            self._beats[node_id] = self._unsaved[node_id] = self._ctx.clock()
        return True

    def nodes(self) -> list[common_pb2.Node]:
        """The stored nodes with their last heartbeats: the ones this coordinator heard
        (newer than any it saved), else the stored ones (nodes silent since it started)."""
        store = self._ctx.store
        nodes = store.list_nodes()
        with self._lock:
            beats = dict(self._beats)
        unheard = [node.node_id for node in nodes if node.node_id not in beats]
        beats.update(store.heartbeats(unheard))
        for node in nodes:
            beat = beats.get(node.node_id)
            if beat is not None:
                node.last_heartbeat.FromNanoseconds(int(beat * 1e9))
        return nodes

    def with_usage(self) -> list[common_pb2.Node]:
        """The nodes, each with the slots jobs use on it."""
        nodes = self.nodes()
        used = decide.used_slots(self._ctx.store.list_jobs())
        for node in nodes:
            node.used_slots = used.get(node.node_id, 0)
        return nodes

    def save_heartbeats(self) -> None:
        with self._lock:
            beats, self._unsaved = self._unsaved, {}
        self._ctx.store.save_heartbeats(beats)

    def mark_lost(self, nodes: list[common_pb2.Node], now: float) -> list[common_pb2.Node]:
        """Marks LOST the READY nodes silent past the heartbeat timeout, in one write (a
        rack that vanishes is a hundred nodes); returns those newly lost."""
        settings = self._ctx.settings
        by_id = {node.node_id: node for node in nodes}
        silent = decide.lost_nodes(now, nodes, settings.heartbeat_timeout_s, self._ctx.started_at)
        changed = self._ctx.store.set_node_states(
            silent, common_pb2.NODE_STATE_LOST, expected=common_pb2.NODE_STATE_READY, now=now
        )
        newly_lost = [by_id[node_id] for node_id in changed]
        with self._lock:
            self._lost = {n.node_id for n in nodes if n.state == common_pb2.NODE_STATE_LOST} | set(changed)
        return newly_lost

    def open_commands(self, node_id: str, after_id: str) -> CommandStream:
        """A stream of the node's commands after `after_id` (default: from now on); the
        caller closes it."""
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        if after_id and not valid_stream_id(after_id):
            raise InvalidArgument("after_command_id", f"{after_id!r} is not a command id (such as 1700000000000-0)")
        store = self._ctx.store
        if store.get_node(node_id) is None:
            raise NotFound(f"node {node_id!r} is not registered")
        return CommandStream(self.feed, store, node_id, after_id or store.last_command_id(node_id))
