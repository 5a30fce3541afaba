"""Acknowledged writes, counted while the control plane's state store is under a fault.

A `WriteProbe` submits a small job and cancels it, again and again, on a thread, as a
client would during a Redis failover: every call that returned is a write the client was
told succeeded. Afterwards `lost` reads each one back (a submission that is gone, a cancel
that did not stick): what a failover must never lose. The gaps between successful calls
are the control plane's unavailability as a client saw it."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from unicron.client import ClientError, UnicronClient
from unicron.v1 import common_pb2

# Between two tries of a call that failed: a client's retry, not a busy loop.
RETRY_S = 0.05


@dataclass
class WriteProbe:
    client: UnicronClient
    spec: Callable[[str], common_pb2.JobSpec]
    prefix: str = "acked"
    submitted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    failures: int = 0
    last_error: str = ""
    # Why calls were refused: the first 100 characters of each message, and how often.
    refusals: dict[str, int] = field(default_factory=dict)
    # Monotonic times of every call that succeeded: unavailability is the longest gap.
    successes: list[float] = field(default_factory=list)
    stopped_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> WriteProbe:
        self._thread = threading.Thread(target=self._run, name="write-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.stopped_at = time.monotonic()

    def _run(self) -> None:
        try:
            self._submit_and_cancel()
        except Exception as exc:  # noqa: BLE001 (a bug of the probe's own, said instead of lost on its thread)
            self.last_error = f"the probe stopped: {exc!r}"

    def _submit_and_cancel(self) -> None:
        index = 0
        while not self._stop.is_set():
            name = f"{self.prefix}-{index}"
            spec = self.spec(name)
            if self._call(functools.partial(self.client.submit, spec), name, self.submitted):
                index += 1
                cancel = functools.partial(self.client.cancel, name, "write probe")
                while not self._stop.is_set() and not self._call(cancel, name, self.cancelled):
                    pass

    def _call(self, call: Callable[[], object], name: str, acknowledged: list[str]) -> bool:
        try:
            call()
        except ClientError as exc:
            if exc.code.name in ("ALREADY_EXISTS", "NOT_FOUND") or (
                exc.code.name == "FAILED_PRECONDITION" and "ended" in str(exc)
            ):
                # What an unacknowledged write did, or did not: a retried submission whose
                # first try took the name, a cancel whose first try ended the job, a cancel of
                # a job whose unacknowledged submission a failover lost. Not counted.
                return True
            self.failures += 1
            self.last_error = f"{exc.code.name}: {exc}"
            reason = self.last_error[:100]
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
            self._stop.wait(RETRY_S)
            return False
        acknowledged.append(name)
        self.successes.append(time.monotonic())
        return True

    def longest_gap_s(self, since: float) -> float:
        """The longest time without a successful call after `since` (a fault's start), until
        the probe stopped (or now)."""
        end = self.stopped_at if self.stopped_at is not None else time.monotonic()
        times = [since, *(t for t in self.successes if t > since), end]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def first_success_after(self, since: float) -> float | None:
        return next((t - since for t in self.successes if t > since), None)

    def lost(self, client: UnicronClient) -> list[str]:
        """Each acknowledged write that is not in the store any more, said in words."""
        jobs = {job.spec.name: job for job in client.list_jobs()}
        missing = [f"submission {name}" for name in self.submitted if name not in jobs]
        missing += [
            f"cancel of {name}"
            for name in self.cancelled
            if name in jobs and jobs[name].state != common_pb2.JOB_STATE_CANCELLED
        ]
        return missing
