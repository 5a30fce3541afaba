"""The trainer's fault injector: fires faults at a chosen iteration, off unless the agent
enabled it. Each fault announces itself (FaultFired, with the time it takes effect) so
detection latency can be measured from the moment of injection."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from unicron.faults import EXCEPTION_TEXTS, fault_name
from unicron.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

# A fault that kills or stops this process waits this long after announcing itself, so the
# announcement leaves the process first; the announced time is when the fault hits.
ANNOUNCE_S = 0.1


class InjectedFailure(RuntimeError):
    """Raised by an injected exception fault; its text is a real failure's text."""


class FaultInjector:
    def __init__(
        self,
        enabled: bool,
        announce: Callable[[pb.Fault, float], None],
        stop_requested: threading.Event,
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        self._enabled = enabled
        self._announce = announce
        self._stop = stop_requested
        self._exit = exit_process
        self._lock = threading.Lock()
        self._pending: list[pb.Fault] = []
        self._armed_in_allreduce = False
        self._raise_in_allreduce: pb.Fault | None = None
        self.delay_s = 0.0

    @property
    def enabled(self) -> bool:
        return self._enabled

    def add(self, fault: pb.Fault) -> bool:
        if not self._enabled:
            log.warning("fault injection is disabled; ignoring %s", fault_name(fault.kind))
            return False
        with self._lock:
            self._pending.append(fault)
        return True

    def before_step(self, step: int) -> None:
        """Fires the faults due at this iteration (1-based), in the training thread."""
        with self._lock:
            due = [f for f in self._pending if f.step <= step]
            self._pending = [f for f in self._pending if f.step > step]
        for fault in due:
            self._fire(fault)

    def in_grad_sync(self) -> None:
        """Called as this rank enters the gradient all-reduce, where its peers wait for it:
        a slow rank's delay lands in its own compute time, as a real straggler's would."""
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._armed_in_allreduce:
            self._die(signal.SIGKILL, pb.Fault(kind=pb.FAULT_KIND_VANISH_IN_ALLREDUCE))
        fault, self._raise_in_allreduce = self._raise_in_allreduce, None
        if fault is not None:
            self._announce(fault, time.time())
            raise InjectedFailure(EXCEPTION_TEXTS.get(fault.exception_kind, "injected failure"))

    def _fire(self, fault: pb.Fault) -> None:
        kind = fault.kind
        log.warning("injecting fault %s", fault_name(kind))
        if kind == pb.FAULT_KIND_CRASH:
            self._die(signal.SIGKILL, fault)
        elif kind == pb.FAULT_KIND_HANG:
            self._die(signal.SIGSTOP, fault)
        elif kind == pb.FAULT_KIND_EXIT:
            self._announce(fault, time.time() + ANNOUNCE_S)
            time.sleep(ANNOUNCE_S)
            self._exit(3)
        elif kind == pb.FAULT_KIND_EXCEPTION and fault.in_grad_sync:
            self._raise_in_allreduce = fault
        elif kind == pb.FAULT_KIND_EXCEPTION:
            self._announce(fault, time.time())
            raise InjectedFailure(EXCEPTION_TEXTS.get(fault.exception_kind, "injected failure"))
        elif kind == pb.FAULT_KIND_STUCK_COLLECTIVE:
            self._announce(fault, time.time())
            # Never reach the next collective; peers block in theirs. Only a stop ends it.
            self._stop.wait()
            self._exit(143)
        elif kind == pb.FAULT_KIND_SLOW:
            self._announce(fault, time.time())
            self.delay_s = fault.delay_seconds
        elif kind == pb.FAULT_KIND_VANISH_IN_ALLREDUCE:
            self._armed_in_allreduce = True
        else:
            log.warning("fault %s is not the trainer's to inject", fault_name(kind))

    def _die(self, sig: signal.Signals, fault: pb.Fault) -> None:
        self._announce(fault, time.time() + ANNOUNCE_S)
        time.sleep(ANNOUNCE_S)
        os.kill(os.getpid(), sig)
