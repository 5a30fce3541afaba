"""Where CUDA exists: the GPT example trains on the GPU through the trainer library and a
real trainer process, and the Megatron CPU shim stays out of the way. Skipped without CUDA
(the one-GPU test passed on an H200 on 2026-12-04; the two-GPU tests have not run yet)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.harness import FakeAgent, run_ranks, tiny_spec
from unicron.ports import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_gpt_example_trains_on_one_gpu(tmp_path: Path) -> None:
    agent = FakeAgent()
    try:
        spec = tiny_spec(iterations=8, checkpoint_interval=8)
        (result,) = run_ranks(agent, spec, 1, tmp_path, tmp_path / "ckpt", extra_env={"CUDA_VISIBLE_DEVICES": "0"})
    finally:
        agent.stop()
    assert result.returncode == 0, result.log[-3000:]
    losses = [r.loss for r in agent.of(0, "iteration")]
    assert len(losses) == 8 and losses[-1] < losses[0], losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL takes one GPU per rank)")
def test_two_ranks_on_two_gpus_train_data_parallel(tmp_path: Path) -> None:
    agent = FakeAgent()
    try:
        spec = tiny_spec(iterations=6)
        # No CUDA_VISIBLE_DEVICES or LOCAL_RANK: each rank takes the GPU of its rank.
        results = run_ranks(agent, spec, 2, tmp_path)
    finally:
        agent.stop()
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    assert [r.loss for r in agent.of(0, "iteration")] == [r.loss for r in agent.of(1, "iteration")]


def _blocked_allreduce(rank: int, port: int, result: Any) -> None:
    """Rank 0 enters an all-reduce that rank 1 never joins; a thread aborts rank 0's NCCL
    communicators after a second (what interrupt_collectives does when a reform arrives)."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from unicron.trainer import reform as reforming

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    flag = torch.ones(1, device="cuda")
    dist.all_reduce(flag)  # the group works
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(30)  # a peer that left: never joins the next collective
        return
    threading.Timer(1.0, reforming.abort_communicators).start()
    start = time.monotonic()
    try:
        dist.all_reduce(flag)
        torch.cuda.synchronize()
        result.put(("completed", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - what the abort raises is the point
        result.put((type(exc).__name__, time.monotonic() - start))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL takes one GPU per rank)")
def test_aborting_the_communicators_frees_a_blocked_collective_at_once() -> None:
    import torch.multiprocessing as mp

    port = free_port()
    context = mp.get_context("spawn")
    result = context.Queue()
    procs = [context.Process(target=_blocked_allreduce, args=(rank, port, result), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    outcome, seconds = result.get(timeout=60)
    for proc in procs:
        proc.kill()
    # Failed, and within seconds: not at the 120 s collective timeout.
    assert outcome != "completed" and seconds < 10, (outcome, seconds)
