"""A job's persistent checkpoint in the format its spec chooses (``training.checkpoint_format``):
Unicron's own (``checkpoint.py``, the default), Megatron-Core's distributed checkpoint
(``megatron_checkpoint.py``) or, for an FSDP2 program under Session, torch's DCP
(``dcp_checkpoint.py``); and, where neither holds a checkpoint yet, the Megatron-LM
checkpoint the job starts from (``training.initial_checkpoint``); and the final checkpoint
``pretrain`` ends with, in Megatron's format whatever the job's, for plain scripts to load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unicron.trainer import checkpoint, dcp_checkpoint, megatron_checkpoint
from unicron.trainer.fsdp import FSDPTrainer

FORMATS = ("unicron", "megatron", "dcp")
# Where the final checkpoint of a job that keeps Unicron's format goes, laid out as a
# Megatron-LM save directory (its tracker file and one ``iter_*`` directory).
FINAL_DIR = "final"


def _training(trainer: Any) -> Any:
    return getattr(trainer, "training", None)


def _format(trainer: Any) -> str:
    return str(getattr(_training(trainer), "checkpoint_format", "unicron"))


def _megatron_format(trainer: Any) -> bool:
    return _format(trainer) == "megatron"


def save(trainer: Any, root: str | Path) -> str:
    """Collective: as ``checkpoint.save``, in the job's format."""
    if _megatron_format(trainer):
        return megatron_checkpoint.save(trainer, root)
    if _format(trainer) == "dcp":
        return dcp_checkpoint.save(trainer, root)
    return checkpoint.save(trainer, root)


def restore(trainer: Any, root: str | Path) -> checkpoint.Restored:
    """Collective: the newest good checkpoint of the job's format under ``root`` ("": none),
    else the initial checkpoint the job names, else a fresh model."""
    restored = checkpoint.Restored(checkpoint.SOURCE_FRESH, 0)
    if root:
        chosen = {"megatron": megatron_checkpoint.restore, "dcp": dcp_checkpoint.restore}.get(_format(trainer))
        restored = (chosen or checkpoint.restore)(trainer, root)
    training = _training(trainer)
    initial = getattr(training, "initial_checkpoint", "")
    if restored.source == checkpoint.SOURCE_FRESH and initial:
        # An FSDP2 program under Session starts from torch's format, a Megatron-Core one from Megatron's.
        sharded = isinstance(trainer, FSDPTrainer)
        load = dcp_checkpoint.load_initial if sharded else megatron_checkpoint.load_initial
        return load(trainer, initial, training.initial_checkpoint_weights_only)
    return restored


def final_root(trainer: Any, root: str | Path) -> Path:
    """The Megatron-LM save directory the final checkpoint goes to: the checkpoint directory
    itself when the job checkpoints in Megatron's format, else its ``final/``: Unicron's own
    ``iter_*`` directories (8 digits) and Megatron's (7) are kept apart."""
    return Path(root) if _megatron_format(trainer) else Path(root) / FINAL_DIR


def save_final(trainer: Any, root: str | Path, saved: bool) -> str:
    """Collective: the trained model, optimizer and schedule saved as Megatron-Core's
    distributed checkpoint in ``final_root`` ("" once saved, else why not). ``saved``: this
    iteration's checkpoint was just written in the job's format; in Megatron's, that one is the
    final checkpoint."""
    if saved and _megatron_format(trainer):
        return ""
    return megatron_checkpoint.save(trainer, final_root(trainer, root))
