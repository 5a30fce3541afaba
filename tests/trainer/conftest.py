"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def world1(tmp_path: Path) -> Iterator[None]:
    """A gloo world of one process (this one), for trainers built in the test itself."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
