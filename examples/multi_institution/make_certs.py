"""Make the TLS certificates and SuperNode authentication keys of a local deployment.

    python examples/multi_institution/make_certs.py --out certs --supernode alice --supernode bob

writes, with the ``cryptography`` package (no ``openssl`` needed):

- ``ca.crt``: a throwaway certificate authority (give it to every SuperNode as
  ``--root-certificates`` and to the ``flwr`` CLI as ``root-certificates``);
- ``server.pem`` / ``server.key``: the SuperLink's certificate (for ``127.0.0.1`` and
  ``localhost``), signed by that CA (``--ssl-certfile`` / ``--ssl-keyfile``);
- ``<name>-auth`` / ``<name>-auth.pub``: one P-384 key pair per SuperNode in OpenSSH format, for
  Flower's SuperNode authentication (``flwr supernode register <name>-auth.pub`` on the
  SuperLink's side, ``--auth-supernode-private-key <name>-auth`` on the SuperNode's).

A production federation uses its own certificate authority and lets each institution make its
own key pair; this script is for trying the deployment on one machine.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

#: How long the certificates are valid, in days.
VALID_DAYS = 30
#: Names the SuperLink's certificate is valid for.
SERVER_DNS = "localhost"
SERVER_IP = "127.0.0.1"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey]
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer[0]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_tls(out: Path) -> None:
    """Write ``ca.crt``, ``server.pem`` and ``server.key`` into ``out``."""
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        _certificate("chaos-flwr local CA", ca_key, ("chaos-flwr local CA", ca_key))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names = [x509.DNSName(SERVER_DNS), x509.IPAddress(ipaddress.ip_address(SERVER_IP))]
    server = (
        _certificate("superlink", key, ("chaos-flwr local CA", ca_key))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    (out / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / "server.pem").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (out / "server.key").write_bytes(_pem_key(key))
    (out / "server.key").chmod(0o600)


def make_auth_key(out: Path, name: str) -> None:
    """Write the SuperNode key pair ``<name>-auth`` / ``<name>-auth.pub`` (OpenSSH, P-384)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write into")
    parser.add_argument(
        "--supernode", action="append", default=[], help="a SuperNode's name (repeat)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_tls(args.out)
    for name in args.supernode:
        make_auth_key(args.out, name)
    print(f"wrote ca.crt, server.pem, server.key and {len(args.supernode)} key pairs to {args.out}")


if __name__ == "__main__":
    main()
