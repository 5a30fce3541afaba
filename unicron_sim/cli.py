"""`unicron simulate`: replay a failure trace over a modeled cluster under each recovery
strategy. Needs no running service: the planner and the ladder run in process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TextIO

import unicron_sim as sim
from unicron.errors import InvalidArgument
from unicron_sim import report, strategies, traces


def add_parser(sub: Any, help_text: str) -> None:
    """Adds the `simulate` subcommand to the CLI's subparsers (``help_text``: the one line the
    CLI's own help shows for it, which it keeps without loading the simulator)."""
    cmd = sub.add_parser(
        "simulate",
        help=help_text,
        description="Presets: "
        + "; ".join(f"{p.name} ({p.description})" for p in traces.PRESETS.values())
        + ". Strategies: "
        + ", ".join(strategies.STRATEGIES)
        + ". A trace file is CSV: time_s,node,kind,repair_s.",
    )
    cmd.add_argument("--preset", default="high-failure-128", help="scenario (default %(default)s)")
    cmd.add_argument("--gpus", type=int, default=None, help="cluster size (default: the preset's)")
    cmd.add_argument("--days", type=float, default=None, help="simulated days (default: the preset's)")
    cmd.add_argument("--trace", type=Path, default=None, help="replay this CSV trace instead of generating one")
    cmd.add_argument("--rate", type=float, default=None, help="failures per node per second (generator)")
    cmd.add_argument("--repair-hours", type=float, default=None, help="mean repair time (generator)")
    cmd.add_argument("--seed", type=int, default=0, help="trace and remedy-failure seed")
    cmd.add_argument("--strategies", default=",".join(strategies.STRATEGIES), help="comma-separated subset")
    cmd.add_argument("--save-trace", type=Path, default=None, help="write the trace used as CSV")
    cmd.add_argument("--plot", type=Path, default=None, help="write accumulated WAF over time as PNG")
    cmd.add_argument(
        "--no-dp-hint",
        action="store_true",
        help="skip the planner's size-only DP hint (a never-binding cap; faster on 10,000+ nodes)",
    )
    cmd.add_argument(
        "--reform-model-parallel",
        action="store_true",
        help="price a tensor/pipeline-parallel job's restart at data-parallel degree 1 (no peer holds a lost "
        "shard) as a reform from a peer too, instead of the snapshot restart the coordinator does",
    )
    cmd.add_argument(
        "--replicated-optimizer",
        action="store_true",
        help="run the large jobs without Megatron's distributed optimizer (meta-16k, scale-100k and llama3-405b "
        "shard it by default)",
    )
    cmd.add_argument(
        "--replication",
        type=int,
        choices=(1, 2),
        default=None,
        help="distributed-optimizer jobs' training.replication: 2 (default) keeps a buddy copy of every shard on "
        "another node; 1 keeps none (a lost shard from the snapshot or the checkpoint)",
    )
    cmd.add_argument(
        "--elastic-factor",
        type=float,
        default=None,
        help="failure-free throughput of oobleck, varuna and bamboo relative to Megatron's (default 1.0)",
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    if args.gpus is not None and args.gpus <= 0:
        raise InvalidArgument("gpus", "must be positive")
    if args.elastic_factor is not None and not 0.0 < args.elastic_factor <= 1.0:
        raise InvalidArgument("elastic-factor", "must lie in (0, 1]")
    scenario = sim.Scenario(
        preset=args.preset,
        gpus=args.gpus,
        days=args.days,
        seed=args.seed,
        trace_file=args.trace,
        failure_rate_per_node_per_s=args.rate,
        repair_mean_s=None if args.repair_hours is None else args.repair_hours * 3600.0,
        strategies=sim.strategy_names(args.strategies),
        unicron=strategies.UnicronSettings(
            dp_hint=not args.no_dp_hint, model_parallel_reform=args.reform_model_parallel
        ),
        elastic=strategies.ElasticSettings.uniform(args.elastic_factor),
        distributed_optimizer=False if args.replicated_optimizer else None,
        replication=args.replication or 0,
    )
    outcome = sim.run(scenario)
    if args.save_trace is not None:
        traces.save_csv(args.save_trace, outcome.trace)
    free = outcome.cluster.failure_free_waf()
    if args.plot is not None:
        report.plot([(f"{outcome.cluster.gpus} GPUs, {outcome.duration_s / 86400:g} days", outcome.results)], args.plot)
    if getattr(args, "json", False):
        data = {
            "preset": args.preset,
            "gpus": outcome.cluster.gpus,
            "days": outcome.duration_s / 86400,
            "failures": len(outcome.trace),
            "failure_rate_per_node_per_s": outcome.failure_rate_per_node_per_s,
            "timings": outcome.timings.as_dict(),
            "runs": report.rows(outcome.results, free),
        }
        out.write(json.dumps(data) + "\n")
        return 0
    title = (
        f"{outcome.cluster.gpus} GPUs ({outcome.cluster.nodes} nodes, {len(outcome.cluster.jobs)} jobs), "
        f"{outcome.duration_s / 86400:g} days, {len(outcome.trace)} failures"
    )
    out.write(report.table(outcome.results, free, title) + "\n")
    return 0
