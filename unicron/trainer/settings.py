"""A trainer rank's settings, and the one place that writes them for a trainer to read: the
agent (and anything else that starts trainers: tests, benches) builds the environment with
``trainer_env``, the trainer reads it back with ``load_config`` under ENV_PREFIX."""

from __future__ import annotations

from dataclasses import dataclass

from unicron import timeouts
from unicron.config import require, to_env
from unicron.security import ClientSecurity, load_tls

ENV_PREFIX = "UNICRON_TRAINER"


@dataclass(frozen=True)
class TrainerConfig:
    job_id: str = ""
    generation: int = 0
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    agent: str = ""
    spec: str = ""
    collective_timeout_s: float = timeouts.COLLECTIVE_S
    fault_injection: bool = False
    faults: tuple[str, ...] = ()
    log_level: str = "info"
    # Per-job directory shared by the job's ranks; empty: no persistent checkpoints.
    checkpoint_dir: str = ""
    # Per-job directory on this node, in memory (tmpfs), where ranks keep snapshots of their
    # state every snapshot_interval iterations for a restart; empty: no snapshots.
    snapshot_dir: str = ""
    snapshot_interval: int = 2
    # After a reattemptable error: how long to wait for the agent's decision, and how many
    # times one iteration may be reattempted before the rank gives up.
    reattempt_wait_s: float = timeouts.DECISION_WAIT_S
    max_reattempts: int = 3
    # A process started to join a new group (a grow) without state: it receives the training
    # state from a live peer of its (tensor, pipeline) shard instead of the checkpoint.
    state_from_peer: bool = False
    # Testing, honoured only with fault_injection: as the source of a peer transfer, flip one
    # byte of the state after its checksum was taken (exercises the checkpoint fallback).
    corrupt_peer_state: bool = False
    # How to reach the agent, which always says (UNICRON_TRAINER_PLAINTEXT and _TLS_*): over TLS
    # with the agent's certificate, or plaintext. Unsaid and with no CA (a trainer started by
    # hand or by a test harness): plaintext, with a warning.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    plaintext: bool | None = None
    # The per-worker token the agent issued for this job, generation and rank.
    token: str = ""

    def __post_init__(self) -> None:
        require(bool(self.job_id), "job_id", "is required")
        require(0 <= self.rank < self.world_size, "rank", f"must lie in [0, {self.world_size})")
        require(bool(self.agent), "agent", "is required (host:port of the node's agent)")
        require(bool(self.spec), "spec", "is required (the job spec as JSON)")
        require(0 < self.master_port < 65536, "master_port", "must be a TCP port")
        require(self.reattempt_wait_s >= 0, "reattempt_wait_s", "must not be negative")
        require(self.max_reattempts >= 0, "max_reattempts", "must not be negative")
        require(self.snapshot_interval >= 0, "snapshot_interval", "must not be negative (0: no snapshots)")
        require(self.plaintext is not False or bool(self.tls_ca), "tls_ca", "is required unless plaintext")
        timeouts.check_order(
            {
                "reform_overdue": ("the reform watchdog", timeouts.REFORM_OVERDUE_S),
                "collective": ("collective_timeout_s", self.collective_timeout_s),
                "decision_wait": ("reattempt_wait_s", self.reattempt_wait_s),
            },
            fixed=frozenset({"reform_overdue"}),
        )

    def agent_security(self) -> ClientSecurity:
        if self.plaintext or not self.tls_ca:
            return ClientSecurity.plaintext(self.token)
        return ClientSecurity(load_tls(self.tls_ca, self.tls_cert, self.tls_key), self.token)


def trainer_env(**values: object) -> dict[str, str]:
    """The environment that gives a trainer these settings (names of TrainerConfig's fields;
    an unknown name is a programming error, raised at once)."""
    return to_env(TrainerConfig, ENV_PREFIX, values)
