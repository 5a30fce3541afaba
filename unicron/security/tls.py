"""TLS material (CA, certificate, key as PEM) and the servers' TLS settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from unicron.errors import InvalidArgument

log = logging.getLogger(__name__)


# ---- TLS material and configuration --------------------------------------------------


@dataclass(frozen=True)
class TLS:
    """PEM bytes: the CA that signs every peer (None on a client: the system's roots), this
    process's certificate and key (None on a client that shows no certificate)."""

    ca: bytes | None
    cert: bytes | None = None
    key: bytes | None = None


def read_pem(field_name: str, path: str, marker: str) -> bytes:
    """A PEM file's bytes; InvalidArgument naming the setting when unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(field_name, f"cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or marker.encode() not in data:
        raise InvalidArgument(field_name, f"{path} is not a PEM {marker.lower()}")
    return data


def load_tls(ca: str, cert: str, key: str, prefix: str = "tls_") -> TLS:
    return TLS(
        ca=read_pem(f"{prefix}ca", ca, "CERTIFICATE") if ca else None,
        cert=read_pem(f"{prefix}cert", cert, "CERTIFICATE") if cert else None,
        key=read_pem(f"{prefix}key", key, "PRIVATE KEY") if key else None,
    )
