"""Moving a rank to a new process group without restarting it (docs/architecture.md: Transitions).

The agent's ``reform`` answer (``AgentReform``: new generation, rank, world size and rendezvous)
serves both a reattempt with the same members on a fresh rendezvous and a resize of the
data-parallel degree. This module is the core of it, free of gRPC so tests can drive it
directly; ``unicron/trainer/__main__.py`` decides when to call it.

``reform()`` on a rank that keeps its state:

1. ``capture()``: the rank's training state (``MegatronTrainer.state_dict()``: iteration, model slice,
   optimizer state) *held*: the state dict's own tensors, kept alive after the trainer is
   released (a GPU tensor is copied to the host, so that the rebuilt trainer does not need
   twice the device memory). Nothing is serialized: a rank that keeps its state loads it back
   as it is, and only a rank that sends its shard to a peer serializes it (measured at 100M
   parameters: ``torch.save``, sha256 and ``torch.load`` of the 1.2 GB state took 5, 2 and 6 s,
   every reattempt, before);
2. ``teardown()``: Megatron's parallel state (``MegatronTrainer.close()``) and the whole
   ``torch.distributed`` world (``dist.destroy_process_group()``). With gloo this does not hang
   on a broken group: destroying only closes this process's sockets and joins its gloo worker
   threads, which are idle unless a collective is still in flight, and a collective in flight
   ends at the latest at the group's timeout (measured: 0.01-0.03 s with a dead peer, a dead
   store host, or after a hung peer's collective timed out). Note that
   ``_abort_process_group`` does *not* interrupt a gloo collective blocked on a hung peer (it
   only forgets the group), so nothing faster than the collective timeout exists on gloo;
3. ``join()``: the ranks meet on rank 0's store at ``master_addr:master_port`` (a wait that a
   newer reform interrupts), then ``init_process_group`` with the new rank and world size, the
   same backend and collective timeout, then a fresh ``MegatronTrainer`` with the old one's
   model/training configuration and TP/PP (the DP degree follows from the new world);
4. ``exchange_state()``: every rank of the new group, with or without state, takes part.

A reform that cannot form its group (a peer died meanwhile) raises ReformFailed with the
rank's state as it was: the trainer joins the newer reform that follows with it.

``exchange_state()`` (collective over the new world; ``receive_state()`` is the call of a rank
without state, e.g. a new process started for a grow):

* one ``all_gather`` of a 3-integer tensor per rank: (iteration of the state it holds, or -1;
  tensor-parallel rank; pipeline-parallel rank). Every rank computes the same plan from it: the
  *target* iteration is the newest one held; per (TP, PP) shard the *source* is the lowest rank
  holding state at the target iteration; every other rank of that shard (no state, or older
  state) receives. A shard without any holder at the target makes the plan fail for everyone;
* transfer, inside each data-parallel group that has a receiver (Megatron's DP group is exactly
  the ranks holding the same shard, so groups of different shards proceed concurrently): the
  source broadcasts its held state as its tensors' own bytes, with a small skeleton for the
  rest and a CRC-32 per unit, and every receiver checks what it got before decoding anything
  (``transfer.py``). Before, the source serialized the whole state with ``torch.save`` and the
  receivers hashed and ``torch.load``-ed it: 5, 2 and 6 s at 100M parameters;
* verdict: every rank checks what it is about to load (its own held state: the target
  iteration, fits its model; or the received state: every CRC-32, decodable, the target
  iteration, fits its model), and one ``all_reduce(MIN)`` of a 0/1 flag makes the verdict common. Only
  then does any rank load, so a failed transfer leaves every trainer untouched;
* on a failed verdict every rank, live ones included (the replicas must stay identical), falls
  back to the persistent checkpoint (``checkpoint.restore``, collective, which itself falls
  back to fresh) or, without a checkpoint directory, to the fresh model. One attempt, never a
  loop; the returned source says which it was.

The result's source is ``live`` for a rank that kept its own state, ``peer`` for one that
received it, or the checkpoint module's ``checkpoint`` / ``fresh`` after a fallback, with the
iteration the state was at. The rank continues from that iteration: the data position follows
from it, and ``MegatronTrainer`` re-splits the global batch over the new DP degree.
"""

from __future__ import annotations

import gc
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from unicron.trainer import buddy, checkpoint, transfer
from unicron.trainer.optimizer_shards import (
    SHARD_KEY,
    SHARDS_KEY,
    CopyPlace,
    Place,
    data_parallel_of,
    pieces_to_exchange,
)
from unicron.trainer.piece_moves import reshard
from unicron.trainer.protocol import T, Trainer
from unicron.trainer.snapshot import restore_nearest
from unicron.trainer.step_result import PartialStep
from unicron.trainer.tensor_bytes import StateError

# isort: split
# Megatron is imported after the shim, whose warning filters must see its import-time warnings.
import unicron.trainer.megatron_cpu  # noqa: F401

# isort: split
from megatron.core import parallel_state

log = logging.getLogger(__name__)

SOURCE_LIVE = "live"
SOURCE_PEER = "peer"
# The state came from live peers, the optimizer shards of lost ranks from buddy copies.
SOURCE_BUDDY = "buddy"
NO_STATE = -1
_ARRIVED_KEY = "unicron/arrived"
_ARRIVAL_POLL_S = 0.01
# Added to the arrival count once every rank is in: the group is sealed (see _arrive).
_SEALED = 1_000_000


class Superseded(RuntimeError):
    """A newer reform arrived while this one waited for its group: joining it is pointless."""


@dataclass(frozen=True)
class Held:
    """A rank's training state at ``iteration`` as a state dict whose tensors outlive the
    trainer they came from (see ``capture``); never serialized: a peer that needs it gets its
    tensors' bytes (transfer.py)."""

    iteration: int
    state: dict[str, Any]
    shard: tuple[int, int] = (0, 0)  # (tensor rank, pipeline rank) of the state


def _on_host(value: Any) -> Any:
    """``value`` with every device tensor copied to the host and host tensors as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu") if value.device.type != "cpu" else value.detach()
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_host(item) for item in value)
    return value


def capture(trainer: Trainer) -> Held:
    """``trainer``'s state, outliving the trainer and its process group. Its tensors are the
    trainer's own (host) or host copies (device): once the trainer is released nothing else
    writes them, and ``load_state_dict`` copies them into the next trainer's parameters."""
    state = _on_host(trainer.state_dict())
    return Held(int(state["iteration"]), state, trainer.shard)


def _forget_megatron_groups() -> None:
    """Drops the process groups Megatron's parallel state still refers to after
    ``destroy_model_parallel()`` (0.16 leaves e.g. ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``
    set). Every such global is None before ``initialize_model_parallel`` sets it again."""
    group_type = dist.ProcessGroup
    for name, value in list(vars(parallel_state).items()):
        if not name.startswith("_"):
            continue
        if isinstance(value, group_type) or (
            isinstance(value, list | tuple) and value and all(isinstance(v, group_type) for v in value)
        ):
            setattr(parallel_state, name, None)


def teardown(trainer: Trainer | None) -> str:
    """Destroys Megatron's parallel state and the whole torch.distributed world, releasing
    ``trainer``'s model and optimizer (see the module docstring on why this does not hang with
    gloo). Returns the backend that was in use.

    A gloo group closes its connections only when the last reference to it is gone; peers
    blocked in a collective with this rank notice the closed connections at once and fail
    (otherwise they would wait for the collective timeout). So every reference is dropped: the
    trainer's model and optimizer, Megatron's leftover globals, then a garbage collection for
    the reference cycles between the model, its config and the trainer."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    if trainer is not None:
        trainer.release()
    elif parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _forget_megatron_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    collecting = time.perf_counter()
    gc.collect()
    log.debug("garbage collected", extra={"seconds": round(time.perf_counter() - collecting, 3)})
    return backend


def abort_communicators() -> bool:
    """Aborts every NCCL communicator of this process (ncclCommAbort): a collective blocked in
    one fails at once instead of at its timeout. Safe from another thread than the one in the
    collective; the groups are then unusable, and teardown() finds the world gone. Returns
    whether anything was aborted: False without a world, or on gloo (abort only forgets a gloo
    group, its blocked collective goes on waiting)."""
    if not dist.is_initialized() or str(dist.get_backend()) != "nccl":
        return False
    try:
        dist.distributed_c10d._abort_process_group()
    except (RuntimeError, ValueError) as exc:  # the training thread destroyed the world meanwhile
        log.info("abort of the NCCL communicators skipped: %s", exc)
        return False
    return True


@dataclass(frozen=True)
class Parked:
    """A rank that left its process group after an error: its state for the next group (None:
    it has none worth keeping), and what the failed step had computed
    (``MegatronTrainer.partial_step``)."""

    held: Held | None
    backend: str
    partial: PartialStep | None


def park(trainer: Trainer) -> Parked:
    """Captures ``trainer``'s state and leaves the process group at once, while the decision
    on the error is awaited: peers blocked in a collective with this rank fail now and report
    too, and the reform that follows only has to join the new group. ``trainer`` is released."""
    started = time.perf_counter()
    partial = trainer.partial_step()
    held = capture(trainer)
    captured = time.perf_counter()
    backend = teardown(trainer)
    log.info(
        "left the process group",
        extra={"capture_s": round(captured - started, 3), "teardown_s": round(time.perf_counter() - captured, 3)},
    )
    return Parked(held, backend, partial)


class ReformFailed(Exception):
    """The new group could not be formed (``error``). The rank holds no group now; ``parked``
    is its state as it was before the reform, for a newer one."""

    def __init__(self, error: BaseException, parked: Parked) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error
        self.parked = parked


def join(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout: timedelta | float,
    backend: str = "",
    superseded: Callable[[], bool] = lambda: False,
    namespace: str = "",
    store_exists: bool = False,
) -> None:
    """``init_process_group`` of a new group: waits until all ``world_size`` ranks arrive, at
    most ``timeout``. Raises Superseded as soon as ``superseded()`` turns true on the way.
    ``namespace`` prefixes every key of the group on the store: a store that outlives the
    group (torchrun's, across its restarts; an older generation's, in a process slow to exit,
    on the port this one reuses) would otherwise count a dead attempt's ranks as arrived and
    hand out their addresses. ``store_exists``: a store already serves at
    ``master_addr:master_port`` (torchrun's agent's), so rank 0 connects instead of serving.

    torch's own rendezvous waits for the ranks inside C++ (``init_method="tcp://..."``), where
    nothing can interrupt it: a rank that died after the reform was sent holds the others
    there for the whole timeout, deaf to the reform that replaces this one. So the store is
    made here without waiting for workers, and the ranks count themselves in on it, polling;
    once all are there, the group forms in a moment (or fails at once if one dies just then)."""
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0:
        _await_listener(master_addr, master_port, timeout.total_seconds(), superseded)
    store: dist.Store = dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0 and not store_exists,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )
    if namespace:
        store = dist.PrefixStore(namespace, store)
    _arrive(store, world_size, superseded, deadline, f"{master_addr}:{master_port}", timeout.total_seconds())
    _reset_group_names()
    dist.init_process_group(
        backend=backend or ("nccl" if torch.cuda.is_available() else "gloo"),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def _reset_group_names() -> None:
    """The default group is named after torch's count of groups made, which only the
    destruction of a world sets back to 0. An ``init_process_group`` that failed (a peer left
    while it formed) left no world to destroy but counted a group: this rank would then
    publish its address under group "1" while its peers wait for it under "0", each side
    deaf for the whole timeout (seen: 120 s, then a restart)."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def _arrive(
    store: dist.Store,
    world_size: int,
    superseded: Callable[[], bool],
    deadline: float,
    where: str,
    timeout_s: float,
) -> None:
    """Counts this rank in and waits until the group is sealed: all ``world_size`` ranks in,
    none able to leave any more. A rank that leaves (superseded, or timed out) takes its count
    back first, unless the group is sealed: a count left behind by a rank that went on to a
    newer reform would send the others into ``init_process_group`` to wait, deaf, the whole
    timeout for an address that never comes (seen: a rank joining a grow, 120 s). Once sealed,
    every rank goes on even if superseded: the others are already forming the group with it,
    and the newer reform follows as soon as it has formed."""
    store.add(_ARRIVED_KEY, 1)
    while True:
        arrived = store.add(_ARRIVED_KEY, 0)
        if arrived >= _SEALED:
            return
        if arrived == world_size:
            # Only from exactly "all in": a rank taking its count back at the same moment
            # makes this fail, and the group is not sealed without it.
            sealed = store.compare_set(_ARRIVED_KEY, str(world_size), str(_SEALED + world_size))
            if int(sealed) >= _SEALED:
                return
            continue
        replaced = superseded()
        if replaced or time.monotonic() >= deadline:
            if store.add(_ARRIVED_KEY, -1) >= _SEALED:
                store.add(_ARRIVED_KEY, 1)  # sealed before this rank could leave: it stays
                log.info("the group was sealed before this rank could leave it; forming it first")
                return
            if replaced:
                raise Superseded(f"a newer reform arrived while {arrived} of {world_size} ranks had joined")
            raise TimeoutError(
                f"rendezvous timed out: {arrived} of {world_size} ranks arrived at {where} within {timeout_s:g}s"
            )
        time.sleep(_ARRIVAL_POLL_S)


def _await_listener(
    host: str, port: int, timeout_s: float, superseded: Callable[[], bool] = lambda: False, poll_s: float = 0.005
) -> None:
    """Until rank 0's rendezvous store accepts connections (or ``timeout_s`` passes): a store
    client that finds no server backs off for up to a second before it tries again, and in a
    reform rank 0 is often the last to arrive (it was the one still tearing down). Rank 0 may
    also never come (it died meanwhile): the newer reform that follows ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if superseded():
            raise Superseded(f"a newer reform arrived while waiting for the store at {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(poll_s)


def rebuild(old: T, timeout: timedelta | None = None) -> T:
    """A fresh trainer with ``old``'s program and settings (and collective timeout, unless
    given) on the current process group."""
    return old.rebuild(timeout)


def reform(
    trainer: T,
    new_rank: int,
    new_world: int,
    master_addr: str,
    master_port: int,
    timeout: timedelta | float,
    *,
    keep_state: bool = True,
    checkpoint_dir: str = "",
    corrupt_transfer: bool = False,
    parked: Parked | None = None,
    snapshot_dir: str = "",
    superseded: Callable[[], bool] = lambda: False,
    namespace: str = "",
    copy: buddy.Copy | None = None,
) -> tuple[T, checkpoint.Restored]:
    """Moves this rank from its process group to a new one and returns the new trainer and
    where its state came from. ``trainer`` is released (closed, without model and optimizer).
    ``keep_state=False`` (its state is not consistent, e.g. a step failed halfway through the
    update) makes it a receiver. ``timeout``: of the new group and of Megatron's groups in it.
    ``parked``: the rank left its group already (``park``); its state is the parked one.
    ``namespace``: of the new group's keys on the store (see ``join``). ``copy``: the buddy
    copy of a peer's optimizer shard this rank keeps (buddy.py).

    Raises ReformFailed, holding the state as it was, when the group cannot be formed or the
    exchange breaks (a peer died meanwhile): a newer reform can still use that state."""
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    held: Held | None
    if parked is not None:
        held, backend = parked.held if keep_state else None, parked.backend
    else:
        held = capture(trainer) if keep_state else None
        backend = teardown(trainer)
    log.info(
        "joining a new process group",
        extra={"rank": new_rank, "world_size": new_world, "master": f"{master_addr}:{master_port}"},
    )
    new: T | None = None
    try:
        joining = time.perf_counter()
        join(new_rank, new_world, master_addr, master_port, timeout, backend, superseded, namespace)
        log.info("joined the new process group", extra={"seconds": round(time.perf_counter() - joining, 3)})
        new = rebuild(trainer, timeout)
        restored = exchange_state(new, held, checkpoint_dir, corrupt_transfer, snapshot_dir, copy)
    except Exception as exc:  # noqa: BLE001 - whatever broke the new group, the state is intact
        # A load happens only after the common verdict, so ``held`` is still this rank's
        # state. The half-formed group goes, so that a newer reform starts from nothing.
        teardown(new)
        exc.__traceback__ = None  # its frames hold the half-built trainer
        raise ReformFailed(exc, Parked(held, backend, parked.partial if parked else None)) from None
    return new, restored


def receive_state(trainer: Trainer, checkpoint_dir: str = "", snapshot_dir: str = "") -> checkpoint.Restored:
    """The part of a rank without state in ``exchange_state`` (collective)."""
    return exchange_state(trainer, None, checkpoint_dir, snapshot_dir=snapshot_dir)


@dataclass(frozen=True)
class Plan:
    """Who holds what after the flag exchange; identical on every rank."""

    target: int  # iteration every rank continues from; NO_STATE when nobody holds state
    sources: dict[tuple[int, int], int]  # shard -> global rank that sends it
    receivers: dict[tuple[int, int], list[int]]  # shard -> global ranks that receive it
    problem: str = ""  # non-empty: the peers cannot supply the state


def make_plan(table: list[tuple[int, int, int]]) -> Plan:
    """The plan from every rank's (iteration held or NO_STATE, tp rank, pp rank), by global rank."""
    held = [it for it, _, _ in table if it != NO_STATE]
    if not held:
        return Plan(NO_STATE, {}, {}, "no rank holds state")
    target = max(held)
    sources: dict[tuple[int, int], int] = {}
    receivers: dict[tuple[int, int], list[int]] = {}
    for rank, (it, tp, pp) in enumerate(table):
        shard = (tp, pp)
        if it == target and shard not in sources:
            sources[shard] = rank
        elif it != target:
            receivers.setdefault(shard, []).append(rank)
    missing = sorted(shard for shard in receivers if shard not in sources)
    if missing:
        return Plan(target, sources, receivers, f"no rank holds shard(s) {missing} at iteration {target}")
    return Plan(target, sources, receivers)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_table(
    iteration: int, shard: tuple[int, int], held_dp: tuple[int, int], dp: tuple[int, int], copy: CopyPlace
) -> tuple[list[Place], list[CopyPlace]]:
    """Every rank's place: its held iteration, slice, and the data-parallel (rank, degree) its
    optimizer shard was taken at and is wanted at (degree 0: no sharded optimizer); and the
    buddy copy it keeps (iteration or NO_STATE, and whose shard)."""
    mine = torch.tensor([iteration, *shard, *held_dp, *dp, copy[0], *copy[1]], dtype=torch.int64, device=_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    rows = [[int(v) for v in t] for t in everyone]
    return [(r[0], (r[1], r[2]), (r[3], r[4]), (r[5], r[6])) for r in rows], [(r[7], (r[8], r[9])) for r in rows]


def _copy_place(copy: buddy.Copy | None, trainer: Trainer) -> CopyPlace:
    """What a buddy copy counts for: nothing when there is none or it is of another slice."""
    if copy is None or copy.slice != trainer.shard:
        return (NO_STATE, (0, 0))
    return (copy.iteration, copy.owner)


def _data_parallel_places(trainer: Trainer, held: Held | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rank, degree) of the optimizer shard ``held`` carries and of the one ``trainer`` wants;
    (0, 0) where the optimizer is replicated or nothing is held."""
    wanted = (trainer.data_parallel_rank, trainer.data_parallel_size) if SHARD_KEY in trainer.state_dict() else (0, 0)
    own = held.state.get(SHARD_KEY) if held is not None else None
    return (data_parallel_of(own) if own is not None else (0, 0)), wanted


def _without_shard(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if key != SHARD_KEY}


def _check_received(state: dict[str, Any], target: int) -> None:
    if not {"iteration", "model", "optimizer"} <= state.keys():
        raise StateError("state holds no iteration, model and optimizer")
    if state["iteration"] != target:
        raise StateError(f"state is of iteration {state['iteration']}, expected {target}")


def exchange_state(
    trainer: Trainer,
    held: Held | None,
    checkpoint_dir: str = "",
    corrupt_transfer: bool = False,
    snapshot_dir: str = "",
    copy: buddy.Copy | None = None,
) -> checkpoint.Restored:
    """Collective over the current world: makes every rank's ``trainer`` hold the newest state
    any rank holds (see the module docstring) and returns where this rank's came from.
    ``copy``: the buddy copy of a peer's optimizer shard this rank keeps (buddy.py)."""
    rank = dist.get_rank()
    if held is not None and held.shard != trainer.shard:
        # Same shapes, other weights: a shard is only ever loaded where it belongs.
        log.warning(
            "the state held is of shard %s, this rank now holds %s: taking it from a peer", held.shard, trainer.shard
        )
        held = None
    held_dp, wanted_dp = _data_parallel_places(trainer, held)
    places, copies = _gather_table(
        NO_STATE if held is None else held.iteration, trainer.shard, held_dp, wanted_dp, _copy_place(copy, trainer)
    )
    plan = make_plan([(it, *slice_) for it, slice_, _, _ in places])
    shard = trainer.shard
    state: dict[str, Any] | None = None
    source = SOURCE_LIVE
    # Under the distributed optimizer a rank's own shard moves apart from the model: the
    # data-parallel ranks of a slice exchange every shard held when any of them needs another.
    exchange, problem = pieces_to_exchange(places, plan.target, copies) if not plan.problem else ({}, plan.problem)
    if not problem:
        state, source, problem = _model_state(trainer, held, plan, corrupt_transfer)
        if exchange.get(shard):
            # Every rank of the slice takes part, whatever its own model state came to.
            try:
                owned = reshard(exchange[shard], None if held is None else held.state.get(SHARD_KEY), copy, trainer)
                state = None if state is None else {**_without_shard(state), SHARDS_KEY: [owned]}
                if any(places[holder][2] != key for holder, key in exchange[shard]):
                    source = SOURCE_BUDDY  # a lost rank's shard came from a buddy's memory
            except StateError as exc:
                problem, state = problem or f"rank {rank}: {exc}", None
                log.error("optimizer shards unusable: %s", exc)
        try:
            if state is not None:
                checkpoint.fits(trainer.state_dict())(state)
        except checkpoint.CheckpointError as exc:
            problem, state = f"rank {rank}: {exc}", None
            log.error("%s state is unusable: %s", source, exc)
    ok = torch.tensor([0 if problem else 1], dtype=torch.int32, device=_device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if int(ok.item()) == 1 and state is not None:
        trainer.load_state_dict(state)
        if source == SOURCE_PEER:
            log.info(
                "state received from a peer",
                extra={"iteration": plan.target, "peer": plan.sources[shard]},
            )
        return checkpoint.Restored(source, plan.target)
    log.warning(
        "the state cannot come from live peers (%s); falling back to the node's snapshot or the checkpoint",
        problem or "another rank's state is unusable",
    )
    return restore_nearest(trainer, checkpoint_dir, snapshot_dir)


def _model_state(
    trainer: Trainer, held: Held | None, plan: Plan, corrupt_transfer: bool
) -> tuple[dict[str, Any] | None, str, str]:
    """This rank's state at the plan's target (its own, or a peer's broadcast in its slice's
    group), where it came from, and why it is unusable ("" when it is not)."""
    rank, shard = dist.get_rank(), trainer.shard
    state: dict[str, Any] | None = None
    source = SOURCE_LIVE
    try:
        if plan.receivers.get(shard):
            src = plan.sources[shard]
            sent = _without_shard(held.state) if rank == src and held is not None else None
            corrupt = corrupt_transfer and rank == src
            if corrupt:
                log.warning("corrupting the state sent to peers (fault injection)")
            state = transfer.broadcast_state(sent, src, trainer.data_parallel_group(), _device(), corrupt)
            if rank not in plan.receivers[shard]:
                state = None  # a holder of the target that only listened keeps its own
            elif state is not None:
                source = SOURCE_PEER
                _check_received(state, plan.target)
        if state is None and held is not None and held.iteration == plan.target:
            state = held.state
        elif state is None:  # cannot happen by the plan
            raise StateError(f"no state of iteration {plan.target} here")
    except StateError as exc:
        log.error("%s state is unusable: %s", source, exc)
        return None, source, f"rank {rank}: {exc}"
    return state, source, ""
