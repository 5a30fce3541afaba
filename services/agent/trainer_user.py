"""The user a node's trainers run as, apart from the agent's (the ``trainer_user`` setting).

A trainer runs the user's program. Run as the agent's own user, that program could read
whatever the agent can: the node's TLS key and join token, which speak for the node to the
coordinator, and the agent's state. With a trainer user the agent (which must run as root to
start processes as someone else) starts every trainer and warm spare as that user, with that
user's group and no other, and gives it the per-job checkpoint and snapshot directories it
writes; at start it refuses a credential file that user could read."""

from __future__ import annotations

import logging
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unicron.errors import InvalidArgument

log = logging.getLogger("agent")


@dataclass(frozen=True)
class TrainerUser:
    name: str
    uid: int
    gid: int

    def popen_options(self) -> dict[str, Any]:
        """``subprocess.Popen`` keyword arguments that start the process as this user."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def give(self, directory: Path) -> None:
        """Creates ``directory`` (and its parents) and makes it this user's, so that a trainer
        can write there. A filesystem that refuses the change (a shared one that maps root
        away) is logged: the trainer then reports its own write failures."""
        directory.mkdir(parents=True, exist_ok=True)
        try:
            os.chown(directory, self.uid, self.gid)
        except OSError as exc:
            problem = {"path": str(directory), "error": str(exc)}
            log.warning("cannot give a directory to the trainer user", extra=problem)

    def can_read(self, path: Path) -> bool:
        """Whether this user could read ``path`` by its permission bits (owner, group, other)."""
        info = path.stat()
        if info.st_uid == self.uid:
            return bool(info.st_mode & stat.S_IRUSR)
        if info.st_gid == self.gid:
            return bool(info.st_mode & stat.S_IRGRP)
        return bool(info.st_mode & stat.S_IROTH)


def public_copy(source: Path, target: Path) -> Path:
    """``source`` (a certificate: public) copied to ``target``, readable by everyone."""
    target.write_bytes(source.read_bytes())
    target.chmod(0o644)
    return target


def resolve(setting: str) -> TrainerUser | None:
    """The user ``setting`` names (a user name or a numeric uid); None for "" (the agent's own).
    Raises InvalidArgument for a user this host does not know, or root."""
    if not setting:
        return None
    try:
        entry = pwd.getpwuid(int(setting)) if setting.isdigit() else pwd.getpwnam(setting)
    except KeyError:
        raise InvalidArgument("trainer_user", f"no user {setting!r} on this host") from None
    if entry.pw_uid == 0:
        raise InvalidArgument("trainer_user", "must not be root: a trainer user keeps trainers from the node's secrets")
    return TrainerUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def check(user: TrainerUser, secrets: dict[str, str], euid: int | None = None) -> None:
    """Raises InvalidArgument when the agent cannot start processes as ``user`` (it is not
    root) or when ``user`` could read one of ``secrets`` (setting name -> file; empty paths
    are skipped)."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise InvalidArgument(
            "trainer_user", f"the agent must run as root to start trainers as {user.name!r} (uid {user.uid})"
        )
    for name, path in secrets.items():
        if path and user.can_read(Path(path)):
            raise InvalidArgument(
                name, f"{path} is readable by the trainer user {user.name!r}: make it the agent's alone (chmod 600)"
            )
