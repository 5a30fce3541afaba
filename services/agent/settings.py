"""The agent's settings (``AgentSettings``), apart from the agent itself so that the parts
it is built of (executor.py) can take them without importing the agent."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.agent.trainer_user import TrainerUser
from unicron.monitor import MonitorSettings


@dataclass(frozen=True)
class AgentSettings:
    node_id: str
    slots: int
    failure_domain: str
    work_dir: Path
    checkpoint_dir: Path | None = None
    # Where this node's trainers keep in-memory snapshots of their state (a directory per
    # job; a tmpfs such as /dev/shm). None: no snapshots.
    snapshot_dir: Path | None = None
    stop_grace_s: float = 5.0
    fault_injection: bool = False
    monitoring: bool = True
    health_period_s: float = 5.0
    # How long every health check must have passed, after a shortage (disk, memory) was
    # found, before the agent registers again and so returns its node from isolation.
    health_return_s: float = 60.0
    monitor: MonitorSettings = field(default_factory=MonitorSettings)
    trainer_command: tuple[str, ...] = (sys.executable, "-m", "services.trainer")
    # Trainer processes kept ready (torch and Megatron imported) for ranks that start: a
    # restart then skips seconds of imports. Each costs the memory of an idle trainer.
    warm_spares: int = 0
    # At start, the longest the agent waits for its spares to be warm before it registers: a
    # job that grows onto the node then takes a spare, and its kept ranks do not wait in the
    # new group while a cold process imports torch (10-25 s measured). 0: register at once.
    spare_warmup_s: float = 60.0
    spare_command: tuple[str, ...] = (sys.executable, "-m", "services.trainer.spare")
    # How trainers reach this agent (unicron.trainer.settings.trainer_env: the CA that signed
    # the agent's certificate, or plaintext; never the agent's key), and where: a port of its
    # own that asks for no client certificate ("": the agent's address).
    trainer_env: Mapping[str, str] = field(default_factory=dict)
    trainer_address: str = ""
    # The node's GPU ids, one per slot (empty: no GPUs); a trainer sees its slot's alone.
    gpus: tuple[str, ...] = ()
    # The container image this agent and its trainers run in ("" when none is named).
    image: str = ""
    # The interface the trainers' collectives use ("": the libraries' own choice).
    data_interface: str = ""
    # Whom trainers run as (trainer_user.py); None: the agent's own user.
    trainer_user: TrainerUser | None = None
