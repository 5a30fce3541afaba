"""A development PKI: a local CA, a certificate per service, node and client, and the
cluster's tokens, written to one directory (`make certs`, `unicron certs`, LocalCluster).

Identities live in each certificate's common name, `<kind>:<name>` (unicron.security reads
them): `service:coordinator`, `service:planner`, `node:<node id>`, and `client:<user>`
for the CLI, which only encrypts (users authenticate with their token). The programs the
services depend on get `backend:<name>` (`backend:redis`, `backend:otel-collector`): they
serve TLS with it and call Unicron as no one, since no Unicron server admits that kind,
so their keys, in other images, open nothing of the control plane. Every leaf may
serve and call (a service is both), and names localhost, 127.0.0.1 and ::1 plus the extra
hosts given. Keys are ECDSA P-256: fast to make, which LocalCluster does on every start.

Not for production: the CA key sits beside the certificates, and they last 90 days."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from unicron.errors import InvalidArgument
from unicron.security import new_token

VALID_DAYS = 90
CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
TOKENS_FILE = "tokens.yaml"
JOIN_TOKEN_FILE = "join-token"
SERVICES = ("coordinator", "planner")
# What the services talk to: the coordinator's Redis, the OpenTelemetry collector.
BACKENDS = ("redis", "otel-collector")


@dataclass(frozen=True)
class User:
    name: str
    admin: bool = False


@dataclass(frozen=True)
class Leaf:
    """One certificate and its key, as written."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class DevPKI:
    """What `create_dev_pki` wrote: paths to hand to services and clients."""

    directory: Path
    ca: Path
    tokens_file: Path
    join_token_file: Path
    services: dict[str, Leaf] = field(default_factory=dict)
    nodes: dict[str, Leaf] = field(default_factory=dict)
    backends: dict[str, Leaf] = field(default_factory=dict)
    clients: dict[str, Leaf] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)  # user -> token
    join_token: str = ""

    def env(self, user: str) -> dict[str, str]:
        """The CLI's environment for `user` (unicron.security.ClientSecurity.from_env)."""
        leaf = self.clients[user]
        return {
            "UNICRON_TLS_CA": str(self.ca),
            "UNICRON_TLS_CERT": str(leaf.cert),
            "UNICRON_TLS_KEY": str(leaf.key),
            "UNICRON_TOKEN": self.tokens[user],
        }


def parse_users(spec: str) -> list[User]:
    """`admin:admin,alice` -> admin (an admin) and alice (a user)."""
    users = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, _, role = item.partition(":")
        if role not in ("", "admin", "user"):
            raise InvalidArgument("users", f"{item!r}: the role after ':' must be admin or user")
        users.append(User(name, admin=role == "admin"))
    if not users:
        raise InvalidArgument("users", "needs at least one user")
    return users


def check_name(kind: str, name: str) -> None:
    """Names go into file names and common names: keep them plain."""
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise InvalidArgument(kind, f"{name!r} must be letters, digits, '-', '_' or '.'")


def create_dev_pki(
    directory: Path,
    *,
    nodes: Sequence[str],
    users: Sequence[User] = (User("admin", admin=True),),
    hosts: Iterable[str] = (),
) -> DevPKI:
    """Writes (or completes) a development PKI in `directory`. An existing CA and existing
    tokens are kept, so certificates for new nodes can be added to a running cluster; the
    leaf certificates are issued again."""
    from cryptography import x509  # imported here: services need it only to make certificates
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    for node in nodes:
        check_name("nodes", node)
    for user in users:
        check_name("users", user.name)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    # A little in the past: a peer whose clock is slightly behind still accepts it.
    not_before = now - datetime.timedelta(minutes=5)
    not_after = now + datetime.timedelta(days=VALID_DAYS)

    def write(path: Path, data: bytes, secret: bool) -> None:
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        tmp.replace(path)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_cert_path, ca_key_path = directory / CA_CERT, directory / CA_KEY
    if ca_cert_path.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise InvalidArgument("ca", f"{ca_key_path} is not an EC key")
        ca_key = loaded
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "unicron development CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        write(ca_key_path, key_pem(ca_key), secret=True)
        write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), secret=False)

    alt_names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", "::1")]
    for host in dict.fromkeys([socket.gethostname(), *hosts]):
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))

    def issue(common_name: str, stem: str) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        leaf = Leaf(directory / f"{stem}.pem", directory / f"{stem}-key.pem")
        write(leaf.key, key_pem(key), secret=True)
        write(leaf.cert, cert.public_bytes(serialization.Encoding.PEM), secret=False)
        return leaf

    services = {name: issue(f"service:{name}", name) for name in SERVICES}
    backends = {name: issue(f"backend:{name}", name) for name in BACKENDS}
    node_leaves = {node: issue(f"node:{node}", f"node-{node}") for node in nodes}
    clients = {user.name: issue(f"client:{user.name}", f"client-{user.name}") for user in users}

    tokens_path = directory / TOKENS_FILE
    existing: dict[str, object] = {}
    if tokens_path.exists():
        existing = yaml.safe_load(tokens_path.read_text()) or {}
    known = {
        str(entry["name"]): entry
        for entry in existing.get("users", [])  # type: ignore[attr-defined]
        if isinstance(entry, dict) and "name" in entry
    }
    join_token = str(existing.get("join_token") or new_token())
    entries = []
    tokens: dict[str, str] = {}
    for user in users:
        token = str(known.get(user.name, {}).get("token") or new_token())
        tokens[user.name] = token
        entries.append({"name": user.name, "token": token, "admin": user.admin})
    entries += [entry for name, entry in known.items() if name not in tokens]
    for entry in entries:
        tokens.setdefault(str(entry["name"]), str(entry["token"]))
    header = "# Unicron tokens (development): the coordinator's --tokens-file. Keep it secret.\n"
    write(
        tokens_path,
        (header + yaml.safe_dump({"join_token": join_token, "users": entries}, sort_keys=False)).encode(),
        secret=True,
    )
    join_path = directory / JOIN_TOKEN_FILE
    write(join_path, (join_token + "\n").encode(), secret=True)
    pki = DevPKI(
        directory=directory,
        ca=ca_cert_path,
        tokens_file=tokens_path,
        join_token_file=join_path,
        services=services,
        nodes=node_leaves,
        backends=backends,
        clients=clients,
        tokens=tokens,
        join_token=join_token,
    )
    for user in users:
        lines = [f"export {name}={value}" for name, value in pki.env(user.name).items()]
        write(directory / f"{user.name}.env", ("\n".join(lines) + "\n").encode(), secret=True)
    return pki
