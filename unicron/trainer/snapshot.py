"""In-memory snapshots of a rank's training state, kept on its node by the agent: the middle
state source of a restarted rank, between a live peer and the persistent checkpoint.

Every ``every`` iterations a rank copies its state's tensors to host memory (on a GPU an
asynchronous copy into pinned buffers, so the training thread only queues it); a background
thread waits for the copy and writes it under the directory the agent gives it (a tmpfs such
as /dev/shm by default: memory that outlives the trainer process), in ``tensor_bytes``' form:
the serialized skeleton, then each tensor's own bytes, nothing pickled but the skeleton::

    <dir>/rank3/iter_00000042.snap     skeleton, then the tensors' bytes, in order
    <dir>/rank3/iter_00000042.index    written after the data (its presence makes it complete):
                                       the skeleton's length and CRC-32, (bytes, dtype, CRC-32)
                                       per tensor

At 100M parameters (1.2 GB of state) the write takes about 1 s of a core, where a
``torch.save`` blob with its sha256 took 3 s, and slowed the training thread beside it as
long. Each rank keeps its two newest. Restoring is collective: every rank lists the complete
snapshots of its (tensor, pipeline) shard written on its node by any rank (data-parallel
peers hold the same slice), the ranks agree on the newest iteration all of them have, and
each verifies its copy (CRC-32s, model shape); one ``all_reduce(MIN)`` makes the verdict
common. A bad copy drops that iteration and the next older common one is tried; with none,
the caller falls back to the checkpoint. Nothing here raises on a bad copy."""

from __future__ import annotations

import copy
import json
import logging
import re
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from unicron.trainer import checkpoint, persistent, tensor_bytes
from unicron.trainer.optimizer_shards import SHARD_KEY, SHARDS_KEY, shards_of
from unicron.trainer.piece_moves import reshard_offers
from unicron.trainer.tensor_bytes import StateError

if TYPE_CHECKING:
    from unicron.trainer.protocol import Trainer

log = logging.getLogger(__name__)

SOURCE_SNAPSHOT = "snapshot"
KEEP = 2
FORMAT = 2  # 1: a torch.save blob with a .sha256 beside it
# Written and checked in pieces of this size, so that each piece's CRC-32 reads what the
# write (or the read) just brought into the cache.
PIECE_BYTES = 8 << 20
_NAME_RE = re.compile(r"^iter_(\d+)\.snap$")


def _paths(directory: Path, iteration: int) -> tuple[Path, Path]:
    stem = directory / f"iter_{iteration:08d}"
    return stem.with_suffix(".snap"), stem.with_suffix(".index")


class SnapshotWriter:
    """Writes this rank's snapshots in the background; at most one write in flight (a snapshot
    due while the previous one is still being written is skipped, not queued)."""

    def __init__(
        self, root: str | Path, rank: int, every: int, on_result: Callable[[int, str], None] | None = None
    ) -> None:
        self._dir = Path(root) / f"rank{rank}"
        self._every = every
        self._busy = threading.Lock()
        # Told each attempt's outcome: the iteration, and "" or why it failed.
        self._on_result = on_result or (lambda _iteration, _error: None)

    def after_iteration(self, trainer: Trainer) -> bool:
        """Snapshots ``trainer`` if its iteration is due and no write is in flight; returns
        whether it started one. Only the copy of the state is made here; the next step may
        change the trainer's tensors at once."""
        if self._every <= 0 or trainer.iteration % self._every or not self._busy.acquire(blocking=False):
            return False
        try:
            payload, copied = _detached_payload(trainer)
        except Exception as exc:  # noqa: BLE001 - a snapshot is an optimization; training goes on
            self._busy.release()
            log.warning("snapshot at iteration %d not taken: %s", trainer.iteration, exc)
            self._on_result(trainer.iteration, str(exc) or type(exc).__name__)
            return False
        threading.Thread(
            target=self._write, args=(trainer.iteration, payload, copied), name="snapshot", daemon=True
        ).start()
        return True

    def wait(self, timeout_s: float = 30.0) -> None:
        """Until the write in flight (if any) is done."""
        if self._busy.acquire(timeout=timeout_s):
            self._busy.release()

    def _write(self, iteration: int, payload: dict[str, Any], copied: torch.cuda.Event | None) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            self._dir.mkdir(parents=True, exist_ok=True)
            snap, index = _paths(self._dir, iteration)
            index.unlink(missing_ok=True)  # a snapshot of this iteration written before is void now
            index.write_text(json.dumps(_write_data(snap, payload)))
            for old in sorted(_iterations(self._dir), reverse=True)[KEEP:]:
                for path in _paths(self._dir, old):
                    path.unlink(missing_ok=True)
        except Exception as exc:  # noqa: BLE001 - a snapshot is an optimization; training goes on
            log.warning("snapshot at iteration %d not written: %s", iteration, exc)
            self._on_result(iteration, str(exc) or type(exc).__name__)
        else:
            self._on_result(iteration, "")
        finally:
            self._busy.release()


def _detached_payload(trainer: Trainer) -> tuple[dict[str, Any], torch.cuda.Event | None]:
    """What a snapshot holds, with every tensor copied to host memory and every container
    rebuilt, so that nothing in it is shared with the live trainer; and the CUDA event the
    copies are done at (None on CPU, where they are done on return)."""
    on_gpu = False

    def detach(value: Any) -> Any:
        nonlocal on_gpu
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.device.type == "cpu":
                return value.clone()
            on_gpu = True
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            return host.copy_(value, non_blocking=True)
        if isinstance(value, dict):
            return {k: detach(v) for k, v in value.items()}
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(detach(v) for v in value))
        if isinstance(value, list | tuple):
            return type(value)(detach(v) for v in value)
        return copy.deepcopy(value)

    payload = detach(
        {
            "iteration": trainer.iteration,
            "layout": checkpoint.layout_of(trainer).as_dict(),
            "shard": list(trainer.shard),
            **checkpoint.state_parts(trainer.state_dict()),
        }
    )
    copied = None
    if on_gpu:
        copied = torch.cuda.Event()
        copied.record()
    return payload, copied


def _iterations(directory: Path) -> list[int]:
    """Iterations with a complete snapshot (data and digest) in one rank's directory."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME_RE.match(path.name)
        if match and _paths(directory, int(match.group(1)))[1].is_file():
            found.append(int(match.group(1)))
    return found


def _holders(root: Path) -> dict[int, list[Path]]:
    """Iteration -> the rank directories on this node with a complete snapshot of it."""
    out: dict[int, list[Path]] = {}
    if root.is_dir():
        for directory in sorted(root.glob("rank*")):
            for iteration in _iterations(directory):
                out.setdefault(iteration, []).append(directory)
    return out


def _write_data(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """Writes ``payload`` to ``path``; returns its index."""
    raw, tensors = tensor_bytes.encode(payload)
    table = []
    with path.open("wb") as out:
        out.write(raw)
        for tensor in tensors:
            data = tensor_bytes.bytes_of(tensor)
            crc = 0
            for start in range(0, data.numel(), PIECE_BYTES):
                piece = data[start : start + PIECE_BYTES].numpy().data
                crc = zlib.crc32(piece, crc)
                out.write(piece)
            table.append([data.numel(), tensor_bytes.DTYPES.index(tensor.dtype), crc])
    return {"format": FORMAT, "skeleton": [len(raw), zlib.crc32(raw)], "tensors": table}


def read(directory: Path, iteration: int) -> dict[str, Any]:
    """The snapshot of ``iteration`` in one rank's ``directory``, every CRC-32 checked; raises
    CheckpointError when it is unreadable, incomplete or corrupt."""
    snap, index = _paths(directory, iteration)
    try:
        table = json.loads(index.read_text())
        if table.get("format") != FORMAT:
            raise checkpoint.CheckpointError(f"{snap} is of format {table.get('format')}, not {FORMAT}")
        with snap.open("rb", buffering=0) as source:
            length, want = table["skeleton"]
            raw = source.read(length)
            if len(raw) != length or zlib.crc32(raw) != want:
                raise checkpoint.CheckpointError(f"{snap} is corrupt: its skeleton fails its CRC-32")
            tensors = []
            for number, (size, code, want) in enumerate(table["tensors"]):
                flat = torch.empty(size, dtype=torch.uint8)
                if _read_into(source, flat) != want:
                    raise checkpoint.CheckpointError(f"{snap} is corrupt: tensor {number} fails its CRC-32")
                tensors.append(flat.view(tensor_bytes.DTYPES[code]))
            if source.read(1):
                raise checkpoint.CheckpointError(f"{snap} is corrupt: longer than its index says")
    except OSError as exc:
        raise checkpoint.CheckpointError(f"{snap} unreadable: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
        raise checkpoint.CheckpointError(f"{snap} has a bad index: {exc}") from None
    try:
        return tensor_bytes.decode(raw, tensors)
    except tensor_bytes.StateError as exc:
        raise checkpoint.CheckpointError(f"{snap}: {exc}") from None


def _read_into(source: Any, flat: torch.Tensor) -> int | None:
    """Fills ``flat`` from ``source``; its CRC-32, or None when the file ends first."""
    view = flat.numpy().data.cast("B")
    crc, done = 0, 0
    while done < len(view):
        got = source.readinto(view[done : done + PIECE_BYTES])
        if not got:
            return None
        crc = zlib.crc32(view[done : done + got], crc)
        done += got
    return crc


def _load(directory: Path, iteration: int, trainer: Trainer, whole_shard: bool = True) -> dict[str, Any]:
    """The verified snapshot of ``iteration`` in ``directory`` for ``trainer``'s shard; raises
    CheckpointError when it is corrupt or of another model, split or shard (or, with
    ``whole_shard``, when its optimizer shard is not the one this rank owns)."""
    payload = read(directory, iteration)
    snap = _paths(directory, iteration)[0]
    if payload.get("layout") != checkpoint.layout_of(trainer).as_dict() or payload.get("shard") != list(trainer.shard):
        raise checkpoint.CheckpointError(f"{snap} is of another model, split or shard")
    if payload.get("iteration") != iteration:
        raise checkpoint.CheckpointError(f"{snap} holds iteration {payload.get('iteration')}")
    checkpoint.fits(trainer.state_dict(), whole_shard)(payload)
    return payload


def restore(trainer: Trainer, root: str | Path, newer_than: int = 0) -> checkpoint.Restored | None:
    """Collective: loads the newest snapshot beyond iteration ``newer_than`` that every rank
    has good on its node into ``trainer``; None (trainer untouched) when there is none. Under
    the distributed optimizer a rank's shard need not be on its own node: the data-parallel
    ranks offer every shard their nodes hold of that iteration, and each takes its ranges by
    the same plan of piece moves as a peer transfer (a restart after renumbering, a resize)."""
    holders = {i: dirs for i, dirs in _holders(Path(root)).items() if i > newer_than}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(holders))
    common = set.intersection(*(set(g) for g in gathered)) if gathered else set()
    sharded = SHARD_KEY in trainer.state_dict()
    for iteration in sorted(common, reverse=True):
        payload = _payload(holders[iteration], iteration, trainer, sharded)
        flag = torch.tensor([0 if payload is None else 1], dtype=torch.int32, device=checkpoint.flag_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 1 and payload is not None:
            trainer.load_state_dict({**checkpoint.state_parts(payload), "iteration": iteration})
            log.info("resumed from an in-memory snapshot", extra={"iteration": iteration})
            return checkpoint.Restored(SOURCE_SNAPSHOT, iteration)
        log.warning("snapshot of iteration %d is not good on every rank; trying an older one", iteration)
    return None


def _payload(directories: list[Path], iteration: int, trainer: Trainer, sharded: bool) -> dict[str, Any] | None:
    """This rank's state of ``iteration`` from its node's snapshots (None: none good here).
    Sharded: collective over the data-parallel group, which reshards what the nodes hold."""
    payloads: list[dict[str, Any]] = []
    for directory in directories:
        try:
            payloads.append(_load(directory, iteration, trainer, whole_shard=not sharded))
        except checkpoint.CheckpointError as exc:
            log.warning("snapshot unusable: %s; trying another copy", exc)
            continue
        if not sharded:
            break  # the model and a replicated optimizer: one copy is all of it
    if not sharded:
        return payloads[0] if payloads else None
    problem = "" if payloads else f"rank {dist.get_rank()}: no good snapshot of iteration {iteration} on its node"
    try:
        owned = reshard_offers([s for p in payloads for s in shards_of(p)], trainer, problem)
    except StateError as exc:
        log.warning("the snapshots' optimizer shards are unusable: %s", exc)
        return None
    # The rest (model slice, Megatron's parameter groups, scheduler, RNG) from this rank's own
    # snapshot where its node has it, else from a data-parallel peer's, as a peer transfer.
    place = [trainer.data_parallel_rank, trainer.data_parallel_size]
    base = next((p for p in payloads if p.get(SHARD_KEY, {}).get("data_parallel") == place), payloads[0])
    rest = {key: value for key, value in base.items() if key not in (SHARD_KEY, SHARDS_KEY)}
    return {**rest, SHARDS_KEY: [owned]}


def restore_nearest(trainer: Trainer, checkpoint_dir: str = "", snapshot_dir: str = "") -> checkpoint.Restored:
    """Collective: the state of a rank without a live peer to take it from, nearest first: the
    node's in-memory snapshot when it is newer than the newest persistent checkpoint, else the
    checkpoint (in the job's format), else the checkpoint the job starts from, else a fresh
    model."""
    if snapshot_dir:
        newest = max(checkpoint.list_complete(checkpoint_dir), default=0) if checkpoint_dir else 0
        restored = restore(trainer, snapshot_dir, newer_than=newest)
        if restored is not None:
            return restored
    return persistent.restore(trainer, checkpoint_dir)
