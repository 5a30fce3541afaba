"""Unicron's trainer library: what a user's training program imports.

Megatron-Core level (the runtime owns the loop, as Megatron-LM's ``pretrain()`` does)::

    from unicron.trainer import Training, pretrain

    pretrain(model_provider, dataset_provider, forward_step, Training(iterations=100))

The same program runs under a Unicron agent (which supervises it and heals it) and under plain
``torchrun`` (for development). docs/trainer-library.md has the whole API. Importing this
package loads neither torch nor Megatron; the calls do."""

from unicron.trainer.api import Context, context, pretrain, train_program, under_unicron
from unicron.trainer.program import MegatronProgram, ProgramError, Training

__all__ = [
    "Context",
    "MegatronProgram",
    "ProgramError",
    "Training",
    "context",
    "pretrain",
    "train_program",
    "under_unicron",
]
