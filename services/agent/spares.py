"""Warm spare trainers: processes that have imported torch and Megatron and wait for a rank to
run (services/trainer/spare.py). A restart then skips the seconds of imports; the pool starts a
new spare in the background each time one is taken."""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.agent.trainer_user import TrainerUser
from unicron.trainer.settings import ENV_PREFIX

log = logging.getLogger(__name__)

# The trainer's own settings, which a spare reads only after the handover.
TRAINER_ENV_PREFIX = f"{ENV_PREFIX}_"


# The pool's state for operators and tests: {"size": n, "ready": n}.
STATUS_FILE = "spares.json"
# What a spare prints on stdout once its imports are done.
READY_LINE = b"ready\n"


class SparePool:
    def __init__(
        self,
        size: int,
        spare_argv: Sequence[str],
        serves_argv: Sequence[str],
        env: Mapping[str, str],
        work_dir: Path,
        user: TrainerUser | None = None,
    ) -> None:
        """Keeps `size` spares (`spare_argv`, in `env`, as `user` when given) ready for launches
        of `serves_argv`."""
        self._user = user
        self._size = size
        self._spare_argv = list(spare_argv)
        self._serves_argv = list(serves_argv)
        self._env = dict(env)
        self._work_dir = work_dir
        self._lock = threading.Lock()
        self._spares: list[subprocess.Popen[bytes]] = []
        self._warm: set[int] = set()  # pids of spares done importing
        self._closed = False
        self._changed = threading.Condition(self._lock)

    def fill(self) -> None:
        """Starts spares until `size` are alive (call at start and after each take)."""
        with self._lock:
            self._spares = [p for p in self._spares if p.poll() is None]
            missing = 0 if self._closed else self._size - len(self._spares)
            for _ in range(missing):
                self._spares.append(self._start())
            self._write_status()

    def _start(self) -> subprocess.Popen[bytes]:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        with open(self._work_dir / "spares.err", "ab") as err:
            proc = subprocess.Popen(
                self._spare_argv,
                env=self._env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,  # one line, READY_LINE; a handover sends it elsewhere
                stderr=err,
                start_new_session=True,  # as a trainer: a stop signals its whole group
                **(self._user.popen_options() if self._user else {}),
            )
        threading.Thread(target=self._await_ready, args=(proc,), name="spare-ready", daemon=True).start()
        log.debug("spare trainer started", extra={"pid": proc.pid})
        return proc

    def _await_ready(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.stdout.close()
        if line != READY_LINE:
            try:
                proc.wait(timeout=5)  # it is exiting: let a waiter see it dead
            except subprocess.TimeoutExpired:
                pass
        with self._lock:
            if line == READY_LINE and proc in self._spares:
                self._warm.add(proc.pid)
                self._write_status()
            self._changed.notify_all()  # warm, or dead before it was: either ends a wait

    def wait_warm(self, timeout_s: float) -> int:
        """Waits until every spare of the pool is done importing, at most `timeout_s` (a spare
        that died trying ends the wait too); returns how many are ready."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._closed or all(p.pid in self._warm or p.poll() is not None for p in self._spares),
                timeout=timeout_s,
            )
            return sum(1 for p in self._spares if p.pid in self._warm and p.poll() is None)

    def _write_status(self) -> None:
        """Rewrites the status file (caller holds the lock)."""
        ready = sum(1 for p in self._spares if p.pid in self._warm and p.poll() is None)
        try:
            tmp = self._work_dir / (STATUS_FILE + ".tmp")
            tmp.write_text(json.dumps({"size": self._size, "ready": ready}))
            tmp.replace(self._work_dir / STATUS_FILE)
        except OSError as exc:
            log.warning("cannot write the spare status", extra={"error": str(exc)})

    def serves(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a spare can become this launch: the same program, and the same environment
        apart from the trainer's own settings (torch reads the rest when it is imported)."""
        if list(argv) != self._serves_argv:
            return False
        return {k: v for k, v in env.items() if not k.startswith(TRAINER_ENV_PREFIX)} == self._env

    def take(
        self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path
    ) -> subprocess.Popen[bytes] | None:
        """A live spare turned into this launch, or None (none left, or it cannot serve it).
        One done importing first; else one still importing, which is still ahead of a cold
        start."""
        if self._size <= 0 or not self.serves(argv, env):
            return None
        order = json.dumps({"env": dict(env), "stdout": str(stdout), "stderr": str(stderr)}) + "\n"
        while True:
            with self._lock:
                alive = [p for p in self._spares if p.poll() is None]
                if not alive:
                    break
                proc = next((p for p in alive if p.pid in self._warm), alive[0])
                self._spares.remove(proc)
                self._warm.discard(proc.pid)
                self._write_status()
            if proc.stdin is None:
                continue
            try:
                proc.stdin.write(order.encode())
                proc.stdin.close()
            except OSError:
                continue  # died meanwhile (it logged why in spares.err)
            threading.Thread(target=self.fill, name="spares", daemon=True).start()
            return proc
        threading.Thread(target=self.fill, name="spares", daemon=True).start()
        return None

    def close(self) -> None:
        """Ends the spares not taken: they hold nothing yet."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
            self._warm.clear()
            self._changed.notify_all()
        for proc in spares:
            proc.kill()
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
