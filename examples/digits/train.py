"""The plain PyTorch example: an MLP learning scikit-learn's handwritten digits (shipped inside
the package, nothing to download), in the user's own loop, through the trainer library's
Session. Under Unicron the job spec names it (``program.entry_point:
examples.digits.train:main``); without Unicron::

    torchrun --nproc-per-node 2 -m examples.digits.train --iterations 40

``--fsdp`` shards the same MLP with FSDP2 instead (``Session.register(build=...)``): what
``make bench-peers --fsdp`` runs beside torchft's HSDP.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from unicron.trainer import Session, Training


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="examples.digits.train", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="width of the two hidden layers (default 1024)")
    parser.add_argument("--iterations", type=int, default=40, help="without Unicron: iterations (default 40)")
    parser.add_argument("--global-batch-size", type=int, default=64, help="without Unicron: samples per iteration")
    parser.add_argument("--lr", type=float, default=1e-3, help="without Unicron: peak learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=1234, help="without Unicron: seed (default 1234)")
    parser.add_argument("--checkpoint-dir", default="", help="without Unicron: checkpoints here (default none)")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the MLP with FSDP2 (fully_shard per layer) over the ranks instead of replicating it (default off)",
    )
    return parser.parse_args(argv)


def build_model(hidden: int) -> torch.nn.Module:
    # 64 -> hidden -> hidden -> 10: about 1.1M parameters at the default width.
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


class Digits:
    """scikit-learn's 1,797 8x8 digits, addressed by global sample index: each epoch visits
    every image once, in an order drawn from (seed, epoch), so any split of a step's samples
    over ranks sees the same images."""

    def __init__(self, seed: int) -> None:
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        self.images = torch.from_numpy(images.astype(np.float32) / 16.0)
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self._seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        picked = [int(self._order(g // n)[g % n]) for g in indices]
        return self.images[picked], self.labels[picked]

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng([self._seed, epoch]).permutation(len(self))
        return self._orders[epoch]


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    session = Session(
        Training(
            iterations=args.iterations,
            global_batch_size=args.global_batch_size,
            learning_rate=args.lr,
            seed=args.seed,
            checkpoint_interval=10 if args.checkpoint_dir else 0,
        ),
        checkpoint_dir=args.checkpoint_dir,
    )
    training = session.training

    def build(mesh: Any = None) -> tuple[Any, ...]:
        torch.manual_seed(training.seed)
        model = build_model(args.hidden)
        if mesh is not None:  # FSDP2: each layer, then the root, sharded over the mesh
            for layer in model.modules():
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=training.learning_rate)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=training.iterations)
        return model, optimizer, scheduler

    if args.fsdp:
        session.register(build=build)  # built again on the new mesh after every reform
    else:
        model, optimizer, scheduler = build()
        session.register(model=model, optimizer=optimizer, scheduler=scheduler)
    data = Digits(training.seed)
    for step in session.steps():
        with step:
            model, optimizer = session.model, session.optimizer
            images, labels = data.batch(step.samples())
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            if not args.fsdp:  # FSDP2 reduce-scatters the gradients inside backward
                session.all_reduce_gradients(model)
            optimizer.step()
            session.scheduler.step()
            step.report(loss.item(), tokens=len(labels))


if __name__ == "__main__":
    main()
