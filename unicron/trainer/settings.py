"""A trainer rank's settings, and the one place that writes them for a trainer to read: the
agent (and anything else that starts trainers: tests, benches) builds the environment with
``trainer_env``, the trainer reads it back with ``load_config`` under ENV_PREFIX."""

from __future__ import annotations

from dataclasses import dataclass

from unicron import timeouts
from unicron.config import require, setting, to_env
from unicron.security import ClientSecurity, load_tls

ENV_PREFIX = "UNICRON_TRAINER"


@dataclass(frozen=True)
class TrainerConfig:
    """A trainer rank's settings: the agent that starts it writes them into its environment
    (trainer_env); a trainer started by hand or by a test harness takes them as flags too."""

    job_id: str = setting("", "the job this rank trains (required)")
    generation: int = setting(0, "the job's generation (it grows with every restart or reform) this rank runs in")
    rank: int = setting(0, "this process's rank in the job, in [0, world_size)")
    world_size: int = setting(1, "ranks in the job's process group")
    master_addr: str = setting("127.0.0.1", "rank 0's host, where the process group meets")
    master_port: int = setting(29500, "rank 0's port, where the process group meets")
    agent: str = setting("", "host:port of this node's agent (required)")
    node: str = setting(
        "",
        "the node this rank runs on, as the cluster names it: a buddy copy of its optimizer shard is kept on "
        "another (empty: told apart by the agent's address)",
    )
    domain: str = setting(
        "",
        "the failure domain of this rank's node (a rack, a power feed): a buddy copy goes to another where the"
        " job's nodes allow it (empty: none)",
    )
    spec: str = setting("", "the job spec, as JSON (required)")
    collective_timeout_s: float = setting(
        timeouts.COLLECTIVE_S, "a torch.distributed collective (Megatron's groups included) fails after this long"
    )
    fault_injection: bool = setting(False, "let faults be injected into this rank (testing only)")
    faults: tuple[str, ...] = setting(
        (), "faults to inject, comma-separated kind[:arg][@iteration] (crash@5, slow:0.5); needs --fault-injection"
    )
    log_level: str = setting("info", "debug, info, warning or error")
    checkpoint_dir: str = setting(
        "", "the job's directory for persistent checkpoints, shared by its ranks (empty: no checkpoints)"
    )
    snapshot_dir: str = setting(
        "",
        "the job's directory on this node, in memory (tmpfs), where ranks keep snapshots of their state every "
        "--snapshot-interval iterations for a restart (empty: no snapshots)",
    )
    snapshot_interval: int = setting(2, "iterations between snapshots (0: none)")
    reattempt_wait_s: float = setting(
        timeouts.DECISION_WAIT_S, "after a reattemptable error, how long to wait for the agent's decision"
    )
    max_reattempts: int = setting(3, "how many times one iteration may be reattempted before the rank gives up")
    state_from_peer: bool = setting(
        False,
        "this process joins a new group (a grow) without state: it receives the training state from a live "
        "peer of its (tensor, pipeline) shard instead of the checkpoint",
    )
    corrupt_peer_state: bool = setting(
        False,
        "testing, only with --fault-injection: as the source of a peer transfer, flip one byte of the state after "
        "its checksum was taken (exercises the checkpoint fallback)",
    )
    # The agent always says how to reach it (UNICRON_TRAINER_PLAINTEXT and _TLS_*); unsaid and
    # with no CA means a trainer started by hand or by a test harness.
    tls_ca: str = setting("", "the CA certificate (PEM) the agent's certificate chains to")
    tls_cert: str = setting(
        "", "a client certificate (PEM) for an agent that asks for one; the agent's trainer port asks for none"
    )
    tls_key: str = setting("", "the private key (PEM) of --tls-cert")
    plaintext: bool | None = setting(
        None, "talk to the agent without TLS (unset and no --tls-ca: plaintext, with a warning)"
    )
    token: str = setting("", "the per-worker token the agent issued for this job, generation and rank")

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
