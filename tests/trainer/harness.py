"""Helpers for trainer tests: a tiny job, an in-process reference run, and real trainer ranks
(`python -m services.trainer`) talking to a fake agent on 127.0.0.1."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.trainer.gpt import trainer_configs
from unicron.redisutil import free_port
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2
from unicron_dev.fake_agent import FakeAgent
from unicron_dev.localcluster import ROOT as REPO_ROOT
from unicron_dev.localcluster import gpt_program
from unicron_dev.trainer_procs import (
    RANK_TIMEOUT_S,
    ProcessKey,
    RankResult,
    ReformAgent,
    Trainer,
    start_trainer,
    trainer_process_env,
)

# What trainer tests import from here too.
__all__ = ["REPO_ROOT", "FakeAgent", "ProcessKey", "RankResult", "ReformAgent", "Trainer", "free_port", "start_trainer"]


def tiny_spec(iterations: int, checkpoint_interval: int = 0, dropout: float = 0.0) -> common_pb2.JobSpec:
    """A model small enough that a step takes milliseconds; startup dominates. Without dropout
    by default: the tests on it compare runs across data-parallel degrees within 1e-6, which
    holds without dropout; with it the rounding of a different reduction order grows, and
    tests/trainer/test_exactness.py checks that case against the distance it measures."""
    program = gpt_program(1, 32, 2, 16, 64, hidden_dropout=dropout, attention_dropout=dropout)
    return common_pb2.JobSpec(
        name="tiny",
        program=common_pb2.ProgramSpec(**program),  # type: ignore[arg-type]
        parallelism=common_pb2.ParallelismSpec(tensor=1, pipeline=1, data=1),
        training=common_pb2.TrainingSpec(
            iterations=iterations,
            global_batch_size=4,
            micro_batch_size=1,
            learning_rate=5e-3,
            seed=7,
            checkpoint_interval=checkpoint_interval,
        ),
    )


def relative_difference(got: dict[str, Any], want: dict[str, Any], per_tensor: bool = True) -> float:
    """How far two parameter sets are apart: the largest ||got - want|| / ||want|| over the
    tensors (per_tensor), or that ratio over all parameters as one vector. Both must hold the
    same tensor names."""
    import torch

    names = sorted(k for k, v in want.items() if isinstance(v, torch.Tensor))
    assert names == sorted(k for k, v in got.items() if isinstance(v, torch.Tensor))
    diffs = [float((got[n].double() - want[n].double()).norm()) for n in names]
    norms = [float(want[n].double().norm()) for n in names]
    if per_tensor:
        return max(d / max(n, 1e-30) for d, n in zip(diffs, norms, strict=True))
    return math.sqrt(sum(d * d for d in diffs)) / math.sqrt(sum(n * n for n in norms))


def assert_same_params(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Parameters equal to a reference run's: every tensor within 1e-6 relative, also across
    data-parallel degrees (the GPT example's linear layers have no biases, so no parameter's
    gradient is pure rounding noise; see examples/gpt/model.py)."""
    assert relative_difference(got, want) <= 1e-6


def reference_run(spec: common_pb2.JobSpec, store: Path) -> tuple[list[float], dict[str, Any]]:
    """Fault-free training of ``spec`` in this process, world 1: (losses, final parameters)."""
    import torch
    import torch.distributed as dist

    from tests.trainer.gpt import gpt_trainer

    model, train = trainer_configs(spec)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        trainer = gpt_trainer(model, train)
        try:
            losses = [trainer.step().loss for _ in range(spec.training.iterations)]
            params = {
                k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)
            }
        finally:
            trainer.close()
    finally:
        dist.destroy_process_group()
    return losses, params


def run_ranks(
    agent: FakeAgent,
    spec: common_pb2.JobSpec,
    world_size: int,
    work: Path,
    checkpoint_dir: Path | None = None,
    faults: dict[int, str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Runs every rank of one job as `python -m services.trainer` and waits for them."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    logs = []
    for rank in range(world_size):
        env = trainer_process_env(agent.address, spec, rank, world_size, port, 1, checkpoint_dir, extra_env)
        if faults and rank in faults:
            env.update(trainer_env(fault_injection=True, faults=(faults[rank],)))
        log_path = work / f"rank{rank}.log"
        logs.append(log_path)
        with open(log_path, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "services.trainer"],
                    env=env,
                    cwd=REPO_ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    results = []
    for proc, log_path in zip(procs, logs, strict=True):
        try:
            proc.wait(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        results.append(RankResult(proc.returncode, log_path.read_text()))
    return results


# --- reform: processes that move to a new process group -------------------------------------


# A trainer process as the agent knows it: the (generation, rank) of its hello.


def restart_rank_one_from_its_buddy(spec: common_pb2.JobSpec, tmp_path: Path, root: Path) -> None:
    """Two ranks on two nodes; rank 1 is killed in iteration 9 and its replacement starts on a
    third node. Asserts that every process ended well and that the new rank's first iteration
    (9) took its state from a buddy copy of iteration 8, the one rank 0 keeps."""
    port, new_port = free_port(), free_port()
    agent = ReformAgent({(1, 0): 0}, generation=2, world_size=2, port=new_port, when=ReformAgent.any_error)
    crash = trainer_env(node="node-b", fault_injection=True, faults=("crash@9",))
    stays = trainer_env(node="node-a")
    try:
        old = [start_trainer(agent.address, spec, r, 2, port, tmp_path, 1, root, crash if r else stays) for r in (0, 1)]
        assert old[1].wait().returncode != 0
        joins = trainer_env(node="node-c", state_from_peer=True)
        restarted = start_trainer(agent.address, spec, 1, 2, new_port, tmp_path, 2, root, joins)
        for result in (old[0].wait(), restarted.wait()):
            assert result.returncode == 0, result.log[-3000:]
    finally:
        agent.stop()
    first = agent.of((2, 1), "iteration")[0]
    assert (first.iteration, first.state_source, first.restored_iteration) == (9, "buddy", 8)


def leave_at_six(
    spec: common_pb2.JobSpec, tmp_path: Path, stays: dict[str, str], leaves: dict[str, str]
) -> tuple[ReformAgent, RankResult]:
    """2 -> 1 data-parallel ranks at iteration 6, no persistent checkpoint to fall back to:
    rank 1 (started with ``leaves``) exits, rank 0 (``stays``) goes on alone."""
    port, new_port = free_port(), free_port()
    agent = ReformAgent({(1, 0): 0}, generation=2, world_size=1, port=new_port, when=ReformAgent.any_error)
    exits = {**leaves, **trainer_env(fault_injection=True, faults=("exit@6",))}
    try:
        root = tmp_path / "ckpt"
        ranks = [
            start_trainer(agent.address, spec, r, 2, port, tmp_path, 1, root, exits if r else stays) for r in (0, 1)
        ]
        assert ranks[1].wait().returncode == 3
        result = ranks[0].wait()
    finally:
        agent.stop()
    assert result.returncode == 0, result.log[-3000:]
    return agent, result
