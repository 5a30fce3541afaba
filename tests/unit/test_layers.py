"""The layers the folder names promise: ``unicron/`` (what every service and the CLI need at
run time) imports nothing from ``services/``, the dev tooling or the tests; the services and
benches import no test module; and the everyday CLI loads neither the solver nor torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, wherever in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("package", "forbidden", "allowed_lazy"),
    [
        ("unicron", {"services", "unicron_dev", "tests", "bench", "unicron_sim"}, {"unicron/cli.py": {"unicron_sim"}}),
        ("services", {"unicron_dev", "tests", "bench", "unicron_sim"}, {}),
        ("unicron_sim", {"unicron_dev", "tests", "bench"}, {}),
        ("bench", {"tests"}, {}),
    ],
)
def test_no_package_imports_a_layer_above_it(
    package: str, forbidden: set[str], allowed_lazy: dict[str, set[str]]
) -> None:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if relative.startswith("unicron/v1/"):
            continue
        bad = (_imports(path) & forbidden) - allowed_lazy.get(relative, set())
        found += [f"{relative} imports {name}" for name in sorted(bad)]
    assert not found, found


def test_the_everyday_cli_loads_neither_the_solver_nor_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "unicron.cli", "jobs", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert not loaded & {"ortools", "torch", "megatron", "services", "unicron_sim"}, sorted(loaded)


# The coordinator's and the agent's decisions: no I/O, no clock of their own, no threads (the
# caller passes the time and every value a read would give).
PURE = [
    "services/coordinator/decide.py",
    "services/coordinator/intake.py",
    "services/coordinator/links.py",
    "services/coordinator/remedies.py",
    "services/coordinator/ladder.py",
    "services/coordinator/incidents.py",
    "services/coordinator/transitions.py",
    "services/coordinator/state.py",
    "services/coordinator/cost.py",
    "services/agent/verdicts.py",
    "services/planner/domain.py",
    "services/planner/problem.py",
]
IMPURE = {"redis", "grpc", "threading", "socket", "subprocess", "time", "psutil", "os"}


@pytest.mark.parametrize("relative", PURE)
def test_decisions_are_pure(relative: str) -> None:
    found = _imports(ROOT / relative) & IMPURE
    for module in ("redis_store", "memory_store", "registry", "healing", "reports", "reconciler"):
        if f"services.coordinator.{module}" in (ROOT / relative).read_text():
            found.add(f"services.coordinator.{module}")
    assert not found, f"{relative} imports {sorted(found)}"
