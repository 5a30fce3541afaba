"""In-memory snapshots (unicron/trainer/snapshot.py), world 1 in this process: a restart from
the node's snapshot is exact, beats an older checkpoint, and a corrupt or foreign snapshot falls
back (to an older snapshot, then the checkpoint) without raising. The real trainer takes its
state this way when no live peer is left (the end-to-end self-healing tests)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.gpt import MegatronTrainer, ModelConfig, gpt_trainer
from tests.trainer.harness import relative_difference, tiny_spec, trainer_configs
from unicron.trainer import checkpoint, snapshot

SPEC = tiny_spec(iterations=6)
MODEL, TRAIN = trainer_configs(SPEC)


def _params(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}


def _run_until(steps: int, snaps: Path, ckpt: Path, checkpoint_at: int, every: int = 1) -> list[float]:
    """Trains a fresh trainer for ``steps`` iterations, snapshotting every ``every`` and saving a
    checkpoint after ``checkpoint_at``; the process "dies" after that (the trainer is dropped)."""
    trainer = gpt_trainer(MODEL, TRAIN)
    writer = snapshot.SnapshotWriter(snaps, rank=0, every=every)
    losses = []
    try:
        for _ in range(steps):
            losses.append(trainer.step().loss)
            if trainer.iteration == checkpoint_at:
                assert checkpoint.save(trainer, ckpt) == ""
            writer.after_iteration(trainer)
            writer.wait()
    finally:
        trainer.close()
    return losses


def test_a_restart_takes_the_newer_snapshot_and_ends_exactly_where_a_straight_run_does(
    world1: None, tmp_path: Path
) -> None:
    snaps, ckpt = tmp_path / "snaps", tmp_path / "ckpt"
    straight = gpt_trainer(MODEL, TRAIN)
    try:
        straight_losses = [straight.step().loss for _ in range(6)]
        straight_params = _params(straight)
    finally:
        straight.close()

    losses = _run_until(4, snaps, ckpt, checkpoint_at=2)
    # Two kept per rank; each complete with its digest.
    assert sorted(p.name for p in (snaps / "rank0").iterdir()) == [
        "iter_00000003.index",
        "iter_00000003.snap",
        "iter_00000004.index",
        "iter_00000004.snap",
    ]
    resumed = gpt_trainer(MODEL, TRAIN)
    try:
        restored = snapshot.restore_nearest(resumed, str(ckpt), str(snaps))
        assert restored == checkpoint.Restored(snapshot.SOURCE_SNAPSHOT, 4)
        losses += [resumed.step().loss for _ in range(2)]
        params = _params(resumed)
    finally:
        resumed.close()
    assert losses == straight_losses
    assert relative_difference(params, straight_params) <= 1e-6


def test_a_corrupt_snapshot_falls_back_to_an_older_one_then_to_the_checkpoint(
    world1: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    snaps, ckpt = tmp_path / "snaps", tmp_path / "ckpt"
    _run_until(4, snaps, ckpt, checkpoint_at=2)
    newest = snaps / "rank0" / "iter_00000004.snap"
    newest.write_bytes(newest.read_bytes()[:-50])
    trainer = gpt_trainer(MODEL, TRAIN)
    try:
        with caplog.at_level(logging.WARNING):
            assert snapshot.restore_nearest(trainer, str(ckpt), str(snaps)) == checkpoint.Restored("snapshot", 3)
        assert "corrupt" in caplog.text
        older = snaps / "rank0" / "iter_00000003.snap"
        older.write_bytes(b"garbage")
        assert snapshot.restore_nearest(trainer, str(ckpt), str(snaps)) == checkpoint.Restored("checkpoint", 2)
    finally:
        trainer.close()


def test_a_snapshot_no_newer_than_the_checkpoint_or_of_another_model_is_not_used(world1: None, tmp_path: Path) -> None:
    snaps, ckpt = tmp_path / "snaps", tmp_path / "ckpt"
    _run_until(4, snaps, ckpt, checkpoint_at=4, every=2)
    trainer = gpt_trainer(MODEL, TRAIN)
    try:
        assert snapshot.restore_nearest(trainer, str(ckpt), str(snaps)) == checkpoint.Restored("checkpoint", 4)
    finally:
        trainer.close()
    other = gpt_trainer(
        ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16, vocab_size=64), TRAIN
    )
    try:
        assert snapshot.restore(other, snaps) is None
        assert snapshot.restore_nearest(other, "", str(snaps)) == checkpoint.Restored("fresh", 0)
    finally:
        other.close()


def test_a_snapshot_due_while_one_is_being_written_is_skipped(world1: None, tmp_path: Path) -> None:
    trainer = gpt_trainer(MODEL, TRAIN)
    writer = snapshot.SnapshotWriter(tmp_path, rank=0, every=2)
    try:
        trainer.step()
        assert not writer.after_iteration(trainer)  # iteration 1: not due
        trainer.step()
        writer._busy.acquire()  # a write in flight
        assert not writer.after_iteration(trainer)
        writer._busy.release()
        assert writer.after_iteration(trainer)
        writer.wait()
    finally:
        trainer.close()
    assert (tmp_path / "rank0" / "iter_00000002.index").is_file()


def test_the_snapshot_is_the_state_when_taken_though_training_goes_on_at_once(world1: None, tmp_path: Path) -> None:
    # Serializing and writing happen off the training thread: the copy taken on it must not
    # share a tensor with the trainer, which the next step changes in place.
    trainer = gpt_trainer(MODEL, TRAIN)
    try:
        trainer.step()
        taken = _params(trainer)
        writer = snapshot.SnapshotWriter(tmp_path, rank=0, every=1)
        assert writer.after_iteration(trainer)
        with torch.no_grad():
            for param in trainer.model.parameters():
                param.add_(1.0)
        writer.wait()
        payload = snapshot.read(tmp_path / "rank0", 1)
    finally:
        trainer.close()
    saved = {k: v for k, v in payload["model"].items() if isinstance(v, torch.Tensor)}
    assert saved.keys() == taken.keys()
    assert relative_difference(saved, taken) == 0.0


def test_every_tensor_comes_back_bit_for_bit_and_any_damage_is_named(tmp_path: Path) -> None:
    # The file format alone, without a trainer: every dtype a state may hold, an empty tensor,
    # a tensor larger than one piece, Python values; then a flipped byte, a cut and a bad index.
    state: dict[str, Any] = {
        "iteration": 7,
        "model": {"w": torch.randn(3, 5), "h": torch.randn(4).to(torch.bfloat16), "empty": torch.zeros(0, 2)},
        "optimizer": {"step": torch.tensor(3, dtype=torch.int64), "mask": torch.tensor([True, False])},
        "big": torch.arange(3 * snapshot.PIECE_BYTES // 8 + 5, dtype=torch.float64),
        "groups": [{"lr": 0.1, "params": (0, 1)}],
    }
    directory = tmp_path / "rank0"
    directory.mkdir()
    snap, index = directory / "iter_00000007.snap", directory / "iter_00000007.index"
    index.write_text(json.dumps(snapshot._write_data(snap, state)))
    back = snapshot.read(directory, 7)
    assert back["iteration"] == 7 and back["groups"] == [{"lr": 0.1, "params": (0, 1)}]
    for path in (("model", "w"), ("model", "h"), ("model", "empty"), ("optimizer", "step"), ("optimizer", "mask")):
        got, want = back[path[0]][path[1]], state[path[0]][path[1]]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(back["big"], state["big"])

    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snap.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="tensor 5 fails its CRC-32"):
        snapshot.read(directory, 7)
    snap.write_bytes(bytes(data[:-10]))
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        snapshot.read(directory, 7)
    index.write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="bad index"):
        snapshot.read(directory, 7)
    index.write_text(json.dumps({"format": 1}))
    with pytest.raises(checkpoint.CheckpointError, match="format 1"):
        snapshot.read(directory, 7)
