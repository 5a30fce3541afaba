"""Persistent checkpoints in Megatron-Core's distributed checkpoint format, which Megatron-LM
and any Megatron-Core script read with ``dist_checkpointing.load`` (``training.checkpoint_format:
megatron``), and a job's start from a checkpoint Megatron-LM wrote (``training.initial_checkpoint``).

Layout, as Megatron-LM's (7-digit iteration directories, its tracker file)::

    <root>/latest_checkpointed_iteration.txt   the newest complete iteration (written last)
    <root>/iter_0000030/.metadata, __*_*.distcp, common.pt, metadata.json   dist_checkpointing's
    <root>/iter_0000030/manifest.json          Unicron's: the sha256 and size of every file
    <root>/iter_0000030/.unicron-checkpoint    Unicron wrote this directory (checkpoint.OWNER_MARK)

The state is what Megatron-LM saves: the unwrapped model's ``sharded_state_dict`` under
"model", the optimizer's under "optimizer" (``dp_reshardable`` under the distributed
optimizer, so a checkpoint loads at another data-parallel degree), ``opt_param_scheduler``,
``iteration`` and ``checkpoint_version`` 3.0. Saving is collective (every rank writes its
shards of the state); once ``dist_checkpointing.save`` has returned everywhere, rank 0 hashes
the files into the manifest, then writes the tracker, and prunes as ``checkpoint.prune``
(another program's directories are left alone). Restoring takes the newest checkpoint whose
files all match their manifest (rank 0 checks, every rank learns the verdict) and loads it
with ``dist_checkpointing.load``; a checkpoint that fails is logged and the next older tried.

A start from Megatron-LM's own checkpoint (no manifest there: nothing to verify it against
but Megatron's own metadata) loads the model and, unless ``initial_checkpoint_weights_only``,
the optimizer, the LR schedule and the iteration. A checkpoint of another model, or one that
does not exist, fails the job once, naming it (a ProgramError)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unicron import lifetime
from unicron.trainer import checkpoint
from unicron.trainer.megatron_cpu import cpu_mode
from unicron.trainer.program import ProgramError

log = logging.getLogger(__name__)

FORMAT = "megatron-dist"  # the manifest's format
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's
CHECKPOINT_VERSION = 3.0  # Megatron-LM's, for distributed checkpoints
_HASH_CHUNK = 8 << 20


def _load_errors() -> tuple[type[BaseException], ...]:
    # torch's distributed checkpoint raises CheckpointException, a BaseException.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


LOAD_ERRORS = _load_errors()


def last_line(exc: BaseException) -> str:
    """The line of a (possibly many-line, gathered from every rank) error that says what."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def iteration_dir(root: str | Path, iteration: int) -> Path:
    """Megatron-LM's name of an iteration's directory."""
    return Path(root) / f"iter_{iteration:07d}"


def _files(directory: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file dist_checkpointing wrote into ``directory``."""
    out = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name not in (checkpoint.MANIFEST, checkpoint.OWNER_MARK):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
            out[path.name] = {"sha256": digest.hexdigest(), "size": path.stat().st_size}
    return out


class _NotTheMark(logging.Filter):
    """Megatron warns of "Overwriting old incomplete / corrupted checkpoint" whenever the
    directory is not empty; Unicron's owner mark, dropped first, is all that is there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Overwriting old incomplete" not in record.getMessage()


@contextlib.contextmanager
def _quiet_overwrite() -> Iterator[None]:
    logger = logging.getLogger("megatron.core.dist_checkpointing.serialization")
    quiet = _NotTheMark()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


_MANAGERS: list[Any] = []  # kept alive as long as the process


def _results_queue_dies_with_us() -> None:
    """Megatron-Core's checkpoint writer keeps its results queue in a multiprocessing manager
    it starts at a process's first save and never stops: a trainer that is killed, or exits
    through os._exit, leaves that process running (seen: three left over from test runs).
    Started here instead, the manager dies with the trainer (``unicron.lifetime``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        manager = lifetime.start_manager()
        _MANAGERS.append(manager)
        filesystem_async._results_queue = manager.Queue()


def all_ranks_agree(ok: bool) -> bool:
    """Collective: whether ``ok`` holds on every rank."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=checkpoint.flag_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return int(flag.item()) == 1


def _prepare(directory: Path) -> str:
    """Rank 0's: the directory made Unicron's to write, or why not."""
    if directory.exists() and not checkpoint.written_by_unicron(directory):
        return f"{directory} exists and was not written by Unicron: not overwritten"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / checkpoint.OWNER_MARK).touch()
    (directory / checkpoint.MANIFEST).unlink(missing_ok=True)  # a checkpoint written before is void
    return ""


def _tracker_is_ours(root: Path) -> bool:
    """Whether Unicron may write the tracker file: there is none, or it names an iteration
    directory Unicron wrote (or none that exists). Another program's (Megatron-LM saving to the same directory)
    stays as it is: it names that program's newest checkpoint, which it reads back."""
    try:
        text = (root / TRACKER).read_text().strip()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not text.isdigit():
        return False
    named = iteration_dir(root, int(text))
    return not named.exists() or checkpoint.written_by_unicron(named)  # a dangling tracker names nothing


@dataclass(frozen=True)
class DistributedFormat:
    """A checkpoint format every rank writes its part of (Megatron-Core's dist_checkpointing,
    torch's DCP): how an iteration's directory is named, how the state is written into it and
    loaded from it (collective), and whether Megatron-LM's tracker file is kept. Saving,
    verifying and restoring are the same for all of them (``save_in``, ``restore_from``)."""

    name: str  # the manifest's format
    directory: Callable[[str | Path, int], Path]
    write: Callable[[Any, Path], None]
    load: Callable[[Any, Path], None]
    tracker: bool


def save_in(fmt: DistributedFormat, trainer: Any, root: str | Path) -> str:
    """Collective, as ``checkpoint.save``: "" once the checkpoint is complete (on rank 0; the
    other ranks once their part is written), else why not. Never raises for a failed write."""
    iteration = trainer.iteration
    directory = fmt.directory(root, iteration)
    problem = ""
    if dist.get_rank() == 0:
        try:
            problem = _prepare(directory)
        except OSError as exc:
            problem = f"cannot write {directory}: {exc}"
    if not all_ranks_agree(not problem):
        return problem or "rank 0 could not prepare the checkpoint directory"
    try:
        fmt.write(trainer, directory)
    except Exception as exc:  # noqa: BLE001 - a failed checkpoint is logged; training goes on
        problem = f"rank {dist.get_rank()}: {exc}"
    if not all_ranks_agree(not problem):
        log.warning("checkpoint at iteration %d not saved: %s", iteration, problem or "another rank failed")
        return problem or "another rank could not write its part"
    if dist.get_rank() != 0:
        return ""
    try:
        manifest = {
            "format": fmt.name,
            "iteration": iteration,
            "layout": checkpoint.layout_of(trainer).as_dict(),
            "files": _files(directory),
            "saved_at": time.time(),
        }
        checkpoint.atomic_write(directory / checkpoint.MANIFEST, json.dumps(manifest, indent=1).encode())
        if fmt.tracker and _tracker_is_ours(Path(root)):
            checkpoint.atomic_write(Path(root) / TRACKER, f"{iteration}\n".encode())
        elif fmt.tracker:
            log.warning("%s names another program's checkpoint: left as it is", Path(root) / TRACKER)
    except OSError as exc:
        log.warning("checkpoint at iteration %d not saved: %s", iteration, exc)
        return str(exc)
    deleted = checkpoint.prune(root, iteration)
    log.info("checkpoint saved", extra={"iteration": iteration, "checkpoint": str(directory), "deleted": deleted})
    return ""


def _write_megatron(trainer: Any, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    state = {
        **trainer.sharded_state(),
        "iteration": trainer.iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
        "opt_param_scheduler": trainer.scheduler.state_dict(),
        "unicron_layout": checkpoint.layout_of(trainer).as_dict(),
    }
    _results_queue_dies_with_us()
    with cpu_mode(trainer.device), _quiet_overwrite():
        dist_checkpointing.save(state, str(directory))


def verify(root: str | Path, iteration: int, layout: checkpoint.Layout, fmt: str = FORMAT) -> Path:
    """The directory of checkpoint ``iteration`` once its manifest matches the job and every
    file its sha256; CheckpointError otherwise."""
    manifest = checkpoint.read_manifest(root, iteration, fmt)
    if manifest.get("layout") != layout.as_dict():
        raise checkpoint.CheckpointError(f"saved for another model or split: {manifest.get('layout')}")
    directory = checkpoint.found_dir(root, iteration)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise checkpoint.CheckpointError("the manifest lists no files")
    found = _files(directory)
    for name, entry in files.items():
        if found.get(name) != entry:
            raise checkpoint.CheckpointError(f"{name} is missing or corrupt (its sha256 or size differs)")
    return directory


def _load(trainer: Any, directory: Path, weights_only: bool = False) -> None:
    from megatron.core import dist_checkpointing

    template = trainer.sharded_state(is_loading=True, weights_only=weights_only)
    with cpu_mode(trainer.device):
        loaded = dist_checkpointing.load(template, str(directory))
    trainer.load_sharded(loaded, weights_only)


def restore_from(fmt: DistributedFormat, trainer: Any, root: str | Path) -> checkpoint.Restored:
    """Collective: the newest good checkpoint of ``fmt`` under ``root`` loaded into
    ``trainer``, or ``fresh`` with none."""
    holder: list[Any] = [checkpoint.list_complete(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    layout = checkpoint.layout_of(trainer)
    for iteration in holder[0]:
        problem = ""
        if dist.get_rank() == 0:
            try:
                verify(root, iteration, layout, fmt.name)
            except checkpoint.CheckpointError as exc:
                problem = str(exc)
        if not all_ranks_agree(not problem):
            if problem:
                log.warning("checkpoint at iteration %d is unusable: %s; trying an older one", iteration, problem)
            continue
        try:
            fmt.load(trainer, checkpoint.found_dir(root, iteration))
        except LOAD_ERRORS as exc:  # a checkpoint that does not load is skipped
            problem = f"rank {dist.get_rank()}: {last_line(exc)}"
        if all_ranks_agree(not problem):
            log.info("resumed from checkpoint", extra={"iteration": iteration, "checkpoint": str(root)})
            return checkpoint.Restored(checkpoint.SOURCE_CHECKPOINT, iteration)
        log.warning("checkpoint at iteration %d does not load: %s", iteration, problem or "on another rank")
    return checkpoint.Restored(checkpoint.SOURCE_FRESH, 0)


MEGATRON = DistributedFormat(FORMAT, iteration_dir, _write_megatron, _load, tracker=True)


def save(trainer: Any, root: str | Path) -> str:
    """Collective: ``trainer``'s state saved as Megatron-LM saves it (see ``save_in``)."""
    return save_in(MEGATRON, trainer, root)


def restore(trainer: Any, root: str | Path) -> checkpoint.Restored:
    """Collective: the newest good checkpoint of this format under ``root`` loaded into
    ``trainer``, or ``fresh`` with none."""
    return restore_from(MEGATRON, trainer, root)


def megatron_iteration_dir(path: str | Path) -> Path:
    """The iteration directory a Megatron-LM checkpoint path names: the directory itself when
    it holds a distributed checkpoint, else the iteration its tracker file names under it."""
    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    tracker = path / TRACKER
    try:
        text = tracker.read_text().strip()
    except OSError:
        raise ProgramError(
            f"training.initial_checkpoint {path}: no Megatron checkpoint there (neither metadata.json nor {TRACKER})"
        ) from None
    if text == "release":
        return path / "release"
    if not text.isdigit():
        raise ProgramError(f"training.initial_checkpoint {path}: {TRACKER} names no iteration ({text[:40]!r})")
    directory = iteration_dir(path, int(text))
    if not (directory / "metadata.json").is_file():
        raise ProgramError(f"training.initial_checkpoint {path}: {directory.name} holds no distributed checkpoint")
    return directory


def load_initial(trainer: Any, path: str, weights_only: bool) -> checkpoint.Restored:
    """Collective: ``trainer`` started from the Megatron-LM checkpoint at ``path``. A
    ProgramError names what is wrong with it: the job fails once instead of training something
    else."""
    problem = ""
    directory = Path(path)
    try:
        directory = megatron_iteration_dir(path)
        _load(trainer, directory, weights_only)
    except ProgramError as exc:
        problem = str(exc)
    except LOAD_ERRORS as exc:  # Megatron says what does not fit; the job fails once
        problem = f"training.initial_checkpoint {path} does not fit this job's model: {last_line(exc)}"
    if not all_ranks_agree(not problem):
        raise ProgramError(problem or "training.initial_checkpoint did not load on another rank")
    what = "weights" if weights_only else "model, optimizer and schedule"
    log.info("started from a Megatron checkpoint", extra={"checkpoint": str(directory), "loaded": what})
    return checkpoint.Restored("initial", trainer.iteration)
