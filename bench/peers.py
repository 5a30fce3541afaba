"""The real peers, side by side in one run: the same model (examples/digits, the MLP), the same
fault (one rank killed after iteration k), the same machine, under torchrun (TorchElastic), torchft
and Unicron.

    python -m bench.peers [--quick] [--repeats N] [--peers torchrun,torchft,unicron] [--steps 15-25]

* torchrun: `torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m bench.peers_torchrun
  --checkpoint-dir DIR`: examples/digits/train.py with a rendezvous store per restart attempt (see
  bench/peers_torchrun.py for why), a checkpoint every 10 iterations (the example's own); no
  Unicron process: the example's Session runs on torchrun's world and logs each iteration. One
  rank is SIGKILLed after rank 0 logged iteration k; torchrun stops the other and restarts the
  whole worker group, which resumes from the last checkpoint. Measured from the kill, on rank 0's log lines as they
  arrive: the first iteration after the restart, the return to iteration k, the iterations
  recomputed, and the final parameters against a failure-free run's.
* torchft 0.2.0, in a venv of its own (`.cache/bench-peers-venv`, made by `make bench-peers`):
  two replica groups of one rank each (bench/peers_torchft.py) under one lighthouse. One group's
  process is SIGKILLed after its step k and started again at once (what its supervisor would do);
  it heals from the live group. Measured from the kill: the restarted group's first committed step,
  the steps the surviving group committed meanwhile, the samples dropped (a step committed with
  fewer participants than groups leaves the missing groups' share of the batch untrained), and the
  final parameters and loss against a failure-free torchft run.
* Unicron: reattempt, restart and resize of the same model through `python -m bench.transition
  --model digits:WIDTH` (a LocalCluster of real processes), read from its JSON.

Results go to bench/results/peers.json; a table goes to stdout. A peer that cannot run (the torchft
venv missing) is a row marked skipped with the reason. The exit status is 0 whatever the numbers:
a measurement, not a test. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import log, write_results
from bench.peers_report import (
    EXACT_TOLERANCE,
    GLOBAL_BATCH,
    WORLD,
    FtEvent,
    format_table,
    parse_torchft_line,
    parse_trainer_line,
    relative_difference,
    skipped_row,
    summarize_samples,
    torchft_recovery,
    torchrun_recovery,
    unicron_rows,
)
from bench.transition import draw_steps
from unicron.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "peers.json"
FSDP_RESULTS = RESULTS.with_name("peers-fsdp.json")
PEERS_VENV = ROOT / ".cache" / "bench-peers-venv"
PEERS = ["torchrun", "torchft", "unicron"]
UNICRON_ACTIONS = ["reattempt", "restart", "resize"]
# The digits example checkpoints every 10 iterations when given a directory (examples/digits).
CHECKPOINT_INTERVAL = 10
STEP_RANGE = (15, 25)
ITERATIONS = 40
# torchft's live group trains on while the other restarts (tens of seconds here, at about 50 ms a
# step): its run must outlast that, or the restarted group finds the job finished and nothing heals.
TORCHFT_ITERATIONS = 1000
HIDDEN = 1024
# examples/digits/train.py's default seed: the torchft script uses the same, so that the
# failure-free runs of both agree (same initial weights, same batches).
MODEL_SEED = 1234
# torchft's lighthouse, as torchft's README starts it (heartbeat timeout: its 5 s default).
LIGHTHOUSE_ARGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
TORCHRUN_MAX_RESTARTS = 3
RUN_TIMEOUT_S = 300.0

# ---- running the peers -------------------------------------------------------------------


@dataclass
class Settings:
    repeats: int
    steps: list[int]  # the iteration after which each repeat fails
    hidden: int = HIDDEN
    iterations: int = ITERATIONS
    torchft_iterations: int = TORCHFT_ITERATIONS
    # torchft's own DDP gradient hook, which crashes a live group whose all-reduce fails
    # (bench/peers_torchft.py); off: the fixed hook, so that the heal can be measured.
    torchft_stock_ddp: bool = False
    # The MLP sharded with FSDP2 by every peer (torchft: HSDP across its replica groups).
    fsdp: bool = False
    seed: int = 0
    timeout_s: float = RUN_TIMEOUT_S


@dataclass
class Output:
    """A process's stdout and stderr lines, each with its arrival time, read by a thread (so a
    line is timed when it is written, not when the bench gets round to it)."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> Output:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "a") as out:
            for raw in self.proc.stdout:
                text = raw.decode(errors="replace")
                now = time.time()
                out.write(text)
                with self.changed:
                    self.lines.append((now, text))
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, found: Callable[[list[tuple[float, str]]], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not found(self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not found(self.lines)):
                    return found(self.lines)
                self.changed.wait(min(left, 0.5))
            return True


def _spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Output:
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # Its own process group: a run that times out is ended with everything it started.
        start_new_session=True,
    )
    return Output(proc, log_path).start()


def _end(output: Output, timeout_s: float) -> int:
    """Waits for the process; past the timeout ends its process group (it started them all)."""
    try:
        return output.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(output.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output.proc.wait()
        raise


def _load_params(path: Path) -> dict[str, Any]:
    """A final model's whole tensors, flattened: torchft's saved parameters, or the digits
    example's checkpoint (``iter_N/tp0_pp0.pt``: its model; sharded with FSDP2, the model is
    cut from every rank's shard beside it)."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    model = dict(state["model"] if "model" in state else state)
    if not model and "model" in state:
        model = _sharded_params(path.parents[1])
    return {name: tensor.reshape(-1) for name, tensor in model.items()}


def _sharded_params(root: Path) -> dict[str, Any]:
    """The newest checkpoint's parameters under ``root``, cut whole from every rank's shard."""
    from unicron.trainer import checkpoint
    from unicron.trainer.optimizer_shards import cut, shards_of

    (iteration, *_) = checkpoint.list_complete(root)
    layout = checkpoint.layout_of_config(checkpoint.read_manifest(root, iteration)["layout"]["model"], 1, 1)
    found = checkpoint.find_latest(root, layout)
    if found is None:
        raise RuntimeError(f"no usable checkpoint under {root}")
    shards = shards_of(found[1])
    numels = {name: piece["numel"] for shard in shards for name, piece in shard["pieces"].items()}
    return {name: t["param"] for name, t in cut(shards, {n: (k, 0, k) for n, k in numels.items()}).items()}


class TorchrunSide:
    """The digits example under torchrun with --max-restarts and a checkpoint every 10 iterations."""

    def __init__(self, work: Path, settings: Settings) -> None:
        self.work = work
        self.settings = settings
        self.reference: dict[str, Any] | None = None

    def _run(self, name: str, kill_after: int | None, rank: int) -> tuple[Output, float | None, Path]:
        checkpoints = self.work / name / "checkpoints"
        checkpoints.mkdir(parents=True)
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(WORLD), "--max-restarts", str(TORCHRUN_MAX_RESTARTS),
            "-m", "bench.peers_torchrun", "--iterations", str(self.settings.iterations),
            "--hidden", str(self.settings.hidden), "--checkpoint-dir", str(checkpoints),
        ]  # fmt: skip
        if self.settings.fsdp:
            argv.append("--fsdp")
        output = _spawn(argv, self.work / name / "torchrun.log")
        killed: float | None = None
        if kill_after is not None:

            def reached(lines: list[tuple[float, str]]) -> bool:
                events = (parse_trainer_line(text, t) for t, text in lines)
                return any(e is not None and e.kind == "iteration" and e.iteration >= kill_after for e in events)

            if not output.wait_for(reached, self.settings.timeout_s):
                if output.proc.poll() is None:
                    os.killpg(output.proc.pid, signal.SIGKILL)
                    output.proc.wait()
                raise RuntimeError(f"rank 0 did not reach iteration {kill_after} (exit {output.proc.poll()})")
            victim = self._worker(output.proc.pid, rank)
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
        code = _end(output, self.settings.timeout_s)
        if code != 0:
            raise RuntimeError(f"torchrun exited {code}; log {output.log_path}")
        return output, killed, checkpoints / f"iter_{self.settings.iterations:08d}" / "tp0_pp0.pt"

    @staticmethod
    def _worker(torchrun_pid: int, rank: int) -> int:
        """The pid of torchrun's worker with RANK `rank` (its environment says which)."""
        import psutil

        for child in psutil.Process(torchrun_pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "bench.peers_torchrun" in " ".join(child.cmdline()):
                    return int(child.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        raise RuntimeError(f"no worker of rank {rank} under torchrun {torchrun_pid}")

    def measure_reference(self) -> None:
        _, _, final = self._run("reference", None, 0)
        self.reference = _load_params(final)

    def measure(self, index: int, step: int) -> dict[str, Any]:
        rank = index % WORLD
        sample: dict[str, Any] = {"drawn_step": step, "killed_rank": rank}
        try:
            output, killed, final = self._run(f"repeat-{index + 1}", step, rank)
            assert killed is not None
            events = [e for t, text in output.lines if (e := parse_trainer_line(text, t)) is not None]
            sample.update(torchrun_recovery(events, killed))
            sample["samples_dropped"] = 0  # a restart recomputes the lost iterations, it drops nothing
            if self.reference is not None:
                sample["relative_difference"] = relative_difference(_load_params(final), self.reference)
        except Exception as exc:  # noqa: BLE001 -- one failed sample must not end the bench
            sample["error"] = f"{type(exc).__name__}: {exc}"
        return sample


def torchft_unavailable(venv: Path = PEERS_VENV) -> str | None:
    """Why the torchft peer cannot run here, or None when it can."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no bench venv at {venv} (make bench-peers builds it: torch==2.13.0 torchft==0.2.0)"
    if not (venv / "bin" / "torchft_lighthouse").exists():
        return f"{venv} has no torchft_lighthouse"
    probe = subprocess.run(
        [str(python), "-c", "import torchft, torch, sklearn; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"torchft does not import in {venv}: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the lighthouse did not listen on {port} within {timeout_s:g}s")


class TorchftSide:
    """Two torchft replica groups of one rank (bench/peers_torchft.py) under one lighthouse."""

    def __init__(self, work: Path, settings: Settings, venv: Path = PEERS_VENV) -> None:
        self.work = work
        self.settings = settings
        self.venv = venv
        self.reference: dict[str, Any] | None = None
        self.reference_eval_loss: float | None = None

    def _group(self, directory: Path, lighthouse: str, group: int, incarnation: int, steps: int) -> Output:
        argv = [
            str(self.venv / "bin" / "python"), "-m", "bench.peers_torchft", "--group", str(group),
            "--groups", str(WORLD), "--lighthouse", lighthouse, "--steps", str(steps),
            "--hidden", str(self.settings.hidden), "--global-batch-size", str(GLOBAL_BATCH),
            "--seed", str(MODEL_SEED), "--out-params", str(directory / f"group{group}-{incarnation}.pt"),
        ]  # fmt: skip
        if self.settings.torchft_stock_ddp:
            argv.append("--stock-ddp")
        if self.settings.fsdp:
            argv.append("--fsdp")
        return _spawn(argv, directory / f"group{group}-{incarnation}.log")

    def _run(
        self, name: str, kill_after: int | None, victim: int, steps: int | None = None
    ) -> tuple[list[FtEvent], float | None, Path]:
        steps = steps or self.settings.torchft_iterations
        directory = self.work / name
        directory.mkdir(parents=True)
        port = free_port()
        lighthouse = _spawn(
            [str(self.venv / "bin" / "torchft_lighthouse"), *LIGHTHOUSE_ARGS, "--bind", f"127.0.0.1:{port}"],
            directory / "lighthouse.log",
        )
        groups: dict[tuple[int, int], Output] = {}
        killed: float | None = None
        try:
            _wait_listening(port, 30)
            address = f"http://127.0.0.1:{port}"
            for group in range(WORLD):
                groups[(group, 1)] = self._group(directory, address, group, 1, steps)
            if kill_after is not None:
                first = groups[(victim, 1)]

                def reached(lines: list[tuple[float, str]]) -> bool:
                    return any(
                        (e := parse_torchft_line(text, 1)) is not None
                        and e.event == "step"
                        and e.committed
                        and e.step >= kill_after
                        for _, text in lines
                    )

                if not first.wait_for(reached, self.settings.timeout_s):
                    raise RuntimeError(f"group {victim} did not commit step {kill_after}")
                killed = time.time()
                first.proc.send_signal(signal.SIGKILL)
                first.proc.wait()
                # What the group's supervisor does: start it again at once.
                groups[(victim, 2)] = self._group(directory, address, victim, 2, steps)
            for key, output in groups.items():
                if key == (victim, 1) and killed is not None:
                    continue
                code = _end(output, self.settings.timeout_s)
                if code != 0:
                    raise RuntimeError(f"group {key[0]} (start {key[1]}) exited {code}; log {output.log_path}")
        finally:
            for output in groups.values():
                if output.proc.poll() is None:
                    os.killpg(output.proc.pid, signal.SIGKILL)
                    output.proc.wait()
            lighthouse.proc.terminate()
            try:
                lighthouse.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                lighthouse.proc.kill()
                lighthouse.proc.wait()
        events = [
            e
            for (group, incarnation), output in groups.items()
            for _, text in output.lines
            if (e := parse_torchft_line(text, incarnation)) is not None
        ]
        events.sort(key=lambda e: e.time)
        survivor = next(g for g in range(WORLD) if g != victim or kill_after is None)
        return events, killed, directory / f"group{survivor}-1.pt"

    def measure_reference(self) -> None:
        events, _, final = self._run("reference", None, 0)
        self.reference = _load_params(final)
        done = [e.eval_loss for e in events if e.event == "done" and e.eval_loss is not None]
        self.reference_eval_loss = done[0] if done else None

    def cross_check(self, steps: int) -> dict[str, Any]:
        """The final parameters of a failure-free torchft run of `steps` (torchrun's length): that
        the two peers train the same thing is checked, not assumed."""
        _, _, final = self._run("cross-check", None, 0, steps)
        return _load_params(final)

    def measure(self, index: int, step: int) -> dict[str, Any]:
        victim = index % WORLD
        sample: dict[str, Any] = {"drawn_step": step, "killed_group": victim}
        try:
            events, killed, final = self._run(f"repeat-{index + 1}", step, victim)
            assert killed is not None
            sample.update(torchft_recovery(events, killed, victim))
            if sample["resume_s"] is None:
                raise RuntimeError(
                    "the restarted group committed no step with its peers: the live group finished first "
                    "(raise --torchft-iterations)"
                )
            # Nothing is recomputed: the live group never rolls back; the killed group's
            # uncommitted step is not redone, its share of the batch is dropped.
            sample["iterations_recomputed"] = 0
            sample["regain_s"] = sample["resume_s"]
            done = [e.eval_loss for e in events if e.event == "done" and e.eval_loss is not None]
            sample["eval_loss"] = done[0] if done else None
            if self.reference is not None:
                sample["relative_difference"] = relative_difference(_load_params(final), self.reference)
            if done and self.reference_eval_loss is not None:
                sample["eval_loss_delta"] = round(done[0] - self.reference_eval_loss, 6)
        except Exception as exc:  # noqa: BLE001 -- one failed sample must not end the bench
            sample["error"] = f"{type(exc).__name__}: {exc}"
        return sample


def run_unicron(run_dir: Path, settings: Settings, step_range: tuple[int, int], keep_logs: bool) -> dict[str, Any]:
    """bench.transition on the digits model, in its own process (it runs a LocalCluster and
    installs its own signal handlers), without its baseline: torchrun is this bench's baseline."""
    out = run_dir / "transition.json"
    argv = [
        sys.executable, "-m", "bench.transition", "--model",
        f"{'digits-fsdp' if settings.fsdp else 'digits'}:{settings.hidden}",
        "--actions", ",".join(UNICRON_ACTIONS), "--repeats", str(settings.repeats),
        "--checkpoint-interval", str(CHECKPOINT_INTERVAL), "--steps", f"{step_range[0]}-{step_range[1]}",
        "--seed", str(settings.seed), "--no-baseline", "--out", str(out),
    ]  # fmt: skip
    if keep_logs:
        argv.append("--keep-logs")
    with open(run_dir / "transition.log", "wb") as log_file:
        code = subprocess.run(argv, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0 or not out.exists():
        raise RuntimeError(f"bench.transition exited {code}; log {run_dir / 'transition.log'}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


# ---- main ----------------------------------------------------------------------------------

NOTES = [
    "torchrun: torchrun --standalone --nproc-per-node 2 --max-restarts 3 (monitor interval 0.1 s, its default) "
    "-m bench.peers_torchrun (examples/digits/train.py with a rendezvous store per restart attempt, see that file) "
    "--iterations 40 --checkpoint-dir DIR: the example's own checkpoint every 10 iterations; rank (repeat index mod "
    "2) SIGKILLed right after rank 0 logged the drawn iteration; times are the arrival of rank 0's log lines at the "
    "bench, minus the kill",
    "torchft: torchft 0.2.0 (its lighthouse binary, Manager, ProcessGroupGloo, DistributedDataParallel, "
    "OptimizerWrapper, HTTP checkpoint transport) in .cache/bench-peers-venv, bench/peers_torchft.py; 2 replica "
    "groups of 1 rank, each half of the 64-sample batch; the victim group (repeat index mod 2) SIGKILLed right "
    "after it committed the drawn step and started again at once by the bench (a supervisor's best case); "
    "lighthouse heartbeat timeout 5 s (default), join timeout 10 s, quorum tick 100 ms; gloo and RPC timeout 10 s. "
    "stall = the live group's next committed step (it waits for the lighthouse to drop the dead replica); resume = "
    "the restarted group's first committed step (after healing from the live group)",
    "torchft's DDP: torchft 0.2.0's gradient hook (torchft/ddp.py) asserts on the managed all-reduce's future "
    "chain, which a failed all-reduce never builds: a peer killed inside the all-reduce crashes the live group "
    "too (AssertionError in backward; seen in 2 of 2 kills at a random moment, and once in this bench's runs). "
    "Measured with a fixed hook (bench/peers_torchft.py) that leaves the failed step to should_commit(), as "
    "torchft intends; ddp_hook_errors counts where the fix was needed; --torchft-stock-ddp measures the stock hook",
    "torchft runs 1000 steps, not 40: the live group does not wait, and at about 50 ms a step it would finish a "
    "40-step run long before the restarted process is back; the samples it drops are its step rate times the "
    "restarted group's downtime, so a model whose steps take seconds drops proportionally fewer",
    "samples dropped (torchft): on every committed step, (groups - participants) x 32 samples (the participants "
    "that Manager.num_participants() reported for the step); the job's trajectory changes: the final parameters and "
    "the loss over all 1,797 digits are compared with a failure-free torchft run of the same length "
    "(eval_loss_delta_p50: faulted minus failure-free)",
    "exact: the final parameters within 1e-6 relative of a failure-free run of the same peer, every tensor; "
    "reference_cross_check: a failure-free torchft run of torchrun's 40 iterations against torchrun's, so the two "
    "peers are known to train the same model on the same batches",
    "unicron: python -m bench.transition --model digits:WIDTH --checkpoint-interval 10 --steps LOW-HIGH "
    "--no-baseline (torchrun is this bench's baseline): reattempt (collective timeout in the all-reduce), restart "
    "(the rank's process exits), resize (ECC error: node isolated, job shrunk 2 -> 1); times from the incident's "
    "detection (detection itself: bench-detect, a process death in under 0.3 s p95), failure iterations drawn by "
    "its own seed in the same range; samples dropped 0 by construction (every iteration trains the whole global "
    "batch, re-split over the ranks it has)",
    "every process start imports torch (and under torchrun and Unicron, the trainer library with Megatron-Core): "
    "on this shared 2-core machine that start-up dominates torchrun's and torchft's restart time, and other load "
    "moves every number",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat per peer")
    parser.add_argument("--repeats", type=int, default=None, help="failures per peer and remedy (default 3)")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--steps", default=f"{STEP_RANGE[0]}-{STEP_RANGE[1]}", help="range of failure iterations")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the MLP's width (1024: 1.1M parameters)")
    parser.add_argument("--iterations", type=int, default=ITERATIONS, help="iterations of each torchrun run")
    parser.add_argument(
        "--torchft-iterations", type=int, default=TORCHFT_ITERATIONS, help="committed steps of each torchft run"
    )
    parser.add_argument(
        "--torchft-stock-ddp",
        action="store_true",
        help="torchft 0.2.0's own DDP gradient hook (a failed all-reduce crashes the live group too)",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help=f"every peer shards the MLP with FSDP2 (torchft: HSDP over its groups); results default to {FSDP_RESULTS}",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn failure iterations")
    parser.add_argument("--venv", type=Path, default=PEERS_VENV, help="the torchft venv")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON results (default {RESULTS})")
    parser.add_argument("--keep-logs", action="store_true", help="keep the run directory")
    args = parser.parse_args(argv)
    args.out = args.out or (FSDP_RESULTS if args.fsdp else RESULTS)
    peers = [p for p in args.peers.split(",") if p]
    if set(peers) - set(PEERS):
        parser.error(f"unknown peers: {', '.join(sorted(set(peers) - set(PEERS)))}")
    low_text, _, high_text = args.steps.partition("-")
    try:
        step_range = (int(low_text), int(high_text))
    except ValueError:
        parser.error(f"--steps must be LOW-HIGH, got {args.steps!r}")
    if not 0 < step_range[0] <= step_range[1] < args.iterations - 1:
        parser.error(f"--steps must lie within 1..{args.iterations - 2}")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    steps = draw_steps(["peers"], repeats, args.seed, *step_range, interval=CHECKPOINT_INTERVAL)["peers"]
    settings = Settings(
        repeats=repeats,
        steps=steps,
        hidden=args.hidden,
        iterations=args.iterations,
        torchft_iterations=args.torchft_iterations,
        torchft_stock_ddp=args.torchft_stock_ddp,
        fsdp=args.fsdp,
        seed=args.seed,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    began = time.monotonic()
    environment: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    log(f"run directory {run_dir}; failure iterations {steps}")
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    torchrun = TorchrunSide(run_dir / "torchrun", settings) if "torchrun" in peers else None
    torchft: TorchftSide | None = None
    if "torchft" in peers:
        reason = torchft_unavailable(args.venv)
        if reason is None:
            torchft = TorchftSide(run_dir / "torchft", settings, args.venv)
        else:
            log(f"torchft skipped: {reason}")
            rows.append(skipped_row("torchft", reason))
    try:
        # Failure-free references first, then the repeats interleaved (torchrun, torchft at the
        # same iteration), so that both peers meet the same background load.
        references: dict[str, str] = {}
        for name, side in (("torchrun", torchrun), ("torchft", torchft)):
            if side is None:
                continue
            try:
                side.measure_reference()
                log(f"{name}: failure-free reference done")
            except Exception as exc:  # noqa: BLE001 -- the repeats still measure the times
                references[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name}: failure-free reference failed: {exc}")
        extra["reference_errors"] = references
        if torchft is not None:
            extra["torchft_reference_eval_loss"] = torchft.reference_eval_loss
        if torchrun is not None and torchft is not None and torchrun.reference:
            try:
                same = relative_difference(torchft.cross_check(settings.iterations), torchrun.reference)
                extra["reference_cross_check"] = {
                    "iterations": settings.iterations,
                    "torchft_vs_torchrun_relative_difference": same,
                }
                log(f"failure-free torchft vs torchrun after {settings.iterations} iterations: {same:.2e}")
            except Exception as exc:  # noqa: BLE001
                extra["reference_cross_check"] = {"error": f"{type(exc).__name__}: {exc}"}
        torchrun_samples: list[dict[str, Any]] = []
        torchft_samples: list[dict[str, Any]] = []
        for index, step in enumerate(steps):
            if torchrun is not None:
                torchrun_samples.append(torchrun.measure(index, step))
                log(f"torchrun #{index + 1} step {step}: {_brief(torchrun_samples[-1])}")
            if torchft is not None:
                torchft_samples.append(torchft.measure(index, step))
                log(f"torchft  #{index + 1} step {step}: {_brief(torchft_samples[-1])}")
        if torchrun is not None:
            rows.append(
                summarize_samples(
                    "torchrun",
                    "restart all, checkpoint",
                    torchrun_samples,
                    "measured: final parameters vs a failure-free torchrun run",
                    "SIGKILL",
                )
            )
        if torchft is not None:
            rows.append(
                summarize_samples(
                    "torchft",
                    "restart group, heal",
                    torchft_samples,
                    "measured: final parameters vs a failure-free torchft run",
                    "SIGKILL",
                )
            )
        if "unicron" in peers:
            try:
                transition = run_unicron(run_dir, settings, step_range, args.keep_logs)
                rows.extend(unicron_rows(transition, settings.fsdp))
                extra["unicron_transition"] = {
                    k: transition.get(k) for k in ("settings", "environment", "targets_met") if k in transition
                }
            except Exception as exc:  # noqa: BLE001
                rows.append(skipped_row("unicron", f"{type(exc).__name__}: {exc}"))
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 -- report what was measured before it broke
        log(f"bench aborted: {type(exc).__name__}: {exc}")
        environment["aborted"] = f"{type(exc).__name__}: {exc}"
    environment["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    environment["wall_s"] = round(time.monotonic() - began, 1)
    if args.keep_logs:
        log(f"logs kept in {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    report: dict[str, Any] = {
        "rows": rows,
        "settings": {
            **asdict(settings),
            "peers": peers,
            "step_range": list(step_range),
            "checkpoint_interval": CHECKPOINT_INTERVAL,
            "world": WORLD,
            "global_batch_size": GLOBAL_BATCH,
            "model_seed": MODEL_SEED,
            "exact_tolerance": EXACT_TOLERANCE,
            "lighthouse_args": LIGHTHOUSE_ARGS,
            "torchrun_max_restarts": TORCHRUN_MAX_RESTARTS,
        },
        **extra,
        "environment": environment,
        "notes": NOTES,
    }
    write_results(args.out, report)
    print(format_table(report))
    print(f"\nwrote {args.out} ({environment['wall_s']:.0f} s)")
    return 0


def _brief(sample: dict[str, Any]) -> str:
    keys = ("resume_s", "regain_s", "iterations_recomputed", "samples_dropped", "survivor_steps_meanwhile")
    parts = [f"{k} {sample[k]}" for k in keys if k in sample]
    if "relative_difference" in sample:
        parts.append(f"rel.diff {sample['relative_difference']:.2e}")
    if sample.get("error"):
        parts.append(f"error {sample['error']}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
