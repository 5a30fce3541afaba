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

import logging
from pathlib import Path
from typing import Any

from unicron.trainer import checkpoint
from unicron.trainer.megatron_checkpoint import (
    LOAD_ERRORS,
    DistributedFormat,
    all_ranks_agree,
    last_line,
    restore_from,
    save_in,
)
from unicron.trainer.program import ProgramError

log = logging.getLogger(__name__)

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


def _model_layout(directory: Path, names: list[str]) -> str:
    """Where the checkpoint at ``directory`` keeps the model: "model." (this module's layout),
    "" (torchtitan's: at the top level). ProgramError when it lacks a parameter of ``names``."""
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    for prefix in ("model.", ""):
        if all(prefix + name in keys for name in names):
            return prefix
    missing = next(name for name in names if f"model.{name}" not in keys and name not in keys)
    raise ProgramError(f"training.initial_checkpoint {directory} is of another model: it holds no {missing}")


def _load_weights(trainer: Any, directory: Path, prefix: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = get_model_state_dict(trainer.model)
    state: dict[str, Any] = {"model": model} if prefix else dict(model)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(trainer.model, state["model"] if prefix else state)


def load_initial(trainer: Any, path: str, weights_only: bool) -> checkpoint.Restored:
    """Collective: ``trainer`` started from the DCP checkpoint at ``path`` (see the module's
    docstring). A ProgramError names what is wrong with it: the job fails once instead of
    training something else."""
    directory, problem, whole = Path(path), "", False
    try:
        if not (directory / ".metadata").is_file():
            raise ProgramError(
                f"training.initial_checkpoint {path}: no torch distributed checkpoint there (no .metadata)"
            )
        prefix = _model_layout(directory, list(trainer.model.state_dict()))
        whole = bool(prefix) and not weights_only
        if whole:
            _load(trainer, directory)
        else:
            _load_weights(trainer, directory, prefix)
    except ProgramError as exc:
        problem = str(exc)
    except LOAD_ERRORS as exc:  # DCP says what does not fit (a shape); the job fails once
        problem = f"training.initial_checkpoint {path} does not fit this job's model: {last_line(exc)}"
    if not all_ranks_agree(not problem):
        raise ProgramError(problem or "training.initial_checkpoint did not load on another rank")
    what = "model, optimizer and schedule" if whole else "weights"
    log.info("started from a DCP checkpoint", extra={"checkpoint": str(directory), "loaded": what})
    return checkpoint.Restored("initial", trainer.iteration)


DCP = DistributedFormat(FORMAT, checkpoint.iteration_dir, _write, _load, tracker=False)


def save(trainer: Any, root: str | Path) -> str:
    """Collective: ``trainer``'s state saved as DCP (see ``megatron_checkpoint.save_in``)."""
    return save_in(DCP, trainer, root)


def restore(trainer: Any, root: str | Path) -> checkpoint.Restored:
    """Collective: the newest good DCP checkpoint under ``root`` loaded, or ``fresh``."""
    return restore_from(DCP, trainer, root)
