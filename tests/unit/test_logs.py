"""`unicron logs` without servers: where a rank's output is (the coordinator's `locate`, the
agent's choice of a worker's files), reading a growing file (tails, whole lines, a line
still being written), who the agent lets read, and what the CLI prints."""

from __future__ import annotations

import io
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.agent import log_service
from services.agent.log_service import Cursor, LogService, pick_generation, sendable, tail_offset
from services.agent.supervisor import Output, Supervisor, WorkerExit, WorkerKey
from services.coordinator import logs
from unicron import cli
from unicron.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated, Unavailable
from unicron.security import Kind, WorkerTokens, worker_name
from unicron.v1 import agent_service_pb2, common_pb2, job_service_pb2, logs_pb2

OUT, ERR = logs_pb2.LOG_STREAM_STDOUT, logs_pb2.LOG_STREAM_STDERR


# ---- the coordinator: which node --------------------------------------------------------


def placed_job(world: int = 4) -> common_pb2.Job:
    job = common_pb2.Job(job_id="job-1")
    job.assignment.generation = 3
    job.assignment.world_size = world
    job.assignment.workers.add(node_id="n1", ranks=[0, 1], address="10.0.0.1:7001")
    job.assignment.workers.add(node_id="n2", ranks=[2, 3], address="10.0.0.2:7002")
    return job


def test_locate_finds_the_rank_s_node_and_generation() -> None:
    source = logs.locate(placed_job(), 2)
    assert (source.node_id, source.address, source.generation, source.rank) == ("n2", "10.0.0.2:7002", 3, 2)


def test_a_rank_outside_the_world_is_invalid_argument_naming_rank() -> None:
    with pytest.raises(InvalidArgument) as refused:
        logs.locate(placed_job(world=4), 4)
    assert refused.value.field == "rank" and "world size 4" in str(refused.value)


def test_a_job_never_placed_has_no_logs_yet() -> None:
    with pytest.raises(FailedPrecondition, match="not been placed"):
        logs.locate(common_pb2.Job(job_id="job-1"), 0)


def test_the_node_s_current_address_wins_and_none_is_unavailable() -> None:
    source = logs.locate(placed_job(), 0)
    moved = logs.at_current_address(source, common_pb2.Node(node_id="n1", address="10.0.0.9:7009"))
    assert moved.address == "10.0.0.9:7009"
    assert logs.at_current_address(source, None).address == "10.0.0.1:7001"
    with pytest.raises(Unavailable, match=r"^node n1 "):
        logs.at_current_address(logs.LogSource("job-1", 0, "n1", "", 3), None)


def test_the_agent_request_carries_the_generation_and_the_tail_only_when_set() -> None:
    source = logs.locate(placed_job(), 1)
    read = logs.agent_request(source, job_service_pb2.StreamLogsRequest(job_id="name", rank=1, follow=True))
    assert (read.job_id, read.rank, read.generation, read.follow) == ("job-1", 1, 3, True)
    assert not read.HasField("tail_lines") and list(read.streams) == [OUT, ERR]
    tail = logs.agent_request(source, job_service_pb2.StreamLogsRequest(tail_lines=0, streams=[ERR]))
    assert tail.HasField("tail_lines") and tail.tail_lines == 0 and list(tail.streams) == [ERR]
    with pytest.raises(InvalidArgument) as refused:
        logs.agent_request(source, job_service_pb2.StreamLogsRequest(streams=[7]))  # type: ignore[list-item]
    assert refused.value.field == "streams"


@pytest.mark.parametrize(
    ("code", "details", "error", "text"),
    [
        (grpc.StatusCode.NOT_FOUND, "rank 1 of job-1 has written nothing", NotFound, "rank 1 of job-1"),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect", Unavailable, "node n1 (10.0.0.1:7001) is unreachable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", Unavailable, "node n1 (10.0.0.1:7001) is unreachable"),
        (grpc.StatusCode.UNAUTHENTICATED, "no credentials", FailedPrecondition, "needs TLS"),
        (grpc.StatusCode.INVALID_ARGUMENT, "job_id: 'x' is not a job id", InvalidArgument, "job_id: "),
        (grpc.StatusCode.INTERNAL, "boom", Unavailable, "node n1 (10.0.0.1:7001) did not serve"),
    ],
)
def test_what_the_caller_hears_of_an_agent_s_error(
    code: grpc.StatusCode, details: str, error: type[Exception], text: str
) -> None:
    made = logs.agent_error(logs.locate(placed_job(), 1), code, details)
    assert isinstance(made, error) and text in str(made)


# ---- the agent: which files ------------------------------------------------------------


@pytest.mark.parametrize(
    ("generations", "asked", "chosen"),
    [([1, 3, 5], 0, 5), ([1, 3, 5], 4, 3), ([1, 3, 5], 3, 3), ([3], 2, None), ([], 0, None)],
)
def test_pick_generation(generations: list[int], asked: int, chosen: int | None) -> None:
    assert pick_generation(generations, asked) == chosen


def test_files_are_found_by_name_once_the_agent_forgot(tmp_path: Path) -> None:
    for name in ("gen1-rank0.out", "gen1-rank0.err", "gen2-rank0.err", "gen2-rank1.out", "notes.txt"):
        (tmp_path / name).write_text("")
    found = log_service.outputs_by_name(tmp_path, 0)
    assert sorted(found) == [1, 2] and found[2].out_path == tmp_path / "gen2-rank0.out"
    assert log_service.outputs_by_name(tmp_path / "missing", 0) == {}


# ---- reading a growing file -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "lines", "tail"),
    [
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc", 2, b"b\nc"),
        (b"a\nb\nc\n", 5, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 0, b""),
        (b"", 3, b""),
        (b"\n\n", 1, b"\n"),
        (b"x" * 10 + b"\n" + b"y" * 10 + b"\n", 1, b"y" * 10 + b"\n"),
    ],
)
def test_tail_offset(text: bytes, lines: int, tail: bytes) -> None:
    for block in (3, 1024):  # lines across the blocks read backwards, and within one
        assert text[tail_offset(io.BytesIO(text), len(text), lines, block=block) :] == tail


def test_sendable_keeps_a_line_being_written_for_a_while() -> None:
    assert sendable(b"a\nb", final=False, held_s=0.0) == 2
    assert sendable(b"partial", final=False, held_s=0.0) == 0
    assert sendable(b"partial", final=False, held_s=log_service.PARTIAL_LINE_S) == 7
    assert sendable(b"partial", final=True, held_s=0.0) == 7
    assert sendable(b"x" * log_service.CHUNK_BYTES, final=False, held_s=0.0) == log_service.CHUNK_BYTES


def test_a_cursor_sends_whole_lines_in_chunks_and_the_rest_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "gen1-rank0.out"
    cursor = Cursor(OUT, path)
    assert list(cursor.chunks(final=False, now=0.0)) == []  # not written yet
    big = b"".join(b"line %06d\n" % i for i in range(20_000))  # over three chunks
    path.write_bytes(big + b"progress 10%")
    sent = list(cursor.chunks(final=False, now=0.0))
    assert b"".join(sent) == big and max(map(len, sent)) <= log_service.CHUNK_BYTES
    assert list(cursor.chunks(final=False, now=0.5)) == []  # the last line, held since 0.0
    assert b"".join(cursor.chunks(final=False, now=log_service.PARTIAL_LINE_S)) == b"progress 10%"
    with path.open("ab") as f:
        f.write(b" 20%")
    assert list(cursor.chunks(final=False, now=2.0)) == []
    with path.open("ab") as f:
        f.write(b"\nlast")
    assert b"".join(cursor.chunks(final=False, now=2.1)) == b" 20%\n"
    assert b"".join(cursor.chunks(final=True, now=2.1)) == b"last"


def test_a_cursor_starts_at_the_tail(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"1\n2\n3\n")
    tailed, empty, whole = Cursor(OUT, path), Cursor(OUT, path), Cursor(OUT, path)
    tailed.start(2)
    empty.start(0)
    whole.start(None)
    assert [b"".join(c.chunks(final=True, now=0)) for c in (tailed, empty, whole)] == [b"2\n3\n", b"", b"1\n2\n3\n"]


# ---- the agent's service, over a real supervisor ---------------------------------------


def printer(count: int) -> list[str]:
    """A trainer that prints `count` numbered lines on each stream, then waits to be stopped."""
    lines = f"for i in range({count}): print('out', i, flush=True); print('err', i, file=sys.stderr, flush=True)"
    return [sys.executable, "-c", f"import sys, time\n{lines}\ntime.sleep(60)"]


class Context:
    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    exits: list[WorkerExit] = []
    made = Supervisor(tmp_path, exits.append)
    yield made
    made.stop(grace_s=1.0)


def wait_written(path: Path, text: bytes) -> None:
    deadline = time.monotonic() + 20
    while text not in (path.read_bytes() if path.exists() else b""):
        assert time.monotonic() < deadline, f"{path} never had {text!r}"
        time.sleep(0.02)


def read(service: LogService, context: Context | None = None, **fields: Any) -> list[tuple[int, bytes]]:
    request = agent_service_pb2.ReadLogsRequest(**fields)
    return [(r.chunk.stream, r.chunk.data) for r in service.ReadLogs(request, context or Context())]


def joined(chunks: list[tuple[int, bytes]], stream: int) -> bytes:
    return b"".join(data for s, data in chunks if s == stream)


def test_a_rank_s_output_is_its_worker_s_through_a_reform(supervisor: Supervisor, tmp_path: Path) -> None:
    service = LogService(supervisor, "n1", tmp_path, poll_s=0.01)
    supervisor.launch(WorkerKey("job-1", 1, 0), printer(0), {}, spare=False)
    supervisor.launch(WorkerKey("job-1", 1, 1), printer(3), {}, spare=False)
    wait_written(tmp_path / "job-1" / "gen1-rank1.err", b"err 2")
    # A resize: the worker of rank 1 becomes rank 0 of generation 2 (its files keep their names).
    assert supervisor.rekey(WorkerKey("job-1", 1, 1), WorkerKey("job-1", 2, 0))
    chunks = read(service, job_id="job-1", rank=0, generation=2)
    assert joined(chunks, OUT) == b"out 0\nout 1\nout 2\n" and joined(chunks, ERR) == b"err 0\nerr 1\nerr 2\n"
    assert [s for s, _ in chunks] == sorted(s for s, _ in chunks)  # stdout first, then stderr
    # Generation 0 means the newest; an older generation reads the worker that was the rank then.
    assert joined(read(service, job_id="job-1", rank=0), OUT) == b"out 0\nout 1\nout 2\n"
    assert joined(read(service, job_id="job-1", rank=0, generation=1), OUT) == b""
    assert joined(read(service, job_id="job-1", rank=1, generation=5, tail_lines=1), ERR) == b"err 2\n"
    assert read(service, job_id="job-1", rank=1, streams=[ERR], tail_lines=0) == []


def test_follow_sends_new_lines_until_the_worker_exits(supervisor: Supervisor, tmp_path: Path) -> None:
    service = LogService(supervisor, "n1", tmp_path, poll_s=0.01)
    key = WorkerKey("job-1", 1, 0)
    supervisor.launch(key, printer(0), {}, spare=False)
    worker = supervisor.worker(key)
    assert worker is not None
    out = tmp_path / "job-1" / "gen1-rank0.out"  # written here as the worker would
    received: list[tuple[int, bytes]] = []
    done = threading.Event()

    def follow() -> None:
        request = agent_service_pb2.ReadLogsRequest(job_id="job-1", rank=0, follow=True, streams=[OUT])
        for reply in service.ReadLogs(request, Context()):
            received.append((reply.chunk.stream, reply.chunk.data))
        done.set()

    threading.Thread(target=follow, daemon=True).start()
    with out.open("ab") as f:
        for i in range(3):
            f.write(b"fed %d\n" % i)
            f.flush()
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while joined(received, OUT) != b"fed 0\nfed 1\nfed 2\n":
        assert time.monotonic() < deadline, received
        time.sleep(0.02)
    assert not done.is_set()  # still following
    with out.open("ab") as f:
        f.write(b"unfinished")
    worker.proc.kill()
    assert done.wait(10), "the read did not end with the worker"
    assert joined(received, OUT).endswith(b"fed 2\nunfinished")


def test_a_cancelled_follow_ends(supervisor: Supervisor, tmp_path: Path) -> None:
    service = LogService(supervisor, "n1", tmp_path, poll_s=0.01)
    supervisor.launch(WorkerKey("job-1", 1, 0), printer(1), {}, spare=False)
    context = Context()
    replies = service.ReadLogs(
        agent_service_pb2.ReadLogsRequest(job_id="job-1", rank=0, follow=True),
        context,
    )
    wait_written(tmp_path / "job-1" / "gen1-rank0.err", b"err 0")
    first = next(replies)
    assert first.chunk.data
    context.active = False
    assert len(list(replies)) <= 1  # at most what was already read


@pytest.mark.parametrize("job_id", ["../etc", "..", "a/b", "", "job-1/../../x", "x" * 200])
def test_a_path_for_a_job_id_is_invalid_argument(supervisor: Supervisor, tmp_path: Path, job_id: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        LogService(supervisor, "n1", tmp_path).locate(job_id, 0, 0)
    assert refused.value.field == "job_id"


def test_no_output_is_not_found(supervisor: Supervisor, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="rank 3 of job job-9 has written nothing on node n1"):
        LogService(supervisor, "n1", tmp_path).locate("job-9", 3, 0)


def test_an_unknown_stream_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument) as refused:
        log_service.streams_of([OUT, 9])
    assert refused.value.field == "streams"
    assert log_service.streams_of([ERR, OUT]) == (OUT, ERR)


# ---- who may read ----------------------------------------------------------------------


def test_the_agent_admits_the_coordinator_s_certificate_alone() -> None:
    tokens = WorkerTokens()
    auth = log_service.authenticator(tokens.lookup, tls=True, open_to_anyone=False)
    assert auth(None, "service:coordinator") == log_service.COORDINATOR
    for name in ("service:planner", "node:n1", "client:alice", None):
        with pytest.raises(Unauthenticated):
            auth(None, name)
    trainer = auth(tokens.issue("job-1", 1, 0), "node:n1")
    assert trainer.kind == Kind.WORKER and trainer.name == worker_name("job-1", 1, 0)
    with pytest.raises(Unauthenticated):
        auth("forged", "service:coordinator")  # a bad token is not overlooked for a certificate


def test_plaintext_reads_are_open_only_where_nothing_is_authenticated() -> None:
    tokens = WorkerTokens()
    closed = log_service.authenticator(tokens.lookup, tls=False, open_to_anyone=False)
    with pytest.raises(Unauthenticated):
        closed(None, None)
    opened = log_service.authenticator(tokens.lookup, tls=False, open_to_anyone=True)
    assert opened(None, None).kind == Kind.SERVICE
    assert opened(tokens.issue("job-1", 1, 0), None).kind == Kind.WORKER


# ---- the CLI ----------------------------------------------------------------------------


class LogsClient:
    chunks: list[logs_pb2.LogChunk] = []
    asked: list[tuple[Any, ...]] = []

    def __init__(self, address: str) -> None:
        pass

    def __enter__(self) -> LogsClient:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def logs(self, *args: Any) -> Iterator[logs_pb2.LogChunk]:
        self.asked.append(args)
        yield from self.chunks


def test_the_cli_prints_each_stream_on_its_own(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    chunks = [logs_pb2.LogChunk(stream=OUT, data=b"hello\n"), logs_pb2.LogChunk(stream=ERR, data=b"caf\xc3\xa9\n")]
    monkeypatch.setattr(cli, "UnicronClient", type("Fake", (LogsClient,), {"chunks": chunks, "asked": []}))
    assert cli.main(["logs", "job-1", "--rank", "2", "--tail", "5", "-f", "--stream", "stderr"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "hello\n" and captured.err == "caf\u00e9\n"
    assert cli.UnicronClient.asked == [("job-1", 2, True, 5, (ERR,))]  # type: ignore[attr-defined]


def test_the_cli_s_json_is_text_whatever_the_bytes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    chunks = [logs_pb2.LogChunk(stream=OUT, data=b"hello\n"), logs_pb2.LogChunk(stream=ERR, data=b"bad \xff\n")]
    monkeypatch.setattr(cli, "UnicronClient", type("Fake", (LogsClient,), {"chunks": chunks, "asked": []}))
    assert cli.main(["--json", "logs", "job-1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ['{"stream": "stdout", "text": "hello\\n"}', '{"stream": "stderr", "text": "bad \\ufffd\\n"}']


@pytest.mark.parametrize(("flag", "field"), [("--rank", "rank"), ("--tail", "tail")])
def test_the_cli_refuses_negative_numbers(capsys: pytest.CaptureFixture[str], flag: str, field: str) -> None:
    assert cli.main(["logs", "job-1", flag, "-1"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == f"unicron: {field}: must not be negative\n"


def test_supervisor_outputs_are_remembered_past_the_worker(supervisor: Supervisor, tmp_path: Path) -> None:
    done = threading.Event()
    supervisor._on_exit = lambda exit: done.set()
    supervisor.launch(WorkerKey("job-1", 4, 1), printer(0), {}, spare=False)
    worker = supervisor.worker(WorkerKey("job-1", 4, 1))
    assert worker is not None and supervisor.current_key(worker.worker_id) == WorkerKey("job-1", 4, 1)
    worker.proc.kill()
    assert done.wait(10)
    assert supervisor.current_key(worker.worker_id) is None
    assert supervisor.outputs("job-1", 1) == {4: Output(worker.out_path, worker.err_path, worker.worker_id)}
    assert supervisor.outputs("job-1", 0) == {}
