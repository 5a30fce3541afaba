"""`python -m services.trainer`: one rank of a job, started by its node's agent.

Speaks the agent protocol: a hello, one report per iteration, an error report before an
abnormal exit, a finished message before a clean one. Exit codes: 0 done, 1 failed,
143 stopped by request (as after SIGTERM)."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from google.protobuf import json_format

from services.trainer.agent_link import AgentLink, LinkCallbacks
from services.trainer.faults import FaultInjector
from unicron.config import load_config, require
from unicron.errors import UnicronError
from unicron.failures import classify_exception, kind_name
from unicron.faults import parse_fault
from unicron.logs import setup_logging
from unicron.v1 import common_pb2, node_service_pb2, trainer_service_pb2

EXIT_STOPPED = 143


@dataclass(frozen=True)
class TrainerConfig:
    job_id: str = ""
    generation: int = 0
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    agent: str = ""
    spec: str = ""
    collective_timeout_s: float = 120.0
    fault_injection: bool = False
    faults: tuple[str, ...] = ()
    log_level: str = "info"

    def __post_init__(self) -> None:
        require(bool(self.job_id), "job_id", "is required")
        require(0 <= self.rank < self.world_size, "rank", f"must lie in [0, {self.world_size})")
        require(bool(self.agent), "agent", "is required (host:port of the node's agent)")
        require(bool(self.spec), "spec", "is required (the job spec as JSON)")
        require(0 < self.master_port < 65536, "master_port", "must be a TCP port")


@dataclass
class Run:
    """What the training thread shares with the agent link's thread."""

    config: TrainerConfig
    spec: common_pb2.JobSpec
    link: AgentLink
    stop: threading.Event
    injector: FaultInjector
    iteration: int = 0


def main(argv: list[str]) -> int:
    try:
        config = load_config(TrainerConfig, env_prefix="UNICRON_TRAINER", argv=argv, description="Unicron trainer rank")
        spec = json_format.Parse(config.spec, common_pb2.JobSpec())
        faults = [parse_fault(text, config.rank) for text in config.faults]
    except (UnicronError, json_format.ParseError) as exc:
        print(f"unicron-trainer: {exc}", file=sys.stderr)
        return 2
    log = setup_logging("trainer", config.log_level)
    # The agent sends SIGUSR1 to take stack traces of a hung trainer before acting on it.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    stop = threading.Event()

    def on_sigterm(_signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    hello = trainer_service_pb2.TrainerHello(
        job_id=config.job_id, generation=config.generation, rank=config.rank, pid=os.getpid()
    )

    def announce(fault: common_pb2.Fault, at: float) -> None:
        fired = trainer_service_pb2.FaultFired(fault=fault)
        fired.fault.rank = config.rank
        fired.injected.FromNanoseconds(int(at * 1e9))
        link.send(trainer_service_pb2.ConnectRequest(fault_fired=fired))

    injector = FaultInjector(config.fault_injection, announce, stop)
    for fault in faults:
        injector.add(fault)

    def inject(fault: common_pb2.Fault) -> None:
        injector.add(fault)

    link = AgentLink(
        config.agent,
        hello,
        LinkCallbacks(on_stop=lambda reason: stop.set(), on_inject=inject, on_lost=lambda reason: stop.set()),
    )
    run = Run(config, spec, link, stop, injector)
    link.open()
    try:
        train(run, log)
    except BaseException:
        log.exception("training failed")
        link.close()
        return 1
    if stop.is_set() and run.iteration < spec.training.iterations:
        log.info("stopped on request", extra={"iteration": run.iteration})
        link.close()
        return EXIT_STOPPED
    link.send(
        trainer_service_pb2.ConnectRequest(finished=trainer_service_pb2.TrainerFinished(iterations=run.iteration))
    )
    link.close()
    return 0


def report_error(run: Run, exc: BaseException) -> None:
    """Tells the agent what went wrong, before any cleanup: tearing down a process group
    whose peers still wait in a collective can block, and the report must not wait."""
    kind = classify_exception(exc)
    error = trainer_service_pb2.TrainerError(
        kind=kind, message=f"{type(exc).__name__}: {exc}"[:2000], iteration=run.iteration + 1
    )
    error.first_seen.FromNanoseconds(time.time_ns())
    run.link.send(trainer_service_pb2.ConnectRequest(error=error))
    logging.getLogger("trainer").error("reported %s", kind_name(kind))


def train(run: Run, log: logging.Logger) -> None:
    # Imported here: torch and Megatron take seconds to import, and config errors should
    # be reported before that.
    import torch
    import torch.distributed as dist

    from services.trainer.gpt import GPTTrainer, ModelConfig, TrainConfig

    config, spec = run.config, run.spec
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    model = spec.model
    training = spec.training
    try:
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            init_method=f"tcp://{config.master_addr}:{config.master_port}",
            rank=config.rank,
            world_size=config.world_size,
            timeout=timedelta(seconds=config.collective_timeout_s),
        )
        # GPTTrainer enters the Megatron CPU shim (megatron_cpu.cpu_mode) around its own calls.
        trainer = GPTTrainer(
            ModelConfig(
                num_layers=model.num_layers,
                hidden_size=model.hidden_size,
                num_attention_heads=model.num_attention_heads,
                seq_length=model.seq_length,
                vocab_size=model.vocab_size,
            ),
            TrainConfig(
                global_batch_size=training.global_batch_size,
                micro_batch_size=training.micro_batch_size,
                lr=training.learning_rate,
                seed=training.seed,
            ),
            tensor_parallel=spec.parallelism.tensor,
            pipeline_parallel=spec.parallelism.pipeline,
            device="cuda" if use_cuda else "cpu",
        )
        if run.injector.enabled:
            trainer.grad_sync_hook = run.injector.in_grad_sync
        log.info("model ready", extra={"rank": config.rank, "world_size": config.world_size})
        while run.iteration < training.iterations and not run.stop.is_set():
            run.injector.before_step(run.iteration + 1)
            result = trainer.step()
            run.iteration = result.iteration
            run.link.send(
                trainer_service_pb2.ConnectRequest(
                    iteration=node_service_pb2.IterationReport(
                        job_id=config.job_id,
                        generation=config.generation,
                        rank=config.rank,
                        iteration=result.iteration,
                        loss=result.loss,
                        seconds=result.seconds,
                        tokens=result.tokens,
                        flops=result.flops,
                        compute_seconds=result.compute_seconds,
                    )
                )
            )
        trainer.close()
    except BaseException as exc:
        report_error(run, exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
