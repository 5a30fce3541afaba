"""The trainer library's public calls for user programs (re-exported by ``unicron.trainer``).

``pretrain(model_provider, dataset_provider, forward_step)`` is the Megatron-Core level: the
runtime owns the loop. ``context()`` tells a program where it runs (its job, rank, data
settings) under Unicron or under plain torchrun alike."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unicron.trainer import runtime
from unicron.trainer.program import (
    DatasetProvider,
    ForwardStep,
    MegatronProgram,
    ModelProvider,
    ProgramError,
    Training,
)


@dataclass(frozen=True)
class Context:
    """Where a program runs. job: the job's name (or "local"); rank and world_size of this
    process; data: the job spec's data settings (path, tokenizer, options); under_unicron:
    whether an agent supervises it; training: the settings in force (the job spec's under
    Unicron)."""

    job: str
    rank: int
    world_size: int
    data_path: str = ""
    tokenizer: str = ""
    data_options: Mapping[str, str] = field(default_factory=dict)
    under_unicron: bool = False
    training: Training | None = None


def under_unicron() -> bool:
    """Whether this process was started by a Unicron agent."""
    run = runtime.active()
    return run.supervised if run is not None else runtime.under_agent()


def context() -> Context:
    """This process's context. Under Unicron it comes from the job spec; under torchrun from
    its environment (RANK, WORLD_SIZE), with no data settings."""
    run = runtime.current()
    if run is None:
        return Context(
            job="local", rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1"))
        )
    from unicron.trainer.loop import training_of

    data = run.spec.data
    return Context(
        job=run.spec.name or run.config.job_id,
        rank=run.rank,
        world_size=run.world_size,
        data_path=data.path,
        tokenizer=data.tokenizer,
        data_options=dict(data.options),
        under_unicron=run.supervised,
        training=training_of(run.spec) if run.supervised else None,
    )


def pretrain(
    model_provider: ModelProvider,
    dataset_provider: DatasetProvider,
    forward_step: ForwardStep,
    training: Training | None = None,
    *,
    seq_length: int = 0,
    describe: Mapping[str, Any] | None = None,
    flops_per_token: float = 0.0,
    checkpoint_dir: str = "",
    valid_dataset_provider: DatasetProvider | None = None,
) -> None:
    """Trains a Megatron-Core program to its last iteration, the way Megatron-LM's
    ``pretrain()`` does, with Unicron's recovery underneath: errors reported and classified,
    reform in place, state from a live peer, snapshots, checkpoints, resize with the global
    batch kept.

    The three providers are the program (see ``MegatronProgram``). ``training`` holds the
    settings for runs without Unicron (under Unicron the job spec's are used: the planner sized
    the job by them). ``checkpoint_dir`` (runs without Unicron only; under Unicron the agent's
    directory) enables persistent checkpoints every ``training.checkpoint_interval``.
    ``valid_dataset_provider(num_samples)``: the validation data, addressed like the training
    data; the job evaluates on it every ``training.eval_interval`` iterations.

    Returns when the last iteration is done. Raises SystemExit(143) when Unicron stopped the
    rank (a resize left it out, the job was cancelled), and the error after reporting it when
    training cannot go on."""
    program = MegatronProgram(
        model_provider,
        dataset_provider,
        forward_step,
        seq_length=seq_length,
        description=dict(describe or {}),
        flops_per_token=flops_per_token,
        valid_dataset_provider=valid_dataset_provider,
    )
    train_program(program, training, checkpoint_dir=checkpoint_dir)


def train_program(program: MegatronProgram, training: Training | None = None, *, checkpoint_dir: str = "") -> None:
    """``pretrain`` with the program as one object."""
    from unicron.trainer import loop

    run = runtime.current()
    if run is None:
        run = runtime.attach_local(loop.local_spec(training or Training()), checkpoint_dir)
    if run.finished:
        raise ProgramError("pretrain() was called again after the job's last iteration")
    loop.train(run, program)
    if run.stop.is_set() and run.iteration < run.spec.training.iterations:
        raise SystemExit(runtime.EXIT_STOPPED)
    runtime.finish(run)
