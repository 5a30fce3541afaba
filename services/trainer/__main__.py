"""`python -m services.trainer`: one rank of a job, started by its node's agent.

It attaches to the agent (unicron.trainer.runtime.attach: settings from UNICRON_TRAINER_*,
the link opened), then runs the job's program (JobSpec.program):

* an entry point "module:function" is imported and called, in this process, with sys.argv
  [module, *args], in the program's working directory and environment;
* a command replaces this process (exec), keeping the agent's environment: its program
  attaches through the trainer library itself.

An entry point that does not import, and a program that returns before its last iteration,
are errors of the program (FAILURE_KIND_PROGRAM_ERROR, with the traceback): the job fails once
instead of being restarted into the same error. Exit codes: 0 done, 1 failed, 2 bad settings,
143 stopped by request."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from unicron.errors import UnicronError
from unicron.logs import exit_flushed
from unicron.trainer import runtime
from unicron.trainer.program import ProgramError
from unicron.v1 import common_pb2


def resolve(entry_point: str) -> Callable[[], Any]:
    """The function named by "module:function"; ProgramError when it cannot be had."""
    module_name, _, function_name = entry_point.partition(":")
    if not module_name or not function_name:
        raise ProgramError(f"entry point {entry_point!r} is not of the form module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ProgramError(f"entry point {entry_point!r}: importing {module_name} failed: {exc}") from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ProgramError(f"entry point {entry_point!r}: {module_name} has no function {function_name}")
    return function


def enter(program: common_pb2.ProgramSpec) -> None:
    """The program's working directory, environment and command line, in this process."""
    if program.working_dir:
        os.chdir(program.working_dir)
        sys.path.insert(0, str(Path(program.working_dir).resolve()))
    os.environ.update(dict(program.env))
    sys.argv = [program.entry_point.partition(":")[0], *program.args]


def execute(program: common_pb2.ProgramSpec) -> None:
    """Replaces this process by the program's command (the agent's environment kept)."""
    if program.working_dir:
        os.chdir(program.working_dir)
    env = {**os.environ, **dict(program.env)}
    argv = [*program.command, *program.args]
    logging.getLogger("trainer").info("executing the program's command", extra={"command": argv[:8]})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)


def main(argv: list[str]) -> int:
    try:
        spec = _spec_only()
        if spec is not None and spec.program.command:
            execute(spec.program)  # does not return, unless exec fails (below)
        run = runtime.attach(argv)
    except (UnicronError, json_format.ParseError) as exc:
        print(f"unicron-trainer: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"unicron-trainer: cannot execute the program's command: {exc}", file=sys.stderr)
        return 2
    try:
        program = run.spec.program
        if not program.entry_point:
            raise ProgramError("the job spec names no program (program.entry_point or program.command)")
        enter(program)
        # Before the program imports Megatron: the shim's warning filters then see its
        # import-time warnings (on CPU, noise).
        import unicron.trainer.megatron_cpu  # noqa: F401

        function = resolve(program.entry_point)
        function()
        if not run.finished and not run.stop.is_set():
            raise ProgramError(
                f"the program returned after iteration {run.iteration} of {run.spec.training.iterations}"
                " without finishing (does it call unicron.trainer.pretrain?)"
            )
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == runtime.EXIT_STOPPED or run.stop.is_set():
            return _stopped(run)
        if code == 0 and not run.finished:
            return _failed(run, ProgramError(f"the program exited 0 after iteration {run.iteration}, before its last"))
        run.link.close()
        return code
    except BaseException as exc:  # noqa: BLE001 - any error of the program ends the rank, reported
        return _failed(run, exc)
    if run.stop.is_set() and not run.finished:
        return _stopped(run)
    run.link.close()
    return 0


def _stopped(run: runtime.Run) -> int:
    logging.getLogger("trainer").info("stopped on request", extra={"iteration": run.iteration})
    run.link.close()
    return runtime.EXIT_STOPPED


def _failed(run: runtime.Run, exc: BaseException) -> int:
    if exc is not run.reported:
        runtime.report_error(run, exc)
    logging.getLogger("trainer").error("training failed", exc_info=exc)
    run.link.close()
    return 1


def _spec_only() -> common_pb2.JobSpec | None:
    """The job spec from the agent's environment, read before attaching: a command program
    attaches by itself after the exec."""
    text = os.environ.get("UNICRON_TRAINER_SPEC", "")
    return json_format.Parse(text, common_pb2.JobSpec()) if text else None


if __name__ == "__main__":
    exit_flushed(main(sys.argv[1:]))
