from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from unicron.config import help_text, load_config, require, setting
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


@dataclass(frozen=True)
class Numbers:
    limit_s: float = 2.0
    count: int = 1
    name: str = "n"


@pytest.mark.parametrize(
    ("written", "field", "value"),
    [
        ("1e1", "limit_s", 10.0),  # YAML 1.1 reads 1e1 as a string
        ("1.0e1", "limit_s", 10.0),
        ("2.5E-1", "limit_s", 0.25),
        ("3", "limit_s", 3.0),
        ("1e2", "count", 100),
        ("7", "count", 7),
        ("1e9", "name", "1e9"),  # where a string is expected, the text as written
        ("'1e9'", "name", "1e9"),
    ],
)
def test_config_files_read_yaml_numbers(tmp_path: Path, written: str, field: str, value: object) -> None:
    file = tmp_path / "c.yaml"
    file.write_text(f"{field}: {written}\n")
    config = load_config(Numbers, env_prefix="X", argv=["--config", str(file)], env={})
    assert getattr(config, field) == value and type(getattr(config, field)) is type(value)


@pytest.mark.parametrize(
    ("text", "field"),
    [("limit_s: 1e", "limit_s"), ("limit_s: 1.0.0", "limit_s"), ("count: 2.5", "count"), ("count: 1e-1", "count")],
)
def test_bad_numbers_in_config_files_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    file = tmp_path / "c.yaml"
    file.write_text(text + "\n")
    with pytest.raises(InvalidArgument) as error:
        load_config(Numbers, env_prefix="X", argv=["--config", str(file)], env={})
    assert error.value.field == field


def _config_classes() -> list[type]:
    """Every class a process reads with load_config: the services' (TLSConfig and all its
    subclasses, found so that a new service cannot be missed) and the trainer's."""
    import services.agent.__main__
    import services.coordinator.__main__
    import services.planner.__main__  # noqa: F401 - defines its config class
    from unicron.security import TLSConfig
    from unicron.trainer.settings import TrainerConfig

    found: list[type] = [TLSConfig, TrainerConfig]
    for cls in found:
        found += [sub for sub in cls.__subclasses__() if sub not in found]
    assert {cls.__name__ for cls in found} >= {"CoordinatorConfig", "PlannerConfig", "AgentConfig"}
    return found


def test_every_setting_says_what_it_does() -> None:
    missing = [
        f"{cls.__name__}.{field.name}"
        for cls in _config_classes()
        for field in dataclasses.fields(cls)
        if len(str(field.metadata.get("help", "")).strip()) < 10
    ]
    assert not missing, f"settings without help (declare them with unicron.config.setting): {missing}"


def test_help_says_what_a_setting_does_its_default_and_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    from services.coordinator.__main__ import CoordinatorConfig

    with pytest.raises(SystemExit) as exited:
        load_config(CoordinatorConfig, env_prefix="UNICRON_COORDINATOR", argv=["--help"], env={})
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--heartbeat-timeout-s HEARTBEAT_TIMEOUT_S a node silent this long is declared lost "
        "(default 3; env UNICRON_COORDINATOR_HEARTBEAT_TIMEOUT_S)" in text
    )
    assert (
        "--plaintext, --no-plaintext no TLS at all" in text
        and "(default false; env UNICRON_COORDINATOR_PLAINTEXT)" in text
    )
    assert "(default true; env UNICRON_COORDINATOR_REFORM_RESTARTS)" in text


def test_help_shows_defaults_readably() -> None:
    @dataclass(frozen=True)
    class Shown:
        empty: str = setting("", "an empty string")
        peers: tuple[str, ...] = setting(("a:1", "b:2"), "a tuple")
        rate: float = setting(1.0 / 3, "a float no short form gives back")
        ratio: float = setting(0.5, "50% of it")  # argparse formats help with %
        maybe: bool | None = setting(None, "unset until said")
        bare: int = 4

    texts = {field.name: help_text(field, "X") for field in dataclasses.fields(Shown)}
    assert texts == {
        "empty": "an empty string (default empty; env X_EMPTY)",
        "peers": "a tuple (default a:1,b:2; env X_PEERS)",
        "rate": f"a float no short form gives back (default {1.0 / 3!r}; env X_RATE)",
        "ratio": "50%% of it (default 0.5; env X_RATIO)",
        "maybe": "unset until said (default unset; env X_MAYBE)",
        "bare": "default 4; env X_BARE",
    }


def test_a_service_prints_its_help_without_its_dependencies() -> None:
    """--help needs no Redis (here: an address nothing listens at) and exits 0 at once."""
    env = {**os.environ, "UNICRON_COORDINATOR_REDIS_URL": "redis://127.0.0.1:1/0", "UNICRON_DEPENDENCY_TIMEOUT_S": "30"}
    done = subprocess.run(
        [sys.executable, "-m", "services.coordinator", "--help"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps the help to the terminal's width
    assert "UNICRON_COORDINATOR_REDIS_URL" in text and "default redis://127.0.0.1:6379/0" in text


def test_the_agents_directory_does_not_depend_on_where_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.agent.__main__ import AgentConfig, agent_root

    monkeypatch.chdir(tmp_path)
    home = {"XDG_STATE_HOME": "/var/state"}
    assert agent_root(AgentConfig(plaintext=True), home) == Path("/var/state/unicron/agent")
    assert agent_root(AgentConfig(plaintext=True), {}) == Path.home() / ".local/state/unicron/agent"
    # Given relative, it is taken from the start directory once, and kept absolute.
    assert agent_root(AgentConfig(plaintext=True, work_dir="run/agent"), home) == tmp_path / "run/agent"
