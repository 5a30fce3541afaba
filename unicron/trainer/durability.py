"""What this rank's last checkpoint and snapshot attempts came to. A failed save is logged and
training goes on (the state is still in memory); each iteration report carries the failure
until a save succeeds again, so that the coordinator can show the job as unprotected rather
than leave the news in a log file on the node."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from unicron.v1 import node_service_pb2


@dataclass
class Streak:
    """A run of failed saves: the newest error, and the iteration of the first; and the
    iteration of the newest save that succeeded (0: none yet in this process)."""

    error: str = ""
    since: int = 0
    saved: int = 0

    def record(self, iteration: int, error: str) -> None:
        if not error:
            self.error, self.since, self.saved = "", 0, iteration
            return
        self.since = self.since or iteration
        self.error = error


class Durability:
    """Shared by the training thread (checkpoints, reports) and the snapshot writer's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checkpoint = Streak()
        self._snapshot = Streak()

    def checkpointed(self, iteration: int, error: str) -> None:
        """A checkpoint attempt at `iteration`: "" when saved, else why not."""
        with self._lock:
            self._checkpoint.record(iteration, error)

    def snapshotted(self, iteration: int, error: str) -> None:
        with self._lock:
            self._snapshot.record(iteration, error)

    def fill(self, report: node_service_pb2.IterationReport) -> None:
        with self._lock:
            report.checkpoint_error = self._checkpoint.error
            report.checkpoint_failing_since = self._checkpoint.since
            report.snapshot_error = self._snapshot.error
            report.snapshot_failing_since = self._snapshot.since
            report.checkpoint_saved_iteration = self._checkpoint.saved
            report.snapshot_saved_iteration = self._snapshot.saved
