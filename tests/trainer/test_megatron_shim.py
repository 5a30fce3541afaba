"""Canary for the Megatron-Core CPU shim (services/trainer/megatron_cpu.py).

Each test exercises one piece the shim redirects from CUDA to the CPU. When a megatron-core or
torch upgrade moves a CUDA call somewhere the shim does not reach, the failing test names the
piece that broke instead of leaving a bare "Torch not compiled with CUDA enabled".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from unicron.trainer.megatron_cpu import cpu_mode

# isort: split
from megatron.core import tensor_parallel

from tests.trainer.gpt import MegatronTrainer, ModelConfig, TrainConfig, gpt_trainer


def _broke(piece: str, detail: str) -> str:
    return (
        f"Megatron-Core CPU shim broke ({piece}): {detail}. A megatron-core/torch upgrade "
        "probably added or moved a CUDA call; fix services/trainer/megatron_cpu.py."
    )


@contextlib.contextmanager
def _shim_piece(piece: str) -> Iterator[None]:
    """Turn an error raised inside into a failure that names the shim piece that broke.

    Megatron's own asserts (e.g. on CUDA tensor type names) are breakages too, so
    AssertionError is wrapped like any other error; keep the test's asserts outside.
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - any error here is a shim breakage, whatever its type
        pytest.fail(_broke(piece, repr(exc)))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MegatronTrainer]:
    store = tmp_path_factory.mktemp("shim") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        with _shim_piece("building GPTModel, DDP and optimizer on CPU"):
            built = gpt_trainer(ModelConfig(num_layers=1), TrainConfig(global_batch_size=2))
        yield built
        built.close()
    finally:
        dist.destroy_process_group()


def test_device_arguments_are_rewritten_to_cpu() -> None:
    with cpu_mode():
        made = {
            'torch.zeros(device="cuda")': torch.zeros(1, device="cuda"),
            "torch.empty(device=current_device())": torch.empty(1, device=torch.cuda.current_device()),
            "torch.tensor(device=cuda:0)": torch.tensor([1.0], device=torch.device("cuda", 0)),
            "Tensor.cuda()": torch.ones(1).cuda(),
            'Tensor.to("cuda")': torch.ones(1).to("cuda"),
            "Tensor.to(current_device())": torch.ones(1).to(torch.cuda.current_device()),
        }
        type_name = torch.ones(1).type()
    for call, tensor in made.items():
        assert tensor.device.type == "cpu", _broke("device rewrite", f"{call} -> {tensor.device}")
    assert type_name == "torch.cuda.FloatTensor", _broke("Tensor.type() CUDA spelling used by grad clipping", type_name)


def test_rng_tracker_fork_uses_cpu_generator(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING")
    queued = len(torch.cuda._queued_calls)

    def draws_in_fork() -> tuple[torch.Tensor, torch.Tensor, bool]:
        tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        outside = torch.get_rng_state()
        with tracker.fork():
            inside = torch.rand(4)
        restored = torch.equal(torch.get_rng_state(), outside)
        return inside, torch.rand(4), restored

    with _shim_piece("RNG tracker (model_parallel_cuda_manual_seed / fork)"), cpu_mode():
        forked_1, default_1, restored = draws_in_fork()
        forked_2, default_2, _ = draws_in_fork()
    assert restored, _broke("RNG tracker", "fork() did not restore the default generator state")
    assert torch.equal(forked_1, forked_2), _broke("RNG tracker", "forked stream not seeded")
    assert torch.equal(default_1, default_2), _broke("RNG tracker", "default stream not seeded")
    assert not torch.equal(forked_1, default_1), _broke("RNG tracker", "fork() draws from the default stream")
    assert len(torch.cuda._queued_calls) == queued, _broke(
        "RNG tracker", "state setters are queued as lazy CUDA calls instead of applied"
    )
    # On the CPU the device generator is the CPU's: every fork that draws moves "both", and
    # Megatron's warning of it would be most of a rank's log.
    assert "RNG state changed" not in caplog.text


def test_model_is_built_on_cpu(trainer: MegatronTrainer) -> None:
    params = dict(trainer.model.named_parameters())
    assert params, _broke("GPTModel", "model has no parameters")
    off_cpu = [name for name, p in params.items() if p.device.type != "cpu"]
    assert not off_cpu, _broke("GPTModel use_cpu_initialization", f"params off CPU: {off_cpu}")


def test_ddp_buffers_are_on_cpu(trainer: MegatronTrainer) -> None:
    buffers = trainer.model.buffers
    assert buffers, _broke("DDP param/grad buffer", "DistributedDataParallel built no buffers")
    for buffer in buffers:
        assert buffer.grad_data.device.type == "cpu", _broke(
            "DDP param/grad buffer", f"grad buffer on {buffer.grad_data.device}"
        )
    for name, param in trainer.model.named_parameters():
        assert param.main_grad.device.type == "cpu", _broke(
            "DDP param/grad buffer", f"{name}.main_grad on {param.main_grad.device}"
        )


def test_one_training_step_runs_on_cpu(trainer: MegatronTrainer) -> None:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with _shim_piece("pipeline schedule / DDP all-reduce / Megatron optimizer"):
        result = trainer.step()
    assert math.isfinite(result.loss), _broke("training step", f"loss {result.loss}")
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, _broke("Megatron optimizer", "step() left every parameter unchanged")
    # get_megatron_optimizer returns one MegatronOptimizer or a ChainedOptimizer of them; each
    # wraps a torch optimizer whose per-parameter state (Adam moments) must be on the CPU.
    wrappers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    state = [slot for w in wrappers for slot in w.optimizer.state.values()]
    off_cpu = [
        key
        for slot in state
        for key, value in slot.items()
        if isinstance(value, torch.Tensor) and value.device.type != "cpu"
    ]
    assert state and not off_cpu, _broke("Megatron optimizer", f"state off CPU: {off_cpu}")
