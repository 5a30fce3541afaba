"""`make gpu-image-test`: the image's GPU variant (deploy/Dockerfile, TORCH=cuda), built
and checked on this machine, which has no GPU.

It uses compose_test's private Docker engine (no bridge, no firewall rules, a private
socket, its images under .cache/docker) and base image (python:3.11-slim-bookworm when it
can be pulled, else the stand-in made from Debian's packages). The host's pip downloads
every wheel into deploy/wheels first (the lock's, then PyPI's torch 2.13.0, its CUDA 13.0
build, with the NVIDIA libraries it pins: a few GB), so the build itself downloads nothing
(WHEELS_ONLY=1: a container here does not trust the host's certificate store). Then, in
the image: torch is that release and a CUDA build, its
CUDA libraries load, CUDA reports no device (there is none here), pynvml imports and the
agent's NVML check reports itself unavailable rather than failing, and the agent, the CLI
and the trainer library import. The image and the wheels it added are removed at the end
(`--keep` keeps them) and the engine stopped, with nothing left changed on the host. Needs root. Not part of
`make test`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import compose_test as ct

IMAGE = "unicron:0.1.0-cuda"
TORCH_RELEASE = "2.13.0"

# Run inside the image: what it holds, as JSON on the last line.
PROBE = """
import ctypes, glob, json, os, sys
import torch
import pynvml
from services.agent.health import NvmlCheck
import services.agent.__main__, unicron.cli, unicron.trainer
site = os.path.dirname(os.path.dirname(torch.__file__))
libs = sorted(glob.glob(os.path.join(site, "nvidia", "**", "*.so*"), recursive=True))
loaded = []
for name in ("libcudart.so", "libcublas.so", "libcudnn.so", "libnccl.so"):
    match = [p for p in libs if os.path.basename(p).startswith(name)]
    if match:
        ctypes.CDLL(match[0])
        loaded.append(name)
try:
    nccl = torch.cuda.nccl.version()
except Exception as exc:  # no device: say why rather than fail
    nccl = f"unknown ({type(exc).__name__})"
print(json.dumps({
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(),
    "nccl": nccl,
    "cuda_available": torch.cuda.is_available(),
    "device_count": torch.cuda.device_count(),
    "nvml_available": NvmlCheck.available(),
    "pynvml": pynvml.__name__,
    "nvidia_libraries": len(libs),
    "loaded": loaded,
    "user": os.getuid(),
}, default=str))
"""


def fetch_gpu_wheels() -> list[Path]:
    """The lock's wheels (compose_test's), then PyPI's torch release and the GPU additions
    with everything they pin, the lock's other pins kept; returns the wheels this added."""
    ct.fetch_wheels()
    before = set(ct.WHEELS.iterdir())
    lines = [line.split(";")[0].strip() for line in ct.LOCK.read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("#") and not line.startswith("torch==")]
    gpu = ct.ROOT / "deploy" / "requirements-gpu.txt"
    # The host's pip settings point at this disk's CPU torch and cap its version: not here.
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write("\n".join(pins) + "\n")
        constraints.flush()
        subprocess.run(
            [
                *(str(ct.VENV_BIN / "pip"), "download", "--quiet", "--only-binary=:all:"),
                *("--index-url", "https://pypi.org/simple", "-d", str(ct.WHEELS)),
                *("-c", constraints.name, "-r", str(gpu), f"torch=={TORCH_RELEASE}"),
            ],
            check=True,
            env=env,
        )
    added = sorted(set(ct.WHEELS.iterdir()) - before)
    size = sum(path.stat().st_size for path in added)
    ct.say(f"{len(added)} wheels added to deploy/wheels ({size / 1e9:.1f} GB), torch's CUDA build among them")
    return added


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help=f"keep {IMAGE} in the engine's cache (several GB)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("gpu-image-test runs its own Docker engine and needs root", file=sys.stderr)
        return 2
    ct.LABEL = "gpu-image-test"
    ct.teardown_on_sigterm()
    ct.ensure_tools()
    before = ct.host_state()
    engine = ct.Engine()
    failed: BaseException | None = None
    found: dict[str, object] = {}
    added: list[Path] = []
    try:
        added = fetch_gpu_wheels()
        engine.start()
        base = ct.UPSTREAM_BASE if ct.pulled(ct.UPSTREAM_BASE) else ct.standin_image()
        ct.say(f"base image {base}; building {IMAGE} (TORCH=cuda) from deploy/wheels")
        start = time.monotonic()
        build = [
            *("docker", "build", "--network", "host", "-f", "deploy/Dockerfile"),
            *("--build-arg", f"BASE={base}", "--build-arg", "TORCH=cuda", "--build-arg", "WHEELS_ONLY=1"),
            *("-t", IMAGE, "."),
        ]
        log = ct.run(build, timeout=3600)
        built = time.monotonic() - start
        torch_line = next((line.strip() for line in log.splitlines() if line.startswith("torch: CUDA")), "?")
        size = ct.run(["docker", "images", "--format", "{{.Size}}", IMAGE]).strip()
        ct.say(f"built in {built:.0f}s ({size}); the build's own check: {torch_line}")
        out = ct.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", IMAGE, "-c", PROBE])
        found = json.loads(out.strip().splitlines()[-1])
        ct.say(f"in the image: {json.dumps(found)}")
        problems = []
        if str(found["torch"]).split("+")[0] != TORCH_RELEASE:
            problems.append(f"torch {found['torch']}, not {TORCH_RELEASE}")
        if not found["cuda"]:
            problems.append("torch is not a CUDA build")
        if found["cuda_available"] or found["nvml_available"]:
            problems.append("CUDA or NVML says a GPU is here, and this machine has none")
        if not {"libcudart.so", "libcublas.so", "libcudnn.so", "libnccl.so"} <= set(map(str, found["loaded"])):  # type: ignore[call-overload]
            problems.append(f"CUDA libraries missing: loaded only {found['loaded']}")
        if found["user"] != 10001:
            problems.append(f"runs as uid {found['user']}, not 10001")
        if problems:
            raise AssertionError("; ".join(problems))
        ct.say(
            f"torch {found['torch']} (CUDA {found['cuda']}, cuDNN {found['cudnn']}), {found['nvidia_libraries']} "
            "NVIDIA libraries; no device here, NVML unavailable, reported as such"
        )
    except BaseException as exc:  # noqa: BLE001 - report, then tear down whatever happened
        failed = exc
    finally:
        if engine.proc and not args.keep:
            ct.run(["docker", "image", "rm", "--force", IMAGE], check=False, quiet=True)
            ct.run(["docker", "builder", "prune", "--force"], check=False, quiet=True)
        killed = engine.stop()
        if not args.keep:
            for wheel in added:
                wheel.unlink(missing_ok=True)
    after = ct.host_state()
    problems = [f"{key} changed" for key in before if before[key] != after[key]]
    if killed:
        problems.append(f"had to kill: {killed}")
    ct.say("torn down: no container, engine or network change left" if not problems else f"teardown: {problems}")
    if failed is not None:
        print(f"gpu-image-test FAILED: {type(failed).__name__}: {failed}", file=sys.stderr)
        return 1
    if problems:
        return 1
    ct.say("gpu-image-test PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
