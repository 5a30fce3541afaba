"""Unicron's trainer library: what a user's training program imports.

Megatron-Core level (the runtime owns the loop, as Megatron-LM's ``pretrain()`` does)::

    from unicron.trainer import Training, pretrain

    pretrain(model_provider, dataset_provider, forward_step, Training(iterations=100))

Plain PyTorch level (your loop; the session takes reform, resize and stop at step boundaries)::

    session = Session(Training(iterations=100))
    session.register(model=model, optimizer=optimizer, scheduler=scheduler)
    for step in session.steps():
        with step:
            ...  # forward, backward, session.all_reduce_gradients(model), optimizer.step()
            step.report(loss.item())

The same program runs under a Unicron agent (which supervises it and heals it) and under plain
``torchrun`` (for development). docs/trainer-library.md has the whole API. Importing this
package loads neither torch nor Megatron; the calls do."""

from typing import TYPE_CHECKING

from unicron.trainer.api import Context, context, pretrain, train_program, under_unicron
from unicron.trainer.program import MegatronProgram, ProgramError, Training

if TYPE_CHECKING:
    from unicron.trainer.session import Session, Step


def __getattr__(name: str) -> object:
    # Session imports torch: only when asked for, so that importing the package stays light.
    if name in ("Session", "Step"):
        from unicron.trainer import session

        return getattr(session, name)
    raise AttributeError(f"module 'unicron.trainer' has no attribute {name!r}")


__all__ = [
    "Context",
    "MegatronProgram",
    "ProgramError",
    "Session",
    "Step",
    "Training",
    "context",
    "pretrain",
    "train_program",
    "under_unicron",
]
