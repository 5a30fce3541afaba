"""TensorBoard event files of a run, written by its rank 0 when the job asks for them
(``training.tensorboard_dir``): per iteration the loss, learning rate, gradient norm, the loss
function's report (under its own names, as Megatron-LM's ``training_log`` writes them), fp16's
skipped updates and, where evaluated, the validation loss. Every process that is rank 0 writes
its own event file into the directory (TensorBoard merges a run's files by step), so a restart
or a reform adds a file and loses nothing."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class ScalarLog:
    """Writes a run's scalars into ``directory`` ("": nowhere, for every rank but 0 and a job
    that asks for none); a write that fails is logged once and training goes on."""

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._writer: Any = None
        self._failed = False

    def write(self, iteration: int, scalars: dict[str, float]) -> None:
        if self._failed or not self._directory:
            return
        try:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=self._directory)
            for name, value in scalars.items():
                self._writer.add_scalar(name, value, iteration)
            self._writer.flush()
        except Exception as exc:  # noqa: BLE001 - a log is not worth a failed job
            self._failed = True
            log.warning("TensorBoard events not written to %s: %s", self._directory, exc)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def scalars_of(result: Any, validation_loss: float | None) -> dict[str, float]:
    """What one iteration (an engine StepResult) puts in TensorBoard."""
    out = {"loss": result.loss, "learning-rate": result.learning_rate, "skipped-iterations": float(result.skipped)}
    out.update(result.metrics)
    if result.grad_norm is not None:
        out["grad-norm"] = result.grad_norm
    if validation_loss is not None:
        out["validation loss"] = validation_loss
    return out
