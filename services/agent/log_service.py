"""The agent's AgentLogService: the output of this node's trainers, read by the coordinator
for `unicron logs` (architecture.md, Observability).

Each worker writes its stdout and stderr to two files for life (supervisor.py); a reform
moves a rank into a worker whose files are named after an older membership, so a rank's
files are found through the supervisor's record of who was which rank (and, after the
agent restarted, by their names). A read sends what the worker wrote (the last lines of
each stream, or all), then, when following, what it writes until it exits or stops being
that rank.

Who may read: the coordinator alone (POLICY). With TLS the agent admits its certificate,
`service:coordinator`, and no other (a trainer shows no certificate, only its token).
Plaintext, a caller cannot be told apart: an agent without a join token belongs to a
cluster that authenticates no one (its coordinator registered it without credentials),
and serves logs to any caller as that coordinator would; with a join token it admits no
one here, and the coordinator says that reading logs needs TLS."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import grpc

from services.agent.supervisor import Output, Supervisor
from unicron.errors import InvalidArgument, NotFound
from unicron.rpc import grpc_errors
from unicron.security import Authenticator, Kind, Principal, TokenLookup, authenticate
from unicron.v1 import agent_service_pb2, agent_service_pb2_grpc, logs_pb2

log = logging.getLogger(__name__)

# The certificate the coordinator calls with (unicron.certs), and who it is here.
COORDINATOR_CERTIFICATE = "service:coordinator"
COORDINATOR = Principal(Kind.SERVICE, "coordinator")
# A plaintext agent without a join token: its cluster authenticates no one.
ANYONE = Principal(Kind.SERVICE, "anyone")

# A response's most bytes; well under the message limit, and what one read takes.
CHUNK_BYTES = 64 * 1024
# How often a followed worker's files are looked at.
POLL_S = 0.2
# A line still being written is sent after this long without its end (a progress bar).
PARTIAL_LINE_S = 1.0

STREAMS: tuple[logs_pb2.LogStream, ...] = (logs_pb2.LOG_STREAM_STDOUT, logs_pb2.LOG_STREAM_STDERR)
# Job ids are the coordinator's (job-<date>-<hex>); anything else never named a directory.
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_FILE_NAME = re.compile(r"gen(\d+)-rank(\d+)\.(out|err)")


def authenticator(lookup: TokenLookup, *, tls: bool, open_to_anyone: bool) -> Authenticator:
    """Trainers by their worker tokens; the coordinator by its certificate (TLS), or anyone
    without credentials where the cluster authenticates no one (see the module's text). No
    other certificate names anyone here."""

    def auth(token: str | None, common_name: str | None) -> Principal:
        if token is None and tls and common_name == COORDINATOR_CERTIFICATE:
            return COORDINATOR
        if token is None and common_name is None and open_to_anyone:
            return ANYONE
        return authenticate(token, None, lookup)

    return auth


# ---- which files ----------------------------------------------------------------------


def pick_generation(generations: Sequence[int], asked: int) -> int | None:
    """The newest generation at or before `asked` (0: the newest of all); None if none."""
    eligible = [g for g in generations if not asked or g <= asked]
    return max(eligible, default=None)


def outputs_by_name(job_dir: Path, rank: int) -> dict[int, Output]:
    """The rank's files by the names they were launched under (what is left to go by after
    the agent restarted and forgot who was which rank)."""
    found: dict[int, Output] = {}
    try:
        names = [p.name for p in job_dir.iterdir()]
    except OSError:
        return found
    for name in names:
        match = _FILE_NAME.fullmatch(name)
        if match is None or int(match.group(2)) != rank:
            continue
        generation = int(match.group(1))
        stem = job_dir / f"gen{generation}-rank{rank}"
        found[generation] = Output(Path(f"{stem}.out"), Path(f"{stem}.err"), "")
    return found


def streams_of(requested: Sequence[int]) -> tuple[logs_pb2.LogStream, ...]:
    """The streams asked for, in order (both for none); InvalidArgument for an unknown one."""
    for stream in requested:
        if stream not in STREAMS:
            raise InvalidArgument("streams", f"{stream} is not LOG_STREAM_STDOUT (1) or LOG_STREAM_STDERR (2)")
    return tuple(s for s in STREAMS if s in requested) if requested else STREAMS


# ---- reading a growing file -----------------------------------------------------------


def tail_offset(f: BinaryIO, size: int, lines: int, block: int = CHUNK_BYTES) -> int:
    """Where the last `lines` lines of the file's first `size` bytes start. A last line
    without its end counts as a line; the newline that ends the file does not start one."""
    if lines <= 0:
        return size
    end = size
    if size:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            end = size - 1
    seen = 0
    position = end
    while position > 0:
        start = max(0, position - block)
        f.seek(start)
        data = f.read(position - start)
        at = len(data)
        while (at := data.rfind(b"\n", 0, at)) >= 0:
            seen += 1
            if seen == lines:
                return start + at + 1
        position = start
    return 0


def sendable(data: bytes, *, final: bool, held_s: float) -> int:
    """How much of the bytes at a file's end to send now: up to the last line's end, so that
    the two streams do not interleave mid-line; all of it when the file is done growing, or
    when the last line has waited PARTIAL_LINE_S for its end or fills a chunk."""
    if final or len(data) >= CHUNK_BYTES:
        return len(data)
    cut = data.rfind(b"\n") + 1
    if cut:
        return cut
    return len(data) if held_s >= PARTIAL_LINE_S else 0


@dataclass
class Cursor:
    """How far one stream of a worker has been sent."""

    stream: logs_pb2.LogStream
    path: Path
    offset: int = 0
    held_since: float | None = None  # when a line without its end was first held back

    def start(self, tail_lines: int | None) -> None:
        """From the last `tail_lines` lines written so far; None: from the start."""
        if tail_lines is None:
            return
        try:
            with open(self.path, "rb") as f:
                self.offset = tail_offset(f, f.seek(0, 2), tail_lines)
        except OSError:
            pass  # not written yet: a spare's handover creates it

    def chunks(self, *, final: bool, now: float) -> Iterator[bytes]:
        """What was written since the last call, in pieces of at most CHUNK_BYTES."""
        try:
            f = open(self.path, "rb")
        except OSError:
            return
        with f:
            size = f.seek(0, 2)
            f.seek(self.offset)
            while self.offset < size:
                data = f.read(min(CHUNK_BYTES, size - self.offset))
                if not data:
                    return
                at_end = self.offset + len(data) >= size
                held_s = now - self.held_since if self.held_since is not None else 0.0
                take = sendable(data, final=final or not at_end, held_s=held_s)
                if take == 0:  # the same unfinished line as before, or a first look at it
                    if self.held_since is None:
                        self.held_since = now
                    return
                self.offset += take
                # What is left is a line begun after the last line's end: held from now.
                self.held_since = now if take < len(data) else None
                yield data[:take]
                if take < len(data):
                    return


# ---- the service -----------------------------------------------------------------------


class LogService(agent_service_pb2_grpc.AgentLogServiceServicer):
    """Serves ReadLogs on the agent's (threaded) server: a followed read holds a thread,
    which the guard's cap on open streams bounds."""

    def __init__(
        self,
        supervisor: Supervisor,
        node_id: str,
        work_dir: Path,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._supervisor = supervisor
        self._node_id = node_id
        self._work_dir = work_dir
        self._poll_s = poll_s
        self._clock = clock

    def locate(self, job_id: str, rank: int, generation: int) -> Output:
        """Where the worker of `rank` at `generation` (see ReadLogsRequest) writes."""
        if not _JOB_ID.fullmatch(job_id) or ".." in job_id:
            raise InvalidArgument("job_id", f"{job_id!r} is not a job id")
        known: Mapping[int, Output] = {
            **outputs_by_name(self._work_dir / job_id, rank),
            **self._supervisor.outputs(job_id, rank),
        }
        chosen = pick_generation(list(known), generation)
        if chosen is None:
            raise NotFound(f"rank {rank} of job {job_id} has written nothing on node {self._node_id}")
        return known[chosen]

    def _running_as(self, output: Output, job_id: str, rank: int) -> bool:
        """Whether the worker still runs as this rank of this job (a resize may renumber it)."""
        key = self._supervisor.current_key(output.worker_id) if output.worker_id else None
        return key is not None and key.job_id == job_id and key.rank == rank

    @grpc_errors
    def ReadLogs(
        self, request: agent_service_pb2.ReadLogsRequest, context: grpc.ServicerContext
    ) -> Iterator[agent_service_pb2.ReadLogsResponse]:
        streams = streams_of(list(request.streams))
        output = self.locate(request.job_id, request.rank, request.generation)
        paths = {logs_pb2.LOG_STREAM_STDOUT: output.out_path, logs_pb2.LOG_STREAM_STDERR: output.err_path}
        cursors = [Cursor(stream, paths[stream]) for stream in streams]
        tail = request.tail_lines if request.HasField("tail_lines") else None
        for cursor in cursors:
            cursor.start(tail)
        following = request.follow
        while True:
            # Looked at before reading: what a worker wrote before it exited is all there.
            live = following and self._running_as(output, request.job_id, request.rank)
            now = self._clock()
            for cursor in cursors:
                for data in cursor.chunks(final=not live, now=now):
                    yield agent_service_pb2.ReadLogsResponse(chunk=logs_pb2.LogChunk(stream=cursor.stream, data=data))
            if not live or not context.is_active():
                return
            time.sleep(self._poll_s)
