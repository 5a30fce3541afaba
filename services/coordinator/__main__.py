"""`python -m services.coordinator`: the control plane as a process.

Any number of coordinator processes may share one Redis; one of them acts. A process first
waits for the coordinator lease (services.coordinator.lease), logging that it is a
standby; only once it holds the lease does it create the Coordinator, bind its gRPC port
and start its reconcile loop. A standby does not listen, so clients and agents given every
coordinator's address (`host:p1,host:p2`) connect to the active one. While active it
renews the lease; if the lease is lost it exits at once with EXIT_LEASE_LOST (75) and its
supervisor restarts it as a standby. SIGTERM releases the lease, so a standby takes over
immediately."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
import yaml

from services.coordinator import priority, quotas
from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.ladder import LadderPolicy
from services.coordinator.lease import DEFAULT_TTL_S, EXIT_LEASE_LOST, Lease, LeaseKeeper, lease_client
from services.coordinator.metrics import CoordinatorMetrics, census, setup_metrics
from services.coordinator.planner_client import PlannerClient
from services.coordinator.prometheus import DEFAULT_BIND, parse_bind, serve_metrics
from services.coordinator.redis_store import RedisStore
from services.coordinator.server import serve
from unicron import redisutil, rpc, timeouts
from unicron.config import require, setting
from unicron.errors import UnicronError
from unicron.logs import exit_flushed
from unicron.redis_replication import SENTINEL_SCHEMES, NotReplicated, is_sentinel, parse_sentinel_url
from unicron.security import ServerSecurity, TLSConfig, TokenBook, server_security
from unicron.service import redis_dependency, run_server

NAME = "coordinator"
GIL_SWITCH_INTERVAL_S = 0.001
REPLICATION_POLL_S = 1.0


@dataclass(frozen=True)
class CoordinatorConfig(TLSConfig):
    bind: str = setting("127.0.0.1:50051", "host:port to serve on (once this process holds the lease)")
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        "the Redis that holds the cluster's state and the lease; rediss://: over mutual TLS, checked against "
        "--tls-ca, with this coordinator's --tls-cert and --tls-key as its client certificate; "
        "redis+sentinel://HOST:PORT,HOST:PORT,.../MASTER (rediss+sentinel:// over TLS): the primary the sentinels "
        "name, followed across failovers",
    )
    redis_acks: int = setting(
        -1,
        "replicas that must hold a write before it is acknowledged or acted on (Redis WAIT); -1: 1 with a "
        "redis+sentinel:// URL, 0 (no wait) with a single Redis",
    )
    redis_wait_ms: int = setting(
        1000, "how long a write waits for --redis-acks replicas before it is refused as UNAVAILABLE"
    )
    planners: tuple[str, ...] = setting(
        ("127.0.0.1:50061",), "planner replicas, host:port, comma-separated; a plan asks the next that answers"
    )
    heartbeat_interval_s: float = setting(1.0, "how often agents are told to send a heartbeat")
    heartbeat_timeout_s: float = setting(3.0, "a node silent this long is declared lost")
    reconcile_interval_s: float = setting(0.5, "how often the reconcile loop compares jobs with what runs")
    plan_time_limit_s: float = setting(2.0, "how long the planner's solver may search for one plan")
    failure_rate_per_node_per_s: float = setting(
        1.0 / (30 * 24 * 3600),
        "expected failures per node per second (by default one a month); plans weigh a change's cost "
        "against the expected time to the next failure",
    )
    max_workers: int = setting(64, "threads for the servicers' blocking work (Redis calls)")
    log_level: str = setting("info", "debug, info, warning or error")
    lease_ttl_s: float = setting(
        DEFAULT_TTL_S, "the leader lease: a standby takes over within about this long after the active one dies"
    )
    identity: str = setting("", "who holds the lease, for logs and tools (empty: host:pid@bind)")
    remedy_attempts: int = setting(
        2, "a remedy used this many times for a job within --remedy-window-s escalates to the next, heavier one"
    )
    remedy_window_s: float = setting(600.0, "the window in which a job's remedies are counted")
    max_remedies: int = setting(6, "this many remedies of any kind for a job within the window fail the job")
    ack_timeout_s: float = setting(
        timeouts.ACK_S, "how long an agent may take to acknowledge a start, stop or reform command"
    )
    recovery_timeout_s: float = setting(
        timeouts.RECOVERY_S, "a remedied job must finish an iteration within this long, else it counts as a new failure"
    )
    reform_restarts: bool = setting(
        True, "restart only a job's dead ranks (state from a live peer) while the others wait"
    )
    tokens_file: str = setting(
        "",
        "users' tokens and the agents' join token (YAML: join_token, users: [{name, token, admin, team}]; "
        "make certs writes one); required with TLS, and with --plaintext and none no one is authenticated",
    )
    priority_classes_file: str = setting(
        "",
        "the priority classes jobs name (YAML: classes: {NAME: {weight, preemptible}}, default: NAME); empty: the"
        " built-in production (weight 10), research (1, the default) and best-effort (0.1, preemptible)",
    )
    quotas_file: str = setting(
        "",
        "the teams' quotas (YAML: teams: {NAME: {guarantee: SLOTS, borrow_limit: SLOTS}}; no borrow_limit: any idle"
        " slots); users join teams in the tokens file (team: NAME); empty: no team is limited",
    )
    metrics_bind: str = setting(
        DEFAULT_BIND,
        "host:port of the Prometheus /metrics endpoint (plain HTTP, served by the active coordinator); empty: none",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.plaintext or bool(self.tokens_file),
            "tokens_file",
            "is required: users need tokens (make certs writes one), or run with --plaintext",
        )
        if self.tokens_file:
            TokenBook.load(self.tokens_file)  # a bad file is named now, not at the first call
        if self.priority_classes_file:
            try:
                priority.load(self.priority_classes_file)
            except (OSError, ValueError, yaml.YAMLError) as exc:
                require(False, "priority_classes_file", str(exc))
        if self.quotas_file:
            try:
                quotas.load(self.quotas_file)
            except (OSError, ValueError, yaml.YAMLError) as exc:
                require(False, "quotas_file", str(exc))
        require(":" in self.bind, "bind", "must be host:port")
        require(
            self.redis_url.startswith(("redis://", "rediss://", "unix://", *SENTINEL_SCHEMES)),
            "redis_url",
            f"must be redis://, rediss://, unix:// or redis+sentinel://, got {self.redis_url!r}",
        )
        if is_sentinel(self.redis_url):
            parse_sentinel_url(self.redis_url)  # names what is wrong with it (InvalidArgument)
        require(
            not (self.redis_url.startswith(("rediss://", "rediss+sentinel://")) and self.plaintext),
            "redis_url",
            "rediss:// needs this coordinator's TLS files (--tls-ca, --tls-cert, --tls-key), not --plaintext",
        )
        require(self.redis_acks >= -1, "redis_acks", "must be -1 (automatic), 0 or more replicas")
        require(self.redis_wait_ms > 0, "redis_wait_ms", "must be positive")
        if self.metrics_bind:
            parse_bind(self.metrics_bind)
        require(len(self.planners) > 0, "planners", "needs at least one planner address")
        require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be positive")
        require(
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            "must exceed heartbeat_interval_s",
        )
        require(self.reconcile_interval_s > 0, "reconcile_interval_s", "must be positive")
        require(self.max_workers >= 4, "max_workers", "must be at least 4")
        require(self.lease_ttl_s >= 0.3, "lease_ttl_s", "must be at least 0.3")
        require(self.remedy_attempts >= 1, "remedy_attempts", "must be at least 1")
        require(self.remedy_window_s > 0, "remedy_window_s", "must be positive")
        require(self.max_remedies >= 1, "max_remedies", "must be at least 1")
        require(self.ack_timeout_s > 0, "ack_timeout_s", "must be positive")
        require(self.recovery_timeout_s > 0, "recovery_timeout_s", "must be positive")
        # The trainers' own timeouts are theirs to set; their defaults must fit this deadline.
        timeouts.check_order(
            {
                "ack": ("ack_timeout_s", self.ack_timeout_s),
                "recovery": ("recovery_timeout_s", self.recovery_timeout_s),
                "collective": ("the trainers' collective timeout", timeouts.COLLECTIVE_S),
                "decision_wait": ("the trainers' decision wait", timeouts.DECISION_WAIT_S),
            },
            fixed=frozenset({"collective", "decision_wait"}),
        )

    @property
    def acks(self) -> int:
        """The replicas each write waits for (--redis-acks, with -1 resolved)."""
        if self.redis_acks >= 0:
            return self.redis_acks
        return 1 if is_sentinel(self.redis_url) else 0


def redis_tls(config: CoordinatorConfig) -> redisutil.RedisTLS | None:
    """The coordinator's own CA, certificate and key, for a rediss:// Redis."""
    if config.plaintext or not config.redis_url.startswith(("rediss://", "rediss+sentinel://")):
        return None
    return redisutil.RedisTLS(config.tls_ca, config.tls_cert, config.tls_key)


def setup(
    config: CoordinatorConfig, server: rpc.Server, log: logging.Logger, lease: Lease | None = None
) -> Callable[[], None]:
    """Adds the servicers to the server; returns what starts the reconcile loop. With a
    lease, every state-changing write is fenced by it."""
    coordinator = Coordinator(
        RedisStore(
            redisutil.connect(config.redis_url, redis_tls(config), acks=config.acks, wait_ms=config.redis_wait_ms),
            lease=lease,
        ),
        PlannerClient(config.planners, security=config.client()),
        Settings(
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            reconcile_interval_s=config.reconcile_interval_s,
            failure_rate_per_node_per_s=config.failure_rate_per_node_per_s,
            plan_time_limit_s=config.plan_time_limit_s,
            ladder=LadderPolicy(config.remedy_attempts, config.remedy_window_s, config.max_remedies),
            ack_timeout_s=config.ack_timeout_s,
            recovery_timeout_s=config.recovery_timeout_s,
            reform_restarts=config.reform_restarts,
            priority_classes=priority.load(config.priority_classes_file)
            if config.priority_classes_file
            else priority.BUILT_IN,
            quotas=quotas.load(config.quotas_file) if config.quotas_file else quotas.NONE,
        ),
        agent_security=config.client(),  # agents admit its certificate to read their logs
    )
    coordinator.metrics = CoordinatorMetrics(
        coordinator.cluster,
        census=lambda: census(
            coordinator.list_jobs(),
            coordinator.registry.nodes(),
            coordinator.ctx.settings.priority_classes.classes,
            coordinator.ctx.clock(),
            coordinator.ctx.settings.quotas,
        ),
    )
    if config.metrics_bind:
        server.on_stop(serve_metrics(config.metrics_bind).stop)
    serve(server, coordinator)
    # The reconcile loop and the servicers' Redis calls are threads that give up the GIL
    # for every round trip and must win it back from the event loop's thread: at Python's
    # 5 ms default, a remedy's twenty round trips took ~90 ms under a thousand agents.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    log.info("state in %s, planners %s", redisutil.redacted(config.redis_url), ",".join(config.planners))
    return coordinator.start


def identity_of(config: CoordinatorConfig) -> str:
    return config.identity or f"{socket.gethostname()}:{os.getpid()}@{config.bind}"


def fail_stop(log: logging.Logger, reason: str) -> None:
    """Stops acting at once: no servicer, loop or in-flight write may go on. Fenced writes
    would be refused anyway; exiting also frees the port for nothing stale to answer."""
    log.critical("lost the coordinator lease, stopping now: %s", reason, extra={"exit_code": EXIT_LEASE_LOST})
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_LEASE_LOST)


def main(argv: Sequence[str], on_lost: Callable[[logging.Logger, str], None] = fail_stop) -> int:
    """unicron.service.run_server's life with the lease before the port: wait for the lease
    as a standby, then bind, serve and reconcile until SIGTERM (0) or until the lease is
    lost (EXIT_LEASE_LOST)."""
    holder = _LeaseHolder(on_lost)
    return run_server(
        NAME,
        CoordinatorConfig,
        argv,
        holder.setup,
        prepare=holder.acquire,
        # Under Sentinel, `wait_for_replication` waits instead, naming what is missing.
        dependencies=lambda config: []
        if is_sentinel(config.redis_url)
        else [redis_dependency(config.redis_url, redis_tls(config))],
        security=security,
        asyncio=True,
    )


def security(config: CoordinatorConfig) -> ServerSecurity:
    """Users and join-token agents by their tokens, nodes and services by their certificates."""
    return server_security(config, TokenBook.load(config.tokens_file).lookup if config.tokens_file else None)


def wait_for_replication(config: CoordinatorConfig, log: logging.Logger, stopping: threading.Event) -> bool:
    """Under Sentinel, waits as a standby until the group can be trusted: a sentinel answers,
    knows the master, and the primary has the replicas writes wait for (says what is missing,
    once per change). False when stopped first; a quorum that can never fail over is refused
    (FailedPrecondition), before anything is decided."""
    said = ""
    redacted = redisutil.redacted(config.redis_url)
    while not stopping.is_set():
        problem = redisutil.replication_problem_at(config.redis_url, redis_tls(config), config.acks)
        if problem is None:
            if said:
                log.info("the Redis group is ready", extra={"redis_url": redacted})
            warn_if_lease_shorter_than_failover(config, log)
            return True
        if problem != said:
            log.warning("standby: waiting for Redis: %s", problem, extra={"redis_url": redacted})
            said = problem
        stopping.wait(REPLICATION_POLL_S)
    return False


# A failover takes the sentinels' down-after time and about this much more (the election,
# the promotion, the replicas following the new primary).
FAILOVER_MARGIN_S = 2.0


def warn_if_lease_shorter_than_failover(config: CoordinatorConfig, log: logging.Logger) -> None:
    down_after = redisutil.sentinel_down_after_s(config.redis_url, redis_tls(config))
    if down_after is not None and config.lease_ttl_s < down_after + FAILOVER_MARGIN_S:
        log.warning(
            "the lease (%gs) is shorter than a Redis failover (the sentinels' down-after %gs and about %gs more):"
            " the active coordinator will stop at each failover and a standby take over; --lease-ttl-s %g follows it",
            config.lease_ttl_s,
            down_after,
            FAILOVER_MARGIN_S,
            down_after + 2 * FAILOVER_MARGIN_S,
        )


class _LeaseHolder:
    """The lease across run_server's two steps: acquired before the port is bound, renewed
    while serving, given back after the coordinator stopped."""

    def __init__(self, on_lost: Callable[[logging.Logger, str], None]) -> None:
        self._on_lost = on_lost
        self._lease: Lease | None = None
        self._keeper: LeaseKeeper | None = None

    def acquire(self, config: CoordinatorConfig, log: logging.Logger, stopping: threading.Event) -> bool:
        setup_metrics(NAME, prometheus=bool(config.metrics_bind))
        if not wait_for_replication(config, log, stopping):
            return False
        client = lease_client(config.redis_url, config.lease_ttl_s, redis_tls(config), acks=config.acks)
        lease = Lease(client, identity_of(config), ttl_s=config.lease_ttl_s)
        try:
            acquired = lease.try_acquire()
        except (redis.RedisError, NotReplicated):  # Redis not up yet: wait for it as a standby does
            acquired = False
        if not acquired:
            log.info(
                "standby: waiting for the coordinator lease",
                extra={"identity": lease.identity, "lease_ttl_s": config.lease_ttl_s},
            )
            if not lease.wait_acquire(stopping):
                return False
        log.info("active: holding the coordinator lease", extra={"identity": lease.identity, "fence": lease.fence})
        self._lease = lease
        self._keeper = LeaseKeeper(lease, on_lost=lambda reason: self._on_lost(log, reason))
        self._keeper.start()
        return True

    def setup(self, config: CoordinatorConfig, server: rpc.Server, log: logging.Logger) -> Callable[[], None]:
        try:
            start = setup(config, server, log, lease=self._lease)
        except UnicronError:
            self._give_back(log)
            raise
        # After the coordinator stopped (setup's callback runs first): give the lease back,
        # so a standby takes over now instead of after the TTL.
        server.on_stop(lambda: self._give_back(log))
        return start

    def _give_back(self, log: logging.Logger) -> None:
        if self._keeper is not None:
            self._keeper.stop()
        if self._lease is not None and self._lease.release():
            log.info("released the coordinator lease")


if __name__ == "__main__":
    exit_flushed(main(sys.argv[1:]))
