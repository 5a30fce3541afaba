"""The settings every service shares (its config dataclass inherits TLSConfig), and the
server security they make."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from unicron.config import require, setting
from unicron.security.client import ClientSecurity
from unicron.security.guard import ServerSecurity, token_authenticator
from unicron.security.identity import Principal, TokenLookup
from unicron.security.limits import DEFAULT_MAX_MESSAGE_BYTES, Limits
from unicron.security.tls import TLS, load_tls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TLSConfig:
    """The settings every service shares (its config dataclass inherits them)."""

    tls_ca: str = setting("", "the cluster CA certificate (PEM) that callers' and servers' certificates must chain to")
    tls_cert: str = setting("", "this process's certificate (PEM), for serving and for calling other services")
    tls_key: str = setting("", "the private key (PEM) of --tls-cert")
    plaintext: bool = setting(False, "no TLS at all (only when asked for; said loudly at start)")
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES, "the largest gRPC message this process accepts or sends, in bytes"
    )
    rate_limit_per_s: float = setting(
        200.0, "calls per second one caller (a user, node or worker; an anonymous connection) may make"
    )
    rate_limit_burst: float = setting(400.0, "calls one caller may make in a burst, above its rate")
    max_streams_per_caller: int = setting(8, "streams one caller may hold open at once")

    def __post_init__(self) -> None:
        if not self.plaintext:
            for name in ("tls_ca", "tls_cert", "tls_key"):
                require(bool(getattr(self, name)), name, "is required (make certs writes one), or run with --plaintext")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            require(not path or os.path.isfile(path), name, f"no such file: {path}")
        load_tls(self.tls_ca, self.tls_cert, self.tls_key)  # a file that is no PEM: named now
        require(
            bool(self.tls_cert) == bool(self.tls_key),
            "tls_key",
            "a certificate needs its key and a key its certificate",
        )
        require(self.max_message_bytes >= 1024, "max_message_bytes", "must be at least 1024")
        require(self.rate_limit_per_s > 0, "rate_limit_per_s", "must be positive")
        require(self.rate_limit_burst >= 1, "rate_limit_burst", "must be at least 1")
        require(self.max_streams_per_caller >= 1, "max_streams_per_caller", "must be at least 1")

    def tls(self) -> TLS | None:
        """The TLS material (None with --plaintext); InvalidArgument naming a bad file."""
        if self.plaintext:
            return None
        return load_tls(self.tls_ca, self.tls_cert, self.tls_key)

    def limits(self) -> Limits:
        return Limits(
            max_message_bytes=self.max_message_bytes,
            rate_per_s=self.rate_limit_per_s,
            burst=self.rate_limit_burst,
            streams_per_caller=self.max_streams_per_caller,
        )

    def client(self, token: str = "") -> ClientSecurity:
        """How this process calls other services: its own certificate, the same CA."""
        return ClientSecurity(self.tls(), token)


def server_security(config: TLSConfig, lookup: TokenLookup | None = None, certificates: bool = True) -> ServerSecurity:
    """A service's server security from its configuration: TLS unless --plaintext; callers
    authenticated by their token (with `lookup`) and by their certificate (unless not
    `certificates`). Plaintext with no tokens to check authenticates no one
    (ServerSecurity.warnings says so)."""
    tls = config.tls()
    if tls is None and lookup is None:
        return ServerSecurity(None, None, limits=config.limits())
    return ServerSecurity(tls, token_authenticator(lookup or _no_tokens, certificates), limits=config.limits())


def _no_tokens(_token: str) -> Principal | None:
    return None
