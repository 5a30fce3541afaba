"""The client a user installs to submit and watch jobs, without the runtime: the package built
as a wheel and installed into a fresh venv brings grpcio, protobuf and YAML, and neither torch
nor OR-Tools; its `unicron` command submits a job to a running cluster, lists it, reads the
queue and watches the job to its end. A command that needs what the client lacks (simulate,
certs) says so in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import running
from unicron_dev.localcluster import ROOT, LocalCluster

pytestmark = pytest.mark.e2e

# What the wheel is built from (copied, so that the build leaves nothing in the checkout).
Completed = subprocess.CompletedProcess[str]
PACKAGED = ("pyproject.toml", "README.md", "unicron", "services", "examples", "unicron_sim", "unicron_dev")

SPEC = """\
name: light-client
program:
  entry_point: examples.digits.train:main
  args: [--hidden, "64"]
parallelism: {data: 1}
training: {iterations: 30, global_batch_size: 16, micro_batch_size: 1}
"""


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the client wheel installed (its dependencies from the package index)."""
    work = tmp_path_factory.mktemp("light")
    source = work / "source"
    source.mkdir()
    for name in PACKAGED:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(origin, source / name)
    wheels = work / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source], check=True, timeout=300)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    (wheel,) = wheels.glob("unicron-*.whl")
    pip_install = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    subprocess.run([*pip_install, str(wheel)], check=True, timeout=600)
    return venv


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(Path(tmp_path_factory.mktemp("light-cluster")), agents=1, slots_per_agent=1)
    cluster = running(local)
    yield next(cluster)
    next(cluster, None)


def _outside(venv: Path, cwd: Path, *argv: str, extra: dict[str, str] | None = None) -> Completed:
    """A command of the venv run from ``cwd`` with no path into this checkout (no PYTHONPATH,
    not its working directory)."""
    env = {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(cwd), **(extra or {})}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _unicron(venv: Path, cluster: LocalCluster, *words: str, cwd: Path) -> Completed:
    unicron = str(venv / "bin" / "unicron")
    return _outside(venv, cwd, unicron, "--coordinator", cluster.coordinator, *words, extra=cluster.client_env())


def test_the_client_install_has_neither_torch_nor_the_solver(client_venv: Path, tmp_path: Path) -> None:
    python = str(client_venv / "bin" / "python")
    for module in ("torch", "ortools", "megatron", "redis"):
        found = _outside(client_venv, tmp_path, python, "-c", f"import {module}")
        assert found.returncode != 0, f"{module} came with the client"
    where = _outside(client_venv, tmp_path, python, "-c", "import unicron; print(unicron.__file__)")
    assert str(client_venv) in where.stdout, where.stdout


def test_the_client_submits_lists_and_watches_a_job(client_venv: Path, cluster: LocalCluster, tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(SPEC)
    submitted = _unicron(client_venv, cluster, "submit", "job.yaml", cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    listed = _unicron(client_venv, cluster, "jobs", cwd=tmp_path)
    assert listed.returncode == 0 and "light-client" in listed.stdout, listed
    queued = _unicron(client_venv, cluster, "queue", cwd=tmp_path)  # waiting or started by now
    assert queued.returncode == 0 and ("light-client" in queued.stdout or "no job is waiting" in queued.stdout), queued
    watched = _unicron(client_venv, cluster, "watch", "light-client", cwd=tmp_path)
    assert watched.returncode == 0, watched.stdout[-2000:] + watched.stderr
    with cluster.client() as client:
        assert client.get("light-client").progress.iteration == 30


def test_what_the_client_lacks_is_said_in_one_line(client_venv: Path, cluster: LocalCluster, tmp_path: Path) -> None:
    for words in (("simulate", "--preset", "meta-16k"), ("certs", "--out", str(tmp_path / "certs"))):
        done = _unicron(client_venv, cluster, *words, cwd=tmp_path)
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'unicron[all]'" in lines[0], done.stderr
