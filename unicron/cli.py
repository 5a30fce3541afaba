"""`unicron`: submit and inspect jobs, list nodes and incidents, show the cluster's
efficiency. Tables for people, --json for scripts; errors are one line on stderr with a
non-zero exit code, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from unicron import failures, jobspec
from unicron.client import DEFAULT_COORDINATOR, ClientError, UnicronClient
from unicron.errors import InvalidArgument, UnicronError
from unicron.faults import FAULT_NAMES, parse_fault
from unicron.job_view import QUEUE_HEADERS, QUOTA_HEADERS, print_job, queue_row, quota_row, remedy_name, state_name
from unicron.v1 import common_pb2, job_service_pb2, logs_pb2

SIMULATE_HELP = "replay a failure trace over a modeled cluster under each recovery strategy"
EXIT_USAGE = 2
EXIT_FAILED = 1
BAD_INPUT = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
}


TERMINAL_STATES = frozenset(
    {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED}
)


def node_state_name(state: int) -> str:
    return common_pb2.NodeState.Name(state).removeprefix("NODE_STATE_").lower()


def to_json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def ago(timestamp_ns: int, now: float | None = None) -> str:
    if not timestamp_ns:
        return "-"
    seconds = max(0.0, (now or time.time()) - timestamp_ns / 1e9)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def table(rows: Sequence[Sequence[str]], headers: Sequence[str], out: TextIO) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    for row in (headers, *rows):
        out.write("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip() + "\n")


def job_row(job: common_pb2.Job) -> list[str]:
    spec = job.spec
    progress = job.progress
    placed = ",".join(f"{w.node_id}:{len(w.ranks)}" for w in job.assignment.workers) or "-"
    loss = f"{progress.loss:.4f}" if progress.iteration else "-"
    return [
        job.job_id,
        spec.name,
        state_name(job.state),
        f"{progress.iteration}/{spec.training.iterations}",
        loss,
        placed,
        ago(job.created.ToNanoseconds()),
    ]


_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def human(value: float, unit: str) -> str:
    """value with an SI prefix and three significant digits: 1.23 GFLOP/s, 45.6 TFLOP."""
    if value == 0:
        return f"0 {unit}"
    # 999.96e9 rounds to 1000 G: show it as 1.00 T instead.
    scale, prefix = next(((size, p) for size, p in _PREFIXES if abs(value) >= size * 0.9995), (1.0, ""))
    scaled = value / scale
    digits = 2 if abs(scaled) < 9.995 else 1 if abs(scaled) < 99.95 else 0
    return f"{scaled:.{digits}f} {prefix}{unit}"


def waf_seconds(cost: common_pb2.FailureCost) -> float:
    """WAF x seconds lost in all three phases (detection, transition, sub-healthy)."""
    return cost.detection_waf_seconds + cost.transition_waf_seconds + cost.sub_healthy_waf_seconds


def incident_row(incident: common_pb2.Incident) -> list[str]:
    detected = incident.detected.ToNanoseconds() / 1e9
    latency = detected - incident.first_seen.ToNanoseconds() / 1e9
    ranks = sorted({r.rank for r in incident.reports if r.HasField("rank")})
    costed = incident.HasField("resumed")
    return [
        incident.incident_id,
        incident.job_id or "-",
        failures.kind_name(incident.kind),
        failures.severity_name(incident.severity),
        time.strftime("%H:%M:%S", time.localtime(detected)),
        f"{latency:.2f}s",
        f"{len(incident.reports)} ({','.join(map(str, ranks)) or 'node'})",
        incident.recommended_action,
        incident.action_taken or "-",
        remedy_name(incident.remedy),
        f"{incident.cost.transition_seconds:.2f}s" if costed else "-",
        human(waf_seconds(incident.cost), "FLOP") if costed else "-",
    ]


# LATENCY is the detection time (first sign -> classified report); TRANSITION and COST
# (WAF-seconds lost, i.e. weighted FLOP) are known once the job resumed.
INCIDENT_HEADERS = [
    "ID",
    "JOB",
    "KIND",
    "SEV",
    "DETECTED",
    "LATENCY",
    "REPORTS (RANKS)",
    "FIRST ACTION",
    "TAKEN",
    "REMEDY",
    "TRANSITION",
    "COST",
]

CLUSTER_HEADERS = ["NAME", "STATE", "WEIGHT", "SLOTS", "FLOP/S", "WAF", "INCIDENTS", "COST"]


def print_cluster(cluster: job_service_pb2.GetClusterResponse, out: TextIO) -> None:
    out.write(f"nodes      {cluster.nodes_ready} ready, {cluster.nodes_lost} lost\n")
    out.write(f"slots      {cluster.slots_used}/{cluster.slots_total} used\n")
    out.write(f"WAF        {human(cluster.waf, 'FLOP/s')} (weighted achieved FLOP/s)\n")
    plural = "" if cluster.incidents == 1 else "s"
    out.write(
        f"failures   {cluster.incidents} incident{plural}, "
        f"{human(cluster.failure_waf_seconds, 'FLOP')} lost (WAF-seconds)\n"
    )
    if not cluster.jobs:
        out.write("jobs       none active or recent\n")
        return
    out.write("\n")
    rows = [
        [
            j.name,
            state_name(j.state),
            f"{j.weight:g}",
            str(j.slots),
            human(j.flops_per_second, "FLOP/s") if j.flops_per_second else "-",
            human(j.waf, "FLOP/s") if j.waf else "-",
            str(j.incidents),
            human(j.failure_waf_seconds, "FLOP") if j.incidents else "-",
        ]
        for j in cluster.jobs
    ]
    table(rows, CLUSTER_HEADERS, out)


JOB_HEADERS = ["ID", "NAME", "STATE", "ITERATION", "LOSS", "PLACEMENT", "SUBMITTED"]


class ProgressView:
    """A progress bar on a terminal; one line per event elsewhere (logs, CI)."""

    def __init__(self, out: TextIO, width: int = 30) -> None:
        self._out = out
        self._tty = out.isatty()
        self._width = width
        self._bar_shown = False

    def progress(self, event: common_pb2.JobEvent, total: int) -> None:
        p = event.progress
        rate = f"{1 / p.iteration_seconds:.2f} it/s" if p.iteration_seconds > 0 else ""
        extra = f" lr {p.learning_rate:.3g}" if p.learning_rate else ""
        if p.HasField("grad_norm"):
            extra += f" gnorm {p.grad_norm:.3g}"
        if p.validation_iteration == p.iteration and p.iteration:
            extra += f" val {p.validation_loss:.4f}"
        text = f"{p.iteration}/{total} loss {p.loss:.4f}{extra} {rate}".rstrip()
        if not self._tty:
            self._out.write(f"  iteration {text}\n")
            self._out.flush()
            return
        done = int(self._width * p.iteration / max(total, 1))
        self._out.write(f"\r  [{'#' * done}{'.' * (self._width - done)}] {text}   ")
        self._out.flush()
        self._bar_shown = True

    def line(self, text: str) -> None:
        if self._bar_shown:
            self._out.write("\n")
            self._bar_shown = False
        self._out.write(text + "\n")
        self._out.flush()


@dataclass
class WatchResult:
    final_state: int = common_pb2.JOB_STATE_UNSPECIFIED
    first_loss: float | None = None
    last_loss: float | None = None


def follow(client: UnicronClient, job_id: str, out: TextIO, as_json: bool) -> WatchResult:
    """Shows a job's events until it ends."""
    view = ProgressView(out)
    total = 0
    result = WatchResult()
    for event in client.watch(job_id):
        if as_json:
            out.write(json.dumps(to_json(event)) + "\n")
            out.flush()
        if event.type == common_pb2.JOB_EVENT_TYPE_SNAPSHOT:
            total = event.job.spec.training.iterations
            if not as_json:
                line = f"watching {event.job.job_id} ({event.job.spec.name}): {state_name(event.state)}"
                if event.state in TERMINAL_STATES and event.job.reason:
                    line += f" ({event.job.reason})"  # it ended before: say why, once
                view.line(line)
        elif event.type == common_pb2.JOB_EVENT_TYPE_PROGRESS:
            if result.first_loss is None:
                result.first_loss = event.progress.loss
            result.last_loss = event.progress.loss
            if not as_json:
                view.progress(event, total)
        elif not as_json:
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time.ToNanoseconds() / 1e9))
            view.line(f"{stamp}  {state_name(event.state):<10} {event.message}")
        result.final_state = event.state
    return result


def watch_job(client: UnicronClient, job_id: str, out: TextIO, as_json: bool) -> int:
    """Follows a job to its end; exit code 0 only if it succeeded."""
    result = follow(client, job_id, out, as_json)
    return 0 if result.final_state == common_pb2.JOB_STATE_SUCCEEDED else EXIT_FAILED


def build_parser(simulate: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unicron", description="Self-healing workload manager for LLM training.")
    parser.add_argument(
        "--coordinator",
        default=os.environ.get("UNICRON_COORDINATOR", DEFAULT_COORDINATOR),
        help="coordinator host:port (env UNICRON_COORDINATOR, default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    submit = sub.add_parser("submit", help="submit a job from a YAML spec")
    submit.add_argument("spec", help="path to the job spec (YAML)")
    submit.add_argument("--watch", action="store_true", help="follow the job until it ends")
    sub.add_parser("jobs", help="list jobs")
    sub.add_parser(
        "queue",
        help="the waiting jobs in the order the planner prefers them (heavier class first, then the longer"
        " waiting), each with what it waits for",
    )
    sub.add_parser("quota", help="each team's quota: its guarantee, what it may borrow, what it holds and borrows")
    for name, text in (("get", "show one job"), ("watch", "follow a job until it ends")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("job", help="job id or name")
    cancel = sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job", help="job id or name")
    cancel.add_argument("--reason", default="", help="recorded in the job's history")
    sub.add_parser("nodes", help="list nodes")
    drain = sub.add_parser(
        "drain",
        help="admins: move a node's ranks off (the cheapest transition) and give it no new ones",
        description="Not a failure: no incident, no failure cost. Refused, with nothing moved, "
        "when a job on the node would have nowhere to run. `unicron uncordon NODE` returns it.",
    )
    drain.add_argument("node", help="node id")
    uncordon = sub.add_parser(
        "uncordon",
        help="admins: return a drained node, or an isolated one once repaired, to service",
        description="A node isolated after a SEV1 fault (or cut off from a job's peers) stays out of "
        "every plan until its agent registers again; uncordon is the operator's word that it is "
        "repaired, without restarting the agent.",
    )
    uncordon.add_argument("node", help="node id")
    sub.add_parser("cluster", help="show the cluster's efficiency: slots, WAF per job, what failures cost")
    incidents = sub.add_parser("incidents", help="list failure incidents")
    incidents.add_argument("job", nargs="?", default="", help="only this job's (id or name)")
    inject = sub.add_parser(
        "inject",
        help="inject a fault into a running job (its agents must run with --fault-injection)",
        description="FAULT is kind[:arg][@step]: "
        + ", ".join(FAULT_NAMES)
        + "; e.g. crash@5, exception:illegal_memory_access, slow:0.5, hang.",
    )
    inject.add_argument("job", help="job id or name")
    inject.add_argument("fault", help="what to inject, e.g. crash@5 or exception:ecc_error")
    inject.add_argument("--rank", type=int, default=0, help="rank that misbehaves (default 0)")
    logs = sub.add_parser(
        "logs",
        help="show what a rank of a job printed, read from its node",
        description="The rank's stdout is printed on stdout, its stderr on stderr. A job that ended "
        "shows its last assignment's ranks.",
    )
    logs.add_argument("job", help="job id or name")
    logs.add_argument("--rank", type=int, default=0, help="global rank (default 0)")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing what it writes until its process exits"
    )
    logs.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N lines of each stream")
    logs.add_argument("--stream", choices=sorted(LOG_STREAMS), default="all", help="which output (default all)")
    if simulate:
        from unicron_sim import cli as simulate_cli

        simulate_cli.add_parser(sub, SIMULATE_HELP)
    else:
        # The simulator loads the planner and the solver: only `unicron simulate` pays for it.
        sub.add_parser("simulate", help=SIMULATE_HELP, add_help=False)
    certs = sub.add_parser(
        "certs",
        help="create a development CA, certificates and tokens (not for production)",
        description="Writes ca.pem, a certificate per service, node and user and for Redis and the "
        "OpenTelemetry collector, tokens.yaml (the "
        "coordinator's --tokens-file), join-token and <user>.env (source it to use the CLI). An "
        "existing CA and tokens are kept.",
    )
    certs.add_argument("--out", default="run/certs", help="directory (default %(default)s)")
    certs.add_argument("--nodes", default=socket.gethostname(), help="node ids, comma-separated (default %(default)s)")
    certs.add_argument(
        "--users", default="admin:admin", help="users, name[:admin], comma-separated (default %(default)s)"
    )
    certs.add_argument("--hosts", default="", help="more host names or IPs the services answer on, comma-separated")
    return parser


def make_certs(args: argparse.Namespace, out: TextIO) -> int:
    from pathlib import Path

    from unicron.certs import create_dev_pki, parse_users

    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    pki = create_dev_pki(Path(args.out), nodes=nodes, users=parse_users(args.users), hosts=hosts)
    d = pki.directory
    out.write(f"wrote a development CA and certificates to {d}\n")
    out.write(f"  coordinator: --tls-ca {pki.ca} --tls-cert {d}/coordinator.pem --tls-key {d}/coordinator-key.pem\n")
    out.write(f"               --tokens-file {pki.tokens_file}\n")
    out.write(f"  planner:     --tls-ca {pki.ca} --tls-cert {d}/planner.pem --tls-key {d}/planner-key.pem\n")
    redis, collector = pki.backends["redis"], pki.backends["otel-collector"]
    out.write(f"  redis:       --tls-ca-cert-file {pki.ca} --tls-cert-file {redis.cert} --tls-key-file {redis.key}\n")
    out.write(f"  otel collector (receiver tls): client_ca_file {pki.ca}, cert_file {collector.cert},\n")
    out.write(f"               key_file {collector.key}\n")
    for node, leaf in pki.nodes.items():
        out.write(f"  agent {node}: --node-id {node} --tls-ca {pki.ca} --tls-cert {leaf.cert} --tls-key {leaf.key}\n")
    for user in pki.clients:
        out.write(f"  CLI as {user}: source {d}/{user}.env\n")
    return 0


def _listing(
    items: Sequence[Message], rows: list[list[str]], headers: list[str], args: argparse.Namespace, out: TextIO
) -> int:
    if args.json:
        out.write(json.dumps([to_json(i) for i in items]) + "\n")
    else:
        table(rows, headers, out)
    return 0


def _one(item: Message, text: Callable[[], object], args: argparse.Namespace, out: TextIO) -> int:
    out.write(json.dumps(to_json(item)) + "\n") if args.json else text()
    return 0


def _submit(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    job = client.submit(jobspec.normalized(jobspec.load_spec_file(args.spec)))
    if args.json and not args.watch:
        out.write(json.dumps(to_json(job)) + "\n")
    elif not args.json:
        out.write(f"submitted {job.job_id} ({job.spec.name})\n")
    return watch_job(client, job.job_id, out, args.json) if args.watch else 0


def _jobs(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    jobs = client.list_jobs()
    return _listing(jobs, [job_row(j) for j in jobs], JOB_HEADERS, args, out)


def _queue(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    entries = client.queue()
    if not entries and not args.json:
        out.write("no job is waiting\n")
        return 0
    return _listing(entries, [queue_row(e) for e in entries], QUEUE_HEADERS, args, out)


def _quota(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    reply = client.quotas()
    if not reply.teams and not args.json:
        out.write("no team quotas on this cluster\n")
        return 0
    code = _listing(list(reply.teams), [quota_row(t) for t in reply.teams], QUOTA_HEADERS, args, out)
    if not args.json:
        promised = sum(t.guarantee for t in reply.teams)
        out.write(f"guarantees: {promised} of the cluster's {reply.cluster_slots} healthy slots\n")
    return code


def _get(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    job = client.get(args.job)
    return _one(job, lambda: print_job(job, out), args, out)


def _cancel(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    job = client.cancel(args.job, args.reason)
    return _one(job, lambda: out.write(f"cancelled {job.job_id}\n"), args, out)


def _incidents(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    found = client.incidents(args.job)
    return _listing(found, [incident_row(i) for i in found], INCIDENT_HEADERS, args, out)


def _inject(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    if args.rank < 0:
        raise InvalidArgument("rank", "must not be negative")
    node = client.inject(args.job, parse_fault(args.fault, args.rank))
    out.write(json.dumps({"node_id": node}) + "\n") if args.json else out.write(
        f"sent {args.fault} for rank {args.rank} to {node}\n"
    )
    return 0


LOG_STREAMS = {
    "all": (),
    "stdout": (logs_pb2.LOG_STREAM_STDOUT,),
    "stderr": (logs_pb2.LOG_STREAM_STDERR,),
}


def _logs(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    if args.rank < 0:
        raise InvalidArgument("rank", "must not be negative")
    if args.tail is not None and args.tail < 0:
        raise InvalidArgument("tail", "must not be negative")
    try:
        for chunk in client.logs(args.job, args.rank, args.follow, args.tail, LOG_STREAMS[args.stream]):
            if args.json:
                name = logs_pb2.LogStream.Name(chunk.stream).removeprefix("LOG_STREAM_").lower()
                out.write(json.dumps({"stream": name, "text": chunk.data.decode(errors="replace")}) + "\n")
                out.flush()
            else:
                write_bytes(sys.stderr if chunk.stream == logs_pb2.LOG_STREAM_STDERR else out, chunk.data)
    except BrokenPipeError:
        # `unicron logs JOB | head`: the reader has what it wanted. Python's own flush at
        # exit would fail the same way, and print a traceback for it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def write_bytes(stream: TextIO, data: bytes) -> None:
    """The bytes as the program wrote them, where the stream has bytes underneath."""
    buffer = getattr(stream, "buffer", None)
    stream.flush()
    if buffer is None:
        stream.write(data.decode(errors="replace"))
        stream.flush()
        return
    buffer.write(data)
    buffer.flush()


def _cluster(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    cluster = client.cluster()
    return _one(cluster, lambda: print_cluster(cluster, out), args, out)


def _drain(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    node, jobs = client.drain(args.node)
    moving = f"; moving {', '.join(jobs)} off it" if jobs else "; no job runs there"
    return _one(node, lambda: out.write(f"drained {node.node_id}{moving}\n"), args, out)


def _uncordon(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    node = client.uncordon(args.node)
    return _one(node, lambda: out.write(f"uncordoned {node.node_id}: it takes ranks again\n"), args, out)


def _node_row(n: common_pb2.Node) -> list[str]:
    return [
        n.node_id,
        node_state_name(n.state) + (", drained" if n.cordoned else ""),
        ago(n.state_since.ToNanoseconds()).removesuffix(" ago") if n.HasField("state_since") else "-",
        f"{n.used_slots}/{n.slots}",
        n.address,
        n.failure_domain or "-",
        ago(n.last_heartbeat.ToNanoseconds()),
    ]


def _nodes(client: UnicronClient, args: argparse.Namespace, out: TextIO) -> int:
    nodes = client.nodes()
    headers = ["NODE", "STATE", "FOR", "SLOTS USED", "ADDRESS", "DOMAIN", "HEARTBEAT"]
    return _listing(nodes, [_node_row(n) for n in nodes], headers, args, out)


# The commands that talk to a coordinator, each (client, args, out) -> exit code.
COMMANDS: dict[str, Callable[[UnicronClient, argparse.Namespace, TextIO], int]] = {
    "submit": _submit,
    "jobs": _jobs,
    "queue": _queue,
    "quota": _quota,
    "get": _get,
    "watch": lambda client, args, out: watch_job(client, args.job, out, args.json),
    "cancel": _cancel,
    "incidents": _incidents,
    "inject": _inject,
    "cluster": _cluster,
    "nodes": _nodes,
    "logs": _logs,
    "drain": _drain,
    "uncordon": _uncordon,
}


def run(args: argparse.Namespace, out: TextIO) -> int:
    if args.command == "simulate":  # in process: no coordinator needed
        from unicron_sim import cli as simulate_cli

        return simulate_cli.run(args, out)
    if args.command == "certs":
        return make_certs(args, out)
    with UnicronClient(args.coordinator) as client:
        return COMMANDS[args.command](client, args, out)


def _lacks(exc: ModuleNotFoundError, command: str) -> int:
    """The client install (``pip install unicron``) has neither the solver nor torch: a command
    that needs them says so in one line."""
    print(f"unicron: {command} needs {exc.name}, which this install lacks: pip install 'unicron[all]'", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(simulate="simulate" in words)
    except ModuleNotFoundError as exc:
        return _lacks(exc, "simulate")
    args = parser.parse_args(words)
    try:
        return run(args, sys.stdout)
    except UnicronError as exc:
        print(f"unicron: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ClientError as exc:
        print(f"unicron: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.code in BAD_INPUT else EXIT_FAILED
    except ModuleNotFoundError as exc:
        return _lacks(exc, args.command)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader left (`unicron get ... | head`): what is left unwritten goes nowhere, and
        # Python's own flush at exit must not fail on the closed pipe with a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
