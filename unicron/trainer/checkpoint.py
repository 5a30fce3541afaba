"""Persistent checkpoints of a training job: save every few iterations, resume from the
newest good one.

Layout under the job's checkpoint directory (shared by all of the job's ranks)::

    <root>/iter_00000030/tp0_pp0.pt       one shard per (tensor, pipeline) slice: torch.save of
    <root>/iter_00000030/tp1_pp0.pt       {format, iteration, tp_rank, pp_rank, layout, model, optimizer}
    <root>/iter_00000030/tp0_pp0_dp1.pt   under the distributed optimizer: each data-parallel
                                          rank's optimizer shard ({optimizer_shard: pieces})
    <root>/iter_00000030/manifest.json    written last; its presence makes the checkpoint complete

The manifest names the iteration, the model's shape and TP/PP (``layout``) and the sha256 and
size of every shard file. The ranks of data-parallel rank 0 write the shards (the slices are
identical across DP ranks: Megatron's non-distributed optimizer keeps the full optimizer state
on each); every rank then joins one ``all_gather_object`` carrying the shard records, which is
also the barrier: once it returns on global rank 0 every shard is durable, and rank 0 writes
the manifest (temp file, fsync, ``os.replace``, fsync of the directory). A crash at any point
leaves either no manifest (incomplete, ignored) or a manifest whose shards are all on disk.
Rank 0 then keeps the newest ``KEEP`` complete checkpoints and deletes the rest of what
Unicron wrote (``OWNER_MARK``); another program's ``iter_*`` directories are left alone.

Restoring is collective too. Rank 0 lists the complete checkpoints (newest first) and
broadcasts that list, so every rank considers the same candidates even if its view of a
shared file system lags. For each candidate every rank checks the manifest against the job
(shape, TP, PP), the sha256 of *its own* shard and that the shard fits its model; one
``all_reduce(MIN)`` of a 0/1 flag makes the verdict common. The first candidate good on every
rank wins; a bad one is logged and the next older one tried; with none left the job starts
fresh. Nothing here raises on a bad copy, so a corrupt checkpoint never turns into a crash
loop. A shard holds no data-parallel state, so the DP degree may differ between save and load.

Under Megatron's distributed optimizer the optimizer state is not replicated: the slice file
holds the model, the optimizer's parameter groups and the rest, and every data-parallel rank
writes its own optimizer shard beside it (``tp{t}_pp{p}_dp{d}.pt``; the manifest records each,
and ``optimizer_data_parallel``, the degree they were taken at). A rank restoring reads its
slice and every shard of it and cuts its own ranges from them (``optimizer_shards``), so such a
checkpoint loads at any data-parallel degree too.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from unicron.trainer.optimizer_shards import SHARD_KEY, SHARDS_KEY, data_parallel_of, ranges_of, shards_of
from unicron.trainer.optimizer_shards import missing as missing_ranges
from unicron.trainer.piece_moves import reshard_offers
from unicron.trainer.tensor_bytes import StateError

if TYPE_CHECKING:
    from unicron.trainer.protocol import Trainer

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
# Dropped into an ``iter_*`` directory before Unicron writes anything there: what ``prune``
# may delete is what carries it (or a manifest of Unicron's format, written before the mark
# existed). A checkpoint directory may also hold another program's ``iter_*`` directories
# (Megatron-LM's own layout is ``iter_0000100/`` beside ``latest_checkpointed_iteration.txt``).
OWNER_MARK = ".unicron-checkpoint"
# Complete checkpoints kept on disk; older ones are deleted after each save.
KEEP = 2
SOURCE_CHECKPOINT = "checkpoint"
SOURCE_FRESH = "fresh"
# What every state copy (checkpoint, snapshot, peer transfer) carries besides the iteration:
# the optimizer shard(s) only under the distributed optimizer.
STATE_KEYS = ("model", "optimizer", "scheduler", "rng", SHARD_KEY, SHARDS_KEY)

_DIR_RE = re.compile(r"^iter_(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used, and why."""


@dataclass(frozen=True)
class Layout:
    """What a checkpoint must match to be loaded: the program's description of its model (its
    shape) and the TP x PP split."""

    model: str  # the description as canonical JSON, so that layouts compare as text
    tensor_parallel: int
    pipeline_parallel: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": json.loads(self.model),
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
        }


def layout_of_config(description: dict[str, Any], tensor_parallel: int, pipeline_parallel: int) -> Layout:
    return Layout(json.dumps(description, sort_keys=True, default=str), tensor_parallel, pipeline_parallel)


def layout_of(trainer: Trainer) -> Layout:
    layout = trainer.layout()
    return layout_of_config(layout["model"], layout["tensor_parallel"], layout["pipeline_parallel"])


@dataclass(frozen=True)
class ShardRecord:
    tp_rank: int
    pp_rank: int
    file: str
    sha256: str
    size: int
    # A distributed optimizer's shard of the slice: its data-parallel rank and degree (None:
    # the slice's own file).
    dp_rank: int | None = None
    dp_size: int = 0

    @property
    def key(self) -> str:
        slice_key = f"tp{self.tp_rank}_pp{self.pp_rank}"
        return slice_key if self.dp_rank is None else f"{slice_key}_dp{self.dp_rank}"


@dataclass(frozen=True)
class Restored:
    """Where a rank's state came from: SOURCE_CHECKPOINT at ``iteration``, or SOURCE_FRESH (0)."""

    source: str
    iteration: int


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:08d}"


def shard_file(tp_rank: int, pp_rank: int, dp_rank: int | None = None) -> str:
    return f"tp{tp_rank}_pp{pp_rank}.pt" if dp_rank is None else f"tp{tp_rank}_pp{pp_rank}_dp{dp_rank}.pt"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def write_shard(
    root: str | Path,
    iteration: int,
    tp_rank: int,
    pp_rank: int,
    state: dict[str, Any],
    data_parallel: tuple[int, int] | None = None,
) -> ShardRecord:
    """Durably writes one shard (``state`` holds ``model`` and ``optimizer``, plus anything
    else worth keeping; or, with ``data_parallel`` = (rank, degree), one data-parallel rank's
    optimizer shard) and returns what the manifest records of it."""
    directory = iteration_dir(root, iteration)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / OWNER_MARK).touch()
    payload = {**state, "format": FORMAT, "iteration": iteration, "tp_rank": tp_rank, "pp_rank": pp_rank}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    dp_rank, dp_size = data_parallel if data_parallel is not None else (None, 0)
    name = shard_file(tp_rank, pp_rank, dp_rank)
    _atomic_write(directory / name, data)
    return ShardRecord(tp_rank, pp_rank, name, hashlib.sha256(data).hexdigest(), len(data), dp_rank, dp_size)


def write_manifest(root: str | Path, iteration: int, layout: Layout, shards: list[ShardRecord]) -> Path:
    """Marks checkpoint ``iteration`` complete. Call only once every shard is durable."""
    expected = {(t, p) for t in range(layout.tensor_parallel) for p in range(layout.pipeline_parallel)}
    slices = [s for s in shards if s.dp_rank is None]
    got = {(s.tp_rank, s.pp_rank) for s in slices}
    if got != expected or len(slices) != len(expected):
        raise CheckpointError(f"iteration {iteration}: shards {sorted(got)} do not cover TPxPP {sorted(expected)}")
    optimizer = [s for s in shards if s.dp_rank is not None]
    degree = max((s.dp_size for s in optimizer), default=0)
    wanted = {(t, p, d) for t, p in expected for d in range(degree)}
    if {(s.tp_rank, s.pp_rank, s.dp_rank) for s in optimizer} != wanted or len(optimizer) != len(wanted):
        raise CheckpointError(f"iteration {iteration}: optimizer shards do not cover TPxPPxDP (DP {degree})")
    manifest = {
        "format": FORMAT,
        "iteration": iteration,
        "layout": layout.as_dict(),
        "shards": {
            s.key: {"file": s.file, "sha256": s.sha256, "size": s.size}
            for s in sorted(shards, key=lambda s: (s.tp_rank, s.pp_rank, -1 if s.dp_rank is None else s.dp_rank))
        },
        "saved_at": time.time(),
    }
    if degree:
        manifest["optimizer_data_parallel"] = degree
    path = iteration_dir(root, iteration) / MANIFEST
    _atomic_write(path, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return path


def _iteration_dirs(root: str | Path) -> dict[int, Path]:
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return {}
    found: dict[int, Path] = {}
    for entry in entries:
        match = _DIR_RE.match(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return found


def list_complete(root: str | Path) -> list[int]:
    """Iterations of the checkpoints that have a manifest, newest first (not yet verified)."""
    return sorted((i for i, d in _iteration_dirs(root).items() if (d / MANIFEST).is_file()), reverse=True)


def found_dir(root: str | Path, iteration: int) -> Path:
    """The directory of checkpoint ``iteration`` as it lies on disk (Unicron's own format names
    it with 8 digits, Megatron's with 7), or where Unicron's format would put it."""
    return _iteration_dirs(root).get(iteration) or iteration_dir(root, iteration)


def read_manifest(root: str | Path, iteration: int, expected_format: object = FORMAT) -> dict[str, Any]:
    """Checkpoint ``iteration``'s manifest, which must be of ``expected_format``."""
    path = found_dir(root, iteration) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError("no manifest (incomplete checkpoint)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"manifest unreadable: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"manifest is not a JSON object: {manifest!r:.80}")
    if manifest.get("format") != expected_format:
        raise CheckpointError(f"manifest is of the format {manifest.get('format')!r}, not {expected_format!r}")
    if manifest.get("iteration") != iteration:
        raise CheckpointError(f"manifest names iteration {manifest.get('iteration')}, its directory {iteration}")
    return manifest


def read_shard(
    root: str | Path,
    iteration: int,
    layout: Layout,
    tp_rank: int,
    pp_rank: int,
    data_parallel: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The verified shard (tp_rank, pp_rank) of checkpoint ``iteration``; CheckpointError when
    the manifest is missing or does not match ``layout``, or the shard is missing or corrupt.
    Under the distributed optimizer it carries every data-parallel rank's optimizer shard, or,
    with ``data_parallel`` (this rank's (rank, degree) now), only the saved shards this rank
    reads for its group's reshard: the d-th of every ``degree``, so that the group reads each
    file once."""
    manifest = read_manifest(root, iteration)
    saved = manifest.get("layout")
    if saved != layout.as_dict():
        raise CheckpointError(f"saved for another model or split: checkpoint {saved}, this job {layout.as_dict()}")
    payload = _read_file(root, iteration, manifest, shard_file(tp_rank, pp_rank))
    if "model" not in payload or "optimizer" not in payload:
        raise CheckpointError(f"shard {shard_file(tp_rank, pp_rank)} holds no model and optimizer state")
    if (payload.get("iteration"), payload.get("tp_rank"), payload.get("pp_rank")) != (iteration, tp_rank, pp_rank):
        raise CheckpointError(
            f"shard {shard_file(tp_rank, pp_rank)} is of iteration {payload.get('iteration')} "
            f"tp{payload.get('tp_rank')}_pp{payload.get('pp_rank')}"
        )
    degree = manifest.get("optimizer_data_parallel", 0)
    if degree:
        # Every data-parallel rank's shard of this slice: this rank's ranges under the
        # current degree may lie in any of them.
        shards = []
        first, step = data_parallel if data_parallel is not None else (0, 1)
        for dp_rank in range(first, int(degree), step):
            part = _read_file(root, iteration, manifest, shard_file(tp_rank, pp_rank, dp_rank))
            if not isinstance(part.get(SHARD_KEY), dict) or data_parallel_of(part[SHARD_KEY]) != (dp_rank, degree):
                raise CheckpointError(f"{shard_file(tp_rank, pp_rank, dp_rank)} holds no optimizer shard {dp_rank}")
            shards.append(part[SHARD_KEY])
        payload[SHARDS_KEY] = shards
    return payload


def _read_file(root: str | Path, iteration: int, manifest: dict[str, Any], file: str) -> dict[str, Any]:
    """One file of checkpoint ``iteration``, checked against its manifest entry and decoded."""
    entry = manifest.get("shards", {}).get(file.removesuffix(".pt"))
    if not isinstance(entry, dict):
        raise CheckpointError(f"the manifest lists no shard {file.removesuffix('.pt')}")
    path = found_dir(root, iteration) / str(entry.get("file"))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"shard {path.name} unreadable: {exc.strerror or exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256") or len(data) != entry.get("size"):
        raise CheckpointError(
            f"shard {path.name} is corrupt: sha256 {digest[:12]}.. ({len(data)} bytes), "
            f"manifest {str(entry.get('sha256'))[:12]}.. ({entry.get('size')} bytes)"
        )
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decoding failure makes the shard unusable
        raise CheckpointError(f"shard {path.name} cannot be decoded: {exc}") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"shard {path.name} holds no state")
    return payload


def try_shard(
    root: str | Path,
    iteration: int,
    layout: Layout,
    tp_rank: int,
    pp_rank: int,
    check: Callable[[dict[str, Any]], None] | None = None,
    data_parallel: tuple[int, int] | None = None,
) -> dict[str, Any] | None:
    """``read_shard`` (plus ``check``, which raises CheckpointError) or None with a warning."""
    try:
        payload = read_shard(root, iteration, layout, tp_rank, pp_rank, data_parallel)
        if check is not None:
            check(payload)
        return payload
    except CheckpointError as exc:
        log.warning(
            "checkpoint at iteration %d is unusable: %s; falling back to an older one",
            iteration,
            exc,
            extra={"checkpoint": str(iteration_dir(root, iteration))},
        )
        return None


def find_latest(
    root: str | Path, layout: Layout, tp_rank: int = 0, pp_rank: int = 0
) -> tuple[int, dict[str, Any]] | None:
    """One process's choice: the newest checkpoint whose shard (tp_rank, pp_rank) is good."""
    for iteration in list_complete(root):
        payload = try_shard(root, iteration, layout, tp_rank, pp_rank)
        if payload is not None:
            return iteration, payload
    return None


def written_by_unicron(directory: Path) -> bool:
    """Whether Unicron wrote ``directory``: its mark, or a manifest of Unicron's format."""
    if (directory / OWNER_MARK).is_file():
        return True
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT and "shards" in manifest


def atomic_write(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path`` (a temp file, fsync, rename, fsync of the directory)."""
    _atomic_write(path, data)


def prune(root: str | Path, newest: int, keep: int = KEEP) -> list[int]:
    """After checkpoint ``newest`` is complete: keeps it and the ``keep - 1`` newest complete
    ones before it and deletes every other ``iter_*`` directory Unicron wrote: older
    checkpoints, incomplete leftovers, and anything newer than ``newest``, which can only be a
    bad checkpoint of an abandoned run (restoring always takes the newest good one, and
    training on from there is deterministic). An ``iter_*`` directory Unicron did not write
    (another program's checkpoint) is left alone and named in a warning. Returns the deleted
    iterations."""
    dirs = _iteration_dirs(root)
    ours = {i: path for i, path in dirs.items() if written_by_unicron(path)}
    foreign = sorted(path.name for i, path in dirs.items() if i not in ours)
    if foreign:
        log.warning(
            "leaving %d checkpoint directories in %s alone: not written by Unicron (%s)",
            len(foreign),
            root,
            ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else ""),
        )
    complete = [i for i in sorted(ours, reverse=True) if i <= newest and (ours[i] / MANIFEST).is_file()]
    kept = set(complete[:keep])
    deleted = []
    for iteration, path in sorted(ours.items()):
        if iteration not in kept:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(iteration)
    return deleted


def flag_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def save(trainer: Trainer, root: str | Path) -> str:
    """Collective: every rank of the job calls it after the same iteration. Returns "" when
    the checkpoint became complete (known on global rank 0; other ranks once their part is
    done), else why not. A failure to write is logged, never raised: training goes on."""
    iteration = trainer.iteration
    tp_rank, pp_rank = trainer.shard
    records: list[ShardRecord | str] = []
    try:
        state = trainer.state_dict()
        own = state.get(SHARD_KEY)
        # Under HSDP the other replicas hold the same shards: the first one writes them.
        first_replica = getattr(trainer, "replica", 0) == 0
        if trainer.data_parallel_rank == 0 and first_replica:
            whole = {**state_parts(state), "layout": layout_of(trainer).as_dict()}
            whole.pop(SHARD_KEY, None)  # written on its own, as every other rank's
            records.append(write_shard(root, iteration, tp_rank, pp_rank, whole))
        if own is not None and first_replica:
            records.append(write_shard(root, iteration, tp_rank, pp_rank, {SHARD_KEY: own}, data_parallel_of(own)))
    except Exception as exc:  # noqa: BLE001 - reported through the gather, then logged
        records.append(f"rank {dist.get_rank()} could not write tp{tp_rank}_pp{pp_rank}: {exc}")
    gathered: list[list[ShardRecord | str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, records)
    mine = [r for r in records if isinstance(r, str)]
    if dist.get_rank() != 0:
        return mine[0] if mine else ""
    errors = [g for rank_records in gathered for g in rank_records if isinstance(g, str)]
    shards = [g for rank_records in gathered for g in rank_records if isinstance(g, ShardRecord)]
    try:
        if errors:
            raise CheckpointError("; ".join(errors))
        write_manifest(root, iteration, layout_of(trainer), shards)
    except (CheckpointError, OSError) as exc:
        log.warning("checkpoint at iteration %d not saved: %s", iteration, exc)
        return str(exc) or type(exc).__name__
    deleted = prune(root, iteration)
    log.info(
        "checkpoint saved",
        extra={"iteration": iteration, "checkpoint": str(iteration_dir(root, iteration)), "deleted": deleted},
    )
    return ""


def state_parts(state: dict[str, Any]) -> dict[str, Any]:
    """The parts of a rank's state that every copy carries besides its iteration: the model,
    the optimizer, the LR scheduler and the RNG states."""
    return {key: state[key] for key in STATE_KEYS if key in state}


def fits(current: dict[str, Any], whole_shard: bool = True) -> Callable[[dict[str, Any]], None]:
    """A check that a shard's state has exactly this rank's parameter names and shapes (and,
    with ``whole_shard``, every range of this rank's optimizer shard; without, only that it
    carries optimizer shards at all, for a copy offered to a reshard)."""
    model = {k: tuple(v.shape) for k, v in current["model"].items() if isinstance(v, torch.Tensor)}
    shard = current.get(SHARD_KEY)
    # A distributed optimizer's groups name no parameters: its shard says what it holds.
    groups = [] if shard is not None else [len(g["params"]) for g in current["optimizer"].get("param_groups", [])]

    def check(payload: dict[str, Any]) -> None:
        saved = payload["model"]
        if not isinstance(saved, dict):
            raise CheckpointError("model state is not a mapping")
        shapes = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
        if shapes != model:
            diff = sorted(set(shapes.items()) ^ set(model.items()))[:3]
            raise CheckpointError(f"model state does not fit this rank's model (first differences: {diff})")
        optimizer = payload["optimizer"]
        if not isinstance(optimizer, dict):
            raise CheckpointError("optimizer state is not a mapping")
        _check_shards(shard, shards_of(payload), whole_shard)
        if shard is None:
            saved_groups = [len(g.get("params", [])) for g in optimizer.get("param_groups", [])]
            if sorted(saved_groups) != sorted(groups):
                raise CheckpointError(f"optimizer state has parameter groups {saved_groups}, this rank {groups}")

    return check


def _check_shards(shard: dict[str, Any] | None, saved: list[dict[str, Any]], whole: bool = True) -> None:
    """That a state copy carries this rank's optimizer shard (``shard``: the ranges it owns,
    None under a replicated optimizer)."""
    if shard is None and saved:
        raise CheckpointError("the state is of a distributed optimizer, this job's optimizer is replicated")
    if shard is not None and not saved:
        raise CheckpointError("the state is of a replicated optimizer, this job's is distributed")
    if shard is not None and whole:
        problems = missing_ranges(saved, ranges_of(shard))
        if problems:
            raise CheckpointError(f"the optimizer shards miss part of this rank's: {problems[0]}")


def _resharded(payload: dict[str, Any] | None, trainer: Trainer, iteration: int) -> dict[str, Any] | None:
    """Collective over the data-parallel group: ``payload`` with the optimizer shard this rank
    owns now, cut from the saved shards its group read (None when that fails anywhere)."""
    problem = "" if payload is not None else f"rank {dist.get_rank()}: checkpoint {iteration} is unusable here"
    try:
        owned = reshard_offers(shards_of(payload) if payload is not None else [], trainer, problem)
    except StateError as exc:
        log.warning("checkpoint at iteration %d cannot be resharded: %s", iteration, exc)
        return None
    assert payload is not None  # a problem raised above
    return {**{k: v for k, v in payload.items() if k not in (SHARD_KEY, SHARDS_KEY)}, SHARDS_KEY: [owned]}


def restore(trainer: Trainer, root: str | Path) -> Restored:
    """Collective: every rank calls it before training. Loads the newest checkpoint that is
    good on every rank into ``trainer`` (which then continues from its iteration), or leaves
    the fresh model when there is none."""
    holder: list[Any] = [list_complete(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    candidates: list[int] = holder[0]
    layout = layout_of(trainer)
    tp_rank, pp_rank = trainer.shard
    # Under the distributed optimizer each rank reads its share of the saved shards and the
    # group reshards them by piece moves (piece_moves.py), as from memory or a snapshot.
    sharded = SHARD_KEY in trainer.state_dict()
    place = (trainer.data_parallel_rank, trainer.data_parallel_size) if sharded else None
    check = fits(trainer.state_dict(), whole_shard=not sharded)
    for iteration in candidates:
        payload = try_shard(root, iteration, layout, tp_rank, pp_rank, check, place)
        if sharded:
            payload = _resharded(payload, trainer, iteration)
        flag = torch.tensor([0 if payload is None else 1], dtype=torch.int32, device=flag_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 1 and payload is not None:
            trainer.load_state_dict({**state_parts(payload), "iteration": iteration})
            log.info(
                "resumed from checkpoint",
                extra={"iteration": iteration, "checkpoint": str(iteration_dir(root, iteration))},
            )
            return Restored(SOURCE_CHECKPOINT, iteration)
        if payload is not None:
            log.warning(
                "checkpoint at iteration %d is good here but not on every rank; falling back to an older one",
                iteration,
            )
    if candidates:
        log.warning("no usable checkpoint in %s; starting fresh", root)
    return Restored(SOURCE_FRESH, 0)
