"""The peers benchmark's pure parts (bench/peers_report.py: log parsing, recovery from timed events,
dropped samples, the report's rows and table) and its torchft script's model and data against the
digits example, so `make bench-peers` cannot rot between its rare runs. No torchrun, no torchft
and no cluster here: torchft need not be installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import peers, peers_report, peers_torchft
from bench.peers_report import FtEvent, LogEvent


def _line(msg: str, **fields: object) -> str:
    return json.dumps({"ts": "2026-01-01T00:00:00.000Z", "level": "info", "msg": msg, **fields})


def test_trainer_lines_give_iterations_and_restores_and_nothing_else() -> None:
    assert peers_report.parse_trainer_line(_line("iteration 17: loss 0.5124, 0.069s", tokens=64), 3.0) == LogEvent(
        3.0, "iteration", 17, 0.5124
    )
    restored = _line("resumed from checkpoint", iteration=20, checkpoint="/x/iter_00000020")
    assert peers_report.parse_trainer_line(restored, 4.0) == LogEvent(4.0, "resumed", 20)
    for other in (
        "[E1202 17:22:03.322389674 TCPStore.cpp:277] [c10d] The server socket failed to bind.",
        _line("checkpoint saved", iteration=20),
        _line("iterations ahead"),
        "{not json",
        "[1, 2]",
        "",
    ):
        assert peers_report.parse_trainer_line(other, 1.0) is None


def _torchrun_events() -> list[LogEvent]:
    first = [LogEvent(float(i), "iteration", i) for i in range(1, 17)]
    # Iteration 17 was computed before the kill (at 16.5) and its line arrives after it.
    late = [LogEvent(16.6, "iteration", 17)]
    restart = [LogEvent(30.0, "resumed", 10), LogEvent(30.1, "resumed", 10)]
    second = [LogEvent(40.0 + i, "iteration", 10 + i) for i in range(1, 12)]
    return first + late + restart + second


def test_torchrun_recovery_times_the_restart_from_the_kill() -> None:
    got = peers_report.torchrun_recovery(_torchrun_events(), killed=16.5)
    assert got == {
        "step_at_kill": 17,
        "restored_iteration": 10,
        "iterations_recomputed": 7,
        "first_iteration": 11,
        "resume_s": 24.5,  # 41.0 - 16.5
        "regain_s": 30.5,  # iteration 17 again at 47.0
    }


def test_torchrun_recovery_needs_a_restart() -> None:
    events = [e for e in _torchrun_events() if e.kind != "resumed"]
    with pytest.raises(ValueError, match="restored"):
        peers_report.torchrun_recovery(events, killed=16.5)
    # A job that never got back to where it was: the regain is unknown, not zero.
    short = [e for e in _torchrun_events() if not (e.kind == "iteration" and e.time >= 40.0 and e.iteration >= 15)]
    got = peers_report.torchrun_recovery(short, killed=16.5)
    assert got["resume_s"] == 24.5 and got["regain_s"] is None


def test_torchft_lines_parse_and_others_are_ignored() -> None:
    step = json.dumps(
        {"event": "step", "time": 5.0, "group": 1, "step": 3, "committed": True, "participants": 2, "loss": 0.5}
    )
    assert peers_report.parse_torchft_line(step, 2) == FtEvent(
        incarnation=2, group=1, event="step", time=5.0, step=3, committed=True, participants=2, loss=0.5
    )
    ready = peers_report.parse_torchft_line(json.dumps({"event": "ready", "time": 1.0, "group": 0}), 1)
    assert ready is not None and ready.event == "ready"
    for other in ("2026-12-02T17:25:36.038 [INFO] [torchft::manager] - quorum", '{"event": "other", "time": 1}', "{x"):
        assert peers_report.parse_torchft_line(other, 1) is None


def _step(incarnation: int, group: int, time: float, step: int, participants: int, **kw: bool) -> FtEvent:
    committed = kw.get("committed", True)
    participating = kw.get("participating", True)
    healed = kw.get("healed", False)
    return FtEvent(incarnation, group, "step", time, step, committed, participants, participating, healed)


def _torchft_events() -> list[FtEvent]:
    """Group 0 killed at t=10.5 after its step 10; group 1 stalls 5 s (the heartbeat timeout),
    commits steps 11-20 alone, and one attempt fails; group 0's new process heals at step 21 (not
    participating) and trains with group 1 from step 22."""
    events = [_step(1, g, float(s), s, 2) for s in range(1, 11) for g in (0, 1)]
    events.append(_step(1, 1, 15.4, 11, 1, committed=False))
    events += [_step(1, 1, 15.5 + 0.1 * (s - 11), s, 1) for s in range(11, 21)]
    events.append(FtEvent(2, 0, "start", 16.0))
    events.append(FtEvent(2, 0, "ready", 25.0))
    events.append(_step(2, 0, 26.0, 21, 1, participating=False, healed=True))
    events.append(_step(1, 1, 26.0, 21, 1))
    events += [_step(i, g, 26.0 + s - 21, s, 2) for s in range(22, 25) for i, g in ((2, 0), (1, 1))]
    return sorted(events, key=lambda e: e.time)


def test_torchft_recovery_counts_the_stall_the_heal_and_the_dropped_samples() -> None:
    got = peers_report.torchft_recovery(_torchft_events(), killed=10.5, victim=0)
    assert got["step_at_kill"] == 10
    assert got["restarted_started_s"] == 5.5 and got["restarted_ready_s"] == 14.5
    assert got["resume_s"] == 15.5 and got["resume_step"] == 21 and got["healed"]
    assert got["rejoin_s"] == 16.5  # step 22, the first with both groups' samples
    assert got["stall_s"] == 5.0  # group 1's step 11 at 15.5
    assert got["survivor_steps_meanwhile"] == 11  # steps 11-21, up to the restarted group's first commit
    assert got["survivor_steps_discarded"] == 1
    # Steps 11-21 trained one group's half: 11 x 32 samples never trained.
    assert got["steps_with_dropped_samples"] == list(range(11, 22))
    assert got["samples_dropped"] == 11 * 32


def test_a_step_in_flight_at_the_kill_is_no_end_of_the_stall() -> None:
    # Group 1's step 11 was all-reduced with group 0's gradient before the kill landed.
    events = sorted([*_torchft_events(), _step(1, 1, 10.6, 11, 2)], key=lambda e: e.time)
    got = peers_report.torchft_recovery(events, killed=10.5, victim=0)
    assert got["stall_s"] == 5.0
    assert got["samples_dropped"] == 11 * 32  # step 11 counts once, at its fewest participants


def test_torchft_recovery_when_the_restarted_group_never_commits() -> None:
    events = [e for e in _torchft_events() if not (e.group == 0 and e.incarnation == 2)]
    got = peers_report.torchft_recovery(events, killed=10.5, victim=0)
    assert got["resume_s"] is None and got["rejoin_s"] is None
    with pytest.raises(ValueError, match="victim"):
        peers_report.torchft_recovery([e for e in events if e.group != 0], killed=10.5, victim=0)


def test_dropped_samples_count_each_step_once() -> None:
    events = [_step(1, 0, 1.0, 1, 2), _step(1, 1, 1.0, 1, 2), _step(1, 1, 2.0, 2, 1), _step(2, 0, 2.0, 2, 1)]
    assert peers_report.dropped_samples(events, groups=2, per_group=32) == 32
    assert peers_report.dropped_samples([_step(1, 1, 2.0, 2, 1, committed=False)], groups=2, per_group=32) == 0


def test_relative_difference_is_the_worst_tensor() -> None:
    want = {"a": torch.ones(4), "b": torch.full((2,), 2.0)}
    assert peers_report.relative_difference(dict(want), want) == 0.0
    got = {"a": torch.ones(4), "b": torch.tensor([2.0, 2.2])}
    assert peers_report.relative_difference(got, want) == pytest.approx(0.2 / (8**0.5))
    with pytest.raises(ValueError):
        peers_report.relative_difference({"a": torch.ones(4)}, want)


def test_a_row_summarizes_samples_and_keeps_failures_apart() -> None:
    samples: list[dict[str, Any]] = [
        {"step_at_kill": 16, "resume_s": 20.0, "regain_s": 21.0, "iterations_recomputed": 6, "samples_dropped": 0},
        {"step_at_kill": 23, "resume_s": 30.0, "regain_s": 32.0, "iterations_recomputed": 3, "samples_dropped": 0},
        {"step_at_kill": 19, "error": "RuntimeError: boom"},
    ]
    samples[0]["relative_difference"] = 0.0
    samples[1]["relative_difference"] = 5e-7
    row = peers_report.summarize_samples("torchrun", "restart all, checkpoint", samples, "measured", "SIGKILL")
    assert row["n"] == 2 and row["repeats"] == 3
    assert row["resume_p50_s"] == 25.0 and row["stall_p50_s"] == 25.0 and row["regain_p50_s"] == 26.5
    assert row["iterations_recomputed_p50"] == 4.5 and row["iterations_recomputed_max"] == 6
    assert row["exact"] is True and row["max_relative_difference"] == 5e-7
    assert row["errors"] == ["RuntimeError: boom"]
    samples[1]["relative_difference"] = 0.2
    assert peers_report.summarize_samples("torchft", "x", samples, "measured", "SIGKILL")["exact"] is False
    assert "rejoin_p50_s" not in row and "ddp_hook_errors" not in row
    torchft = [{**samples[0], "rejoin_s": 3.0, "ddp_hook_errors": 1}, {**samples[1], "rejoin_s": 5.0}]
    row = peers_report.summarize_samples("torchft", "x", torchft, "measured", "SIGKILL")
    assert row["rejoin_p50_s"] == 4.0 and row["ddp_hook_errors"] == 1
    nothing = peers_report.summarize_samples("torchft", "x", [{"error": "no"}], "measured", "SIGKILL")
    assert nothing["n"] == 0 and nothing["resume_p50_s"] is None and nothing["exact"] is None


def _transition_report() -> dict[str, Any]:
    sample = {"step": 17, "transition_s": 1.5, "regain_s": 2.0, "lost_iterations": 0, "state_source": "peer"}
    return {
        "actions": [
            {
                "action": "restart",
                "fault": "crash",
                "state_sources": {"peer": 1},
                "samples": [
                    {**sample, "resumed_by": "restart", "size_before": 2, "size_after": 2, "error": ""},
                    {"step": 21, "transition_s": None, "error": "RuntimeError: the job did not resume"},
                ],
            }
        ]
    }


def test_unicron_rows_come_from_the_transition_report() -> None:
    (row,) = peers_report.unicron_rows(_transition_report())
    assert row["peer"] == "unicron" and row["remedy"] == "restart"
    assert row["n"] == 1 and row["resume_p50_s"] == 1.5 and row["regain_p50_s"] == 2.0
    assert row["iterations_recomputed_max"] == 0 and row["samples_dropped_p50"] == 0
    # Exactness is not measured by the transition bench: claimed (tested elsewhere), not "yes".
    assert row["exact"] is None and row["exact_claimed"]
    assert row["errors"] == ["RuntimeError: the job did not resume"]


def test_the_table_shows_every_row_and_every_skip() -> None:
    rows = [
        peers_report.skipped_row("torchft", "no bench venv"),
        *peers_report.unicron_rows(_transition_report()),
    ]
    table = peers_report.format_table({"rows": rows})
    assert "torchft   skipped: no bench venv" in table
    assert "claimed (tests)" in table
    assert "failed sample: RuntimeError: the job did not resume" in table


def test_a_missing_torchft_venv_is_a_skipped_row_with_its_reason(tmp_path: Path) -> None:
    reason = peers.torchft_unavailable(tmp_path / "none")
    assert reason is not None and "make bench-peers" in reason
    out = tmp_path / "peers.json"
    argv = ["--peers", "torchft", "--venv", str(tmp_path / "none"), "--repeats", "1", "--out", str(out)]
    assert peers.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == [{"peer": "torchft", "skipped": reason}]


def test_the_torchft_script_trains_the_digits_example_model_on_its_batches() -> None:
    from examples.digits import train

    torch.manual_seed(7)
    want = train.build_model(64).state_dict()
    torch.manual_seed(7)
    got = peers_torchft.build_model(64).state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    ours, theirs = peers_torchft.Digits(1234), train.Digits(1234)
    for indices in (range(0, 32), range(1790, 1830), range(5000, 5010)):
        for a, b in zip(ours.batch(indices), theirs.batch(indices), strict=True):
            assert torch.equal(a, b)


def test_group_shares_split_a_step_as_the_session_splits_it_over_ranks() -> None:
    # Session.samples(): rank r of dp takes [(it - 1) * gbs + r * gbs/dp, ... + gbs/dp).
    assert peers_torchft.group_samples(3, 1, 2, 64) == range(160, 192)
    assert peers_torchft.group_samples(3, 0, 1, 64) == range(128, 192)
    with pytest.raises(ValueError):
        peers_torchft.group_samples(1, 0, 3, 64)
