"""`python -m services.trainer.spare`: a trainer process started before any job needs it.

Most of a restarted rank's time to its first iteration is the interpreter importing torch and
Megatron (seconds). A spare pays that ahead: it imports them, then waits for one line on stdin,
a JSON object {"env": {...}, "stdout": path, "stderr": path}. It then becomes that trainer: it
takes the environment, sends its output to the files and runs the trainer's main. End of input
(the agent stopped, or died) ends it quietly.

The environment is read by the trainer after the handover, except what torch reads when it is
imported (OMP_NUM_THREADS and the like): the agent hands a spare only to a rank whose
environment, apart from the trainer's own UNICRON_TRAINER_* settings, is the spare's own."""

from __future__ import annotations

import json
import os
import sys

from unicron.logs import exit_flushed


def _become(order: dict[str, object]) -> None:
    env, stdout, stderr = order["env"], order["stdout"], order["stderr"]
    if not isinstance(env, dict) or not isinstance(stdout, str) or not isinstance(stderr, str):
        raise ValueError("a handover needs env (an object), stdout and stderr (paths)")
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})


def main() -> int:
    # The point of a spare: these imports are what a cold start waits for.
    import torch
    import torch.distributed  # noqa: F401

    import unicron.trainer.engine  # noqa: F401  (Megatron-Core)
    from services.trainer.__main__ import main as trainer_main

    # The agent hands ready spares out first (services/agent/spares.py).
    os.write(1, b"ready\n")
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    try:
        _become(json.loads(line))
    except (ValueError, KeyError, OSError) as exc:
        print(f"unicron-trainer-spare: bad handover: {exc}", file=sys.stderr)
        return 2
    sys.stdin.close()
    return trainer_main(sys.argv[1:])


if __name__ == "__main__":
    exit_flushed(main())
