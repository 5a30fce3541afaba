"""Simulator benchmark: every preset under every recovery strategy, the WAF and the effective
training time ratio (ETTR) each achieves, its ratio to Unicron, the cost per incident by phase,
the wall time of the largest run; then what moves the comparison: Unicron with tensor- and
pipeline-parallel reforms (``--reform-model-parallel``), Unicron's distributed-optimizer jobs
without buddy copies (replication 1), and the elastic systems at 0.9 and 0.75 of Megatron's
failure-free throughput. ``meta-16k``, ``scale-100k`` and ``llama3-405b`` run distributed-optimizer
jobs, their buddy copies' memory and iteration time charged to Unicron (reported per preset);
``llama3-405b`` is Llama 3 405B's own run, checkpoint-restart calibrated on Meta's published
figures (unicron_sim/llama3.py), Unicron beside it.

    python -m bench.sim [--quick] [--presets high-failure-128,meta-16k,scale-100k,llama3-405b] [--seed S]

The Unicron strategy runs the project's real ladder and CP-SAT planner in process for every
failure (unicron_sim/). Results go to bench/results/sim.json and bench/results/sim.png; a table
with PASS/FAIL per target goes to stdout. The exit status is 0 whatever the numbers: this is a
measurement, not a test. See bench/README.md ("Simulator").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import unicron_sim as sim
from bench.common import log, write_results
from unicron_sim import llama3, report, sharded, strategies, traces
from unicron_sim.model import GPUS_PER_NODE

RESULTS = Path(__file__).resolve().parent / "results" / "sim.json"
PLOT = RESULTS.with_suffix(".png")
PRESETS = ["high-failure-128", "meta-16k", "scale-100k", "llama3-405b"]
# --quick: fewer simulated days per preset (development only; the targets need the full runs).
QUICK_DAYS = {"high-failure-128": 2.0, "meta-16k": 7.0, "scale-100k": 3.0, "llama3-405b": 14.0}
# Targets (the issues): Unicron at least 1.9x checkpoint-restart on the high-failure 128-GPU
# trace (a stress test at about 250x Llama 3's failure rate, not a calibrated one); an ETTR of
# at least 98% on meta-16k (Llama 3 405B's published failure rate) with the fitted transition
# times; ahead of every other strategy on every preset with no throughput penalty on the others
# (the elastic systems at 1.0 of Megatron's failure-free throughput); 30 days on 100,000 GPUs
# in < 2 min.
TARGET_RATIO_CR_128 = 1.9
TARGET_ETTR_META = 0.98
TARGET_WALL_100K_S = 120.0
# The calibration check: checkpoint-restart on llama3-405b within this of Meta's 90% (the trace
# is a Poisson draw: about 419 +- 20 interruptions over the full 54 days).
TARGET_LLAMA3_CR_TOLERANCE = 0.015
# The elastic systems' failure-free throughput relative to Megatron's: 1.0 in the main runs (no
# number for it could be checked against the papers' own tables; unicron_sim/strategies.py),
# and these in the sensitivity table.
ELASTIC_FACTORS = (0.9, 0.75)
# Presets whose Unicron runs skip the planner's DP hint (see main).
NO_DP_HINT = frozenset({"scale-100k"})
# Presets whose distributed-optimizer jobs are run again without buddy copies (what_if); not
# scale-100k, whose Unicron run is most of the bench's time.
NO_BUDDY_WHAT_IF = frozenset({"meta-16k", "llama3-405b"})
NOTES = [
    "ratio_unicron_over: Unicron's accumulated WAF-seconds over the strategy's (above 1: Unicron trained more)",
    "efficiency: WAF-seconds over the strategy's own failure-free run; ettr: share of the wall time the jobs "
    "trained (at any size; lost and recomputed work is down time), weighted by the GPUs each started on",
    "replans: re-plans of the whole cluster (planner calls); jobs_changed_without_failure: the changes they made "
    "to jobs no failure hit; nodes_taken_out: nodes a failure took out (each one is re-planned: checked)",
    "per incident costs are in seconds of the cluster's failure-free WAF (detection, transition, sub-healthy)",
    "detection: bench/results/detection.json p50 when present; transitions: the fitted lines of "
    "unicron_sim/data/transition_fit.json x state bytes per rank, plus a rendezvous term per rank and the work "
    "lost (see 'timings'); the other strategies' numbers are documented models (unicron_sim/strategies.py)",
    "unicron prices tensor/pipeline-parallel jobs as the coordinator handles them: reforms in place, each rank "
    "keeping its shard, a lost shard taken from a data-parallel peer (a snapshot restart only at data-parallel "
    "degree 1); what_if.model_parallel_reform prices that last case as a reform too",
    "the elastic systems (oobleck, varuna, bamboo) train at 1.0 of Megatron's failure-free throughput in 'runs'; "
    "'sensitivity' reruns them at 0.9 and 0.75",
    "meta-16k, scale-100k and llama3-405b run bf16 jobs under Megatron's distributed optimizer: Unicron prices "
    "each transition by the bytes it moves (model slice from a peer, optimizer shard from its buddy's copy, "
    "resharded ranges; a snapshot or the checkpoint when a rank and its buddy are lost together: counters "
    "'shards from ...') and pays the buddy copies on every iteration in WAF and ETTR ('buddy'); "
    "what_if.no_buddy_copies runs it with replication 1",
    "llama3-405b: Llama 3 405B's own run (one job on 16,384 GPUs, 419 unexpected interruptions in 54 days, "
    "Meta reports > 90% effective training time); megatron-cr's times are calibrated on that figure "
    "('llama3': each number and its source)",
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
                "target": "high-failure-128 (stress, ~250x Llama 3's failure rate): Unicron / megatron-cr",
                "limit": f">= {TARGET_RATIO_CR_128}",
                "value": value,
                "met": value is not None and value >= TARGET_RATIO_CR_128,
            }
        )
    meta = next((r for r in runs if r["preset"] == "meta-16k" and r["strategy"] == "unicron"), None)
    if meta is not None:
        out.append(
            {
                "target": "meta-16k (Llama 3 405B's failure rate): Unicron's ETTR, fitted transition times",
                "limit": f">= {TARGET_ETTR_META:.0%}",
                "value": meta["ettr"],
                "met": meta["ettr"] >= TARGET_ETTR_META,
            }
        )
    llama = next((r for r in runs if r["preset"] == "llama3-405b" and r["strategy"] == "megatron-cr"), None)
    if llama is not None:
        out.append(
            {
                "target": "llama3-405b: checkpoint-restart calibrated on Meta's published > 90% (ETTR)",
                "limit": f"within {TARGET_LLAMA3_CR_TOLERANCE:.1%} of {llama3.PUBLISHED_ETTR:.0%}"
                + ("" if full else " (quick run: fewer days)"),
                "value": llama["ettr"],
                "met": abs(llama["ettr"] - llama3.PUBLISHED_ETTR) <= TARGET_LLAMA3_CR_TOLERANCE,
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
                "target": f"{preset}: Unicron ahead of every other strategy (elastic ones at 1.0 throughput)",
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
        f"{'preset':<17} {'strategy':<14} {'WAF FLOP-s':>11} {'eff':>6} {'ETTR':>7} {'U/x':>6} {'incid':>6} "
        f"{'replan':>6} {'det/inc':>8} {'trans/inc':>9} {'sub/inc':>8} {'wall s':>7}"
    )
    lines += [header, "-" * len(header)]
    for r in data["runs"]:
        per = r["per_incident_cluster_s"]
        ratio = r["ratio_unicron_over"]
        lines.append(
            f"{r['preset']:<17} {r['strategy']:<14} {r['waf_flops_seconds']:>11.3e} {r['efficiency']:>6.3f} "
            f"{100 * r['ettr']:>6.2f}% {(f'{ratio:.2f}' if ratio else '-'):>6} {r['incidents']:>6} {r['replans']:>6} "
            f"{per['detection']:>8.2f} {per['transition']:>9.2f} {per['sub_healthy']:>8.2f} {r['wall_s']:>7.2f}"
        )
    lines.append("eff: WAF over the strategy's failure-free run; ETTR: share of the wall time trained; U/x: Unicron")
    lines.append("over the strategy; replan: cluster re-plans; det/trans/sub: per incident, in seconds of the")
    lines.append("cluster's failure-free WAF")
    lines += _buddy_lines(data.get("buddy", {}))
    lines += _llama3_lines(data)
    nobuddy = data.get("what_if", {}).get("no_buddy_copies", [])
    if nobuddy:
        lines += ["", "What if the distributed-optimizer jobs kept no buddy copies (replication 1):"]
        for w in nobuddy:
            lines.append(
                f"  {w['preset']:<17} unicron ETTR {100 * w['ettr']:.2f}% (with copies {100 * w['ettr_with']:.2f}%), "
                f"eff {w['efficiency']:.3f}; {w['sources']}"
            )
    whatifs = data.get("what_if", {}).get("model_parallel_reform", [])
    if whatifs:
        lines += ["", "What if model-parallel jobs at data-parallel degree 1 reformed too (--reform-model-parallel):"]
        for w in whatifs:
            ratios = ", ".join(f"{k} {v:.3f}" for k, v in w["ratio_over"].items() if v)
            lines.append(
                f"  {w['preset']:<17} unicron eff {w['efficiency']:.3f}, ETTR {100 * w['ettr']:.2f}%; over: {ratios}"
            )
    rows = data.get("sensitivity", {}).get("elastic_failure_free_factor", [])
    if rows:
        lines += ["", "Unicron over the elastic systems at a failure-free throughput penalty (1.0 = 'runs'):"]
        for row in rows:
            ratios = ", ".join(f"{k} {v:.3f}" for k, v in row["ratio_unicron_over"].items() if v)
            lines.append(f"  {row['preset']:<17} factor {row['factor']:<5} {ratios}")
    lines.append("")
    for t in data["targets"]:
        value = t["value"]
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        extra = f" (behind: {', '.join(t['behind'])})" if t.get("behind") else ""
        lines.append(f"{'PASS' if t['met'] else 'FAIL'}  {t['target']}: {shown} (target {t['limit']}){extra}")
    return "\n".join(lines)


def _buddy_lines(buddy: dict[str, Any]) -> list[str]:
    if not buddy:
        return []
    lines = ["", "Buddy copies of the distributed-optimizer jobs, charged to Unicron (per rank, at the start size):"]
    for preset, b in buddy.items():
        lines.append(
            f"  {preset:<17} {b['jobs']} jobs: host memory {b['memory_gb_min']:.2f}-{b['memory_gb_max']:.2f} GB "
            f"(copy + send buffer), copy {b['copy_s_min']:.3f}-{b['copy_s_max']:.3f} s per iteration = "
            f"{100 * b['overhead_min']:.2f}-{100 * b['overhead_max']:.2f}% of it"
        )
    lines.append(
        "  (bandwidths assumed, not measured on GPUs: device to host 50 GB/s, network 50 GB/s per rank; "
        "measured on this 2-core CPU machine: 23% of a 0.33 s iteration at 10M parameters, bench/buddy.py)"
    )
    return lines


def _llama3_lines(data: dict[str, Any]) -> list[str]:
    calibration = data.get("llama3")
    if not calibration:
        return []
    ettr = calibration["ettr"]
    cr = calibration["checkpoint_restart"]
    lines = [
        "",
        "llama3-405b, where the simulator meets a measured cluster (Llama 3 405B, 16,384 H100s, 54 days):",
        "  Meta (Dubey et al. 2024, sec. 3.3.4): 419 unexpected interruptions, > 90% effective training time",
        f"  megatron-cr calibrated to it: ETTR {100 * ettr.get('megatron-cr', 0.0):.2f}% "
        f"(detection {cr['mean_detection_s']:.0f} s mean, requeue {cr['requeue_s']:.0f} s, "
        f"setup {cr['setup_s']:.0f} s, "
        f"checkpoint every {cr['checkpoint_interval_s'] / 60:.1f} min: "
        f"{calibration['derived']['lost_per_interruption_s'] / 60:.1f} min per interruption)",
        f"  unicron on the same trace: ETTR {100 * ettr.get('unicron', 0.0):.2f}%",
    ]
    return lines


def buddy_summary(outcome: sim.Outcome, settings: sharded.BuddySettings) -> dict[str, Any] | None:
    """The buddy copies' memory and time per iteration for the preset's distributed-optimizer
    jobs at their start sizes (what the Unicron strategy charges)."""
    rows: list[dict[str, Any]] = []
    for job in outcome.cluster.jobs:
        gpus = job.start_nodes * GPUS_PER_NODE
        if not sharded.copies(job, gpus):
            continue
        rows.append(
            {
                "job": job.job_id,
                "shard_bytes": job.shard_bytes_per_rank(gpus),
                "slice_bytes": job.slice_bytes_per_rank,
                "memory_bytes": sharded.memory_bytes(job, gpus),
                "iteration_s": job.iteration_s(gpus),
                "copy_s": sharded.copy_s(job, gpus, settings),
                "overhead": 1.0 - sharded.effective_share(job, gpus, settings),
            }
        )
    if not rows:
        return None
    return {
        "jobs": len(rows),
        "memory_gb_min": min(r["memory_bytes"] for r in rows) / 1e9,
        "memory_gb_max": max(r["memory_bytes"] for r in rows) / 1e9,
        "copy_s_min": min(r["copy_s"] for r in rows),
        "copy_s_max": max(r["copy_s"] for r in rows),
        "overhead_min": min(r["overhead"] for r in rows),
        "overhead_max": max(r["overhead"] for r in rows),
        "settings": dataclasses.asdict(settings),
        "per_job": rows,
    }


def no_buddy(preset: str, scenario: sim.Scenario, with_copies: sim.RunResult) -> dict[str, Any]:
    """Unicron alone over the same trace with replication 1: a lost shard from the snapshot or
    the checkpoint."""
    (result,) = sim.run(dataclasses.replace(scenario, strategies=("unicron",), replication=1)).results
    return {
        "preset": preset,
        "ettr": round(result.ettr, 5),
        "ettr_with": round(with_copies.ettr, 5),
        "efficiency": round(result.efficiency, 4),
        "waf_flops_seconds": result.waf_seconds,
        "ratio_with_over_without": round(with_copies.waf_seconds / result.waf_seconds, 4),
        "sources": ", ".join(f"{k} {v}" for k, v in result.counters.items() if k.startswith("shards from"))
        or "no shard lost",
        "wall_s": round(result.wall_s, 3),
    }


def what_if(preset: str, scenario: sim.Scenario, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Unicron alone with model-parallel reforms over the same trace, against the main runs."""
    reform = dataclasses.replace(
        scenario,
        strategies=("unicron",),
        unicron=dataclasses.replace(scenario.unicron, model_parallel_reform=True),
    )
    (result,) = sim.run(reform).results
    others = {
        r["strategy"]: r["waf_flops_seconds"] for r in runs if r["preset"] == preset and r["strategy"] != "unicron"
    }
    return {
        "preset": preset,
        "efficiency": round(result.efficiency, 4),
        "ettr": round(result.ettr, 5),
        "waf_flops_seconds": result.waf_seconds,
        "ratio_over": {k: round(result.waf_seconds / v, 4) if v else None for k, v in others.items()},
        "wall_s": round(result.wall_s, 3),
    }


def sensitivity(preset: str, scenario: sim.Scenario, unicron_waf: float) -> list[dict[str, Any]]:
    """The elastic systems again at each penalty in ELASTIC_FACTORS, over the same trace."""
    out = []
    for factor in ELASTIC_FACTORS:
        rerun = dataclasses.replace(
            scenario, strategies=strategies.ELASTIC, elastic=strategies.ElasticSettings.uniform(factor)
        )
        results = sim.run(rerun).results
        out.append(
            {
                "preset": preset,
                "factor": factor,
                "ratio_unicron_over": {r.strategy: round(unicron_waf / r.waf_seconds, 4) for r in results},
                "ettr": {r.strategy: round(r.ettr, 5) for r in results},
            }
        )
    return out


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
    whatifs: list[dict[str, Any]] = []
    nobuddies: list[dict[str, Any]] = []
    buddies: dict[str, Any] = {}
    calibration: dict[str, Any] = {}
    sensitivities: list[dict[str, Any]] = []
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
        summary = buddy_summary(outcome, settings.buddy)
        if summary is not None:
            buddies[preset] = summary
        if preset == "llama3-405b":
            calibration = {**llama3.sources(), "ettr": {r.strategy: round(r.ettr, 5) for r in outcome.results}}
        if summary is not None and preset in NO_BUDDY_WHAT_IF:
            log(f"{preset}: Unicron without buddy copies")
            nobuddies.append(no_buddy(preset, scenario, unicron))
        title = f"{preset}: {outcome.cluster.gpus:,} GPUs, {outcome.duration_s / traces.DAY_S:g} days"
        panels.append((title, outcome.results))
        log(f"{preset}: Unicron with model-parallel reforms; elastic systems at {ELASTIC_FACTORS}")
        whatifs.append(what_if(preset, scenario, runs))
        sensitivities += sensitivity(preset, scenario, unicron.waf_seconds)
    report.plot(panels, args.plot)
    data: dict[str, Any] = {
        "runs": runs,
        "wall_s": round(time.perf_counter() - began, 1),
        "targets": targets(runs, full=not args.quick),
        "what_if": {"model_parallel_reform": whatifs, "no_buddy_copies": nobuddies},
        "buddy": buddies,
        "llama3": calibration,
        "sensitivity": {"elastic_failure_free_factor": sensitivities},
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
