"""Link certificates: grpc mutual TLS bound to the parties' Ed25519 keys.

Every party that takes part in direct links holds :class:`LinkCredentials`: one ephemeral ECDSA
P-256 key (made with ``cryptography``) and two X.509 certificates for it.

*Serve certificate* (self-signed, ``CA:TRUE``, DNS name :data:`LINK_SERVER_NAME`)
    What the party's link server presents. The party publishes its DER bytes in its signed
    endpoint record (:func:`chaos_flwr.membership.endpoint_body`), and a dialler uses exactly
    that certificate as its only TLS root: the handshake then succeeds only against the holder
    of that key, i.e. the party whose signed record names it (pinning; no name check is needed
    beyond it, so every serve certificate carries the same DNS name).

*Dial certificate* (issued by the public link root, carries a *binding*)
    What the party presents as a TLS client. grpc's Python API always verifies a client's
    chain against the server's roots and offers no custom verifier, so every dial certificate
    is issued by one fixed, **public** root (:func:`link_root_pem`; its private key is derived
    from a published constant). That root proves nothing, and is not meant to: it only lets
    grpc accept the chain. Authentication is the binding, a non-critical X.509 extension
    (:data:`BINDING_OID`) holding ``{party, sig, expires}``, where ``sig`` is the party's
    Ed25519 signature (its charter key) over the federation, the party id, the SHA-256 of the
    certificate's SubjectPublicKeyInfo and ``expires`` (the certificates' end, unix seconds:
    after it the binding is refused, so a stolen link key cannot be re-certified for longer).
    After the handshake the server reads the peer certificate from grpc's auth context and
    checks the binding (:func:`verify_dial_cert`):
    TLS proved the peer holds the certificate's private key, the binding proves a charter
    party vouched for that key. A binding copied into another certificate names another key
    and fails; a copied certificate is useless without its private key.

Nothing here is new cryptography: X.509, ECDSA and TLS 1.2/1.3 come from ``cryptography`` and
grpc (BoringSSL); Ed25519 signatures from :mod:`chaos_flwr.identity`.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .. import codec
from ..defaults import LINK_CERT_MAX_BYTES, LINK_CERT_VALIDITY_S
from ..errors import ChaosError, LinkAuthError, NotMemberError
from ..identity import verify_signature

__all__ = [
    "BINDING_OID",
    "LINK_SERVER_NAME",
    "LinkCredentials",
    "binding_bytes",
    "link_root_pem",
    "peer_spki",
    "spki_digest",
    "verify_dial_cert",
]

#: The DNS name of every serve certificate (diallers pin the certificate, not the name).
LINK_SERVER_NAME = "chaos-link.invalid"
#: OID of the binding extension (a UUID OID, ITU-T X.667: no registry needed).
BINDING_OID = x509.ObjectIdentifier("2.25.248047372734617305627716012655263915649")
_BINDING_DOMAIN = b"chaos-flwr/link-binding/v2\x00"
_ROOT_DOMAIN = b"chaos-flwr/public-link-root/v1\x00"
_ROOT_NAME = "chaos-flwr public link root (not a trust anchor)"
_BINDING_MAX_BYTES = 1024


def spki_digest(cert: x509.Certificate) -> bytes:
    """SHA-256 of the certificate's DER SubjectPublicKeyInfo (what a binding names)."""
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


def peer_spki(pem: bytes) -> bytes | None:
    """:func:`spki_digest` of a (handshake-proven) peer certificate in PEM; ``None`` if there is
    none or it does not parse (a pinned reader is matched on it: TLS proved the peer holds the
    key)."""
    if not pem or len(pem) > 4 * LINK_CERT_MAX_BYTES:
        return None
    try:
        return spki_digest(x509.load_pem_x509_certificate(pem))
    except ValueError:
        return None


def binding_bytes(federation: str, party_id: str, spki: bytes, expires: int) -> bytes:
    """The exact bytes a party signs to bind a link key (``spki``: its SHA-256) to itself
    until ``expires`` (unix seconds: its certificates' end; a binding is refused after it, so
    a stolen link key is good no longer, whatever certificate it is copied into)."""
    return _BINDING_DOMAIN + codec.encode(
        {"federation": federation, "party": party_id, "spki": spki, "expires": expires}
    )


def binding_expires(dial_cert_pem: bytes) -> int | None:
    """When the binding a dial certificate carries expires (``None``: no binding of this
    format, e.g. one made before bindings carried their expiry: to be replaced)."""
    try:
        cert = x509.load_pem_x509_certificate(dial_cert_pem)
        ext = cert.extensions.get_extension_for_oid(BINDING_OID).value
        raw = ext.value if isinstance(ext, x509.UnrecognizedExtension) else b""
        value = codec.decode(raw, max_bytes=_BINDING_MAX_BYTES)
    except (ValueError, x509.ExtensionNotFound, ChaosError):
        return None
    expires = value.get("expires") if isinstance(value, dict) else None
    return expires if isinstance(expires, int) and not isinstance(expires, bool) else None


_CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)


@lru_cache(maxsize=1)
def _root() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    scalar = int.from_bytes(hashlib.sha256(_ROOT_DOMAIN).digest(), "big")
    key = ec.derive_private_key(scalar, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _ROOT_NAME)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(2999, 1, 1, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def link_root_pem() -> bytes:
    """PEM of the public link root (the only root a link server accepts client chains from)."""
    return _root()[1].public_bytes(serialization.Encoding.PEM)


def _name(party_id: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, party_id[:64])])


def _validity(builder: x509.CertificateBuilder, now: datetime.datetime) -> x509.CertificateBuilder:
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(
        now + datetime.timedelta(seconds=LINK_CERT_VALIDITY_S)
    )


@dataclass(frozen=True)
class LinkCredentials:
    """A party's link key and its two certificates (see the module docstring).

    Attributes
    ----------
    party_id, federation : str
        Whose credentials, for which federation.
    key_pem : bytes
        The ECDSA P-256 private key (PKCS#8 PEM, unencrypted; kept in memory).
    serve_cert_pem, dial_cert_pem : bytes
        The self-signed serve certificate and the root-issued dial certificate (PEM).
    """

    party_id: str
    federation: str
    key_pem: bytes
    serve_cert_pem: bytes
    dial_cert_pem: bytes

    @classmethod
    def create(
        cls, identity: Any, federation: str, *, now: datetime.datetime | None = None
    ) -> LinkCredentials:
        """Make a fresh link key for ``identity`` (a :class:`chaos_flwr.identity.Identity`,
        or anything with ``party_id`` and ``sign``) and both certificates."""
        at = now if now is not None else datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        serve = (
            _validity(x509.CertificateBuilder(), at)
            .subject_name(_name(identity.party_id))
            .issuer_name(_name(identity.party_id))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(LINK_SERVER_NAME)]), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        root_key, root = _root()
        digest = hashlib.sha256(
            key.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        ).digest()
        expires = int((at + datetime.timedelta(seconds=LINK_CERT_VALIDITY_S)).timestamp())
        sig = identity.sign(binding_bytes(federation, identity.party_id, digest, expires))
        binding = codec.encode({"party": identity.party_id, "sig": sig, "expires": expires})
        dial = (
            _validity(x509.CertificateBuilder(), at)
            .subject_name(_name(identity.party_id))
            .issuer_name(root.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.UnrecognizedExtension(BINDING_OID, binding), critical=False)
            .sign(root_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        return cls(
            party_id=identity.party_id,
            federation=federation,
            key_pem=key.private_bytes(
                pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            serve_cert_pem=serve.public_bytes(pem),
            dial_cert_pem=dial.public_bytes(pem),
        )

    @property
    def spki(self) -> bytes:
        """:func:`spki_digest` of this link key (what a relay grant pins)."""
        return spki_digest(x509.load_pem_x509_certificate(self.dial_cert_pem))

    @property
    def serve_cert_der(self) -> bytes:
        """The serve certificate as DER (what the endpoint record carries)."""
        cert = x509.load_pem_x509_certificate(self.serve_cert_pem)
        return cert.public_bytes(serialization.Encoding.DER)


def serve_cert_pem_of(der: bytes) -> bytes:
    """PEM of a serve certificate given as DER (from an endpoint record).

    Raises
    ------
    LinkAuthError
        If ``der`` is not one certificate of at most ``LINK_CERT_MAX_BYTES`` bytes.
    """
    if len(der) > LINK_CERT_MAX_BYTES:
        raise LinkAuthError(f"a link certificate of {len(der)} bytes is above the limit")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise LinkAuthError(f"a link certificate does not parse: {exc}") from None
    return cert.public_bytes(serialization.Encoding.PEM)


def verify_dial_cert(
    pem: bytes, federation: str, keyring: dict[str, bytes], *, now: float | None = None
) -> str:
    """The party a (handshake-proven) dial certificate is bound to.

    Parameters
    ----------
    pem
        The peer's leaf certificate as grpc's auth context gives it (``x509_pem_cert``); TLS
        has proved the peer holds its private key.
    federation
        This federation's name (a binding for another federation is refused).
    keyring
        Party id -> Ed25519 public key of the charter parties.
    now
        Unix seconds to check the binding's expiry against (default: the wall clock).

    Raises
    ------
    LinkAuthError
        No certificate, no or a malformed binding, a binding that does not verify under the
        charter key of the party it names (a member's id with another key), a binding that
        names another key (copied from another certificate), or an expired binding.
    NotMemberError
        The binding names a party that is not in the charter.
    """
    if not pem or len(pem) > 4 * LINK_CERT_MAX_BYTES:
        raise LinkAuthError("the peer presented no link certificate (or an oversized one)")
    try:
        cert = x509.load_pem_x509_certificate(pem)
        ext = cert.extensions.get_extension_for_oid(BINDING_OID).value
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise LinkAuthError(f"the peer's certificate carries no party binding: {exc}") from None
    raw = ext.value if isinstance(ext, x509.UnrecognizedExtension) else b""
    try:
        value = codec.decode(raw, max_bytes=_BINDING_MAX_BYTES)
    except ChaosError as exc:
        raise LinkAuthError(f"the peer's party binding is malformed: {exc}") from None
    if not isinstance(value, dict) or set(value) != {"party", "sig", "expires"}:
        raise LinkAuthError("the peer's party binding must be {party, sig, expires}")
    party, sig, expires = value["party"], value["sig"], value["expires"]
    if not isinstance(party, str) or not isinstance(sig, bytes) or type(expires) is not int:
        raise LinkAuthError("the peer's party binding has a bad 'party', 'sig' or 'expires'")
    key = keyring.get(party)
    if key is None:
        raise NotMemberError(f"the peer's binding names {party[:80]!r}, not a charter party")
    if expires < (time.time() if now is None else now):
        raise LinkAuthError(f"the peer's binding for {party} expired (its link key is old)")
    try:
        verify_signature(key, sig, binding_bytes(federation, party, spki_digest(cert), expires))
    except ChaosError:
        raise LinkAuthError(
            f"the peer's binding for {party} does not verify under its charter key for this "
            "certificate's key (another key signed it, or it was copied from another certificate)"
        ) from None
    return party
