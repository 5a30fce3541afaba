"""A user program for tests/e2e/test_logs.py: the digits example's model trained through the
trainer library's Session, printing a line per iteration on stdout (and one at start on
stderr), a little slowed so that a test sees it write while it follows."""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from examples.digits.train import Digits, build_model
from unicron.trainer import Session

MARK = "logs-e2e"


def main() -> None:
    session = Session()
    print(f"{MARK} rank {session.rank} started", file=sys.stderr, flush=True)
    torch.manual_seed(session.training.seed)
    model = build_model(64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    session.register(model=model, optimizer=optimizer)
    data = Digits(session.training.seed)
    for step in session.steps():
        with step:
            images, labels = data.batch(step.samples())
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            session.all_reduce_gradients(model)
            optimizer.step()
            step.report(loss.item(), tokens=len(labels))
        print(f"{MARK} rank {session.rank} iteration {step.iteration}", flush=True)
        time.sleep(0.05)
