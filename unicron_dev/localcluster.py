"""Every service as a local process on 127.0.0.1: what `make demo` and the end-to-end
tests run. Stops cleanly, leaving no process behind.

Secure like a real cluster unless told otherwise: it makes a development CA, certificates
and tokens in `<run_dir>/certs` (unicron.certs), so every call goes over mutual TLS with
tokens. In-process clients get the admin's credentials from `client()` (or
`client_security()`); a CLI in a subprocess takes them from `client_env()`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from services.agent.supervisor import REGISTRY_FILE
from services.coordinator.lease import LEASE_KEY
from unicron import jobspec, redisutil, rpc
from unicron.certs import DevPKI, User, create_dev_pki
from unicron.client import UnicronClient
from unicron.errors import FailedPrecondition, Unavailable
from unicron.redisutil import LocalRedis, RedisTLS, free_port
from unicron.security import ClientSecurity, load_tls
from unicron.v1 import common_pb2
from unicron_dev.netns import Host
from unicron_dev.redis_group import RedisGroup

ROOT = Path(__file__).resolve().parent.parent


GPT_ENTRY_POINT = "examples.gpt.train:main"


def gpt_program(
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    seq_length: int = 32,
    vocab_size: int = 128,
    **extra: float,
) -> dict[str, object]:
    """The job spec's ``program`` for the GPT example (examples/gpt) of this shape."""
    shape = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "seq_length": seq_length,
        "vocab_size": vocab_size,
        **extra,
    }
    args = [part for key, value in shape.items() for part in (f"--{key.replace('_', '-')}", str(value))]
    return {"entry_point": GPT_ENTRY_POINT, "args": args}


def tiny_gpt(
    name: str, data: int = 2, iterations: int = 100_000, seed: int = 3, dropout: float = 0.0
) -> common_pb2.JobSpec:
    """A GPT small enough for 0.05-0.1 s iterations on a CPU core: what end-to-end tests and
    benchmarks run on a local cluster (defaults filled, validated). Without dropout by default:
    the cluster tests compare a job that shrank with a failure-free run at its first size within
    1e-6, which a resize keeps only without dropout (tests/trainer/test_exactness.py measures
    the bound with it)."""
    return jobspec.normalized(
        jobspec.spec_from_dict(
            {
                "name": name,
                "program": gpt_program(hidden_dropout=dropout, attention_dropout=dropout),
                "parallelism": {"data": data},
                "training": {"iterations": iterations, "global_batch_size": 8, "micro_batch_size": 2, "seed": seed},
            }
        )
    )


def llm_gpt(name: str, layers: int, hidden: int, data: int = 2, iterations: int = 100_000) -> common_pb2.JobSpec:
    """The GPT example configured as LLM teams train: bf16, Megatron's distributed optimizer,
    dropout 0.1, Adam's beta2 0.95; ``layers`` x ``hidden`` sets its size (4 x 448: 10M
    parameters; 8 x 1024: 102M, with a 1024-token vocabulary and 64-token sequences)."""
    heads = max(1, hidden // 64)
    program = gpt_program(layers, hidden, heads, 64, 1024, hidden_dropout=0.1, attention_dropout=0.1)
    return jobspec.normalized(
        jobspec.spec_from_dict(
            {
                "name": name,
                "program": program,
                "parallelism": {"data": data},
                "training": {
                    "iterations": iterations,
                    "global_batch_size": 8,
                    "micro_batch_size": 2,
                    "seed": 3,
                    "precision": "bf16",
                    "distributed_optimizer": True,
                    "adam_beta2": 0.95,
                },
            }
        )
    )


def digits_mlp(
    name: str, data: int = 2, hidden: int = 1024, iterations: int = 100_000, seed: int = 3, fsdp: bool = False
) -> common_pb2.JobSpec:
    """The plain PyTorch example (examples/digits): an MLP whose width sets its size, about
    1.1M parameters at 1024, 10M at 3,150 and 100M at 10,000 (64*h + h*h + 10*h weights). The
    same program runs under torchrun and beside torchft, so benches compare like with like.
    ``fsdp``: sharded with FSDP2 over the ranks instead of replicated."""
    return jobspec.normalized(
        jobspec.spec_from_dict(
            {
                "name": name,
                "program": {
                    "entry_point": "examples.digits.train:main",
                    "args": ["--hidden", str(hidden), *(["--fsdp"] if fsdp else [])],
                },
                "parallelism": {"data": data},
                "training": {"iterations": iterations, "global_batch_size": 64, "micro_batch_size": 1, "seed": seed},
            }
        )
    )


def llama_fsdp(
    name: str, size: str = "tiny", data: int = 2, iterations: int = 100_000, precision: str = "fp32", seed: int = 3
) -> common_pb2.JobSpec:
    """The FSDP2 example (examples/llama_fsdp): a Llama-style decoder sharded with
    ``fully_shard`` under Session, 1.07M parameters at ``tiny``, about 10M at ``10m`` and 100M
    at ``100m``, on the GPT example's text with 32-token samples. Its shards get buddy copies
    (replication 2, said so that the coordinator maps them)."""
    return jobspec.normalized(
        jobspec.spec_from_dict(
            {
                "name": name,
                "program": {
                    "entry_point": "examples.llama_fsdp.train:main",
                    "args": ["--size", size, "--seq-length", "32"],
                },
                "parallelism": {"data": data},
                "training": {
                    "iterations": iterations,
                    "global_batch_size": 8,
                    "micro_batch_size": 4,
                    "seed": seed,
                    "learning_rate": 3e-3,
                    "precision": precision,
                    "replication": 2,
                },
            }
        )
    )


@dataclass
class Service:
    name: str
    address: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]


@dataclass
class LocalCluster:
    run_dir: Path
    agents: int = 2
    slots_per_agent: int = 2
    planners: int = 2
    redis_url: str | None = None
    heartbeat_timeout_s: float = 3.0
    # More than one: a standby set sharing the Redis, one active through the lease; agents
    # and clients get every address, comma-separated (see `coordinator`).
    coordinators: int = 1
    # None: 3 s with a standby (it takes over that fast), 10 s for a lone coordinator, which
    # has no one to hand over to: a short lease only lets a stalled machine fence it (seen
    # here: every process silent for 13 s, the coordinator stopped with exit 75); 6 s under
    # Sentinel (redis_replicas), to outlast a failover.
    lease_ttl_s: float | None = None
    fault_injection: bool = False
    # Spare trainers per agent (services/agent/spares.py). Off by default here: on a small
    # machine each one is an idle trainer's memory, and its imports compete for the CPU.
    warm_spares: int = 0
    agent_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    # Mutual TLS and tokens (a development CA in <run_dir>/certs); False: every service runs
    # with --plaintext and authenticates no one.
    secure: bool = True
    # Where Redis's append-only file and the trainers' snapshots go, as a real deployment keeps
    # them: snapshots in memory (a tmpfs), Redis on a disk of its own. None: under run_dir.
    # With one shared disk, a large model's checkpoints delay Redis's fsync past the
    # coordinator's lease (seen at 100M parameters: the coordinator stopped, exit 75).
    scratch_dir: Path | None = None
    # The active coordinator's Prometheus endpoint, http://<metrics_address>/metrics: a free
    # port on 127.0.0.1 that every coordinator is given and only the active one binds. Off
    # (empty) when False, or when the coordinators run in network namespaces.
    metrics: bool = True
    metrics_address: str = ""
    # The coordinator's --quotas-file (services/coordinator/quotas.py); None: no team quotas.
    quotas_file: Path | None = None
    # More than 0: Redis replicated under Sentinel (unicron_dev.redis_group): a primary, this
    # many replicas and three sentinels; the coordinators reach it by a redis+sentinel:// URL
    # and acknowledge a write only once a replica holds it.
    redis_replicas: int = 0
    services: list[Service] = field(default_factory=list)
    pki: DevPKI | None = None
    _redis: LocalRedis | None = None
    redis_group: RedisGroup | None = None

    # An admin and a plain user, for tests of who sees what.
    USERS = (User("admin", admin=True), User("alice"))

    def client_security(self, user: str = "admin") -> ClientSecurity:
        """How a client calls this cluster as `user` (plaintext without a token when not secure)."""
        if self.pki is None:
            return ClientSecurity.plaintext()
        leaf = self.pki.clients[user]
        return ClientSecurity(load_tls(str(self.pki.ca), str(leaf.cert), str(leaf.key)), self.pki.tokens[user])

    def client_env(self, user: str = "admin") -> dict[str, str]:
        """The environment for a `unicron` CLI in a subprocess, as `user`."""
        return self.pki.env(user) if self.pki is not None else {"UNICRON_PLAINTEXT": "1"}

    def client(self, user: str = "admin", timeout_s: float = 10.0) -> UnicronClient:
        """A client of the active coordinator, as `user`."""
        return UnicronClient(self.coordinator, timeout_s=timeout_s, security=self.client_security(user))

    def _service_security(self) -> ClientSecurity:
        """For health checks: any certificate of the CA will do."""
        return self.client_security()

    def _tls_args(self, name: str) -> list[str]:
        if self.pki is None:
            return ["--plaintext"]
        if name.startswith("node-"):
            leaf = self.pki.nodes[name]
        else:
            leaf = self.pki.services["planner" if name.startswith("planner") else "coordinator"]
        return ["--tls-ca", str(self.pki.ca), "--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key)]

    @property
    def coordinator(self) -> str:
        """The coordinators' addresses, comma-separated (one address with one coordinator)."""
        return ",".join(s.address for s in self.coordinator_services())

    def coordinator_services(self) -> list[Service]:
        """The coordinator processes: `coordinator`, then `coordinator-1`, `coordinator-2`..."""
        return [s for s in self.services if s.name == "coordinator" or s.name.startswith("coordinator-")]

    def active_coordinator(self) -> str | None:
        """The name of the coordinator holding the lease (as Redis says: it may have just
        died, until its lease expires), or None when no one holds it."""
        client = self.redis_client()
        try:
            raw = client.get(LEASE_KEY)
        finally:
            client.close()
        if raw is None:
            return None
        identity = raw.decode().split(" ", 2)[-1]  # type: ignore[union-attr]
        return next((s.name for s in self.coordinator_services() if identity.endswith("@" + s.address)), None)

    def wait_active_coordinator(self, timeout_s: float = 30.0, not_this: str | None = None) -> str:
        """Waits until a coordinator (other than `not_this`) holds the lease and serves;
        returns its name."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            name = self.active_coordinator()
            if (
                name is not None
                and name != not_this
                and rpc.wait_ready(self.service(name).address, timeout_s=0.5, security=self._service_security())
            ):
                return name
            time.sleep(0.05)
        raise Unavailable(f"no coordinator took over within {timeout_s}s")

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def trainer_processes(self, job_id: str, rank: int | None = None) -> list[psutil.Process]:
        """The job's live trainer processes (of one rank, when given), as the agents'
        registries (services/agent/supervisor.py) list them."""
        found = []
        for registry in sorted((self.run_dir / "agents").glob(f"*/{REGISTRY_FILE}")):
            try:
                entries = json.loads(registry.read_text())
            except (OSError, ValueError):
                continue  # being rewritten: a reader tries again
            for entry in entries:
                if entry["job_id"] != job_id or (rank is not None and entry["rank"] != rank):
                    continue
                try:
                    found.append(psutil.Process(entry["pid"]))
                except psutil.NoSuchProcess:
                    continue
        return found

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.secure:
                nodes = [self._node_id(i) for i in range(self.agents)]
                self.pki = create_dev_pki(
                    self.run_dir / "certs", nodes=nodes, users=self.USERS, hosts=self._certificate_hosts()
                )
            if self.redis_url is None and self.redis_replicas:
                self.redis_group = self._new_redis_group().start()
                self.redis_url = self.redis_group.url
            elif self.redis_url is None:
                self._redis = self._new_redis().start()
                self.redis_url = self._redis.url
            planner_addresses = [self._spawn(f"planner-{i}", "services.planner", []) for i in range(self.planners)]
            self._wait_ready(planner_addresses, timeout_s)
            if self.metrics and self._host("coordinator") is None:
                self.metrics_address = f"127.0.0.1:{free_port()}"
            coordinator_args = [
                "--metrics-bind",
                self.metrics_address,
                "--redis-url",
                self.redis_url,
                "--planners",
                ",".join(planner_addresses),
                "--heartbeat-timeout-s",
                str(self.heartbeat_timeout_s),
                "--lease-ttl-s",
                str(self.lease_ttl()),
                *(["--tokens-file", str(self.pki.tokens_file)] if self.pki is not None else []),
                *(["--quotas-file", str(self.quotas_file)] if self.quotas_file is not None else []),
            ]
            # The first becomes active; the others start once it serves, as standbys.
            self._wait_ready([self._spawn("coordinator", "services.coordinator", coordinator_args)], timeout_s)
            for i in range(1, self.coordinators):
                self._spawn(f"coordinator-{i}", "services.coordinator", coordinator_args)
            for service in self.coordinator_services()[1:]:
                self._wait_standby(service, 0, timeout_s)
            coordinator = self.coordinator
            for i in range(self.agents):
                node_id = self._node_id(i)
                self._spawn(
                    node_id,
                    "services.agent",
                    [
                        "--node-id",
                        node_id,
                        "--coordinator",
                        coordinator,
                        "--slots",
                        str(self.slots_per_agent),
                        "--work-dir",
                        str(self.run_dir / "agents"),
                        "--failure-domain",
                        f"rack-{i % 2}",
                        "--fault-injection" if self.fault_injection else "--no-fault-injection",
                        "--warm-spares",
                        str(self.warm_spares),
                        # Per cluster: agents of two clusters on one machine share node ids.
                        "--snapshot-dir",
                        str((self.scratch_dir or self.run_dir) / "snapshots" / node_id),
                        *self.agent_args,
                    ],
                    port=0,
                )
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _node_id(index: int) -> str:
        return f"node-{chr(ord('a') + index)}"

    # ---- where services run: hooks for unicron_dev.netcluster -------------------------

    def _host(self, name: str) -> Host | None:
        """The namespace host service `name` runs on; None: this machine's 127.0.0.1."""
        return None

    def _certificate_hosts(self) -> list[str]:
        """Addresses the services' certificates name besides localhost and 127.0.0.1."""
        return []

    def redis_client(self) -> redis.Redis:
        """A connection to this cluster's Redis, as its coordinators make one (over TLS with the
        coordinator's certificate when the Redis serves TLS)."""
        assert self.redis_url is not None
        return redisutil.connect(self.redis_url, self._redis_tls("coordinator"))

    def _redis_tls(self, name: str, backend: bool = False) -> RedisTLS | None:
        if self.pki is None:
            return None
        leaf = (self.pki.backends if backend else self.pki.services)[name]
        return RedisTLS(str(self.pki.ca), str(leaf.cert), str(leaf.key))

    def _new_redis(self) -> LocalRedis:
        """A secure cluster's Redis serves mutual TLS alone, as the rest of its control plane."""
        return LocalRedis(
            (self.scratch_dir or self.run_dir) / "redis",
            tls=self._redis_tls("redis", backend=True),
            client_tls=self._redis_tls("coordinator"),
        )

    def _new_redis_group(self) -> RedisGroup:
        return RedisGroup(
            (self.scratch_dir or self.run_dir) / "redis",
            replicas=self.redis_replicas,
            tls=self._redis_tls("redis", backend=True),
            client_tls=self._redis_tls("coordinator"),
        )

    def _spawn(self, name: str, module: str, args: list[str], port: int | None = None) -> str:
        """Starts a service; `port` None picks a free one, 0 lets the service bind any."""
        host = self._host(name)
        ip = host.address if host is not None else "127.0.0.1"
        if port is None:
            port = free_port() if host is None else self._fresh_port(host)
        address = f"{ip}:{port}"
        argv = [sys.executable, "-m", module, "--bind", address, *self._tls_args(name), *args]
        if host is not None:
            argv = host.argv(argv)
        self.services.append(
            Service(name, address, self._popen(argv, self.run_dir / f"{name}.log"), self.run_dir / f"{name}.log", argv)
        )
        return address

    def _fresh_port(self, host: Host) -> int:
        """A port no service of this cluster uses on `host` (a namespace holds nothing else)."""
        used = {int(s.address.rpartition(":")[2]) for s in self.services if s.address.startswith(f"{host.address}:")}
        return next(port for port in range(50100, 51000) if port not in used)

    def lease_ttl(self) -> float:
        if self.lease_ttl_s is not None:
            return self.lease_ttl_s
        # Under Sentinel the lease outlasts most failovers (1 s down-after, 2-5 s in all), so
        # that the active coordinator follows them instead of stopping at every one.
        if self.redis_replicas:
            return 6.0
        return 3.0 if self.coordinators > 1 else 10.0

    def _popen(self, argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        """Starts a stopped or killed service again with the same arguments and address."""
        service = self.service(name)
        if service.proc.poll() is None:
            raise RuntimeError(f"{name} is still running")
        log_start = service.log_path.stat().st_size if service.log_path.exists() else 0
        service.proc = self._popen(service.argv, service.log_path)
        if service in self.coordinator_services() and len(self.coordinator_services()) > 1:
            # It comes back as a standby, or active if no one else holds the lease.
            self._wait_standby(service, log_start, timeout_s, or_active=True)
        elif not name.startswith("node-"):
            self._wait_ready([service.address], timeout_s)

    def _wait_standby(self, service: Service, log_start: int, timeout_s: float, or_active: bool = False) -> None:
        """Waits until a coordinator says (in its log, after byte `log_start`) that it is a
        standby waiting for the lease, or serving when `or_active`."""
        marks = [b"waiting for the coordinator lease"] + ([b"coordinator serving"] if or_active else [])
        deadline = time.monotonic() + timeout_s
        while True:
            with open(service.log_path, "rb") as log:
                log.seek(log_start)
                text = log.read()
            if any(mark in text for mark in marks):
                return
            if service.proc.poll() is not None:
                raise Unavailable(f"{service.name} exited with code {service.proc.returncode}; see {service.log_path}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{service.name} not standing by after {timeout_s}s; see {service.log_path}")
            time.sleep(0.05)

    def _wait_ready(self, addresses: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for address in addresses:
            service = next(s for s in self.services if s.address == address)
            while not rpc.wait_ready(address, timeout_s=1.0, security=self._service_security()):
                if service.proc.poll() is not None:
                    raise Unavailable(
                        f"{service.name} exited with code {service.proc.returncode}; see {service.log_path}"
                    )
                if time.monotonic() > deadline:
                    raise Unavailable(f"{service.name} not ready after {timeout_s}s; see {service.log_path}")

    def wait_nodes(
        self, list_nodes: Callable[[], Sequence[common_pb2.Node]], count: int, timeout_s: float = 90.0
    ) -> None:
        """Waits until `count` nodes are READY (list_nodes: e.g. UnicronClient.nodes). Agents with
        warm spares register once the spares have imported torch: seconds on a busy machine."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(node.state == common_pb2.NODE_STATE_READY for node in list_nodes()) >= count:
                return
            time.sleep(0.2)
        raise Unavailable(f"fewer than {count} agents registered within {timeout_s}s")

    def restart_redis(self) -> None:
        """Kills this cluster's Redis (SIGKILL, as a crash would) and starts it again on the
        same port and data directory; its append-only file brings every write back."""
        if self._redis is None:
            raise FailedPrecondition("this cluster uses a Redis it did not start")
        self._redis.kill()
        self._redis.start()

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        self.service(name).proc.send_signal(sig)

    def stop(self, grace_s: float = 15.0) -> list[str]:
        """SIGTERM in reverse start order (agents stop their trainers first), then SIGKILL.

        Returns the processes that outlived their parent's shutdown and had to be killed
        (empty when everything stopped as it should)."""
        descendants: list[psutil.Process] = []
        for service in self.services:
            try:
                descendants += psutil.Process(service.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for service in reversed(self.services):
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
            try:
                service.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                service.proc.kill()
                service.proc.wait()
        self.services.clear()
        if self._redis:
            self._redis.stop()
            self._redis = None
        if self.redis_group:
            self.redis_group.stop()
            self.redis_group = None
        leftovers = []
        for proc in descendants:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    leftovers.append(f"{proc.pid} ({' '.join(proc.cmdline()[:4])})")
                    proc.kill()
            except psutil.NoSuchProcess:
                pass
        return leftovers

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
