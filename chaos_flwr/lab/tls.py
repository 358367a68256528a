"""TLS certificates and SuperNode authentication keys of a lab deployment, made at set-up.

Everything is made with the ``cryptography`` package (which Flower brings): a throwaway
certificate authority, the SuperLink's certificate for the addresses it is reached at, and one
P-384 key pair per SuperNode in OpenSSH format for Flower 1.42's SuperNode authentication
(``flwr supernode register <name>-auth.pub`` on the SuperLink's side,
``--auth-supernode-private-key <name>-auth`` on the SuperNode's). A production federation uses
its own CA and lets each institution make its own key pair.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from chaos_flwr.lab.settings import LAB_TLS_VALID_DAYS

__all__ = ["TlsFiles", "make_auth_key", "make_tls"]

#: Common name of the lab's certificate authority.
_CA_NAME = "chaos-flwr lab CA"


@dataclass(frozen=True)
class TlsFiles:
    """Where :func:`make_tls` wrote the CA and the SuperLink's certificate and key."""

    ca: Path
    certificate: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(_CA_NAME))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LAB_TLS_VALID_DAYS))
    )


def make_tls(
    out: Path, addresses: Sequence[str], dns_names: Sequence[str] = ("localhost",)
) -> TlsFiles:
    """Write ``ca.crt``, ``server.pem`` and ``server.key`` (mode 0600) into ``out``.

    Parameters
    ----------
    out : Path
        Folder to write into (created).
    addresses : Sequence[str]
        IP addresses the SuperLink is reached at (its certificate's IP subject names).
    dns_names : Sequence[str], optional
        Host names it is reached at.

    Returns
    -------
    TlsFiles
        The three paths.
    """
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        _builder(_CA_NAME, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    server = (
        _builder("superlink", key)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    files = TlsFiles(ca=out / "ca.crt", certificate=out / "server.pem", key=out / "server.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.certificate.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.key.chmod(0o600)
    return files


def make_auth_key(out: Path, name: str) -> tuple[Path, Path]:
    """Write the SuperNode key pair ``<name>-auth`` (0600) / ``<name>-auth.pub`` (OpenSSH,
    P-384) into ``out``; return (private, public)."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = out / f"{name}-auth"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    private.chmod(0o600)
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    (out / f"{name}-auth.pub").write_bytes(public + f" {name}\n".encode())
    return private, out / f"{name}-auth.pub"
