"""`make demo`: the whole system on this machine. Prepares the GPT example's data (the Python
standard library's sources, BPE-tokenized), starts Redis, the coordinator, two planner replicas
and two agents, submits a small GPT job spanning both agents, kills one of its ranks partway
through (fault injection) so the self-healing loop shows, follows the job to its end, prints a
summary with the incident and what it cost and a few tokens the trained model writes, and stops
everything."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from unicron import jobspec
from unicron.cli import INCIDENT_HEADERS, follow, incident_row, print_job, state_name, table
from unicron.client import ClientError
from unicron.errors import UnicronError
from unicron.faults import parse_fault
from unicron.v1 import common_pb2
from unicron_dev.localcluster import ROOT, LocalCluster


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", default=str(ROOT / "examples" / "gpt-tiny.yaml"))
    parser.add_argument("--run-dir", default=str(ROOT / "run" / "demo"))
    parser.add_argument(
        "--fault",
        default="crash@12",
        help="fault to inject into the job's last rank (kind[:arg][@iteration]); 'none' for a clean run",
    )
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    spec = jobspec.normalized(jobspec.load_spec_file(args.spec))
    started = time.monotonic()
    if spec.data.path and not prepare_data(spec):
        return 1
    say(f"starting Redis, coordinator, 2 planners, 2 agents (logs in {run_dir})")
    fault = None if args.fault == "none" else parse_fault(args.fault, jobspec.world_size(spec) - 1)
    cluster = LocalCluster(
        run_dir, redis_url=os.environ.get("UNICRON_REDIS_URL"), fault_injection=fault is not None, warm_spares=1
    )
    code = 1
    try:
        cluster.start()
        print(f"every call over mutual TLS with tokens (a development CA in {run_dir / 'certs'})")
        with cluster.client() as client:
            cluster.wait_nodes(client.nodes, 2)
            say("nodes")
            nodes = client.nodes()
            table([[n.node_id, n.address, str(n.slots)] for n in nodes], ["NODE", "AGENT", "SLOTS"], sys.stdout)
            say(f"submitting {args.spec}")
            job = client.submit(spec)
            print(
                f"submitted {job.job_id}: {spec.program.entry_point or spec.program.command[0]}, "
                f"{jobspec.world_size(spec)} ranks, {spec.training.iterations} iterations"
            )
            if fault is not None:
                # Faults go to live trainers: wait for the first iteration.
                while client.get(job.job_id).state in (common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED):
                    time.sleep(0.1)
                node = client.inject(job.job_id, fault)
                print(f"armed fault {args.fault} on rank {fault.rank} ({node}): watch the job heal itself")
            watched = follow(client, job.job_id, sys.stdout, as_json=False)
            job = client.get(job.job_id)
            say("summary")
            print_job(job, sys.stdout)
            found = client.incidents(job.job_id)
            if found:
                say("incidents")
                table([incident_row(i) for i in found], INCIDENT_HEADERS, sys.stdout)
            trend = (
                f"loss {watched.first_loss:.4f} -> {watched.last_loss:.4f}"
                if watched.first_loss is not None and watched.last_loss is not None
                else "no progress"
            )
            print(
                f"\nresult: {state_name(job.state)} in {time.monotonic() - started:.0f}s, "
                f"{job.progress.iteration} iterations, {trend}"
            )
            code = 0 if job.state == common_pb2.JOB_STATE_SUCCEEDED else 1
            if code == 0 and spec.data.tokenizer:
                show_generation(spec, run_dir / "agents" / "checkpoints" / job.job_id)
    except (UnicronError, ClientError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    finally:
        say("stopping every process")
        leftovers = cluster.stop()
        if leftovers:
            print(f"had to kill {len(leftovers)} process(es) that outlived their service: {', '.join(leftovers)}")
            code = code or 1
        else:
            print("stopped: no Unicron process left running")
    return code


def _absolute(path: str) -> str:
    return path if not path or Path(path).is_absolute() else str(ROOT / path)


def prepare_data(spec: common_pb2.JobSpec) -> bool:
    """Builds the spec's data set when it is missing (examples.gpt.data), and makes its paths
    absolute, as every agent must read them."""
    spec.data.path, spec.data.tokenizer = _absolute(spec.data.path), _absolute(spec.data.tokenizer)
    out = Path(spec.data.path).parent
    say(f"preparing the data in {out} (once: Python's standard library, BPE-tokenized)")
    done = subprocess.run(
        [sys.executable, "-m", "examples.gpt.data", "--out", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    print((done.stdout or done.stderr).strip().splitlines()[-1] if (done.stdout or done.stderr) else "")
    return done.returncode == 0


def show_generation(spec: common_pb2.JobSpec, checkpoints: Path, prompt: str = "def ") -> None:
    """A few tokens the trained model writes after ``prompt`` (examples.gpt.generate)."""
    say(f"what the trained model writes after {prompt!r}")
    argv = [sys.executable, "-m", "examples.gpt.generate", "--checkpoint", str(checkpoints)]
    argv += ["--tokenizer", spec.data.tokenizer, "--prompt", prompt, "--", *spec.program.args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout.strip() if done.returncode == 0 else f"(no generation: {done.stderr.strip()[-300:]})")


if __name__ == "__main__":
    sys.exit(main())
