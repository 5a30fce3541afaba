"""What the plain PyTorch level's two trainers share (``session.TorchTrainer`` for a replicated
model, ``fsdp.FSDPTrainer`` for an FSDP2-sharded one): the user's model, optimizer and LR
scheduler, whether the step's update began, and the replicated part of the state (the LR
schedule, the RNG state, the iteration)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


class PlainLoopTrainer:
    """One (TP, PP) slice: a plain loop is data-parallel only. A step is redone whole."""

    tensor_parallel = 1
    pipeline_parallel = 1
    shard = (0, 0)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        device: str,
        timeout: timedelta | None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._device, self._timeout = device, timeout
        self.iteration = 0
        self.update_started = False
        self.grad_sync_hook: Any = None
        optimizer.register_step_pre_hook(self._updating)

    def _updating(self, *_: Any) -> None:
        self.update_started = True

    @property
    def device(self) -> str:
        return self._device

    @property
    def timeout(self) -> timedelta | None:
        return self._timeout

    @property
    def step_is_redoable(self) -> bool:
        return not self.update_started

    def shard_to_copy(self) -> dict[str, Any] | None:
        return None  # every rank a whole replica: any peer has what a lost rank had

    def replicated_state(self) -> dict[str, Any]:
        """The part every rank holds alike: the iteration, the RNG state, the LR schedule."""
        state: dict[str, Any] = {"iteration": self.iteration, "rng": {"torch": torch.get_rng_state()}}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_replicated(self, state: dict[str, Any]) -> None:
        """Loads what ``replicated_state`` holds, after the model and optimizer were loaded,
        and drops what a failed step left."""
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
        self.discard_step()
        self.iteration = int(state["iteration"])

    def discard_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.update_started = False

    def partial_step(self) -> None:
        return None  # a plain loop's step is redone whole

    def close(self) -> None:
        pass
