"""Run Megatron-Core 0.16 on CPU-only PyTorch.

Megatron-Core assumes CUDA: it allocates its DDP param/grad buffers, optimizer scalars,
grad-norm scratch and pipeline shape tensors with ``device="cuda"`` or
``device=torch.cuda.current_device()``, calls ``.cuda()``, and keeps its RNG tracker on
``torch.cuda`` generators. On a CPU build every one of those raises. Rather than fork Megatron,
this module redirects those device requests to the CPU:

* ``_CpuDeviceMode`` (a ``TorchFunctionMode``) rewrites CUDA device arguments to ``"cpu"`` for
  every torch call made on the thread that entered ``cpu_mode()``.
* A few ``torch.cuda`` functions that are not torch functions (so no mode sees them) are
  replaced with CPU equivalents; see ``_install_cuda_patches``.

Import this module before anything from ``megatron`` so its warning filter takes effect.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Megatron warns once per module at import that it falls back to pure-PyTorch kernels; on CPU
# that fallback is exactly what we want, so the warnings are noise.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")
# Advice about CUDA stream connections; meaningless on the CPU.
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")

_patch_lock = threading.Lock()
_patched = False


def default_device() -> str:
    """The device a job runs on when it does not say: CUDA when present, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def wants_cpu(device: str | None = None) -> bool:
    """True when Megatron must be steered to the CPU for a job asking for ``device``.

    ``None`` means ``default_device()``.
    """
    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but CUDA is not available")
    return device == "cpu"


def _is_cuda_device(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    # A bare int is how Megatron spells torch.cuda.current_device(); bool is an int subclass
    # but never a device.
    return isinstance(value, int) and not isinstance(value, bool)


def _cpu_if_cuda(value: object) -> object:
    return "cpu" if _is_cuda_device(value) else value


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrite CUDA device arguments of torch calls to the CPU."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.cuda:
            # The tensor already lives on the only device we have; .cuda() on its own device
            # returns self, so do the same.
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron asserts dtypes via type() strings spelled for CUDA ("torch.cuda.
            # FloatTensor", e.g. in grad clipping and the fp16 optimizer); answer in that
            # spelling so those checks test the dtype, which is what they mean.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1:
            # Only Tensor.to takes a device positionally (an int there is a device index, never
            # a dtype), so positional rewriting is limited to it.
            args = (args[0], *(_cpu_if_cuda(a) for a in args[1:]))
        return func(*args, **kwargs)


def _cpu_rng_state(device: object = "cuda") -> torch.Tensor:
    del device  # there is one generator: the CPU default one
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
    del device, graph_safe
    torch.set_rng_state(new_state)


def _seed_cpu(seed: int) -> None:
    torch.manual_seed(seed)


def _install_cuda_patches() -> None:
    """Replace the ``torch.cuda`` calls Megatron makes outside any tensor op.

    Process-wide and permanent (a mode cannot see these calls, so they cannot be thread-local),
    installed on the first CPU job. On a CPU build the originals only raise ("Torch not compiled
    with CUDA enabled"), so nothing that worked before breaks; on a CUDA build they would reroute
    the whole process, so do not mix CPU and CUDA trainers in one process.
    """
    global _patched
    with _patch_lock:
        if _patched:
            return
        # Megatron passes this as a device argument everywhere; 0 is then rewritten to "cpu"
        # by _CpuDeviceMode.
        torch.cuda.current_device = lambda: 0
        # Pipeline p2p code syncs the stream after batched isend/irecv; CPU ops are synchronous.
        torch.cuda.synchronize = lambda device=None: None
        # The RNG tracker (tensor_parallel.random.CudaRNGStatesTracker) forks the "device"
        # generator around model-parallel regions. On CPU the device generator is the CPU
        # default generator, so dropout inside a fork draws from the forked stream as intended
        # (Megatron then logs "CPU RNG state changed within GPU RNG context" per fork, since
        # the two are one here: _OneGenerator drops that line).
        torch.cuda.get_rng_state = _cpu_rng_state
        torch.cuda.random.get_rng_state = _cpu_rng_state
        torch.cuda.set_rng_state = _set_cpu_rng_state
        torch.cuda.manual_seed = _seed_cpu
        torch.cuda.random.manual_seed = _seed_cpu
        # Megatron restores tracker states through torch.cuda._lazy_call, which on a CPU build
        # never runs the callback and instead queues it forever (a leak per fork). Its own
        # setter is the narrowest place to reroute.
        from megatron.core.tensor_parallel import random as mcore_random

        mcore_random._set_cuda_rng_state = _set_cpu_rng_state
        logging.getLogger(mcore_random.__name__).addFilter(_OneGenerator())
        _patched = True


class _OneGenerator(logging.Filter):
    """Drops Megatron's warning that the CPU generator moved inside a fork of the device
    generator: on the CPU the two are one, so every fork that draws (dropout) moves it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


@contextlib.contextmanager
def cpu_mode(device: str | None = None) -> Iterator[None]:
    """Make Megatron-Core calls on this thread run on the CPU.

    TorchFunctionMode is thread-local, so the thread that builds and trains the model must be
    the one inside this context. ``device`` is the job's device (``None``: CUDA when present,
    else the CPU); the context is a no-op when that is CUDA. ``MegatronTrainer`` enters it itself
    around every call, so callers need it only for their own Megatron calls.
    """
    if not wants_cpu(device):
        yield
        return
    _install_cuda_patches()
    with _CpuDeviceMode():
        yield
