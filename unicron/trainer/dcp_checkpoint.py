"""Persistent checkpoints in torch's distributed checkpoint format (DCP,
``torch.distributed.checkpoint``), for FSDP2 programs under Session
(``training.checkpoint_format: dcp``): what a plain PyTorch script, torchtitan included,
loads with ``dcp.load`` under any world size.

Layout (Unicron's iteration directories, 8 digits)::

    <root>/iter_00000030/.metadata, __*_*.distcp   DCP's
    <root>/iter_00000030/manifest.json             Unicron's: the sha256 and size of every file
    <root>/iter_00000030/.unicron-checkpoint       Unicron wrote this directory

The state is torch's own state dicts, as ``torch.distributed.checkpoint.state_dict.get_state_dict``
gives them (fully qualified parameter names, DTensors): ``{"model": ..., "optimizer": ...,
"scheduler": ..., "iteration": N}``. A script takes the model with::

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id="<root>/iter_00000030")
    set_model_state_dict(model, state["model"])

Saving, verifying and restoring (the newest checkpoint whose files match their manifest, else
the next older) are the Megatron format's (``megatron_checkpoint.save_in``); DCP reshards on
load, so a checkpoint of any shard degree loads at any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unicron.trainer import checkpoint
from unicron.trainer.megatron_checkpoint import DistributedFormat, restore_from, save_in

FORMAT = "torch-dcp"  # the manifest's format


def _state(trainer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(trainer.model, trainer.optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "iteration": trainer.iteration}
    if trainer.scheduler is not None:
        state["scheduler"] = trainer.scheduler.state_dict()
    return state


def _write(trainer: Any, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(trainer), checkpoint_id=str(directory))


def _load(trainer: Any, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(
        trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    if trainer.scheduler is not None and "scheduler" in state:
        trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.discard_step()
    trainer.iteration = int(state["iteration"])


DCP = DistributedFormat(FORMAT, checkpoint.iteration_dir, _write, _load, tracker=False)


def save(trainer: Any, root: str | Path) -> str:
    """Collective: ``trainer``'s state saved as DCP (see ``megatron_checkpoint.save_in``)."""
    return save_in(DCP, trainer, root)


def restore(trainer: Any, root: str | Path) -> checkpoint.Restored:
    """Collective: the newest good DCP checkpoint under ``root`` loaded, or ``fresh``."""
    return restore_from(DCP, trainer, root)
