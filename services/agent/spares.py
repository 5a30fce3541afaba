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

log = logging.getLogger(__name__)

# The trainer's own settings, which a spare reads only after the handover.
TRAINER_ENV_PREFIX = "UNICRON_TRAINER_"


class SparePool:
    def __init__(
        self,
        size: int,
        spare_argv: Sequence[str],
        serves_argv: Sequence[str],
        env: Mapping[str, str],
        work_dir: Path,
    ) -> None:
        """Keeps `size` spares (`spare_argv`, in `env`) ready for launches of `serves_argv`."""
        self._size = size
        self._spare_argv = list(spare_argv)
        self._serves_argv = list(serves_argv)
        self._env = dict(env)
        self._log_path = work_dir / "spares.err"
        self._lock = threading.Lock()
        self._ready: list[subprocess.Popen[bytes]] = []
        self._closed = False

    def fill(self) -> None:
        """Starts spares until `size` are alive (call at start and after each take)."""
        with self._lock:
            self._ready = [p for p in self._ready if p.poll() is None]
            missing = 0 if self._closed else self._size - len(self._ready)
            for _ in range(missing):
                self._ready.append(self._start())

    def _start(self) -> subprocess.Popen[bytes]:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as err:
            proc = subprocess.Popen(
                self._spare_argv,
                env=self._env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,  # as a trainer: a stop signals its whole group
            )
        log.debug("spare trainer started", extra={"pid": proc.pid})
        return proc

    def serves(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a spare can become this launch: the same program, and the same environment
        apart from the trainer's own settings (torch reads the rest when it is imported)."""
        if list(argv) != self._serves_argv:
            return False
        return {k: v for k, v in env.items() if not k.startswith(TRAINER_ENV_PREFIX)} == self._env

    def take(
        self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path
    ) -> subprocess.Popen[bytes] | None:
        """A live spare turned into this launch, or None (none ready, or it cannot serve it)."""
        if self._size <= 0 or not self.serves(argv, env):
            return None
        order = json.dumps({"env": dict(env), "stdout": str(stdout), "stderr": str(stderr)}) + "\n"
        while True:
            with self._lock:
                if not self._ready:
                    break
                proc = self._ready.pop(0)
            if proc.poll() is not None or proc.stdin is None:
                continue  # died waiting (it logged why in spares.err)
            try:
                proc.stdin.write(order.encode())
                proc.stdin.close()
            except OSError:
                continue
            threading.Thread(target=self.fill, name="spares", daemon=True).start()
            return proc
        threading.Thread(target=self.fill, name="spares", daemon=True).start()
        return None

    def close(self) -> None:
        """Ends the spares not taken: they hold nothing yet."""
        with self._lock:
            self._closed = True
            spares, self._ready = self._ready, []
        for proc in spares:
            proc.kill()
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
