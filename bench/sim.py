"""Simulator benchmark: every preset under every recovery strategy, the WAF each achieves, its
ratio to Unicron, the cost per incident by phase, and the wall time of the largest run.

    python -m bench.sim [--quick] [--presets high-failure-128,meta-16k,scale-100k] [--seed S]

The Unicron strategy runs the project's real ladder and CP-SAT planner in process for every
failure (unicron_sim/). Results go to bench/results/sim.json and bench/results/sim.png; a table
with PASS/FAIL per target goes to stdout. The exit status is 0 whatever the numbers: this is a
measurement, not a test. See bench/README.md ("Simulator").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import unicron_sim as sim
from bench.common import log, write_results
from unicron_sim import report, strategies, traces

RESULTS = Path(__file__).resolve().parent / "results" / "sim.json"
PLOT = RESULTS.with_suffix(".png")
PRESETS = ["high-failure-128", "meta-16k", "scale-100k"]
# --quick: fewer simulated days per preset (development only; the targets need the full runs).
QUICK_DAYS = {"high-failure-128": 2.0, "meta-16k": 7.0, "scale-100k": 3.0}
# Targets (the issue): Unicron at least 1.9x checkpoint-restart on the high-failure 128-GPU
# trace, ahead of every other strategy on every preset, 30 days on 100,000 GPUs in < 2 min.
TARGET_RATIO_CR_128 = 1.9
TARGET_WALL_100K_S = 120.0
# Presets whose Unicron runs skip the planner's DP hint (see main).
NO_DP_HINT = frozenset({"scale-100k"})
NOTES = [
    "ratio_unicron_over: Unicron's accumulated WAF-seconds over the strategy's (above 1: Unicron trained more)",
    "per incident costs are in seconds of the cluster's failure-free WAF (detection, transition, sub-healthy)",
    "detection and transition times: bench/results/detection.json and transition.json p50 when present "
    "(see 'timings'); the other strategies' numbers are documented models (unicron_sim/strategies.py)",
    "scale-100k's wall time is the Unicron strategy's alone (the real planner re-plans every node loss and return); "
    "its requests carry max_changed_jobs = number of jobs (never binding), which makes the planner skip its "
    "size-only DP hint (planner.dp_hint false)",
]


def _row(preset: str, outcome: sim.Outcome) -> list[dict[str, Any]]:
    rows = report.rows(outcome.results, outcome.cluster.failure_free_waf())
    for row in rows:
        row.update(
            preset=preset,
            gpus=outcome.cluster.gpus,
            days=round(outcome.duration_s / traces.DAY_S, 3),
            failures_in_trace=len(outcome.trace),
        )
    return [{"preset": r.pop("preset"), "gpus": r.pop("gpus"), "days": r.pop("days"), **r} for r in rows]


def targets(runs: list[dict[str, Any]], full: bool) -> list[dict[str, Any]]:
    """PASS/FAIL per target from the JSON rows."""
    out: list[dict[str, Any]] = []
    cr = next((r for r in runs if r["preset"] == "high-failure-128" and r["strategy"] == "megatron-cr"), None)
    if cr is not None:
        value = cr["ratio_unicron_over"]
        out.append(
            {
                "target": "high-failure-128: Unicron / megatron-cr",
                "limit": f">= {TARGET_RATIO_CR_128}",
                "value": value,
                "met": value is not None and value >= TARGET_RATIO_CR_128,
            }
        )
    for preset in dict.fromkeys(r["preset"] for r in runs):
        others = [r for r in runs if r["preset"] == preset and r["strategy"] != "unicron"]
        worst = min((r["ratio_unicron_over"] or 0.0 for r in others), default=None)
        if worst is None:
            continue
        behind = [r["strategy"] for r in others if not (r["ratio_unicron_over"] or 0.0) > 1.0]
        out.append(
            {
                "target": f"{preset}: Unicron ahead of every other strategy",
                "limit": "> 1 (smallest ratio)",
                "value": worst,
                "met": not behind,
                "behind": behind,
            }
        )
    big = next((r for r in runs if r["preset"] == "scale-100k" and r["strategy"] == "unicron"), None)
    if big is not None:
        out.append(
            {
                "target": f"scale-100k: {big['days']:g} days on {big['gpus']} GPUs simulated (Unicron strategy)",
                "limit": f"< {TARGET_WALL_100K_S:g} s" + ("" if full else " (quick run: fewer days)"),
                "value": big["wall_s"],
                "met": big["wall_s"] < TARGET_WALL_100K_S and full,
            }
        )
    return out


def format_table(data: dict[str, Any]) -> str:
    lines = []
    header = (
        f"{'preset':<17} {'strategy':<14} {'WAF FLOP-s':>11} {'eff':>6} {'U/x':>6} {'incid':>6} "
        f"{'det/inc':>8} {'trans/inc':>9} {'sub/inc':>8} {'wall s':>7}"
    )
    lines += [header, "-" * len(header)]
    for r in data["runs"]:
        per = r["per_incident_cluster_s"]
        ratio = r["ratio_unicron_over"]
        lines.append(
            f"{r['preset']:<17} {r['strategy']:<14} {r['waf_flops_seconds']:>11.3e} {r['efficiency']:>6.3f} "
            f"{(f'{ratio:.2f}' if ratio else '-'):>6} {r['incidents']:>6} {per['detection']:>8.2f} "
            f"{per['transition']:>9.2f} {per['sub_healthy']:>8.2f} {r['wall_s']:>7.2f}"
        )
    lines.append("U/x: Unicron over the strategy; det/trans/sub: per incident, in seconds of the cluster's")
    lines.append("failure-free WAF")
    lines.append("")
    for t in data["targets"]:
        value = t["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        extra = f" (behind: {', '.join(t['behind'])})" if t.get("behind") else ""
        lines.append(f"{'PASS' if t['met'] else 'FAIL'}  {t['target']}: {shown} (target {t['limit']}){extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer simulated days (development only)")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated subset of the presets")
    parser.add_argument("--seed", type=int, default=0, help="trace and remedy-failure seed")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    parser.add_argument("--plot", type=Path, default=PLOT, help=f"PNG plot (default {PLOT})")
    args = parser.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in traces.PRESETS]
    if unknown:
        parser.error(f"unknown presets: {', '.join(unknown)}; known: {', '.join(traces.PRESETS)}")
    began = time.perf_counter()
    runs: list[dict[str, Any]] = []
    panels: list[tuple[str, list[sim.RunResult]]] = []
    timings: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    for preset in presets:
        days = QUICK_DAYS.get(preset) if args.quick else None
        # At 100,000 GPUs the planner's size-only DP hint costs ~50 ms of each ~65 ms re-plan (it
        # scales with jobs x sizes x GPUs): a cap no plan reaches skips it; the plans were
        # identical over a full 30-day run (bench/README.md).
        settings = strategies.UnicronSettings(dp_hint=preset not in NO_DP_HINT)
        scenario = sim.Scenario(
            preset=preset, days=days, seed=args.seed, strategies=strategies.STRATEGIES, unicron=settings
        )
        log(f"{preset}: simulating {', '.join(scenario.strategies)}")
        outcome = sim.run(scenario)
        timings = outcome.timings.as_dict()
        runs += _row(preset, outcome)
        unicron = next(r for r in outcome.results if r.strategy == "unicron")
        planner[preset] = {**unicron.planner, "dp_hint": settings.dp_hint}
        log(f"{preset}: {len(outcome.trace)} failures, Unicron {unicron.wall_s:.1f} s, planner {unicron.planner}")
        title = f"{preset}: {outcome.cluster.gpus:,} GPUs, {outcome.duration_s / traces.DAY_S:g} days"
        panels.append((title, outcome.results))
    report.plot(panels, args.plot)
    data: dict[str, Any] = {
        "runs": runs,
        "wall_s": round(time.perf_counter() - began, 1),
        "targets": targets(runs, full=not args.quick),
        "planner": planner,
        "timings": timings,
        "settings": {"seed": args.seed, "quick": args.quick, "presets": presets},
        "environment": {"cpus": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "notes": NOTES,
    }
    data["targets_met"] = all(t["met"] for t in data["targets"])
    write_results(args.out, data)
    print(format_table(data))
    print(f"\nwrote {args.out} and {args.plot} ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
