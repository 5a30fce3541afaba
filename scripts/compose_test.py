"""`make compose-test`: the whole stack of deploy/compose.yaml as containers, on this
machine, and a job that heals itself in it.

This machine pulls no images and must not use Docker's bridge networks, so the test runs
its own Docker engine (`dockerd --bridge=none --iptables=false --ip-forward=false
--ip-masq=false`, a private socket, its data under .cache/docker so images are kept between
runs) and compose.host.yaml on top of compose.yaml: every service on the host's network at
127.0.0.1 ports 17xxx, the base image a stand-in made from Debian's packages (debootstrap,
`docker import`) when the registry's cannot be pulled, and the local OTLP receiver in
place of the collector and the viewer.

Steps: start the engine; build the images; check that a container missing a setting or
its dependency says which and exits non-zero; `up` (mutual TLS between every service, Redis
and the collector stand-in included, as compose.yaml by default); submit a job with the
host's `unicron` CLI, as the admin of the `certs` step's share; kill one of its trainers
(SIGKILL, inside an agent's container); see the incident, the job resume and succeed, and
the incident's trace in the viewer's query API; then `down`, stop the engine, and check that
no container, engine process, network interface, firewall rule or forwarding setting is
left changed. Needs root. Not part of `make test`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
DATA_ROOT = CACHE / "docker" / "data"
# Unix socket paths are short-lived and length-limited, so the engine's runtime state
# stays in /tmp; only its images (DATA_ROOT) are worth keeping.
EXEC_ROOT = Path("/tmp/unicron-compose-test/exec")
SOCKET = "/tmp/unicron-compose-test/docker.sock"
DOCKER_HOST = f"unix://{SOCKET}"
ROOTFS = CACHE / "standin" / "rootfs"
STANDIN_IMAGE = "unicron-standin/bookworm:1"
UPSTREAM_BASE = "python:3.11-slim-bookworm"
UPSTREAM_REDIS = "redis:7.2-bookworm"
WHEELS = ROOT / "deploy" / "wheels"
LOCK = ROOT / "deploy" / "requirements.lock"
PROJECT = "unicron-compose-test"
# The stack's default, mutual TLS everywhere (Redis and the collector included): the host's
# CLI and client show the admin's certificate and token from the `cli` share.
COMPOSE_FILES = [
    *("-f", str(ROOT / "deploy" / "compose.yaml")),
    *("-f", str(ROOT / "deploy" / "compose.host.yaml")),
]
IMAGE = "unicron:0.1.0"
MERGED = CACHE / "compose.merged.yaml"
COORDINATOR = "127.0.0.1:17051"
VIEWER = "http://127.0.0.1:17686"
PORTS = (17051, 17061, 17062, 17071, 17072, 17317, 17379, 17417, 17686)
PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
VENV_BIN = ROOT / ".venv" / "bin"

JOB_SPEC = """\
name: compose-test
program:
  entry_point: examples.gpt.train:main
  args: [--num-layers, 2, --hidden-size, 64, --num-attention-heads, 4, --seq-length, 32, --vocab-size, 128]
parallelism: {data: 4}
training: {iterations: 120, global_batch_size: 16, micro_batch_size: 2, seed: 7}
"""
KILL_AT_ITERATION = 15

_started = time.monotonic()


# What say() prefixes its lines with (scripts/gpu_image_test.py, which reuses the engine, sets its own).
LABEL = "compose-test"


def say(message: str) -> None:
    print(f"[{LABEL} {time.monotonic() - _started:6.1f}s] {message}", flush=True)


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 600, quiet: bool = False) -> str:
    """Runs a command with the private engine's DOCKER_HOST; returns its stdout."""
    env = {**os.environ, "DOCKER_HOST": DOCKER_HOST, "COMPOSE_PROJECT_NAME": PROJECT}
    done = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    if not quiet and done.returncode != 0:
        say(f"{argv[0]} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout


def wait(what: str, ready: Callable[[], bool], timeout_s: float, period_s: float = 0.5) -> float:
    """Seconds until ready() holds; raises after timeout_s."""
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(period_s)
    return time.monotonic() - start


# ---- the host, before and after --------------------------------------------------------


def host_state() -> dict[str, str]:
    """What the engine must leave as it found it: interfaces, firewall rules, forwarding."""

    def output(*argv: str) -> str:
        done = subprocess.run(argv, capture_output=True, text=True)
        # iptables-save stamps its output with the time; those comment lines differ anyway.
        return "\n".join(line for line in done.stdout.splitlines() if not line.startswith("#"))

    return {
        "interfaces": output("ip", "-brief", "link"),
        "iptables": output("iptables-save"),
        "ip6tables": output("ip6tables-save"),
        "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        "mounts": Path("/proc/mounts").read_text(),
    }


def ensure_tools() -> None:
    missing = [package for tool, package in PACKAGES.items() if shutil.which(tool) is None]
    if missing:
        say(f"installing {' '.join(missing)} from the system's packages")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True, env=env)


def check_ports_free() -> None:
    for port in PORTS:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"port {port} on 127.0.0.1 is in use; the stack needs {PORTS}")


def teardown_on_sigterm() -> None:
    """A stop (SIGTERM) raises KeyboardInterrupt, as Ctrl-C does, so the engine and what it
    started are torn down by the caller's `finally`, not left running."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


# ---- the engine ------------------------------------------------------------------------


class Engine:
    """A dockerd of our own: no bridge, no firewall rules, no forwarding, private socket."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = CACHE / "docker" / "dockerd.log"

    def start(self) -> None:
        DATA_ROOT.mkdir(parents=True, exist_ok=True)
        EXEC_ROOT.mkdir(parents=True, exist_ok=True)
        flags = ["--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false"]
        help_text = subprocess.run(["dockerd", "--help"], capture_output=True, text=True).stdout
        if "--ip6tables" in help_text:
            flags.append("--ip6tables=false")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    "dockerd",
                    f"--host={DOCKER_HOST}",
                    f"--data-root={DATA_ROOT}",
                    f"--exec-root={EXEC_ROOT}",
                    f"--pidfile={EXEC_ROOT / 'dockerd.pid'}",
                    *flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        seconds = wait("dockerd", self._answers, 60)
        say(f"dockerd up in {seconds:.1f}s ({' '.join(flags)}; socket {SOCKET})")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"dockerd exited with {self.proc.returncode}; see {self.log_path}")
        return (
            subprocess.run(
                ["docker", "version"], env={**os.environ, "DOCKER_HOST": DOCKER_HOST}, capture_output=True
            ).returncode
            == 0
        )

    def stop(self) -> list[str]:
        """Stops dockerd (and the containerd it started); returns what had to be killed."""
        if self.proc is None:
            return []
        killed = []
        try:
            family = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            killed.append(f"dockerd {self.proc.pid}")
        _, alive = psutil.wait_procs(family, timeout=15)
        for proc in alive:
            killed.append(f"{proc.name()} {proc.pid}")
            proc.kill()
        # dockerd leaves its network namespace's bind mount behind (netns/default).
        for mount_point in mounts_under(EXEC_ROOT):
            subprocess.run(["umount", mount_point], check=False)
        shutil.rmtree(EXEC_ROOT.parent, ignore_errors=True)
        self.proc = None
        return killed


def mounts_under(path: Path) -> list[str]:
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return sorted((p for p in points if p.startswith(str(path))), reverse=True)


# ---- images ----------------------------------------------------------------------------


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False, quiet=True).strip() not in ("", "[]")


def pulled(name: str) -> bool:
    """Whether the registry's image is here or can be pulled (not on this machine)."""
    if image_exists(name):
        return True
    try:
        run(["docker", "pull", name], timeout=120, quiet=True, check=True)
    except (RuntimeError, subprocess.TimeoutExpired):
        return False
    return True


def standin_image() -> str:
    """Debian bookworm with python3, venv and redis-server, from the system's packages: the
    base image and Redis's image where the registry's cannot be pulled."""
    if image_exists(STANDIN_IMAGE):
        return STANDIN_IMAGE
    if not (ROOTFS / "usr" / "bin" / "python3").exists():
        say("building a stand-in base image with debootstrap (about a minute)")
        shutil.rmtree(ROOTFS, ignore_errors=True)
        ROOTFS.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,redis-server",
                "bookworm",
                str(ROOTFS),
                "http://deb.debian.org/debian",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for junk in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for path in (ROOTFS / junk).glob("*"):
                if path.is_file():
                    path.unlink()
    tar = subprocess.Popen(["tar", "-C", str(ROOTFS), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(
        ["docker", "import", "--change", 'CMD ["/bin/bash"]', "--change", "ENV LANG=C.UTF-8", "-", STANDIN_IMAGE],
        stdin=tar.stdout,
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "DOCKER_HOST": DOCKER_HOST},
    )
    tar.wait()
    return STANDIN_IMAGE


def fetch_wheels() -> None:
    """Every wheel of the lock into deploy/wheels, through the host's pip (which finds the
    CPU torch on this disk), so the image build downloads nothing (WHEELS_ONLY=1)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as requirements:
        # Markers dropped: the image's Python may need what the host's does not.
        lines = [line.split(";")[0].strip() for line in LOCK.read_text().splitlines()]
        requirements.write("\n".join(line for line in lines if line and not line.startswith("#")) + "\n")
        requirements.write("grpcio-tools==1.80.1\n")
        requirements.flush()
        subprocess.run(
            [
                str(VENV_BIN / "pip"),
                "download",
                "--quiet",
                "--only-binary=:all:",
                "--no-deps",
                "-d",
                str(WHEELS),
                "-r",
                requirements.name,
            ],
            check=True,
            stderr=subprocess.DEVNULL,
        )


# ---- compose ---------------------------------------------------------------------------


def compose_command() -> list[str]:
    """Compose v2 (the docker CLI plugin) where it works, else docker-compose v1."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("neither `docker compose` nor docker-compose is installed")


def merged_config(cli: list[str]) -> Path:
    """compose.yaml with compose.host.yaml over it, as the Compose CLI merges them, less the
    published ports of services on the host's network: meaningless there (Compose v2 drops
    them with a warning), and refused by docker-compose v1, which cannot unset a list that
    compose.yaml sets."""
    config = yaml.safe_load(run([*cli, *COMPOSE_FILES, "config"]))
    for service in config["services"].values():
        if service.get("network_mode") == "host":
            service.pop("ports", None)
    MERGED.write_text(yaml.safe_dump(config, sort_keys=False))
    return MERGED


def container_id(compose: list[str], service: str) -> str:
    return run([*compose, "ps", "-q", service]).strip()


def networks() -> set[str]:
    return set(run(["docker", "network", "ls", "--format", "{{.Name}}"]).split())


def check_bad_input() -> None:
    """A container missing a setting, or whose dependency does not answer, says which in
    one line and exits non-zero (never a half-started service)."""
    coordinator = {
        "UNICRON_COORDINATOR_BIND": "127.0.0.1:17951",
        "UNICRON_COORDINATOR_PLANNERS": "127.0.0.1:17961",
        "UNICRON_COORDINATOR_PLAINTEXT": "true",
    }
    agent = {"UNICRON_AGENT_BIND": "127.0.0.1:17971", "UNICRON_AGENT_PLAINTEXT": "true"}
    unreachable = {"UNICRON_DEPENDENCY_TIMEOUT_S": "2"}
    cases = [
        ("coordinator without its Redis URL", "coordinator", coordinator, 2, "UNICRON_COORDINATOR_REDIS_URL"),
        (
            "coordinator whose Redis does not answer",
            "coordinator",
            {**coordinator, **unreachable, "UNICRON_COORDINATOR_REDIS_URL": "redis://127.0.0.1:17979/0"},
            69,
            "redis unreachable",
        ),
        (
            "agent whose coordinator does not answer",
            "agent",
            {**agent, **unreachable, "UNICRON_AGENT_COORDINATOR": "127.0.0.1:17951"},
            69,
            "coordinator unreachable",
        ),
    ]
    for what, role, env, code, text in cases:
        settings = [arg for name, value in env.items() for arg in ("-e", f"{name}={value}")]
        argv = ["docker", "run", "--rm", "--network", "host", *settings, IMAGE, role]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, env={**os.environ, "DOCKER_HOST": DOCKER_HOST}
        )
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        if done.returncode != code or len(lines) != 1 or text not in lines[0]:
            raise AssertionError(f"{what}: exit {done.returncode}, output {lines}")
        say(f"bad input, {what}: exit {code}: {lines[0][:160]}")


def admin_from_the_cli_share() -> None:
    """The host's CLI and client as the stack's admin: the `certs` step's share for the CLI
    (its volume, read where the engine keeps it), named in this process's environment."""
    volume = f"{PROJECT}_certs-cli"
    place = Path(run(["docker", "volume", "inspect", "--format", "{{.Mountpoint}}", volume]).strip())
    exported = dict(
        line.removeprefix("export ").split("=", 1) for line in (place / "admin.env").read_text().splitlines() if line
    )
    for variable in ("UNICRON_TLS_CA", "UNICRON_TLS_CERT", "UNICRON_TLS_KEY"):
        os.environ[variable] = str(place / Path(exported[variable]).name)  # admin.env names the container's
    os.environ["UNICRON_TOKEN"] = exported["UNICRON_TOKEN"]
    os.environ.pop("UNICRON_PLAINTEXT", None)
    say(f"the host's CLI speaks mutual TLS as the admin (files of volume {volume})")


# ---- the job ---------------------------------------------------------------------------


def cli(*args: str) -> Any:
    """The host's `unicron` CLI, --json."""
    done = subprocess.run(
        [str(VENV_BIN / "unicron"), "--coordinator", COORDINATOR, "--json", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        raise RuntimeError(f"unicron {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def kill_trainer(compose: list[str], job_id: str) -> str:
    """SIGKILL to one of the job's trainers, found in an agent's registry of trainers."""
    script = (
        "import json, os, signal, sys\n"
        "for entry in json.load(open(sys.argv[1])):\n"
        "    if entry['job_id'] == sys.argv[2]:\n"
        "        os.kill(entry['pid'], signal.SIGKILL)\n"
        "        print(entry['rank'], entry['pid'])\n"
        "        break\n"
    )
    for service, node in (("agent-2", "node-b"), ("agent-1", "node-a")):
        registry = f"/var/lib/unicron/work/{node}/trainers.json"
        out = run(
            ["docker", "exec", container_id(compose, service), "python", "-c", script, registry, job_id], check=False
        ).strip()
        if out:
            rank, pid = out.split()
            return f"rank {rank} (pid {pid} in {service})"
    raise RuntimeError(f"no trainer of {job_id} found in the agents' registries")


def incident_trace(trace_ids: set[str]) -> list[str] | None:
    """The operations of an incident's trace (one of trace_ids) in the viewer, once it
    holds its root span."""
    try:
        with urllib.request.urlopen(f"{VIEWER}/api/traces?service=unicron-coordinator", timeout=5) as reply:
            traces = json.load(reply)["data"]
    except OSError:
        return None
    for trace in traces:
        operations = {span["operationName"] for span in trace["spans"]}
        if trace["traceID"] in trace_ids and "unicron.incident" in operations:
            return sorted(operations)
    return None


def job_runs_and_heals(compose: list[str]) -> dict[str, float]:
    from unicron.client import UnicronClient  # the host's package; imported once the venv is known
    from unicron.v1 import common_pb2

    timings: dict[str, float] = {}
    with UnicronClient(COORDINATOR) as client:
        timings["agents registered"] = wait(
            "two READY agents",
            lambda: sum(n.state == common_pb2.NODE_STATE_READY for n in client.nodes()) >= 2,
            120,
        )
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as spec:
            spec.write(JOB_SPEC)
            spec.flush()
            job_id = cli("submit", spec.name)["job_id"]
        say(f"submitted {job_id} from the host with `unicron submit`")

        def iteration() -> int:
            return int(client.get(job_id).progress.iteration)

        timings["first iterations"] = wait(
            f"iteration {KILL_AT_ITERATION}", lambda: iteration() >= KILL_AT_ITERATION, 300, 0.2
        )
        killed_at = iteration()
        victim = kill_trainer(compose, job_id)
        killed = time.monotonic()
        say(f"killed the trainer of {victim} at iteration {killed_at}")
        wait("an incident", lambda: bool(client.incidents(job_id)), 60, 0.2)
        timings["detected"] = time.monotonic() - killed
        wait("the job resumed", lambda: any(i.HasField("resumed") for i in client.incidents(job_id)), 180, 0.2)
        timings["resumed"] = time.monotonic() - killed
        timings["succeeded"] = wait(
            "the job's end",
            lambda: client.get(job_id).state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED),
            600,
        )
        job = client.get(job_id)
        if job.state != common_pb2.JOB_STATE_SUCCEEDED:
            raise AssertionError(f"{job_id} ended {common_pb2.JobState.Name(job.state)}: {job.reason}")
        trace_ids = {i.traceparent.split("-")[1] for i in client.incidents(job_id) if i.traceparent}
    for incident in cli("incidents", job_id):
        say(
            f"incident {incident.get('incident_id')}: {incident.get('kind')} -> {incident.get('remedy')}, "
            f"detection {incident.get('cost', {}).get('detection_seconds', 0):.2f}s, "
            f"transition {incident.get('cost', {}).get('transition_seconds', 0):.2f}s"
        )
    say(f"{job_id} SUCCEEDED after the kill (iteration {job.progress.iteration})")
    operations: list[str] | None = None

    def traced() -> bool:
        nonlocal operations
        operations = incident_trace(trace_ids)
        return operations is not None and {"unicron.incident", "detect", "resumed"} <= set(operations)

    timings["trace in viewer"] = wait("the incident's trace in the viewer", traced, 60, 1.0)
    say(f"viewer ({VIEWER}/api/traces) holds the incident's trace: {', '.join(operations or [])}")
    return timings


# ---- the whole test ----------------------------------------------------------------------


def main() -> int:
    if os.geteuid() != 0:
        print("compose-test runs its own Docker engine and needs root", file=sys.stderr)
        return 2
    teardown_on_sigterm()
    ensure_tools()
    check_ports_free()
    before = host_state()
    engine = Engine()
    compose: list[str] = []
    failed: BaseException | None = None
    timings: dict[str, float] = {}
    try:
        engine.start()
        networks_before = networks()
        if pulled(UPSTREAM_BASE) and pulled(UPSTREAM_REDIS):
            os.environ["UNICRON_BASE_IMAGE"], os.environ["UNICRON_REDIS_IMAGE"] = UPSTREAM_BASE, UPSTREAM_REDIS
        else:
            say(f"{UPSTREAM_BASE} and {UPSTREAM_REDIS} cannot be pulled: using a stand-in from Debian's packages")
            os.environ["UNICRON_BASE_IMAGE"] = os.environ["UNICRON_REDIS_IMAGE"] = standin_image()
        fetch_wheels()
        cli = compose_command()
        compose = [*cli, "-f", str(merged_config(cli))]
        say(f"{' '.join(cli)} ({run([*cli, 'version']).splitlines()[0].strip()}) accepts the files")
        start = time.monotonic()
        # One build: every Unicron service (and the receivers) runs the same image.
        run([*compose, "build", "coordinator"], timeout=1800)
        timings["build"] = time.monotonic() - start
        size = run(["docker", "images", "--format", "{{.Size}}", IMAGE]).strip()
        say(f"images built in {timings['build']:.0f}s ({IMAGE}: {size})")
        check_bad_input()
        start = time.monotonic()
        run([*compose, "up", "-d", "--no-build"], timeout=600)
        timings["up"] = time.monotonic() - start
        services = sorted(run([*compose, "ps", "--services"]).split())
        say(f"stack up in {timings['up']:.0f}s: {', '.join(services)}")
        if networks() != networks_before:
            raise AssertionError(f"compose created networks: {sorted(networks() - networks_before)}")
        admin_from_the_cli_share()
        timings.update(job_runs_and_heals(compose))
    except BaseException as exc:  # noqa: BLE001 - report, then tear down whatever happened
        failed = exc
        if compose:
            logs = run([*compose, "logs", "--no-color", "--tail", "30"], check=False, quiet=True)
            print(logs[-8000:], file=sys.stderr)
    finally:
        if compose:
            run([*compose, "down", "--volumes", "--remove-orphans", "--timeout", "20"], check=False)
        leftover_containers = run(["docker", "ps", "-aq"], check=False, quiet=True).split() if engine.proc else []
        if engine.proc:
            # Superseded builds (gigabytes each); this run's stay, for the next run's cache.
            run(["docker", "image", "prune", "--force", "--filter", "until=1h"], check=False, quiet=True)
        killed = engine.stop()
    after = host_state()
    problems = [f"{key} changed" for key in before if before[key] != after[key]]
    if leftover_containers:
        problems.append(f"containers left: {leftover_containers}")
    if killed:
        problems.append(f"had to kill: {killed}")
    say("torn down: no container, engine or network change left" if not problems else f"teardown: {problems}")
    for name, seconds in timings.items():
        say(f"  {name:<18} {seconds:6.1f}s")
    if failed is not None:
        print(f"compose-test FAILED: {type(failed).__name__}: {failed}", file=sys.stderr)
        return 1
    if problems:
        return 1
    say("compose-test PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
