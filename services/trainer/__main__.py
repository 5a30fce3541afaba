"""`python -m services.trainer`: one rank of a job, started by its node's agent.

Speaks the agent protocol: a hello, one report per iteration, an error report before an
abnormal exit, a finished message before a clean one. Exit codes: 0 done, 1 failed,
143 stopped by request (as after SIGTERM)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from google.protobuf import json_format

from services.trainer.agent_link import AgentLink
from unicron.config import load_config, require
from unicron.errors import UnicronError
from unicron.failures import classify_exception, kind_name
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
    log_level: str = "info"

    def __post_init__(self) -> None:
        require(bool(self.job_id), "job_id", "is required")
        require(0 <= self.rank < self.world_size, "rank", f"must lie in [0, {self.world_size})")
        require(bool(self.agent), "agent", "is required (host:port of the node's agent)")
        require(bool(self.spec), "spec", "is required (the job spec as JSON)")
        require(0 < self.master_port < 65536, "master_port", "must be a TCP port")


def main(argv: list[str]) -> int:
    try:
        config = load_config(TrainerConfig, env_prefix="UNICRON_TRAINER", argv=argv, description="Unicron trainer rank")
        spec = json_format.Parse(config.spec, common_pb2.JobSpec())
    except (UnicronError, json_format.ParseError) as exc:
        print(f"unicron-trainer: {exc}", file=sys.stderr)
        return 2
    log = setup_logging("trainer", config.log_level)
    stop = threading.Event()

    def on_sigterm(_signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    hello = trainer_service_pb2.TrainerHello(
        job_id=config.job_id, generation=config.generation, rank=config.rank, pid=os.getpid()
    )
    link = AgentLink(config.agent, hello, on_stop=lambda reason: stop.set())
    link.open()
    iteration = 0
    try:
        iteration = train(config, spec, link, stop, log)
    except BaseException as exc:
        kind = classify_exception(exc)
        log.exception("training failed", extra={"kind": kind_name(kind)})
        link.send(
            trainer_service_pb2.ConnectRequest(
                error=trainer_service_pb2.TrainerError(
                    kind=kind, message=f"{type(exc).__name__}: {exc}"[:2000], iteration=iteration
                )
            )
        )
        link.close()
        return 1
    if stop.is_set() and iteration < spec.training.iterations:
        log.info("stopped on request", extra={"iteration": iteration})
        link.close()
        return EXIT_STOPPED
    link.send(trainer_service_pb2.ConnectRequest(finished=trainer_service_pb2.TrainerFinished(iterations=iteration)))
    link.close()
    return 0


def train(
    config: TrainerConfig, spec: common_pb2.JobSpec, link: AgentLink, stop: threading.Event, log: logging.Logger
) -> int:
    # Imported here: torch and Megatron take seconds to import, and config errors should
    # be reported before that.
    import torch
    import torch.distributed as dist

    from services.trainer.gpt import GPTTrainer, ModelConfig, TrainConfig

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.collective_timeout_s),
    )
    model = spec.model
    training = spec.training
    done = 0
    try:
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
        log.info("model ready", extra={"rank": config.rank, "world_size": config.world_size})
        while done < training.iterations and not stop.is_set():
            result = trainer.step()
            done = result.iteration
            link.send(
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
                    )
                )
            )
        trainer.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return done


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
