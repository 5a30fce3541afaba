"""bench/peers.py's pure parts (unit-tested in tests/unit/test_bench_peers.py): the peers' log
lines parsed, each peer's recovery read from timed events, the samples summarized into rows,
and the table. No process is started here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bench.common import percentile

GLOBAL_BATCH = 64
WORLD = 2  # ranks under torchrun, replica groups under torchft, data-parallel ranks under Unicron
# Parameters equal a failure-free run's when every tensor is within this (relative): the
# tolerance of the project's exactness tests (tests/trainer/test_exactness.py).
EXACT_TOLERANCE = 1e-6

# The digits example's progress line without Unicron (unicron/trainer/runtime.py, LocalLink) and
# its restore line (unicron/trainer/checkpoint.py): JSON log lines on stderr.
_ITERATION_RE = re.compile(r"^iteration (?P<iteration>\d+): loss (?P<loss>[-\d.eE+naif]+)")


# ---- pure parts (unit-tested) -----------------------------------------------------------


@dataclass(frozen=True)
class LogEvent:
    """One line of the torchrun ranks' output that the bench needs, with its arrival time."""

    time: float
    kind: str  # "iteration" (rank 0's progress) or "resumed" (a rank restored a checkpoint)
    iteration: int
    loss: float | None = None


def parse_trainer_line(line: str, arrived: float) -> LogEvent | None:
    """An iteration or checkpoint-restore event from one JSON log line of the digits example run
    without Unicron; None for any other line (torchrun's own, warnings, other log lines)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(entry, dict):
        return None
    message = str(entry.get("msg", ""))
    if message == "resumed from checkpoint" and isinstance(entry.get("iteration"), int):
        return LogEvent(arrived, "resumed", int(entry["iteration"]))
    match = _ITERATION_RE.match(message)
    if match is None:
        return None
    return LogEvent(arrived, "iteration", int(match["iteration"]), float(match["loss"]))


def torchrun_recovery(events: list[LogEvent], killed: float) -> dict[str, Any]:
    """From the events of one torchrun job (arrival order) and the kill's time: the iteration the
    job had reached (rank 0's last iteration before the restarted group restored its state),
    the restored iteration, and, in seconds from the kill, the first iteration after the restart
    and the return to the reached iteration. Raises ValueError when the job did not restart."""
    resume_index = next((i for i, e in enumerate(events) if e.kind == "resumed" and e.time >= killed), None)
    if resume_index is None:
        raise ValueError("no rank restored a checkpoint after the kill")
    before = [e.iteration for e in events[:resume_index] if e.kind == "iteration"]
    if not before:
        raise ValueError("no iteration before the kill")
    reached = max(before)
    restored = events[resume_index].iteration
    after = [e for e in events[resume_index:] if e.kind == "iteration"]
    first = after[0] if after else None
    back = next((e for e in after if e.iteration >= reached), None)
    return {
        "step_at_kill": reached,
        "restored_iteration": restored,
        "iterations_recomputed": max(0, reached - restored),
        "first_iteration": first.iteration if first else None,
        "resume_s": round(first.time - killed, 4) if first else None,
        "regain_s": round(back.time - killed, 4) if back else None,
    }


@dataclass(frozen=True)
class FtEvent:
    """One line of a torchft replica group's stdout (bench/peers_torchft.py), with the process's
    incarnation (1: first start, 2: after the kill)."""

    incarnation: int
    group: int
    event: str  # start, ready (set up, before the first quorum), step, hook_error, done
    time: float
    step: int = 0
    committed: bool = False
    participants: int = 0
    participating: bool = False
    healed: bool = False
    loss: float | None = None
    eval_loss: float | None = None


def parse_torchft_line(line: str, incarnation: int) -> FtEvent | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(entry, dict) or entry.get("event") not in ("start", "ready", "step", "hook_error", "done"):
        return None
    return FtEvent(
        incarnation=incarnation,
        group=int(entry.get("group", -1)),
        event=str(entry["event"]),
        time=float(entry["time"]),
        step=int(entry.get("step", 0)),
        committed=bool(entry.get("committed", False)),
        participants=int(entry.get("participants", 0)),
        participating=bool(entry.get("participating", False)),
        healed=bool(entry.get("healed", False)),
        loss=entry.get("loss"),
        eval_loss=entry.get("eval_loss"),
    )


def dropped_samples(events: Iterable[FtEvent], groups: int, per_group: int) -> int:
    """Samples a run left untrained: on each committed step (one group's view), the share of the
    groups that did not participate. Each step counts once, whichever groups saw it."""
    seen: dict[int, int] = {}
    for e in events:
        if e.event == "step" and e.committed:
            seen[e.step] = min(seen.get(e.step, groups), e.participants)
    return sum((groups - n) * per_group for n in seen.values())


def torchft_recovery(
    events: list[FtEvent], killed: float, victim: int, groups: int = WORLD, global_batch: int = GLOBAL_BATCH
) -> dict[str, Any]:
    """From the events of one torchft run and the kill's time (the victim group's process killed
    after its step k, started again at once): seconds from the kill to the restarted group's first
    committed step (it heals from a live group, then commits) and to its first step that counts
    its own samples again, what the surviving groups did meanwhile, and the samples dropped."""
    per_group = global_batch // groups
    before = [e.step for e in events if e.group == victim and e.incarnation == 1 and e.event == "step" and e.committed]
    if not before:
        raise ValueError("the victim committed no step before the kill")
    restarted = [e for e in events if e.group == victim and e.incarnation == 2 and e.event == "step"]
    first = next((e for e in restarted if e.committed), None)
    rejoined = next((e for e in restarted if e.committed and e.participating and e.participants == groups), None)
    survivors = [e for e in events if e.group != victim and e.event == "step" and e.time > killed]
    resumed_at = first.time if first else None
    meanwhile = [e for e in survivors if e.committed and (resumed_at is None or e.time <= resumed_at)]
    started = next((e for e in events if e.group == victim and e.incarnation == 2 and e.event == "start"), None)
    ready = next((e for e in events if e.group == victim and e.incarnation == 2 and e.event == "ready"), None)
    # The job's stall: until a live group commits a step without the dead one (a step already in
    # flight at the kill, all-reduced with the victim's gradient, may still commit at once).
    stall = next((e for e in survivors if e.committed and e.participants < groups), None)
    return {
        "step_at_kill": max(before),
        # The restarted process: torch imported, then set up (manager, model, data).
        "restarted_started_s": round(started.time - killed, 4) if started else None,
        "restarted_ready_s": round(ready.time - killed, 4) if ready else None,
        "resume_s": round(first.time - killed, 4) if first else None,
        "resume_step": first.step if first else None,
        "healed": bool(first and first.healed),
        "rejoin_s": round(rejoined.time - killed, 4) if rejoined else None,
        "stall_s": round(stall.time - killed, 4) if stall else None,
        "survivor_steps_meanwhile": len({e.step for e in meanwhile}),
        "survivor_steps_discarded": sum(1 for e in survivors if not e.committed),
        # All-reduces that failed under the live group (a peer died inside one): torchft 0.2.0's
        # own DDP hook would have crashed the live group there (bench/peers_torchft.py).
        "ddp_hook_errors": sum(1 for e in events if e.event == "hook_error" and e.group != victim),
        "samples_dropped": dropped_samples(events, groups, per_group),
        "steps_with_dropped_samples": sorted(
            {e.step for e in events if e.event == "step" and e.committed and e.participants < groups}
        ),
    }


def relative_difference(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The largest ||got - want|| / ||want|| over the tensors (as tests/trainer/harness.py)."""
    names = sorted(want)
    if names != sorted(got):
        raise ValueError(f"different tensors: {sorted(got)} vs {names}")
    worst = 0.0
    for name in names:
        diff = float((got[name].double() - want[name].double()).norm())
        norm = float(want[name].double().norm())
        worst = max(worst, diff / max(norm, 1e-30))
    return worst


def _p50(values: Iterable[float | int | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return round(percentile(present, 0.5), 4) if present else None


def _max(values: Iterable[float | int | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return max(present) if present else None


def summarize_samples(
    peer: str, remedy: str, samples: list[dict[str, Any]], exact_basis: str, resume_from: str
) -> dict[str, Any]:
    """One row of the report from one peer's samples (dicts with resume_s, regain_s,
    iterations_recomputed, samples_dropped, relative_difference and error where known)."""
    good = [s for s in samples if not s.get("error")]
    diffs = [float(s["relative_difference"]) for s in good if s.get("relative_difference") is not None]
    exact: bool | None = None
    if diffs:
        exact = all(d <= EXACT_TOLERANCE for d in diffs)
    deltas = [s.get("eval_loss_delta") for s in good if s.get("eval_loss_delta") is not None]
    # torchft's own measures, where the samples have them: where a restart's time goes, and the
    # failed all-reduces its fixed DDP hook absorbed.
    own: dict[str, Any] = {
        f"{key.removesuffix('_s')}_p50_s": _p50(s.get(key) for s in good)
        for key in ("restarted_started_s", "restarted_ready_s", "rejoin_s")
        if any(key in s for s in good)
    }
    if any("ddp_hook_errors" in s for s in good):
        own["ddp_hook_errors"] = sum(int(s.get("ddp_hook_errors", 0)) for s in good)
    return {
        "peer": peer,
        "remedy": remedy,
        "n": len(good),
        "repeats": len(samples),
        "failed_at": [s.get("step_at_kill") for s in samples],
        "resume_from": resume_from,
        "resume_p50_s": _p50(s.get("resume_s") for s in good),
        # The job's own stall: until any rank trains again (torchft's live group goes on alone).
        "stall_p50_s": _p50(s.get("stall_s", s.get("resume_s")) for s in good),
        "resume_max_s": _max(s.get("resume_s") for s in good),
        "regain_p50_s": _p50(s.get("regain_s") for s in good),
        "iterations_recomputed_p50": _p50(s.get("iterations_recomputed") for s in good),
        "iterations_recomputed_max": _max(s.get("iterations_recomputed") for s in good),
        "samples_dropped_p50": _p50(s.get("samples_dropped") for s in good),
        "samples_dropped_max": _max(s.get("samples_dropped") for s in good),
        "survivor_steps_meanwhile_p50": _p50(s.get("survivor_steps_meanwhile") for s in good),
        "exact": exact,
        "exact_basis": exact_basis,
        "max_relative_difference": _max(diffs),
        "eval_loss_delta_p50": _p50(deltas),
        **own,
        "errors": [s["error"] for s in samples if s.get("error")],
        "samples": samples,
    }


def skipped_row(peer: str, reason: str) -> dict[str, Any]:
    """A peer that could not run: a row that says so, never a row of zeros."""
    return {"peer": peer, "skipped": reason}


UNICRON_EXACT_BASIS = (
    "claimed, not measured by this bench (bench.transition cancels the job after the regain): "
    "tests/trainer/test_session.py (digits: shrink, grow, restart from a checkpoint) and "
    "tests/trainer/test_exactness.py (reattempt, restart from a peer, shrink, grow) check the final "
    f"parameters against a failure-free run within {EXACT_TOLERANCE:g}"
)


UNICRON_FSDP_EXACT_BASIS = (
    "claimed, not measured by this bench: tests/trainer/test_fsdp_exactness.py checks the FSDP2 path on the"
    " Llama example (reattempt, restart from the buddy copy and from the checkpoint bit-identical; shrink and"
    " grow within twice the distance between failure-free runs at the two sizes), not on this MLP"
)


def unicron_rows(report: dict[str, Any], fsdp: bool = False) -> list[dict[str, Any]]:
    """bench.transition's report (its JSON) as rows of this one: per action, the incident's
    detected -> resumed time, the regain, the iterations recomputed (its lost count)."""
    rows = []
    for action in report.get("actions", []):
        samples = [
            {
                "step_at_kill": s.get("step"),
                "resume_s": s.get("transition_s"),
                "regain_s": s.get("regain_s"),
                "iterations_recomputed": s.get("lost_iterations"),
                # The global batch is re-split over the ranks left, never cut: no sample dropped.
                "samples_dropped": 0 if s.get("transition_s") is not None else None,
                "state_source": s.get("state_source"),
                "resumed_by": s.get("resumed_by"),
                "size": f"{s.get('size_before')}->{s.get('size_after')}",
                "error": s.get("error", ""),
            }
            for s in action.get("samples", [])
        ]
        row = summarize_samples(
            "unicron",
            str(action.get("action")),
            samples,
            UNICRON_FSDP_EXACT_BASIS if fsdp else UNICRON_EXACT_BASIS,
            "incident detected (the dead rank's report; detection itself: bench-detect, ~0.1-0.3 s for a crash)",
        )
        # Not measured here (see UNICRON_EXACT_BASIS): claimed, and tested elsewhere.
        row["exact_claimed"] = bool(row["n"])
        row["state_sources"] = action.get("state_sources", {})
        row["fault"] = action.get("fault", "")
        rows.append(row)
    return rows


def _exact_cell(row: dict[str, Any]) -> str:
    if row.get("exact_claimed"):
        return "claimed (tests)"
    if row["exact"] is None:
        return "-"
    cell = "yes" if row["exact"] else "no"
    if row["max_relative_difference"] is not None:
        cell += f" ({row['max_relative_difference']:.1e})"
    return cell


# The table's columns: header, width, the row's key, format ("s": seconds, "n": a count).
_COLUMNS = [
    ("n", 3, "n", "n"),
    ("stall_p50", 9, "stall_p50_s", "s"),
    ("resume_p50", 10, "resume_p50_s", "s"),
    ("regain_p50", 10, "regain_p50_s", "s"),
    ("recomp_p50", 10, "iterations_recomputed_p50", "n"),
    ("recomp_max", 10, "iterations_recomputed_max", "n"),
    ("dropped_p50", 11, "samples_dropped_p50", "n"),
    ("survivor", 8, "survivor_steps_meanwhile_p50", "n"),
]


def format_table(report: dict[str, Any]) -> str:
    def cell(value: float | None, kind: str) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if kind == "s" else f"{value:g}"

    header = f"{'peer':<9} {'remedy':<23} " + " ".join(f"{h:>{w}}" for h, w, _, _ in _COLUMNS) + " exact"
    lines = [header, "-" * len(header)]
    for row in report["rows"]:
        if "skipped" in row:
            lines.append(f"{row['peer']:<9} skipped: {row['skipped']}")
            continue
        cells = " ".join(f"{cell(row[key], kind):>{w}}" for _, w, key, kind in _COLUMNS)
        lines.append(f"{row['peer']:<9} {row['remedy']:<23} {cells} {_exact_cell(row)}")
    lines.append(
        "(seconds from the SIGKILL (torchrun, torchft) or from the incident's detection (unicron); stall: until the "
        "job trains again (torchft: its live group's next committed step); resume: until the failed rank trains again "
        "(torchft: the restarted group's first committed step, after healing); regain: back at the "
        "iteration reached before the fault; recomp: iterations recomputed; dropped: samples never trained; survivor: "
        "steps the live torchft group committed before the restarted one; exact: final parameters vs a failure-free "
        "run, max relative difference)"
    )
    for row in report["rows"]:
        for error in row.get("errors", []):
            lines.append(f"{row['peer']} {row.get('remedy', '')}: failed sample: {error}")
    return "\n".join(lines)
