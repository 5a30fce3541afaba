"""What the runtime's state machinery (reform, peer transfer, snapshots, checkpoints) needs of a
rank's trainer: the Megatron-Core engine (engine.MegatronTrainer) and the plain PyTorch level's
registered state (session.TorchTrainer) both are one."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol, TypeVar


class Trainer(Protocol):
    # Called on this rank's entry into the gradient all-reduce (set by fault injection).
    grad_sync_hook: Any

    @property
    def iteration(self) -> int: ...

    @property
    def shard(self) -> tuple[int, int]:
        """(tensor-parallel rank, pipeline-parallel rank) of the slice this rank holds."""
        ...

    @property
    def data_parallel_rank(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def tensor_parallel(self) -> int: ...

    @property
    def pipeline_parallel(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def timeout(self) -> timedelta | None: ...

    @property
    def step_is_redoable(self) -> bool: ...

    def data_parallel_group(self) -> Any:
        """The ranks holding this rank's shard (None: the whole world)."""
        ...

    def layout(self) -> dict[str, Any]:
        """{"model": what identifies the model, "tensor_parallel", "pipeline_parallel"}."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def shard_to_copy(self) -> dict[str, Any] | None:
        """This rank's optimizer shard (pieces) for a buddy to keep; None where no peer
        needs one (a replicated optimizer, or replicas that hold the same shard)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def discard_step(self) -> None: ...

    def partial_step(self) -> Any: ...

    def rebuild(self, timeout: timedelta | None = None) -> Any:
        """The trainer for the current (new) process group."""
        ...

    def close(self) -> None: ...

    def release(self) -> None:
        """Drops every reference to the process groups, so that leaving one does not hang."""
        ...


T = TypeVar("T", bound=Trainer)
