"""Trainer processes of one node. A thread blocks in wait() on each child, so the agent
learns of an exit the moment it happens rather than on a polling interval.

Each process is a worker with a stable identity for life: its id, pid, log files and slot
(the node's GPU it holds). What a reform changes is its membership, the (job, generation,
rank) key it is found by; the worker, and so its logs and its GPU, stay the same."""

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
from services.agent.trainer_user import TrainerUser

log = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4096
# Memberships whose output files are remembered (for `unicron logs` after a worker exits);
# the oldest are forgotten past this, and then found by their files' names.
OUTPUT_HISTORY = 4096


# What a trainer never inherits: the agent's own settings (UNICRON_AGENT_*: its TLS key and
# certificate, its join token file among them) and a client certificate for the trainer
# link. A trainer runs the user's program; it proves itself to its agent by its worker token
# and checks the agent against the CA, and needs no credential of the node's.
AGENT_ENV_PREFIX = "UNICRON_AGENT_"
# The OTLP exporter's client certificate is the node's own (the compose stack's agents export
# with it): a trainer, which exports nothing, is not told where its key lies.
NEVER_INHERITED = frozenset(
    {
        "UNICRON_TRAINER_TLS_CERT",
        "UNICRON_TRAINER_TLS_KEY",
        *(
            f"OTEL_EXPORTER_OTLP{signal}_CLIENT_{part}"
            for signal in ("", "_TRACES", "_METRICS", "_LOGS")
            for part in ("KEY", "CERTIFICATE")
        ),
    }
)
_KEY_MATERIAL = "PRIVATE KEY-----"


def without_node_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less what names or holds the node's credentials (a key in PEM, whatever the
    variable is called, too)."""
    return {
        name: value
        for name, value in env.items()
        if not name.startswith(AGENT_ENV_PREFIX) and name not in NEVER_INHERITED and _KEY_MATERIAL not in value
    }


@dataclass(frozen=True)
class WorkerKey:
    job_id: str
    generation: int
    rank: int


@dataclass
class Worker:
    """One trainer process for its whole life. ``key`` is its membership now (a reform moves
    it); everything else is fixed at launch."""

    worker_id: str
    proc: subprocess.Popen[bytes]
    out_path: Path
    err_path: Path
    slot: int  # index of the node's slot, and of its GPU where the node has GPUs
    key: WorkerKey


@dataclass(frozen=True)
class Output:
    """Where the worker that held a membership writes: its files for life, and its id (to
    tell whether it still runs, and as what)."""

    out_path: Path
    err_path: Path
    worker_id: str


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
    def __init__(
        self,
        work_dir: Path,
        on_exit: Callable[[WorkerExit], None],
        spares: SparePool | None = None,
        gpus: Sequence[str] = (),
        user: TrainerUser | None = None,
    ) -> None:
        """``gpus``: the node's GPU ids, one per slot; a worker sees only its slot's
        (CUDA_VISIBLE_DEVICES). Empty: a node without GPUs. ``user``: whom trainers run as
        (trainer_user.py; None: the agent's own user)."""
        self._work_dir = work_dir
        self._user = user
        self._on_exit = on_exit
        self._spares = spares
        self._lock = threading.Lock()
        self._workers: dict[WorkerKey, Worker] = {}
        # Every membership a worker held and the files it wrote them to, oldest first: a
        # reform moves a rank into a worker whose files are named after an older one.
        self._outputs: dict[WorkerKey, Output] = {}
        self._gpus = tuple(gpus)
        self._launched = 0
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
        with self._lock:
            slot = self._free_slot()
            self._launched += 1
            worker_id = f"w{self._launched}"
        env = without_node_secrets(env)
        if self._gpus:
            env["CUDA_VISIBLE_DEVICES"] = self._gpus[slot % len(self._gpus)]
        proc = None
        if spare and self._spares is not None:
            proc = self._spares.take(argv, env, out_path, err_path)
        warm = proc is not None
        if proc is None:
            with open(out_path, "ab") as out, open(err_path, "ab") as err:
                proc = subprocess.Popen(
                    list(argv),
                    env=env,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    # Own session: a stop signals the trainer's whole process tree, and a Ctrl-C
                    # at the agent's terminal does not reach trainers behind the agent's back.
                    start_new_session=True,
                    **(self._user.popen_options() if self._user else {}),
                )
        worker = Worker(worker_id, proc, out_path, err_path, slot, key)
        with self._lock:
            closed = self._closed
            if not closed:
                self._workers[key] = worker
                self._remember_output(key, worker)
                self._write_registry()
        if closed:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            raise OSError(f"the agent is stopping: trainer {key} not started")
        threading.Thread(target=self._wait, args=(worker,), name=f"wait-{worker_id}", daemon=True).start()
        log.info(
            "trainer started",
            extra={
                "job_id": key.job_id,
                "rank": key.rank,
                "pid": proc.pid,
                "generation": key.generation,
                "worker": worker_id,
                "slot": slot,
                "warm": warm,
            },
        )
        return proc.pid

    def give(self, directory: Path) -> None:
        """With a trainer user, creates ``directory`` as that user's, for trainers to write in
        (the agent's own user's trainers create their directories themselves)."""
        if self._user is not None:
            self._user.give(directory)

    def _write_registry(self) -> None:
        """Rewrites the registry (caller holds the lock); atomically, for readers."""
        entries = [
            {
                "worker": w.worker_id,
                "pid": w.proc.pid,
                "slot": w.slot,
                "job_id": k.job_id,
                "generation": k.generation,
                "rank": k.rank,
                "stderr": str(w.err_path),
            }
            for k, w in self._workers.items()
        ]
        path = self._work_dir / REGISTRY_FILE
        try:
            self._work_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entries))
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write the trainer registry", extra={"error": str(exc)})

    def previous_jobs(self) -> set[str]:
        """The jobs whose trainers, as the registry a previous run of this agent left says,
        are still alive (a trainer outlives a SIGKILLed agent until it sees its link gone).
        Read before this run's first launch rewrites the registry."""
        try:
            entries = json.loads((self._work_dir / REGISTRY_FILE).read_text())
        except (OSError, ValueError):
            return set()
        return {
            str(e.get("job_id"))
            for e in entries
            if isinstance(e, dict) and isinstance(e.get("pid"), int) and _alive(e["pid"])
        }

    def close(self) -> None:
        """Ends the spares and refuses launches from now on (the trainers are stopped with
        stop())."""
        with self._lock:
            self._closed = True
        if self._spares is not None:
            self._spares.close()

    def _free_slot(self) -> int:
        """The lowest slot no live worker holds (caller holds the lock)."""
        held = {w.slot for w in self._workers.values()}
        return next(i for i in range(len(held) + 1) if i not in held)

    def _wait(self, worker: Worker) -> None:
        code = worker.proc.wait()
        exited_at = time.time()
        with self._lock:
            # The worker may have joined a newer generation since it started (rekey).
            key = worker.key
            if self._workers.get(key) is worker:
                del self._workers[key]
            self._write_registry()
            stopped = key in self._stopping
            self._stopping.discard(key)
        tail = ""
        if code != 0:
            try:
                with open(worker.err_path, "rb") as err:
                    err.seek(max(0, worker.err_path.stat().st_size - STDERR_TAIL_BYTES))
                    tail = err.read().decode(errors="replace")
            except OSError:
                pass
        exit_code, sig = (0, -code) if code < 0 else (code, 0)
        log.info(
            "trainer exited", extra={"job_id": key.job_id, "rank": key.rank, "exit_code": exit_code, "signal": sig}
        )
        self._on_exit(WorkerExit(key, exit_code, sig, tail, stopped, exited_at))

    def rekey(self, old: WorkerKey, new: WorkerKey) -> bool:
        """The worker of `old` now runs as `new` (it joined a new generation in place): its
        membership changes, its id, pid, logs and slot do not."""
        with self._lock:
            worker = self._workers.pop(old, None)
            if worker is None:
                return False
            worker.key = new
            self._workers[new] = worker
            self._remember_output(new, worker)
            self._write_registry()
            if old in self._stopping:
                self._stopping.discard(old)
                self._stopping.add(new)
        return True

    def _remember_output(self, key: WorkerKey, worker: Worker) -> None:
        """Records that `worker` now writes as `key` (caller holds the lock)."""
        self._outputs.pop(key, None)
        self._outputs[key] = Output(worker.out_path, worker.err_path, worker.worker_id)
        while len(self._outputs) > OUTPUT_HISTORY:
            del self._outputs[next(iter(self._outputs))]

    def outputs(self, job_id: str, rank: int) -> dict[int, Output]:
        """Where the workers that were `rank` of the job wrote, by generation."""
        with self._lock:
            return {k.generation: o for k, o in self._outputs.items() if k.job_id == job_id and k.rank == rank}

    def current_key(self, worker_id: str) -> WorkerKey | None:
        """The membership the worker holds now; None once it exited (or was never here)."""
        with self._lock:
            return next((w.key for w in self._workers.values() if w.worker_id == worker_id), None)

    def pids(self, job_id: str) -> dict[WorkerKey, int]:
        with self._lock:
            return {k: w.proc.pid for k, w in self._workers.items() if k.job_id == job_id}

    def stderr_path(self, key: WorkerKey) -> Path:
        """Where the worker now known as ``key`` writes its stderr: the file it was started
        with, whatever reforms renamed its membership since."""
        with self._lock:
            worker = self._workers.get(key)
        if worker is not None:
            return worker.err_path
        return self._work_dir / key.job_id / f"gen{key.generation}-rank{key.rank}.err"

    def worker(self, key: WorkerKey) -> Worker | None:
        with self._lock:
            return self._workers.get(key)

    def running(self, job_id: str | None = None) -> list[WorkerKey]:
        with self._lock:
            return [k for k in self._workers if job_id is None or k.job_id == job_id]

    def stop(self, job_id: str | None = None, grace_s: float = 5.0, max_generation: int = 0) -> None:
        """SIGTERM the job's trainers (all when job_id is None; only generations up to
        max_generation unless it is 0), SIGKILL after grace_s."""
        with self._lock:
            targets = {
                k: w.proc
                for k, w in self._workers.items()
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

    def kill(self, job_id: str, generation: int, wait_s: float = 5.0) -> list[WorkerKey]:
        """SIGKILLs the trainers of exactly this generation of the job, with no grace: ranks
        the coordinator wrote off must not write one more checkpoint beside their successors.
        Waits up to `wait_s` for them to end; returns whom it killed."""
        with self._lock:
            targets = {k: w.proc for k, w in self._workers.items() if k.job_id == job_id and k.generation == generation}
            self._stopping.update(targets)
        for proc in targets.values():
            _signal_group(proc, signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        for proc in targets.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("a killed trainer has not ended yet", extra={"job_id": job_id, "pid": proc.pid})
        return list(targets)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a trainer user's)
        return True
    return True
