"""Trainer processes of one node. A thread blocks in wait() on each child, so the agent
learns of an exit the moment it happens rather than on a polling interval."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.agent.spares import SparePool

log = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4096


@dataclass(frozen=True)
class WorkerKey:
    job_id: str
    generation: int
    rank: int


@dataclass(frozen=True)
class WorkerExit:
    key: WorkerKey
    exit_code: int
    signal: int
    stderr_tail: str
    stopped_by_agent: bool
    exited_at: float


# Which process runs which rank, for operators and tests: a spare's /proc environment does
# not show the rank it became.
REGISTRY_FILE = "trainers.json"


class Supervisor:
    def __init__(self, work_dir: Path, on_exit: Callable[[WorkerExit], None], spares: SparePool | None = None) -> None:
        self._work_dir = work_dir
        self._on_exit = on_exit
        self._spares = spares
        self._lock = threading.Lock()
        self._procs: dict[WorkerKey, subprocess.Popen[bytes]] = {}
        self._stopping: set[WorkerKey] = set()
        # Set by close(): the agent is going away, and a trainer started now (a command that
        # raced the shutdown) would outlive it.
        self._closed = False

    def launch(self, key: WorkerKey, argv: Sequence[str], env: Mapping[str, str], spare: bool = True) -> int:
        """Starts a trainer; through a warm spare when ``spare`` and the pool has one.
        Raises OSError once the supervisor is closed."""
        if self._closed:
            raise OSError(f"the agent is stopping: trainer {key} not started")
        log_dir = self._work_dir / key.job_id
        log_dir.mkdir(parents=True, exist_ok=True)
        stem = log_dir / f"gen{key.generation}-rank{key.rank}"
        out_path, err_path = Path(f"{stem}.out"), Path(f"{stem}.err")
        proc = None
        if spare and self._spares is not None:
            proc = self._spares.take(argv, env, out_path, err_path)
        warm = proc is not None
        if proc is None:
            with open(out_path, "ab") as out, open(err_path, "ab") as err:
                proc = subprocess.Popen(
                    list(argv),
                    env=dict(env),
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    # Own session: a stop signals the trainer's whole process tree, and a Ctrl-C
                    # at the agent's terminal does not reach trainers behind the agent's back.
                    start_new_session=True,
                )
        with self._lock:
            closed = self._closed
            if not closed:
                self._procs[key] = proc
                self._write_registry()
        if closed:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            raise OSError(f"the agent is stopping: trainer {key} not started")
        threading.Thread(target=self._wait, args=(key, proc, err_path), name=f"wait-{key.rank}", daemon=True).start()
        log.info(
            "trainer started",
            extra={
                "job_id": key.job_id,
                "rank": key.rank,
                "pid": proc.pid,
                "generation": key.generation,
                "warm": warm,
            },
        )
        return proc.pid

    def _write_registry(self) -> None:
        """Rewrites the registry (caller holds the lock); atomically, for readers."""
        entries = [
            {"pid": p.pid, "job_id": k.job_id, "generation": k.generation, "rank": k.rank}
            for k, p in self._procs.items()
        ]
        path = self._work_dir / REGISTRY_FILE
        try:
            self._work_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entries))
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write the trainer registry", extra={"error": str(exc)})

    def close(self) -> None:
        """Ends the spares and refuses launches from now on (the trainers are stopped with
        stop())."""
        with self._lock:
            self._closed = True
        if self._spares is not None:
            self._spares.close()

    def _wait(self, key: WorkerKey, proc: subprocess.Popen[bytes], err_path: Path) -> None:
        code = proc.wait()
        exited_at = time.time()
        with self._lock:
            # The process may have joined a newer generation since it started (rekey).
            key = next((k for k, p in self._procs.items() if p is proc), key)
            self._procs.pop(key, None)
            self._write_registry()
            stopped = key in self._stopping
            self._stopping.discard(key)
        tail = ""
        if code != 0:
            try:
                with open(err_path, "rb") as err:
                    err.seek(max(0, err_path.stat().st_size - STDERR_TAIL_BYTES))
                    tail = err.read().decode(errors="replace")
            except OSError:
                pass
        exit_code, sig = (0, -code) if code < 0 else (code, 0)
        log.info(
            "trainer exited", extra={"job_id": key.job_id, "rank": key.rank, "exit_code": exit_code, "signal": sig}
        )
        self._on_exit(WorkerExit(key, exit_code, sig, tail, stopped, exited_at))

    def rekey(self, old: WorkerKey, new: WorkerKey) -> bool:
        """The process of `old` now runs as `new` (it joined a new generation in place)."""
        with self._lock:
            proc = self._procs.pop(old, None)
            if proc is None:
                return False
            self._procs[new] = proc
            self._write_registry()
            if old in self._stopping:
                self._stopping.discard(old)
                self._stopping.add(new)
        return True

    def pids(self, job_id: str) -> dict[WorkerKey, int]:
        with self._lock:
            return {k: p.pid for k, p in self._procs.items() if k.job_id == job_id}

    def stderr_path(self, key: WorkerKey) -> Path:
        return self._work_dir / key.job_id / f"gen{key.generation}-rank{key.rank}.err"

    def running(self, job_id: str | None = None) -> list[WorkerKey]:
        with self._lock:
            return [k for k in self._procs if job_id is None or k.job_id == job_id]

    def stop(self, job_id: str | None = None, grace_s: float = 5.0, max_generation: int = 0) -> None:
        """SIGTERM the job's trainers (all when job_id is None; only generations up to
        max_generation unless it is 0), SIGKILL after grace_s."""
        with self._lock:
            targets = {
                k: p
                for k, p in self._procs.items()
                if (job_id is None or k.job_id == job_id) and (not max_generation or k.generation <= max_generation)
            }
            self._stopping.update(targets)
        for proc in targets.values():
            _signal_group(proc, signal.SIGTERM)
            # A stopped (hung, SIGSTOPped) trainer cannot act on SIGTERM until it runs again.
            _signal_group(proc, signal.SIGCONT)
        for key, proc in targets.items():
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("trainer ignored SIGTERM, killing", extra={"job_id": key.job_id, "rank": key.rank})
                _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
