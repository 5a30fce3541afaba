"""A job's persistent checkpoint in the format its spec chooses (``training.checkpoint_format``):
Unicron's own (``checkpoint.py``, the default) or Megatron-Core's distributed checkpoint
(``megatron_checkpoint.py``); and, where neither holds a checkpoint yet, the Megatron-LM
checkpoint the job starts from (``training.initial_checkpoint``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unicron.trainer import checkpoint, megatron_checkpoint

FORMATS = ("unicron", "megatron")


def _training(trainer: Any) -> Any:
    return getattr(trainer, "training", None)


def _megatron_format(trainer: Any) -> bool:
    return getattr(_training(trainer), "checkpoint_format", "unicron") == "megatron"


def save(trainer: Any, root: str | Path) -> str:
    """Collective: as ``checkpoint.save``, in the job's format."""
    if _megatron_format(trainer):
        return megatron_checkpoint.save(trainer, root)
    return checkpoint.save(trainer, root)


def restore(trainer: Any, root: str | Path) -> checkpoint.Restored:
    """Collective: the newest good checkpoint of the job's format under ``root`` ("": none),
    else the initial checkpoint the job names, else a fresh model."""
    restored = checkpoint.Restored(checkpoint.SOURCE_FRESH, 0)
    if root:
        restored = (megatron_checkpoint.restore if _megatron_format(trainer) else checkpoint.restore)(trainer, root)
    training = _training(trainer)
    initial = getattr(training, "initial_checkpoint", "")
    if restored.source == checkpoint.SOURCE_FRESH and initial:
        return megatron_checkpoint.load_initial(trainer, initial, training.initial_checkpoint_weights_only)
    return restored
