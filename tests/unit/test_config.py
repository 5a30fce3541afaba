from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from unicron.config import load_config, require
from unicron.errors import InvalidArgument


@dataclass(frozen=True)
class Example:
    bind: str = "127.0.0.1:1"
    timeout_s: float = 3.0
    verbose: bool = False
    peers: tuple[str, ...] = ("a:1",)

    def __post_init__(self) -> None:
        require(self.timeout_s > 0, "timeout_s", "must be positive")


def test_defaults() -> None:
    assert load_config(Example, env_prefix="X", argv=[], env={}) == Example()


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("timeout_s: 5\nbind: file:1\nverbose: true\n")
    env = {"X_CONFIG": str(file), "X_TIMEOUT_S": "7", "X_PEERS": "p:1, q:2"}
    config = load_config(Example, env_prefix="X", argv=["--timeout-s", "9"], env=env)
    assert config == Example(bind="file:1", timeout_s=9.0, verbose=True, peers=("p:1", "q:2"))
    assert load_config(Example, env_prefix="X", argv=["--no-verbose"], env=env).verbose is False


@pytest.mark.parametrize(
    ("argv", "env", "field"),
    [
        (["--timeout-s", "soon"], {}, "timeout_s"),
        ([], {"X_TIMEOUT_S": "-1"}, "timeout_s"),
        ([], {"X_VERBOSE": "perhaps"}, "verbose"),
    ],
)
def test_bad_values_name_the_field(argv: list[str], env: dict[str, str], field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        load_config(Example, env_prefix="X", argv=argv, env=env)
    assert error.value.field == field


def test_unknown_file_setting_is_rejected(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("timeout: 5\n")
    with pytest.raises(InvalidArgument) as error:
        load_config(Example, env_prefix="X", argv=["--config", str(file)], env={})
    assert error.value.field == "config.timeout"
