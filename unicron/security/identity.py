"""Who a caller is: the kinds of caller, tokens (users', the join token, per-worker), how a
call's token or certificate names its caller, and the caller of the call being served."""

from __future__ import annotations

import base64
import contextlib
import contextvars
import enum
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from unicron.errors import InvalidArgument, Unauthenticated

log = logging.getLogger(__name__)


AUTH_METADATA = "authorization"
BEARER = "Bearer "


class Kind(enum.StrEnum):
    USER = "user"  # a person or script with a user token
    NODE = "node"  # an agent with a certificate naming its node
    AGENT = "agent"  # an agent with the cluster's join token (any node id)
    SERVICE = "service"  # a Unicron service with its certificate (service:coordinator)
    WORKER = "worker"  # a trainer with the token its agent issued
    TRUSTED = "trusted"  # authentication is off: every caller is trusted


@dataclass(frozen=True)
class Principal:
    kind: Kind
    name: str = ""
    admin: bool = False
    # The team whose quota the user's jobs count against (the tokens file's `team`); "": none.
    team: str = ""

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"


# The caller of every call on a server that authenticates nobody (plaintext without tokens,
# in-process test servers): what every caller was before authentication existed.
TRUSTED = Principal(Kind.TRUSTED, "", admin=True)


# ---- tokens ---------------------------------------------------------------------------


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenBook:
    """The tokens a coordinator accepts, kept as sha256 digests: a lookup hashes first, so its
    time does not depend on how much of a guess was right."""

    by_digest: Mapping[str, Principal] = field(default_factory=dict)

    @staticmethod
    def parse(data: Any, source: str = "tokens_file") -> TokenBook:
        """From the tokens file's mapping: {join_token: str, users: [{name, token, admin, team}]}."""
        if not isinstance(data, dict):
            raise InvalidArgument(source, "must hold a mapping with join_token and users")
        entries: dict[str, Principal] = {}

        def add(token: object, principal: Principal, where: str) -> None:
            if not isinstance(token, str) or len(token) < 16:
                raise InvalidArgument(f"{source}.{where}", "must be a string of at least 16 characters")
            if _digest(token) in entries:
                raise InvalidArgument(f"{source}.{where}", "the same token is given twice")
            entries[_digest(token)] = principal

        unknown = sorted(set(data) - {"join_token", "users"})
        if unknown:
            raise InvalidArgument(f"{source}.{unknown[0]}", "unknown setting")
        if data.get("join_token"):
            add(data["join_token"], Principal(Kind.AGENT), "join_token")
        users = data.get("users") or []
        if not isinstance(users, list):
            raise InvalidArgument(f"{source}.users", "must be a list")
        for index, user in enumerate(users):
            where = f"users[{index}]"
            if not isinstance(user, dict) or not isinstance(user.get("name"), str) or not user["name"]:
                raise InvalidArgument(f"{source}.{where}.name", "is required")
            team = user.get("team") or ""
            if not isinstance(team, str):
                raise InvalidArgument(f"{source}.{where}.team", "must be a team's name")
            principal = Principal(Kind.USER, user["name"], admin=bool(user.get("admin")), team=team)
            add(user.get("token"), principal, f"{where}.token")
        return TokenBook(entries)

    @staticmethod
    def load(path: str, source: str = "tokens_file") -> TokenBook:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidArgument(source, f"cannot read {path}: {exc}") from None
        return TokenBook.parse(data, source)

    def lookup(self, token: str) -> Principal | None:
        return self.by_digest.get(_digest(token))


def worker_name(job_id: str, generation: int, rank: int) -> str:
    return f"{job_id}/{generation}/{rank}"


class WorkerTokens:
    """Per-worker tokens an agent issues to the trainers it starts: `w1.<job>.<generation>.
    <rank>.<mac>`, the MAC keyed by a secret the agent never gives out, so a token proves one
    job, generation and rank and nothing else. Stateless: the agent keeps no list."""

    PREFIX = "w1"

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def _mac(self, body: str) -> str:
        return hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()

    def issue(self, job_id: str, generation: int, rank: int) -> str:
        job = base64.urlsafe_b64encode(job_id.encode()).decode().rstrip("=")
        body = f"{self.PREFIX}.{job}.{generation}.{rank}"
        return f"{body}.{self._mac(body)}"

    def lookup(self, token: str) -> Principal | None:
        parts = token.split(".")
        if len(parts) != 5 or parts[0] != self.PREFIX:
            return None
        body, mac = ".".join(parts[:4]), parts[4]
        if not hmac.compare_digest(self._mac(body), mac):
            return None
        try:
            job_id = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
            generation, rank = int(parts[2]), int(parts[3])
        except ValueError:
            return None
        return Principal(Kind.WORKER, worker_name(job_id, generation, rank))


# ---- authentication -------------------------------------------------------------------


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token of a call's metadata; "" for a malformed one, None for none."""
    for key, value in metadata or ():
        if key == AUTH_METADATA:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return text[len(BEARER) :].strip() if text.startswith(BEARER) else ""
    return None


def certificate_principal(common_name: str) -> Principal | None:
    """Who a client certificate names: `node:<id>` or `service:<name>`; None for other names
    (`client:<user>` only encrypts: users prove themselves with a token)."""
    kind, sep, name = common_name.partition(":")
    if not sep or not name:
        return None
    if kind == Kind.NODE:
        return Principal(Kind.NODE, name)
    if kind == Kind.SERVICE:
        return Principal(Kind.SERVICE, name)
    return None


TokenLookup = Callable[[str], Principal | None]


def authenticate(token: str | None, common_name: str | None, lookup: TokenLookup) -> Principal:
    """Who is calling: a token when one is sent (it must be valid: a bad token is not
    overlooked because a certificate came with it), else the certificate's name."""
    if token is not None:
        if not token:
            raise Unauthenticated("authorization: expected 'Bearer <token>'")
        principal = lookup(token)
        if principal is None:
            raise Unauthenticated("the token is not valid here")
        return principal
    if common_name:
        principal = certificate_principal(common_name)
        if principal is not None:
            return principal
    raise Unauthenticated("no credentials: send a token (authorization: Bearer ...) or a client certificate")


def any_of(*lookups: TokenLookup) -> TokenLookup:
    def lookup(token: str) -> Principal | None:
        return next((p for p in (look(token) for look in lookups) if p is not None), None)

    return lookup


current_caller: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("unicron_caller", default=None)


def caller() -> Principal:
    """The authenticated caller of the call being served (set by the Guard). Outside a
    guarded call there is none, and nothing is allowed."""
    principal = current_caller.get()
    if principal is None:
        raise Unauthenticated("no authenticated caller")
    return principal


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[None]:
    """Calls servicer code directly (tests, in-process tools) as `principal`."""
    token = current_caller.set(principal)
    try:
        yield
    finally:
        current_caller.reset(token)


def read_token_file(field_name: str, path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidArgument(field_name, f"cannot read {path}: {exc.strerror or exc}") from None
    if not token:
        raise InvalidArgument(field_name, f"{path} is empty")
    return token
