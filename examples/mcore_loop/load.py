"""The trained model in a plain Megatron-Core script, as docs/trainer-library.md shows: the
model built as in training, then ``dist_checkpointing.load`` and ``load_state_dict``. Reads a
Megatron-LM save directory (its ``latest_checkpointed_iteration.txt`` and ``iter_*``), such as
``converted.py``'s ``<save>/final``, or one checkpoint directory, such as ``original.py``'s.
With two directories it prints, on each rank, how far apart the two models are.

    torchrun --nproc-per-node 2 -m examples.mcore_loop.load /tmp/mcore-loop/final
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt import GPTModel

from examples.mcore_loop.converted import TENSOR_PARALLEL, model_provider

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's


def checkpoint_of(directory: str) -> str:
    """The newest iteration's directory of a Megatron-LM save directory, or ``directory``."""
    tracker = Path(directory) / TRACKER
    if not tracker.exists():
        return directory
    return str(Path(directory) / f"iter_{int(tracker.read_text().strip()):07d}")


def load(directory: str) -> tuple[GPTModel, int | None]:
    """This rank's slice of the model saved under ``directory``, and its iteration (None when
    the checkpoint does not say)."""
    model = model_provider()
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, checkpoint_of(directory))
    model.load_state_dict(state["model"])
    return model, state.get("iteration")


def distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest relative difference of a parameter between two models of one shape."""
    other = dict(b.named_parameters())
    return max(float((p - other[n]).norm() / p.norm().clamp_min(1e-30)) for n, p in a.named_parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="one or two checkpoint directories")
    parser.add_argument("--tensor-parallel", type=int, default=TENSOR_PARALLEL, help="TP degree (default 2)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_parallel)
    try:
        with torch.no_grad():
            models = [load(directory) for directory in args.checkpoints[:2]]
            found = {"rank": torch.distributed.get_rank(), "iterations": [iteration for _, iteration in models]}
            if len(models) == 2:
                found["distance"] = distance(models[0][0], models[1][0])
        # One write per line: two ranks share the launcher's pipe, and print's separate
        # newline lets their lines run together.
        sys.stdout.write(json.dumps(found) + "\n")
        sys.stdout.flush()
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
