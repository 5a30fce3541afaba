"""Trainers apart from the agent (services/agent/trainer_user.py): with ``trainer_user`` set, a
trainer runs as that user and cannot read the node's key; the agent refuses to start when it
cannot switch users or when that user could read a credential file."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.agent.__main__ import AgentConfig
from services.agent.agent import trainer_base_env
from services.agent.supervisor import Supervisor, WorkerExit, WorkerKey
from services.agent.trainer_user import TrainerUser, check, public_copy, resolve
from unicron.errors import InvalidArgument

ROOT = os.geteuid() == 0


def nobody() -> TrainerUser:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this host")
    return TrainerUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def test_no_setting_is_the_agents_own_user() -> None:
    assert resolve("") is None


@pytest.mark.parametrize(("setting", "problem"), [("no-such-user-7f3a", "no user"), ("0", "must not be root")])
def test_an_unknown_user_or_root_is_refused_naming_the_setting(setting: str, problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem) as refused:
        resolve(setting)
    assert refused.value.field == "trainer_user"


def test_a_user_is_found_by_name_or_uid() -> None:
    user = nobody()
    assert resolve(user.name) == resolve(str(user.uid)) == user


@pytest.mark.parametrize(
    ("mode", "same_group", "readable"),
    [(0o600, False, False), (0o640, False, False), (0o640, True, True), (0o604, False, True), (0o400, False, False)],
)
def test_who_can_read_a_file_goes_by_its_permission_bits(
    tmp_path: Path, mode: int, same_group: bool, readable: bool
) -> None:
    secret = tmp_path / "node.key"
    secret.write_text("key")
    secret.chmod(mode)
    info = secret.stat()
    other = TrainerUser("trainer", info.st_uid + 1, info.st_gid if same_group else info.st_gid + 1)
    assert other.can_read(secret) is readable


def test_the_agent_must_be_root_and_its_secrets_out_of_the_users_reach(tmp_path: Path) -> None:
    user = TrainerUser("trainer", 12345, 12345)
    key = tmp_path / "node.key"
    key.write_text("key")
    key.chmod(0o644)
    with pytest.raises(InvalidArgument, match="must run as root") as refused:
        check(user, {"tls_key": str(key)}, euid=1000)
    assert refused.value.field == "trainer_user"
    with pytest.raises(InvalidArgument, match="readable by the trainer user") as refused:
        check(user, {"tls_key": str(key), "join_token_file": ""}, euid=0)
    assert refused.value.field == "tls_key"
    key.chmod(0o600)
    check(user, {"tls_key": str(key), "join_token_file": ""}, euid=0)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is its owner's alone)."""
    made = Path(tempfile.mkdtemp(prefix="unicron-trainer-user-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.mark.skipif(not ROOT, reason="starting a process as another user needs root")
def test_a_trainer_runs_as_the_trainer_user_and_cannot_read_the_nodes_key(tmp_path: Path, shared_dir: Path) -> None:
    user = nobody()
    key, public = shared_dir / "node.key", shared_dir / "ca.crt"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    key.chmod(0o600)
    public.write_text("certificate")
    public.chmod(0o644)
    exits: list[WorkerExit] = []
    supervisor = Supervisor(tmp_path, exits.append, user=user)
    try:
        jobs = shared_dir / "checkpoints" / "job-1"
        supervisor.give(jobs)
        assert (jobs.stat().st_uid, jobs.stat().st_gid) == (user.uid, user.gid)
        script = f"id -u; id -G; cat {public}; echo; cat {key} || echo refused; touch {jobs}/written && echo wrote"
        key_of = WorkerKey("job-1", 1, 0)
        supervisor.launch(key_of, ["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, spare=False)
        deadline = time.monotonic() + 20
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exits and exits[0].exit_code == 0
        out = (tmp_path / "job-1" / "gen1-rank0.out").read_text().split("\n")
        assert out[:2] == [str(user.uid), str(user.gid)]  # that user, that group, no other
        assert "certificate" in out and "refused" in out and "wrote" in out
        assert "BEGIN PRIVATE KEY" not in "\n".join(out)
    finally:
        supervisor.stop(grace_s=1.0)


def test_the_agent_setting_is_checked_when_the_config_is_built(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as refused:
        AgentConfig(node_id="n1", plaintext=True, trainer_user="no-such-user-7f3a")
    assert refused.value.field == "trainer_user"


def test_a_trainer_user_gets_a_copy_of_the_ca_it_can_read(tmp_path: Path) -> None:
    """The certificates directory is the agent's alone (certs.sh writes it umask 077); the
    CA's certificate is public, and a trainer needs it to check the agent."""
    ca = tmp_path / "certs" / "ca.pem"
    ca.parent.mkdir(mode=0o700)
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    ca.chmod(0o600)
    copy = public_copy(ca, tmp_path / "trainer-ca.pem")
    assert copy.read_text() == ca.read_text()
    assert TrainerUser("trainer", ca.stat().st_uid + 1, ca.stat().st_gid + 1).can_read(copy)


def test_trainers_of_their_own_user_get_a_home_of_their_own(tmp_path: Path) -> None:
    """The agent's HOME is the agent's; caches (torch's, Triton's) go where the trainer may write."""
    assert trainer_base_env(tmp_path / "trainer-home")["HOME"] == str(tmp_path / "trainer-home")
    assert trainer_base_env().get("HOME") == os.environ.get("HOME")
