"""What a simulation reports: a table, JSON rows and a PNG plot of accumulated WAF over time.

Ratios are Unicron's WAF-seconds over each strategy's (``ratio_unicron_over``): above 1, Unicron
trained more. ``efficiency`` is a strategy's WAF-seconds over its own failure-free run's; ``ettr``
(effective training time ratio) the share of the wall time its jobs trained, weighted by their
GPUs (``runner.RunResult.ettr``). ``replans`` counts re-plans of the whole cluster (planner
calls); ``jobs_changed_without_failure`` the changes those re-plans made to jobs no failure had
hit. The cost split per strategy is the coordinator's cost model summed over the
incidents (``runner.RunResult.cost_split``), per incident, in units of the cluster's
failure-free WAF x seconds (``cluster-s``: seconds of the whole cluster's failure-free work).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unicron_sim.runner import RunResult

DAY_S = 86_400.0


def ratios(results: Sequence[RunResult], reference: str = "unicron") -> dict[str, float | None]:
    """Reference WAF-seconds over each strategy's; None when either is missing or 0."""
    base = next((r.waf_seconds for r in results if r.strategy == reference), None)
    return {r.strategy: (base / r.waf_seconds if base and r.waf_seconds else None) for r in results}


def rows(results: Sequence[RunResult], failure_free_waf: float) -> list[dict[str, Any]]:
    """One JSON-ready row per strategy. Costs are in WAF-seconds and, for reading, in
    seconds of the whole cluster's failure-free WAF per incident (``*_cluster_s``)."""
    by = ratios(results)
    out = []
    for r in results:
        split = r.cost_split()
        ratio = by.get(r.strategy)
        n = max(1.0, split["incidents"])
        unit = failure_free_waf or 1.0
        out.append(
            {
                "strategy": r.strategy,
                "waf_flops_seconds": r.waf_seconds,
                "ratio_unicron_over": round(ratio, 4) if ratio else None,
                "efficiency": round(r.efficiency, 4),
                "ettr": round(r.ettr, 5),
                "ettr_min_job": round(min(r.ettr_by_job.values(), default=0.0), 5),
                "failure_free_waf_flops_seconds": r.failure_free_waf_seconds,
                "incidents": int(split["incidents"]),
                "detection_waf_seconds": split["detection_ws"],
                "transition_waf_seconds": split["transition_ws"],
                "sub_healthy_waf_seconds": split["sub_healthy_ws"],
                "nodes_taken_out": r.nodes_taken_out,
                "replans": r.replans,
                "jobs_changed_without_failure": int(split["replans"]),
                "changes_without_failure_waf_seconds": split["replan_transition_ws"] + split["replan_sub_healthy_ws"],
                "per_incident_cluster_s": {
                    "detection": round(split["detection_ws"] / n / unit, 3),
                    "transition": round(split["transition_ws"] / n / unit, 3),
                    "sub_healthy": round(split["sub_healthy_ws"] / n / unit, 3),
                },
                "failures": r.failures,
                "failures_on_nodes_out": r.failures_ignored,
                "counters": r.counters,
                "planner": r.planner,
                "wall_s": round(r.wall_s, 3),
            }
        )
    return out


def table(results: Sequence[RunResult], failure_free_waf: float, title: str = "") -> str:
    """A fixed-width table: one line per strategy."""
    header = (
        f"{'strategy':<14} {'WAF-s':>10} {'eff':>6} {'ETTR':>7} {'U/x':>6} {'incid':>6} {'replan':>6} "
        f"{'det/inc':>8} {'trans/inc':>9} {'sub/inc':>8} {'wall s':>7}"
    )
    lines = [title, header, "-" * len(header)] if title else [header, "-" * len(header)]
    for row in rows(results, failure_free_waf):
        per = row["per_incident_cluster_s"]
        ratio = row["ratio_unicron_over"]
        lines.append(
            f"{row['strategy']:<14} {row['waf_flops_seconds']:>10.3e} {row['efficiency']:>6.3f} "
            f"{100 * row['ettr']:>6.2f}% {(f'{ratio:.2f}' if ratio else '-'):>6} {row['incidents']:>6} "
            f"{row['replans']:>6} {per['detection']:>8.2f} {per['transition']:>9.2f} {per['sub_healthy']:>8.2f} "
            f"{row['wall_s']:>7.2f}"
        )
    lines.append(
        "eff: WAF over the strategy's failure-free run; ETTR: share of the wall time trained; U/x: Unicron's "
        "WAF-seconds over the strategy's; replan: cluster re-plans; det/trans/sub per incident in seconds of "
        "the cluster's failure-free WAF"
    )
    return "\n".join(lines)


def plot(panels: Sequence[tuple[str, Sequence[RunResult]]], path: Path) -> None:
    """Accumulated WAF-seconds over days, one panel per scenario, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; must precede pyplot
    import matplotlib.pyplot as plt

    count = max(1, len(panels))
    fig, axes = plt.subplots(1, count, figsize=(5.2 * count, 4.0), squeeze=False)
    for ax, (title, results) in zip(axes[0], panels, strict=False):
        for r in results:
            days = [t / DAY_S for t, _ in r.timeline]
            ax.plot(days, [w for _, w in r.timeline], label=r.strategy, linewidth=1.6)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("days")
        ax.set_ylabel("accumulated WAF (FLOP)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
