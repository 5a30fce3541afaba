"""The CLI's error paths: one readable line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest

from unicron import cli, job_view
from unicron.redisutil import free_port
from unicron.v1 import common_pb2, job_service_pb2


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_unreachable_coordinator_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    code, out, err = run(capsys, "--coordinator", address, "jobs")
    assert code == cli.EXIT_FAILED
    assert err == f"unicron: cannot reach the coordinator at {address} (is it running?)\n"
    assert out == ""


def test_bad_spec_is_reported_before_any_rpc(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x\nprogram: {entry_point: 'train.py'}\n")
    code, _, err = run(capsys, "--coordinator", f"127.0.0.1:{free_port()}", "submit", str(spec))
    assert code == cli.EXIT_USAGE
    assert err.startswith("unicron: spec.program.entry_point: ") and err.count("\n") == 1


def test_missing_spec_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "submit", str(tmp_path / "nope.yaml"))
    assert code == cli.EXIT_USAGE and "cannot read" in err and "Traceback" not in err


class FakeClient:
    """Stands in for UnicronClient: canned replies, no server."""

    cluster_reply = job_service_pb2.GetClusterResponse()
    incidents_reply: list[common_pb2.Incident] = []
    nodes_reply: list[common_pb2.Node] = []
    queue_reply: list[job_service_pb2.QueueEntry] = []
    quotas_reply = job_service_pb2.ListQuotasResponse()

    def __init__(self, address: str) -> None:
        self.address = address

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def cluster(self) -> job_service_pb2.GetClusterResponse:
        return self.cluster_reply

    def incidents(self, job_id: str = "") -> list[common_pb2.Incident]:
        return self.incidents_reply

    def nodes(self) -> list[common_pb2.Node]:
        return self.nodes_reply

    def queue(self) -> list[job_service_pb2.QueueEntry]:
        return self.queue_reply

    def quotas(self) -> job_service_pb2.ListQuotasResponse:
        return self.quotas_reply


def fake(monkeypatch: pytest.MonkeyPatch, **replies: object) -> None:
    monkeypatch.setattr(cli, "UnicronClient", type("Fake", (FakeClient,), replies))


CLUSTER = job_service_pb2.GetClusterResponse(
    nodes_ready=2,
    nodes_lost=1,
    slots_total=8,
    slots_used=6,
    waf=3.6e9,
    failure_waf_seconds=45.6e9,
    incidents=3,
    jobs=[
        job_service_pb2.JobEfficiency(
            job_id="j1",
            name="gpt-big",
            state=common_pb2.JOB_STATE_RUNNING,
            weight=2,
            slots=4,
            flops_per_second=1.8e9,
            waf=3.6e9,
            failure_waf_seconds=45.6e9,
            incidents=3,
        ),
        job_service_pb2.JobEfficiency(
            job_id="j2", name="gpt-tiny", state=common_pb2.JOB_STATE_RECOVERING, weight=0.5, slots=2
        ),
    ],
)


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (0, "FLOP/s", "0 FLOP/s"),
        (512, "FLOP/s", "512 FLOP/s"),
        (1.2e9, "FLOP/s", "1.20 GFLOP/s"),
        (45.63e9, "FLOP", "45.6 GFLOP"),
        (123.4e12, "FLOP/s", "123 TFLOP/s"),
        (999.97e9, "FLOP", "1.00 TFLOP"),
    ],
)
def test_human_units(value: float, unit: str, text: str) -> None:
    assert cli.human(value, unit) == text


def test_cluster_prints_summary_and_jobs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, cluster_reply=CLUSTER)
    code, out, err = run(capsys, "cluster")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:4] == [
        "nodes      2 ready, 1 lost",
        "slots      6/8 used",
        "WAF        3.60 GFLOP/s (weighted achieved FLOP/s)",
        "failures   3 incidents, 45.6 GFLOP lost (WAF-seconds)",
    ]
    assert lines[5].split() == ["NAME", "STATE", "WEIGHT", "SLOTS", "FLOP/S", "WAF", "INCIDENTS", "COST"]
    assert lines[6].split() == [
        "gpt-big",
        "running",
        "2",
        "4",
        "1.80",
        "GFLOP/s",
        "3.60",
        "GFLOP/s",
        "3",
        "45.6",
        "GFLOP",
    ]
    assert lines[7].split() == ["gpt-tiny", "recovering", "0.5", "2", "-", "-", "0", "-"]


def test_cluster_without_jobs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, cluster_reply=job_service_pb2.GetClusterResponse(nodes_ready=1, slots_total=2, incidents=1))
    code, out, _ = run(capsys, "cluster")
    assert code == 0
    assert "failures   1 incident, 0 FLOP lost (WAF-seconds)\n" in out
    assert out.endswith("jobs       none active or recent\n")


def test_the_queue_shows_each_waiting_job_and_hides_anothers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = [
        job_service_pb2.QueueEntry(position=1, priority_class="production", weight=10, waited_seconds=95, min_slots=8),
        job_service_pb2.QueueEntry(
            position=2,
            job_id="job-1",
            name="mine",
            owner="alice",
            priority_class="research",
            weight=1,
            waited_seconds=301.4,
            waiting_for="waiting for slots: needs 4, 2 free",
            min_slots=4,
        ),
    ]
    fake(monkeypatch, queue_reply=entries)
    code, out, _ = run(capsys, "queue")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:4] == ["#", "ID", "NAME", "CLASS"]
    assert lines[1].split()[:7] == ["1", "-", "(another", "user's)", "production", "-", "10"]
    assert "301s" in lines[2] and lines[2].endswith("waiting for slots: needs 4, 2 free")
    fake(monkeypatch, queue_reply=[])
    assert run(capsys, "queue")[1] == "no job is waiting\n"


def test_the_quota_shows_each_teams_guarantee_use_and_borrowing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    reply = job_service_pb2.ListQuotasResponse(cluster_slots=24)
    reply.teams.add(team="nlp", guarantee=8, borrow_unlimited=True, used=12, borrowed=4, waiting_jobs=0)
    reply.teams.add(team="vision", guarantee=16, borrow_limit=4, used=2, waiting_jobs=1)
    fake(monkeypatch, quotas_reply=reply)
    code, out, _ = run(capsys, "quota")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split() == ["TEAM", "GUARANTEE", "MAY", "BORROW", "USED", "BORROWED", "WAITING", "JOBS"]
    assert lines[1].split() == ["nlp", "8", "any", "idle", "12", "4", "0"]
    assert lines[2].split() == ["vision", "16", "4", "2", "0", "1"]
    assert lines[3] == "guarantees: 24 of the cluster's 24 healthy slots"
    fake(monkeypatch, quotas_reply=job_service_pb2.ListQuotasResponse())
    assert run(capsys, "quota")[1] == "no team quotas on this cluster\n"


def test_cluster_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, cluster_reply=CLUSTER)
    code, out, _ = run(capsys, "--json", "cluster")
    data = json.loads(out)
    assert code == 0
    assert (data["slots_used"], data["waf"], data["jobs"][0]["name"]) == (6, 3.6e9, "gpt-big")
    assert data["jobs"][1]["state"] == "JOB_STATE_RECOVERING"


def test_cluster_unreachable_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    code, out, err = run(capsys, "--coordinator", address, "cluster")
    assert (code, out) == (cli.EXIT_FAILED, "")
    assert err == f"unicron: cannot reach the coordinator at {address} (is it running?)\n"


def test_incidents_show_remedy_transition_and_cost(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    resumed = common_pb2.Incident(
        incident_id="inc-1",
        job_id="j1",
        kind=common_pb2.FAILURE_KIND_PROCESS_EXIT,
        severity=common_pb2.SEVERITY_SEV2,
        recommended_action="restart",
        action_taken="restarted",
        remedy=common_pb2.REMEDY_RESTART,
        cost=common_pb2.FailureCost(
            detection_seconds=0.25,
            transition_seconds=7.5,
            detection_waf_seconds=0.75e9,
            transition_waf_seconds=22.5e9,
            sub_healthy_waf_seconds=1e9,
        ),
    )
    resumed.first_seen.FromNanoseconds(int(99.75e9))
    resumed.detected.FromNanoseconds(int(100e9))
    resumed.resumed.FromNanoseconds(int(107.5e9))
    pending = common_pb2.Incident(incident_id="inc-2", kind=common_pb2.FAILURE_KIND_NODE_LOST)
    fake(monkeypatch, incidents_reply=[resumed, pending])
    code, out, _ = run(capsys, "incidents")
    assert code == 0
    header, first, second = out.splitlines()
    assert header.split()[-3:] == ["REMEDY", "TRANSITION", "COST"]
    assert header.startswith("ID") and "LATENCY" in header and "FIRST ACTION" in header
    assert first.split()[-5:] == ["restarted", "restart", "7.50s", "24.2", "GFLOP"]
    assert "0.25s" in first.split()
    assert second.split()[-3:] == ["-", "-", "-"]


def test_get_shows_worker_states_and_remedies() -> None:
    job = common_pb2.Job(job_id="job-1", state=common_pb2.JOB_STATE_RUNNING, reason="training resumed")
    job.spec.name = "gpt"
    job.assignment.generation = 2
    job.assignment.workers.add(node_id="n1", ranks=[0, 1])
    job.workers.add(node_id="n1", generation=2, state=common_pb2.WORKER_STATE_RUNNING)
    attempt = job.remedies.add(
        incident_id="inc-1", remedy=common_pb2.REMEDY_RESTART, reason="process_exit calls for restart process"
    )
    attempt.started.FromSeconds(100)
    attempt.resumed.FromNanoseconds(int(103.5e9))
    out = io.StringIO()
    job_view.print_job(job, out)
    text = out.getvalue()
    assert "placement  n1: ranks 0, 1 (running, generation 2)" in text
    assert "restart     inc-1  resumed after 3.5s: process_exit calls for restart process" in text


def test_get_and_watch_show_what_the_run_reports() -> None:
    job = common_pb2.Job(job_id="job-1", state=common_pb2.JOB_STATE_RUNNING)
    job.spec.name, job.spec.training.iterations = "gpt", 100
    p = job.progress
    p.iteration, p.loss, p.iteration_seconds, p.learning_rate, p.grad_norm = 40, 2.5, 0.5, 3e-4, 0.812
    p.metrics["lm loss"], p.skipped_steps = 2.5, 3
    p.validation_loss, p.validation_iteration = 2.75, 40
    out = io.StringIO()
    job_view.print_job(job, out)
    assert (
        "training   lr 0.0003, grad norm 0.812, lm loss 2.5, 3 skipped, validation loss 2.7500 (iteration 40)"
        in out.getvalue()
    )
    watched = io.StringIO()
    cli.ProgressView(watched).progress(common_pb2.JobEvent(progress=p), 100)
    assert watched.getvalue() == "  iteration 40/100 loss 2.5000 lr 0.0003 gnorm 0.812 val 2.7500 2.00 it/s\n"
    # Without clipping or evaluation only the rate is shown.
    bare = common_pb2.JobProgress(iteration=3, loss=4.0, learning_rate=1e-3)
    assert job_view.training_line(bare) == "lr 0.001"


def test_nodes_say_how_long_each_is_in_its_state(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = common_pb2.Node(node_id="n2", address="h:2", slots=2, state=common_pb2.NODE_STATE_LOST)
    lost.state_since.FromNanoseconds(int((time.time() - 90) * 1e9))
    fresh = common_pb2.Node(node_id="n1", address="h:1", slots=2, used_slots=1, state=common_pb2.NODE_STATE_READY)
    fake(monkeypatch, nodes_reply=[fresh, lost])
    code, out, _ = run(capsys, "nodes")
    assert code == 0
    header, first, second = (line.split() for line in out.splitlines())
    assert header == ["NODE", "STATE", "FOR", "SLOTS", "USED", "ADDRESS", "DOMAIN", "HEARTBEAT"]
    assert first[:4] == ["n1", "ready", "-", "1/2"]
    assert second[:4] == ["n2", "lost", "1m", "0/2"]


class EndedJobClient(FakeClient):
    def watch(self, job_id: str) -> list[common_pb2.JobEvent]:
        job = common_pb2.Job(job_id=job_id, state=common_pb2.JOB_STATE_FAILED, reason="rank 2 exited with code 1")
        job.spec.name = "gpt"
        return [common_pb2.JobEvent(type=common_pb2.JOB_EVENT_TYPE_SNAPSHOT, state=job.state, job=job)]


def test_watching_a_job_that_already_failed_says_why() -> None:
    out = io.StringIO()
    code = cli.watch_job(EndedJobClient("x"), "job-1", out, as_json=False)  # type: ignore[arg-type]
    assert code == cli.EXIT_FAILED
    assert out.getvalue() == "watching job-1 (gpt): failed (rank 2 exited with code 1)\n"


def test_output_cut_short_by_its_reader_is_no_traceback() -> None:
    """`unicron get ... | head`: the reader closes the pipe; the CLI stops without a word."""
    import subprocess
    import sys

    program = (
        "import sys; from unicron import cli\n"
        "def run(args, out):\n"
        "    for i in range(200000): out.write(f'line {i}\\n')\n"
        "    return 0\n"
        "cli.run = run\n"
        "sys.exit(cli.main(['jobs']))\n"
    )
    shown = subprocess.run(
        f'{sys.executable} -c "$PROGRAM" | head -1',
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PROGRAM": program},
    )
    assert shown.stdout == "line 0\n"
    assert "Traceback" not in shown.stderr and "BrokenPipe" not in shown.stderr, shown.stderr


@pytest.mark.parametrize(
    ("training", "line"),
    [
        (
            {},
            "adam (betas 0.9, 0.999, eps 1e-08); clip grad norm 1; weight decay 0; lr 0.001 constant; fp32",
        ),
        (
            {
                "precision": "bf16",
                "distributed_optimizer": True,
                "adam_beta2": 0.95,
                "clip_grad": 0,
                "weight_decay": 0.1,
                "learning_rate": 3e-4,
                "lr_decay_style": "cosine",
                "lr_warmup_iterations": 10,
                "min_learning_rate": 3e-5,
            },
            "adam (betas 0.9, 0.95, eps 1e-08), distributed over the data-parallel ranks, each shard's buddy copy"
            " on another node or failure domain; no clipping; "
            "weight decay 0.1; lr 0.0003 cosine after 10 warm-up iterations to 3e-05; "
            "bf16 with fp32 main parameters, gradients reduced in fp32",
        ),
        (
            {"optimizer": "sgd", "sgd_momentum": 0.5},
            "sgd (momentum 0.5); clip grad norm 1; weight decay 0; lr 0.001 constant; fp32",
        ),
    ],
)
def test_get_says_which_optimization_the_job_runs(training: dict[str, object], line: str) -> None:
    """Settings the program never wrote (clipping at 1, Adam's betas, the fp32 reduce) show."""
    from unicron import jobspec

    spec = jobspec.spec_from_dict({"name": "gpt", "training": {"iterations": 5, "global_batch_size": 4, **training}})
    assert job_view.optimization_line(spec) == line
    out = io.StringIO()
    job_view.print_job(common_pb2.Job(job_id="job-1", spec=spec), out)
    assert f"optimizer  {line}\n" in out.getvalue()
