"""Persistent checkpoints in Megatron-Core's distributed checkpoint format, in this process
(world 1): what is written (Megatron-LM's layout and tracker, Unicron's checksum manifest
beside), a restore that trains on bit-identically, a plain Megatron-Core model reading the
files with ``dist_checkpointing.load``, a corrupt file falling back, and a job starting from a
checkpoint Megatron wrote: whole, weights only, missing, or of another model."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from examples.gpt.model import ModelConfig, model_provider
from examples.gpt.train import program
from unicron.trainer import checkpoint, megatron_checkpoint, persistent
from unicron.trainer.engine import MegatronTrainer
from unicron.trainer.megatron_cpu import cpu_mode
from unicron.trainer.program import ProgramError, Training

MODEL = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)
TRAINING = Training(
    iterations=12,
    global_batch_size=4,
    micro_batch_size=2,
    learning_rate=1e-2,
    seed=3,
    precision="bf16",
    distributed_optimizer=True,
    checkpoint_format="megatron",
)


def _trainer(training: Training = TRAINING, model: ModelConfig = MODEL) -> MegatronTrainer:
    return MegatronTrainer(program(model, training.seed, precision=training.precision), training)


def _params(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.fixture
def saved(tmp_path: Path, world1: None) -> tuple[Path, list[float], dict[str, torch.Tensor]]:
    """A checkpoint of iteration 3 (and of 2, older), the losses of iterations 4-6 and the
    parameters after 6 when training goes on."""
    trainer = _trainer()
    try:
        for iteration in (1, 2, 3):
            trainer.step()
            if iteration >= 2:
                assert megatron_checkpoint.save(trainer, tmp_path) == ""
        losses = [trainer.step().loss for _ in range(3)]
        return tmp_path, losses, _params(trainer)
    finally:
        trainer.release()


def test_the_files_are_megatrons_with_unicrons_manifest(saved: tuple[Path, list[float], dict]) -> None:
    root, _, _ = saved
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    directory = root / "iter_0000003"
    names = {p.name for p in directory.iterdir()}
    assert {"metadata.json", "common.pt", ".metadata", "manifest.json", checkpoint.OWNER_MARK} <= names
    assert any(name.endswith(".distcp") for name in names)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["format"] == "megatron-dist" and manifest["iteration"] == 3
    assert set(manifest["files"]) == names - {"manifest.json", checkpoint.OWNER_MARK}
    assert checkpoint.list_complete(root) == [3, 2]


@pytest.mark.usefixtures("world1")
def test_a_restore_trains_on_bit_identically(saved: tuple[Path, list[float], dict]) -> None:
    root, losses, final = saved
    trainer = _trainer()
    try:
        restored = persistent.restore(trainer, root)
        assert (restored.source, restored.iteration, trainer.iteration) == ("checkpoint", 3, 3)
        assert [trainer.step().loss for _ in range(3)] == losses
        assert all(v.equal(_params(trainer)[k]) for k, v in final.items())
    finally:
        trainer.release()


@pytest.mark.usefixtures("world1")
def test_a_plain_megatron_core_model_reads_the_checkpoint(saved: tuple[Path, list[float], dict]) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    root, _, _ = saved
    trainer = _trainer()
    try:
        persistent.restore(trainer, root)
        want = {k.removeprefix("module."): v for k, v in _params(trainer).items()}
    finally:
        trainer.release()
    # What a Megatron-Core script does: its model, its sharded state dict, dist_checkpointing.
    with cpu_mode("cpu"):
        parallel_state.initialize_model_parallel(1, 1)
        try:
            gpt = model_provider(MODEL, "bf16")(True, True)
            loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, str(root / "iter_0000003"))
            gpt.load_state_dict(loaded["model"])
            assert loaded["iteration"] == 3 and loaded["checkpoint_version"] == 3.0  # as Megatron-LM reads them
            got = {k: v for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        finally:
            parallel_state.destroy_model_parallel()
    assert sorted(got) == sorted(want)
    assert all(v.equal(want[k]) for k, v in got.items())


@pytest.mark.usefixtures("world1")
def test_a_corrupt_file_falls_back_to_the_older_checkpoint(saved: tuple[Path, list[float], dict]) -> None:
    root, _, _ = saved
    shard = next((root / "iter_0000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    trainer = _trainer()
    try:
        restored = persistent.restore(trainer, root)
        assert (restored.source, restored.iteration) == ("checkpoint", 2)
    finally:
        trainer.release()
    assert shard.exists()  # nothing deleted


def _as_megatron_wrote_it(root: Path, target: Path) -> Path:
    """The checkpoint of iteration 3 as Megatron-LM leaves it: no manifest, no mark."""
    shutil.copytree(root / "iter_0000003", target / "iter_0000003")
    for name in ("manifest.json", checkpoint.OWNER_MARK):
        (target / "iter_0000003" / name).unlink()
    (target / "latest_checkpointed_iteration.txt").write_text("3\n")
    return target


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("weights_only", [False, True])
def test_a_job_starts_from_a_megatron_checkpoint(
    saved: tuple[Path, list[float], dict], tmp_path: Path, weights_only: bool
) -> None:
    root, losses, _ = saved
    megatron = _as_megatron_wrote_it(root, tmp_path / "megatron")
    training = replace(TRAINING, initial_checkpoint=str(megatron), initial_checkpoint_weights_only=weights_only)
    reference = _trainer()
    try:
        persistent.restore(reference, root)
        weights = _params(reference)
    finally:
        reference.release()
    trainer = _trainer(training)
    try:
        restored = persistent.restore(trainer, tmp_path / "own")  # no checkpoint of its own yet
        assert restored.source == "initial"
        assert all(v.equal(_params(trainer)[k]) for k, v in weights.items())
        if weights_only:
            assert trainer.iteration == 0
        else:
            assert trainer.iteration == 3
            assert [trainer.step().loss for _ in range(3)] == losses
    finally:
        trainer.release()


@pytest.mark.usefixtures("world1")
def test_a_missing_or_foreign_initial_checkpoint_fails_naming_it(
    saved: tuple[Path, list[float], dict], tmp_path: Path
) -> None:
    root, _, _ = saved
    missing = replace(TRAINING, initial_checkpoint=str(tmp_path / "nowhere"))
    trainer = _trainer(missing)
    try:
        with pytest.raises(ProgramError, match="no Megatron checkpoint there"):
            persistent.restore(trainer, "")
        assert trainer.iteration == 0
    finally:
        trainer.release()
    other = replace(MODEL, hidden_size=64)
    foreign = replace(TRAINING, initial_checkpoint=str(_as_megatron_wrote_it(root, tmp_path / "m")))
    trainer = _trainer(foreign, other)
    try:
        with pytest.raises(ProgramError, match="does not fit this job's model"):
            persistent.restore(trainer, "")
    finally:
        trainer.release()


@pytest.mark.usefixtures("world1")
def test_another_programs_tracker_is_left_as_it_is(saved: tuple[Path, list[float], dict], tmp_path: Path) -> None:
    """Megatron-LM saving into the same directory keeps its tracker: it names its own newest
    checkpoint, which it reads back; Unicron's checkpoints are found by their manifests."""
    root, _, _ = saved
    shared = _as_megatron_wrote_it(root, tmp_path / "shared")
    trainer = _trainer()
    try:
        persistent.restore(trainer, root)
        trainer.step()
        assert megatron_checkpoint.save(trainer, shared) == ""
    finally:
        trainer.release()
    assert (shared / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    assert checkpoint.list_complete(shared) == [4]


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("checkpoint_format", ["unicron", "megatron"])
def test_the_final_checkpoint_is_megatrons_in_either_format(tmp_path: Path, checkpoint_format: str) -> None:
    trainer = _trainer(replace(TRAINING, checkpoint_format=checkpoint_format, distributed_optimizer=False))
    try:
        trainer.step()
        saved = persistent.save(trainer, tmp_path) == ""
        assert persistent.save_final(trainer, tmp_path, saved) == ""
        final = persistent.final_root(trainer, tmp_path)
    finally:
        trainer.release()
    assert final == (tmp_path / "final" if checkpoint_format == "unicron" else tmp_path)
    assert (final / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert (final / "iter_0000001" / "metadata.json").is_file()
    assert checkpoint.list_complete(tmp_path) == [1]  # the job's own checkpoint, as before
