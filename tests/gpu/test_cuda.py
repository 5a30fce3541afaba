"""Where CUDA exists: the GPT example trains on the GPU through the trainer library and a
real trainer process, and the Megatron CPU shim stays out of the way. Skipped without CUDA
(this suite has not run on a GPU yet: none was lent to the sessions that wrote it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.harness import FakeAgent, run_ranks, tiny_spec

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
