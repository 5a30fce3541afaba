"""Persistent checkpoints (services/trainer/checkpoint.py).

Unit tests of the file format and the fallback rules use tiny tensors and no process group.
The exactness test trains in this process (world 1): 6 iterations straight through against 3,
a checkpoint, and a new trainer that resumes from it. The resize test saves with two real
trainer ranks (DP 2) and resumes with one (DP 1), through `python -m services.trainer`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.gpt import MegatronTrainer, ModelConfig, gpt_trainer
from tests.trainer.harness import (
    FakeAgent,
    assert_same_params,
    relative_difference,
    run_ranks,
    tiny_spec,
    trainer_configs,
)
from unicron.trainer import checkpoint
from unicron.trainer.checkpoint import Layout

SHAPE = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 4, "vocab_size": 16}
LAYOUT = checkpoint.layout_of_config(SHAPE, 1, 1)
SPEC = tiny_spec(iterations=6, checkpoint_interval=3)
MODEL, TRAIN = trainer_configs(SPEC)


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((3, 2), value)}, "optimizer": {"state": {}, "param_groups": []}}


def _save(root: Path, iteration: int, value: float, layout: Layout = LAYOUT) -> None:
    record = checkpoint.write_shard(root, iteration, 0, 0, _state(value))
    checkpoint.write_manifest(root, iteration, layout, [record])


def _loaded_value(found: tuple[int, dict[str, Any]] | None) -> tuple[int, float] | None:
    if found is None:
        return None
    iteration, payload = found
    return iteration, float(payload["model"]["w"][0, 0])


# --- the file format and the fallback rules, no process group --------------------------------


def test_newest_complete_checkpoint_is_loaded(tmp_path: Path) -> None:
    _save(tmp_path, 3, 3.0)
    _save(tmp_path, 6, 6.0)
    assert checkpoint.list_complete(tmp_path) == [6, 3]
    assert _loaded_value(checkpoint.find_latest(tmp_path, LAYOUT)) == (6, 6.0)
    manifest = json.loads((checkpoint.iteration_dir(tmp_path, 6) / checkpoint.MANIFEST).read_text())
    assert manifest["iteration"] == 6
    assert manifest["layout"] == LAYOUT.as_dict()
    assert set(manifest["shards"]) == {"tp0_pp0"} and len(manifest["shards"]["tp0_pp0"]["sha256"]) == 64


def test_corrupt_shard_falls_back_to_the_older_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path, 3, 3.0)
    _save(tmp_path, 6, 6.0)
    shard = checkpoint.iteration_dir(tmp_path, 6) / checkpoint.shard_file(0, 0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert _loaded_value(checkpoint.find_latest(tmp_path, LAYOUT)) == (3, 3.0)
    assert "iteration 6 is unusable" in caplog.text and "corrupt" in caplog.text


def test_truncated_or_missing_shard_falls_back(tmp_path: Path) -> None:
    _save(tmp_path, 3, 3.0)
    _save(tmp_path, 6, 6.0)
    _save(tmp_path, 9, 9.0)
    shard9 = checkpoint.iteration_dir(tmp_path, 9) / checkpoint.shard_file(0, 0)
    shard9.write_bytes(shard9.read_bytes()[:10])
    (checkpoint.iteration_dir(tmp_path, 6) / checkpoint.shard_file(0, 0)).unlink()
    assert _loaded_value(checkpoint.find_latest(tmp_path, LAYOUT)) == (3, 3.0)


def test_wrong_shape_or_split_falls_back_then_starts_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path, 3, 3.0)
    _save(tmp_path, 6, 6.0, checkpoint.layout_of_config({**SHAPE, "hidden_size": 16}, 1, 1))
    with caplog.at_level(logging.WARNING):
        assert _loaded_value(checkpoint.find_latest(tmp_path, LAYOUT)) == (3, 3.0)
    assert "another model or split" in caplog.text
    other_split = checkpoint.layout_of_config(SHAPE, 2, 1)
    assert checkpoint.find_latest(tmp_path, other_split) is None


def test_missing_or_garbled_manifest_means_incomplete(tmp_path: Path) -> None:
    _save(tmp_path, 3, 3.0)
    _save(tmp_path, 6, 6.0)
    _save(tmp_path, 9, 9.0)
    (checkpoint.iteration_dir(tmp_path, 9) / checkpoint.MANIFEST).unlink()
    (checkpoint.iteration_dir(tmp_path, 6) / checkpoint.MANIFEST).write_text('{"format": 1, "itera')
    assert checkpoint.list_complete(tmp_path) == [6, 3]
    assert _loaded_value(checkpoint.find_latest(tmp_path, LAYOUT)) == (3, 3.0)
    assert checkpoint.find_latest(tmp_path / "nothing-here", LAYOUT) is None


def test_manifest_requires_every_shard(tmp_path: Path) -> None:
    record = checkpoint.write_shard(tmp_path, 3, 0, 0, _state(3.0))
    with pytest.raises(checkpoint.CheckpointError, match="do not cover"):
        checkpoint.write_manifest(tmp_path, 3, checkpoint.layout_of_config(SHAPE, 1, 2), [record])
    assert checkpoint.list_complete(tmp_path) == []


def test_prune_keeps_the_last_two_complete(tmp_path: Path) -> None:
    for iteration in (3, 6, 9):
        _save(tmp_path, iteration, float(iteration))
    checkpoint.write_shard(tmp_path, 1, 0, 0, _state(1.0))  # an incomplete leftover
    _save(tmp_path, 15, 15.0)  # a bad checkpoint of an abandoned run, newer than the one just saved
    _save(tmp_path, 12, 12.0)
    assert checkpoint.prune(tmp_path, 12) == [1, 3, 6, 15]
    assert checkpoint.list_complete(tmp_path) == [12, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_00000009", "iter_00000012"]


def test_prune_leaves_what_unicron_did_not_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Megatron-LM's own layout in the same directory: an iteration directory and its marker.
    foreign = checkpoint.iteration_dir(tmp_path, 100)
    (foreign / "mp_rank_00").mkdir(parents=True)
    (foreign / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"weights")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("100")
    empty_foreign = checkpoint.iteration_dir(tmp_path, 2)
    empty_foreign.mkdir()
    # A checkpoint Unicron wrote before its directories were marked: its manifest names it.
    _save(tmp_path, 3, 3.0)
    (checkpoint.iteration_dir(tmp_path, 3) / checkpoint.OWNER_MARK).unlink()
    for iteration in (6, 9):
        _save(tmp_path, iteration, float(iteration))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.prune(tmp_path, 200) == [3]
    assert (foreign / "mp_rank_00" / "model_optim_rng.pt").read_bytes() == b"weights"
    assert empty_foreign.is_dir() and (tmp_path / "latest_checkpointed_iteration.txt").is_file()
    assert "not written by Unicron (iter_00000002, iter_00000100)" in caplog.text


# --- exactness: stop at a checkpoint, resume in a new trainer, world 1 in this process ---------


def _params(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}


def _train(steps: int, model: ModelConfig = MODEL) -> tuple[list[float], dict[str, torch.Tensor]]:
    trainer = gpt_trainer(model, TRAIN)
    try:
        return [trainer.step().loss for _ in range(steps)], _params(trainer)
    finally:
        trainer.close()


def test_resume_from_checkpoint_is_exact(world1: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    straight_losses, straight_params = _train(6)

    first = gpt_trainer(MODEL, TRAIN)
    try:
        assert checkpoint.restore(first, root) == checkpoint.Restored(checkpoint.SOURCE_FRESH, 0)
        losses = [first.step().loss for _ in range(3)]
        assert checkpoint.save(first, root) == ""
    finally:
        first.close()
    assert checkpoint.list_complete(root) == [3]

    second = gpt_trainer(MODEL, TRAIN)
    try:
        assert checkpoint.restore(second, root) == checkpoint.Restored(checkpoint.SOURCE_CHECKPOINT, 3)
        assert second.iteration == 3
        results = [second.step() for _ in range(3)]
        losses += [r.loss for r in results]
        assert [r.iteration for r in results] == [4, 5, 6]
        assert checkpoint.save(second, root) == ""
        resumed_params = _params(second)
    finally:
        second.close()
    assert losses == straight_losses
    assert relative_difference(resumed_params, straight_params) <= 1e-6

    # The newest (6) is corrupt: every rank falls back to 3 and continues from there.
    shard = checkpoint.iteration_dir(root, 6) / checkpoint.shard_file(0, 0)
    shard.write_bytes(shard.read_bytes()[:-100])
    third = gpt_trainer(MODEL, TRAIN)
    try:
        assert checkpoint.restore(third, root) == checkpoint.Restored(checkpoint.SOURCE_CHECKPOINT, 3)
        assert third.step().loss == straight_losses[3]
    finally:
        third.close()

    # A job of another shape finds nothing it can use and starts fresh instead of crashing.
    other = gpt_trainer(
        ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16, vocab_size=64), TRAIN
    )
    try:
        assert checkpoint.restore(other, root) == checkpoint.Restored(checkpoint.SOURCE_FRESH, 0)
        assert other.iteration == 0
    finally:
        other.close()


# --- resize: saved by two real ranks (DP 2), resumed by one (DP 1) ----------------------------


def _reports(agent: FakeAgent, rank: int) -> list[Any]:
    return agent.of(rank, "iteration")


def test_checkpoint_of_dp2_resumes_on_dp1(world1: None, tmp_path: Path) -> None:
    straight_losses, straight_params = _train(6)
    root = tmp_path / "ckpt"
    agent = FakeAgent()
    try:
        saved = run_ranks(agent, tiny_spec(iterations=3, checkpoint_interval=3), 2, tmp_path / "dp2", root)
        for rank, result in enumerate(saved):
            assert result.returncode == 0, f"DP2 rank {rank} exited {result.returncode}:\n{result.log[-3000:]}"
        assert checkpoint.list_complete(root) == [3]
        assert [r.state_source for r in _reports(agent, 0)] == ["fresh", "", ""]

        resumed_agent = FakeAgent()
        try:
            resumed = run_ranks(resumed_agent, SPEC, 1, tmp_path / "dp1", root)
            assert resumed[0].returncode == 0, resumed[0].log[-3000:]
            reports = _reports(resumed_agent, 0)
        finally:
            resumed_agent.stop()
    finally:
        agent.stop()

    assert [r.iteration for r in reports] == [4, 5, 6]
    assert (reports[0].state_source, reports[0].restored_iteration) == ("checkpoint", 3)
    assert [(r.state_source, r.restored_iteration) for r in reports[1:]] == [("", 0), ("", 0)]
    losses = [r.loss for r in _reports(agent, 0)] + [r.loss for r in reports]
    for i, (got, want) in enumerate(zip(losses, straight_losses, strict=True)):
        assert math.isclose(got, want, rel_tol=1e-5), f"iteration {i + 1}: loss {got} != {want}"
    assert checkpoint.list_complete(root) == [6, 3]
    found = checkpoint.find_latest(root, checkpoint.layout_of_config(MODEL.shape(), 1, 1))
    assert found is not None and found[0] == 6
    # DP 2 then DP 1 against DP 1 throughout: equal up to float rounding.
    assert_same_params(found[1]["model"], straight_params)
