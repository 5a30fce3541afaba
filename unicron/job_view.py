"""A job as people read it (`unicron get`, the demo's summary): its state, shape, program,
the optimization it runs, its progress, placement, remedies and history; and the rows of
`unicron queue` and `unicron quota`."""

from __future__ import annotations

import time
from typing import TextIO

from unicron import jobspec
from unicron.v1 import common_pb2, job_service_pb2


def state_name(state: int) -> str:
    return common_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def remedy_name(remedy: int) -> str:
    return common_pb2.Remedy.Name(remedy).removeprefix("REMEDY_").lower() if remedy else "-"


def optimization_line(spec: common_pb2.JobSpec) -> str:
    """What the job's updates are, defaults filled: a user sees the clipping, betas and the
    gradient reduction the runtime applies although the program never said them."""
    t = jobspec.with_defaults(spec).training
    if t.optimizer == "sgd":
        parts = [f"sgd (momentum {t.sgd_momentum:g})"]
    else:
        parts = [f"adam (betas {t.adam_beta1:g}, {t.adam_beta2:g}, eps {t.adam_eps:g})"]
        if t.distributed_optimizer:
            parts[0] += ", distributed over the data-parallel ranks"
            if (t.replication or 2) > 1:
                parts[0] += ", each shard's buddy copy on another node or failure domain"
    parts.append(f"clip grad norm {t.clip_grad:g}" if t.clip_grad else "no clipping")
    parts.append(f"weight decay {t.weight_decay:g}")
    schedule = f"lr {t.learning_rate:g} {t.lr_decay_style}"
    if t.lr_warmup_iterations:
        schedule += f" after {t.lr_warmup_iterations} warm-up iterations"
    if t.lr_decay_style != "constant":
        schedule += f" to {t.min_learning_rate:g}"
    parts.append(schedule)
    if t.precision == "fp32":
        parts.append("fp32")
    else:
        parts.append(f"{t.precision} with fp32 main parameters, gradients reduced in fp32")
    if t.overlap_grad_reduce:
        parts.append("gradient reduce overlapped with backward")
    return "; ".join(parts)


def print_job(job: common_pb2.Job, out: TextIO) -> None:
    spec = job.spec
    par = spec.parallelism
    out.write(f"job        {job.job_id} ({spec.name})\n")
    out.write(f"state      {state_name(job.state)}: {job.reason}\n")
    for condition in job.conditions:
        noun = condition.type.removesuffix("_failing")
        out.write(
            f"condition  {noun} failing since iteration {condition.since_iteration} "
            f"(rank {condition.rank}): {condition.message}\n"
        )
    out.write(
        f"shape      TP {par.tensor} x PP {par.pipeline} x DP {par.data} "
        f"(DP {par.min_data}..{par.max_data}), weight {spec.weight:g}"
        + (f" ({spec.priority_class}{', preemptible' if spec.preemptible else ''})" if spec.priority_class else "")
        + "\n"
    )
    program = spec.program
    what = program.entry_point or " ".join(program.command)
    out.write(f"program    {' '.join([what, *program.args])}\n")
    if spec.data.path:
        out.write(
            f"data       {spec.data.path}"
            + (f" (tokenizer {spec.data.tokenizer})" if spec.data.tokenizer else "")
            + "\n"
        )
    out.write(f"optimizer  {optimization_line(spec)}\n")
    if job.failure_detail:
        out.write("error      the program's traceback:\n")
        out.write("".join(f"           {line}\n" for line in job.failure_detail.rstrip().splitlines()))
    progress = job.progress
    if progress.iteration:
        out.write(
            f"progress   iteration {progress.iteration}/{spec.training.iterations}, loss {progress.loss:.4f}, "
            f"{progress.iteration_seconds:.2f}s/it, {progress.flops_per_second / 1e9:.2f} GFLOP/s, "
            f"{progress.tokens} tokens\n"
        )
        out.write(f"training   {training_line(progress)}\n")
    if progress.measured_flops_per_second:
        measured = sorted(progress.measured_flops_per_second.items())
        out.write(
            "throughput "
            + ", ".join(f"{size} ranks {flops / 1e9:.2f} GFLOP/s" for size, flops in measured)
            + " (measured; the planner sizes the job by these)\n"
        )
    states = {w.node_id: w.state for w in job.workers if w.generation == job.assignment.generation}
    for worker in job.assignment.workers:
        status = (
            common_pb2.WorkerState.Name(states[worker.node_id]).removeprefix("WORKER_STATE_").lower()
            if (worker.node_id in states)
            else ""
        )
        out.write(
            f"placement  {worker.node_id}: ranks {', '.join(map(str, worker.ranks))}"
            + (f" ({status}, generation {job.assignment.generation})" if status else "")
            + (f" [{worker.failure_domain}]" if worker.failure_domain else "")
            + "\n"
        )
    if job.assignment.copies:
        out.write(f"copies     {copies_line(job.assignment)}\n")
    if job.remedies:
        out.write("remedies\n")
        for attempt in job.remedies:
            stamp = time.strftime("%H:%M:%S", time.localtime(attempt.started.ToNanoseconds() / 1e9))
            took = (
                f"resumed after {(attempt.resumed.ToNanoseconds() - attempt.started.ToNanoseconds()) / 1e9:.1f}s"
                if attempt.HasField("resumed")
                else "not resumed"
            )
            out.write(f"  {stamp}  {remedy_name(attempt.remedy):<11} {attempt.incident_id}  {took}: {attempt.reason}\n")
    out.write("history\n")
    for change in job.history:
        stamp = time.strftime("%H:%M:%S", time.localtime(change.time.ToNanoseconds() / 1e9))
        out.write(f"  {stamp}  {state_name(change.state):<10} {change.reason}\n")


def training_line(progress: common_pb2.JobProgress) -> str:
    """The last iteration's learning rate, gradient norm and loss-function report, fp16's
    skipped updates and the newest validation loss, as one line."""
    parts = [f"lr {progress.learning_rate:.3g}"]
    if progress.HasField("grad_norm"):
        parts.append(f"grad norm {progress.grad_norm:.4g}")
    parts += [f"{name} {value:.4g}" for name, value in sorted(progress.metrics.items())]
    if progress.skipped_steps:
        parts.append(f"{progress.skipped_steps} skipped")
    if progress.validation_iteration:
        parts.append(f"validation loss {progress.validation_loss:.4f} (iteration {progress.validation_iteration})")
    return ", ".join(parts)


def copies_line(assignment: common_pb2.Assignment) -> str:
    """Where the buddy copies are, and whose each rank keeps (up to eight ranks shown)."""
    kept = [(rank, by) for rank, by in enumerate(assignment.copy_kept_by) if by >= 0]
    shown = ", ".join(f"{rank}->{by}" for rank, by in kept[:8]) + (", ..." if len(kept) > 8 else "")
    return assignment.copies + (f" (rank -> keeper: {shown})" if shown else "")


QUEUE_HEADERS = ["#", "ID", "NAME", "CLASS", "TEAM", "WEIGHT", "SLOTS", "WAITED", "WAITING FOR"]
QUOTA_HEADERS = ["TEAM", "GUARANTEE", "MAY BORROW", "USED", "BORROWED", "WAITING JOBS"]


def quota_row(team: job_service_pb2.TeamQuota) -> list[str]:
    return [
        team.team,
        str(team.guarantee),
        "any idle" if team.borrow_unlimited else str(team.borrow_limit),
        str(team.used),
        str(team.borrowed),
        str(team.waiting_jobs),
    ]


def queue_row(entry: job_service_pb2.QueueEntry) -> list[str]:
    """One waiting job; another user's shows as "(another user's)", its place and class only."""
    mine = bool(entry.job_id)
    return [
        str(entry.position),
        entry.job_id or "-",
        entry.name if mine else "(another user's)",
        entry.priority_class or "-",
        entry.team or "-",
        f"{entry.weight:g}",
        str(entry.min_slots),
        f"{entry.waited_seconds:.0f}s",
        entry.waiting_for if mine else "-",
    ]
