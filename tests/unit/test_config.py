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


def test_cross_process_timeouts_keep_their_order() -> None:
    from services.coordinator.__main__ import CoordinatorConfig
    from unicron import timeouts
    from unicron.errors import InvalidArgument
    from unicron.trainer.runtime import TrainerConfig

    TrainerConfig(job_id="j", agent="a:1", spec="{}")  # the defaults keep the order
    with pytest.raises(InvalidArgument) as raised:
        TrainerConfig(job_id="j", agent="a:1", spec="{}", collective_timeout_s=timeouts.REFORM_OVERDUE_S)
    assert raised.value.field == "collective_timeout_s" and "before the collective times out" in str(raised.value)
    coordinator = {"planners": ("127.0.0.1:1",), "plaintext": True}
    CoordinatorConfig(**coordinator)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as raised:
        CoordinatorConfig(**coordinator, recovery_timeout_s=90.0)  # type: ignore[arg-type]
    assert raised.value.field == "recovery_timeout_s" and "the trainers' collective timeout" in str(raised.value)
    with pytest.raises(InvalidArgument) as raised:
        CoordinatorConfig(**coordinator, ack_timeout_s=200.0)  # type: ignore[arg-type]
    assert raised.value.field == "ack_timeout_s"


def test_the_trainer_environment_reads_back_as_written() -> None:
    """One owner of the trainer's environment contract: what trainer_env writes, the trainer's
    load_config reads back, field for field."""
    from unicron.config import load_config
    from unicron.trainer.settings import ENV_PREFIX, TrainerConfig, trainer_env

    written = {
        "job_id": "j",
        "generation": 3,
        "rank": 1,
        "world_size": 2,
        "agent": "127.0.0.1:9",
        "spec": "{}",
        "fault_injection": True,
        "faults": ("crash@3", "slow:0.5@4"),
        "state_from_peer": True,
        "collective_timeout_s": 60.0,
        "plaintext": False,
        "tls_ca": "/ca.pem",
    }
    config = load_config(TrainerConfig, env_prefix=ENV_PREFIX, argv=[], env=trainer_env(**written))
    assert {name: getattr(config, name) for name in written} == written
    with pytest.raises(ValueError, match="no setting 'rnak'"):
        trainer_env(rnak=1)


def test_an_agent_advertises_its_bind_host_and_needs_one_for_a_wildcard_bind() -> None:
    from services.agent.__main__ import AgentConfig, advertised_host, interface_of

    assert advertised_host(AgentConfig(plaintext=True, bind="10.1.2.3:0")) == "10.1.2.3"
    assert advertised_host(AgentConfig(plaintext=True, bind="0.0.0.0:7000", advertise="10.1.2.3")) == "10.1.2.3"
    with pytest.raises(InvalidArgument, match="advertise"):
        AgentConfig(plaintext=True, bind="0.0.0.0:7000")
    # Loopback, names and addresses no interface holds name no data interface.
    assert interface_of("127.0.0.1") == interface_of("node-a") == interface_of("192.0.2.77") == ""
