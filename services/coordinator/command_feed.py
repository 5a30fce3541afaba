"""Wakes the coordinator's command streams when their node gets a command.

Every agent holds a command stream open for its life. Each stream used to block in its own
Redis read, a second at a time: with a thousand agents, a thousand reads a second for nothing.
Here one thread blocks in one read over every listening node's command log and bumps that
node's version; a stream reads the log only when its node's version moved. The streams are
coroutines on the server's event loop (unicron.rpc.Server(asyncio=True)): the feed wakes a
node's waiters there, and no other node's."""

from __future__ import annotations

import asyncio
import logging
import threading

from services.coordinator.store import Store
from unicron.errors import UnicronError
from unicron.v1 import node_service_pb2

log = logging.getLogger(__name__)

BLOCK_MS = 1000
RETRY_S = 0.5
# A stream wakes this often even when nothing happens: a safety net, since a departed agent
# cancels its stream's task and the feed's stop wakes every stream.
IDLE_CHECK_S = 30.0

Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Event]


class CommandFeed:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._versions: dict[str, int] = {}
        self._listeners: dict[str, int] = {}
        self._waiters: dict[str, set[Waiter]] = {}
        # node -> the newest command id the feed has seen (where its next read starts)
        self._cursors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="command-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for waiters in self._waiters.values():
                _wake(waiters)

    def listen(self, node_id: str) -> int:
        """Registers a stream of `node_id`; returns the version to wait from. Commands
        appended from now on bump the version; older ones are the stream's own first read."""
        last = self._store.last_command_id(node_id)
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self.start()  # on first use: a coordinator that never serves a stream needs none
            self._listeners[node_id] = self._listeners.get(node_id, 0) + 1
            self._cursors.setdefault(node_id, last)
            return self._versions.get(node_id, 0)

    def leave(self, node_id: str) -> None:
        with self._lock:
            self._listeners[node_id] -= 1
            if not self._listeners[node_id]:
                del self._listeners[node_id]
                self._cursors.pop(node_id, None)

    async def wait(self, node_id: str, seen: int, timeout_s: float) -> int:
        """Waits, on the caller's event loop, until the node's version passes `seen`, the
        feed stops, or `timeout_s`; returns the version."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            version = self._versions.get(node_id, 0)
            if version != seen or self._stop.is_set():
                return version
            self._waiters.setdefault(node_id, set()).add(waiter)
        try:
            await asyncio.wait_for(waiter[1].wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                waiters = self._waiters.get(node_id)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[node_id]
        with self._lock:
            return self._versions.get(node_id, 0)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                cursors = dict(self._cursors)
            if not cursors:
                self._stop.wait(0.05)
                continue
            try:
                newest = self._store.wait_for_commands(cursors, BLOCK_MS)
            except UnicronError as exc:
                log.warning("command feed cannot read Redis", extra={"error": str(exc)})
                self._stop.wait(RETRY_S)
                continue
            if not newest:
                continue
            with self._lock:
                for node_id, command_id in newest.items():
                    self._versions[node_id] = self._versions.get(node_id, 0) + 1
                    if node_id in self._cursors:
                        self._cursors[node_id] = command_id
                    _wake(self._waiters.get(node_id, set()))


def _wake(waiters: set[Waiter]) -> None:
    for loop, event in waiters:
        loop.call_soon_threadsafe(event.set)


class CommandStream:
    """One agent's open command stream: the node's commands after a cursor, read from its log
    only when the feed saw the log grow. `read` blocks on Redis (call it from a thread);
    `changed` waits on the event loop."""

    def __init__(self, feed: CommandFeed, store: Store, node_id: str, cursor: str) -> None:
        self._feed = feed
        self._store = store
        self.node_id = node_id
        self._cursor = cursor
        self._seen = feed.listen(node_id)
        self._read_at: int | None = None  # the version the log was last read at
        self._closed = False

    def read(self) -> list[node_service_pb2.NodeCommand]:
        """The node's new commands, each as durable as an acknowledged write before it is
        handed out (Unavailable, and nothing handed out, when the replicas lag)."""
        if self._read_at == self._seen:
            return []
        pending = self._store.read_commands(self.node_id, self._cursor)
        if pending:
            self._store.barrier()
            self._cursor = pending[-1][0]
        self._read_at = self._seen
        return [command for _, command in pending]

    async def changed(self, timeout_s: float = IDLE_CHECK_S) -> bool:
        """Waits for the node's next command; False once the coordinator stops."""
        while not self._feed.stopped:
            version = await self._feed.wait(self.node_id, self._seen, timeout_s)
            if version != self._seen:
                self._seen = version
                return True
        return False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._feed.leave(self.node_id)
