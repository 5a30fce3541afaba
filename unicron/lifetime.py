"""Helper processes that die with the process that started them.

Linux only: a child started through ``start_manager`` asks the kernel for SIGTERM when its
parent dies (``PR_SET_PDEATHSIG``), so a parent that is SIGKILLed, or exits through
``os._exit`` without running its finalizers, leaves no helper behind. Elsewhere it is a plain
multiprocessing manager. Imports nothing heavy: a spawned child imports this module to run
``die_with_parent``."""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
from multiprocessing.managers import SyncManager

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child: SIGTERM when the parent dies (and now, if it died already)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took
        os.kill(os.getpid(), signal.SIGTERM)


def start_manager() -> SyncManager:
    """A started multiprocessing manager (spawned) that dies with this process."""
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent)
    return manager
