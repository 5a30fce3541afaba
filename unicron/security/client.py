"""The client side: how a client calls (TLS, its token) and the interceptor that sends the
token and a default deadline."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from unicron.errors import InvalidArgument
from unicron.security.identity import AUTH_METADATA, BEARER, read_token_file
from unicron.security.tls import TLS, load_tls

log = logging.getLogger(__name__)


# ---- the client side --------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSecurity:
    """How a client calls: TLS (tls None: plaintext) and the token it sends, if any."""

    tls: TLS | None = None
    token: str = ""

    @staticmethod
    def plaintext(token: str = "") -> ClientSecurity:
        return ClientSecurity(None, token)

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> ClientSecurity:
        """The CLI's settings: UNICRON_TLS_CA, UNICRON_TLS_CERT, UNICRON_TLS_KEY (the client
        certificate, for a coordinator that asks for one), UNICRON_TOKEN or
        UNICRON_TOKEN_FILE, and UNICRON_PLAINTEXT=1 for a plaintext coordinator. With no CA
        the system's roots verify the coordinator."""
        env = os.environ if env is None else env
        token = env.get("UNICRON_TOKEN", "")
        if not token and env.get("UNICRON_TOKEN_FILE"):
            token = read_token_file("UNICRON_TOKEN_FILE", env["UNICRON_TOKEN_FILE"])
        if env.get("UNICRON_PLAINTEXT", "").lower() in ("1", "true", "yes", "on"):
            return ClientSecurity(None, token)
        tls = load_tls(env.get("UNICRON_TLS_CA", ""), env.get("UNICRON_TLS_CERT", ""), env.get("UNICRON_TLS_KEY", ""))
        if (tls.cert is None) != (tls.key is None):
            raise InvalidArgument("UNICRON_TLS_CERT", "a client certificate needs its key, and a key its certificate")
        return ClientSecurity(tls, token)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls.ca, private_key=self.tls.key, certificate_chain=self.tls.cert
        )


class _Metadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
):
    """Adds the token to every call, and a deadline to a unary call that has none."""

    def __init__(self, token: str, default_timeout_s: float) -> None:
        self._metadata = [(AUTH_METADATA, BEARER + token)] if token else []
        self._default_timeout_s = default_timeout_s

    def _details(self, details: Any, unary: bool) -> Any:
        timeout = details.timeout
        if unary and timeout is None:
            timeout = self._default_timeout_s
        if not self._metadata and timeout == details.timeout:
            return details
        return _CallDetails(
            details.method,
            timeout,
            [*(details.metadata or ()), *self._metadata],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, unary=True), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details, unary=True), requests)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, unary=False), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details, unary=False), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


def client_interceptor(token: str, default_timeout_s: float) -> grpc.UnaryUnaryClientInterceptor:
    return _Metadata(token, default_timeout_s)
