"""Party identities: Ed25519 key pairs and the party ids derived from them.

Every party of a federation is an Ed25519 key pair. Its **party id** is derived from the public
key alone (``"p"`` + the first 16 hex digits of the SHA-256 of the raw 32-byte key), so any party
can check that a key and an id belong together without asking anyone.

Keys live on disk as PEM: ``<name>.key`` (PKCS#8, unencrypted, mode 0600) and ``<name>.pub``
(SubjectPublicKeyInfo) beside it. Loading refuses, with a :class:`~chaos_flwr.errors.KeyFileError`
that says what to do, a missing or unreadable file, a file that is not PEM, and any key that is
not Ed25519 (RSA, EC, X25519, ...).

Keys are generated, parsed and written with ``cryptography`` (OpenSSL); **signing and
verifying** use libsodium, through PyNaCl (the Python Cryptographic Authority's binding, like
``cryptography`` itself). Verification is the hot path of every protocol message (each receiver
checks every signature itself), and libsodium's ``crypto_sign_open`` takes about 60 % of
OpenSSL's time on this project's machines (signing about 70 %; Ed25519 signing is deterministic,
so the signatures are byte for byte those OpenSSL makes). One verifier for every party also means
every party accepts exactly the same signatures: libsodium refuses a non-canonical ``S``,
small-order public keys and a small-order ``R`` (the strict RFC 8032 rules), so a crafted
signature cannot be valid for some parties and invalid for others. Every signature made here is
canonical, so nothing honest is refused.

This module does file I/O only in :meth:`Identity.save`, :meth:`Identity.load` and
:func:`load_public_key`; signing and verifying are pure.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import tempfile
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from nacl.bindings import crypto_core_ed25519_is_valid_point, crypto_sign, crypto_sign_open
from nacl.exceptions import BadSignatureError, CryptoError

from .defaults import (
    IDENTITY_KEY_FILE_MODE,
    IDENTITY_KEY_SUFFIX,
    IDENTITY_MAX_KEY_FILE_BYTES,
    IDENTITY_PUB_FILE_MODE,
    IDENTITY_PUB_SUFFIX,
)
from .errors import ConfigError, KeyFileError, SignatureError
from .localfile import check_local_file

__all__ = [
    "PARTY_ID_LENGTH",
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "Identity",
    "is_party_id",
    "load_public_key",
    "party_id_of",
    "public_key_from_b64",
    "public_key_to_b64",
    "verify_signature",
]

#: Length of a raw Ed25519 public key.
PUBLIC_KEY_BYTES = 32
#: Length of an Ed25519 signature.
SIGNATURE_BYTES = 64
#: Length of a party id string (``"p"`` + 16 hex digits).
PARTY_ID_LENGTH = 17

_SEED_DOMAIN = b"chaos-flwr/identity-seed/v1\x00"
_PARTY_ID_RE = re.compile(r"p[0-9a-f]{16}")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def party_id_of(public_key: bytes) -> str:
    """Derive the party id of a raw Ed25519 public key.

    Parameters
    ----------
    public_key
        The 32 raw bytes of the key.

    Returns
    -------
    str
        ``"p"`` followed by the first 16 hex digits of ``sha256(public_key)``.

    Raises
    ------
    SignatureError
        If ``public_key`` is not 32 bytes.
    """
    if not isinstance(public_key, bytes | bytearray) or len(public_key) != PUBLIC_KEY_BYTES:
        raise SignatureError(
            f"public_key must be {PUBLIC_KEY_BYTES} raw bytes, got "
            f"{len(public_key) if isinstance(public_key, bytes | bytearray) else type(public_key)}"
        )
    return "p" + hashlib.sha256(bytes(public_key)).hexdigest()[:16]


def is_party_id(value: object) -> bool:
    """Tell whether ``value`` has the form of a party id (``"p"`` + 16 lowercase hex digits)."""
    return isinstance(value, str) and _PARTY_ID_RE.fullmatch(value) is not None


def public_key_to_b64(public_key: bytes) -> str:
    """Standard base64 of a raw 32-byte public key (the form charters use)."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"public_key must be {PUBLIC_KEY_BYTES} raw bytes")
    return base64.b64encode(public_key).decode("ascii")


def public_key_from_b64(text: str) -> bytes:
    """Parse the canonical standard base64 of a raw 32-byte public key.

    Raises
    ------
    SignatureError
        If ``text`` is not canonical base64 of exactly 32 bytes, or the bytes are not a valid
        Ed25519 public key (off the curve, non-canonical, or of small order).
    """
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise SignatureError(f"public key {text!r} is not valid base64") from exc
    if len(raw) != PUBLIC_KEY_BYTES or base64.b64encode(raw).decode("ascii") != text:
        raise SignatureError(
            f"public key {text!r} must be the canonical base64 of {PUBLIC_KEY_BYTES} raw bytes"
        )
    if not crypto_core_ed25519_is_valid_point(raw):
        # A small-order (or non-canonical, or off-curve) key: under a lax verifier anyone could
        # forge its signatures, and no honest key pair has one.
        raise SignatureError(
            f"public key {text!r} is not a valid Ed25519 key (not a canonical point of the "
            "prime-order group: a small-order key would let anyone forge its signatures)"
        )
    return raw


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Check an Ed25519 signature (strict RFC 8032 rules, libsodium).

    Parameters
    ----------
    public_key
        The signer's 32 raw public key bytes.
    signature
        The 64-byte signature.
    data
        The exact bytes that were signed.

    Raises
    ------
    SignatureError
        If the key or signature is malformed, or the signature does not verify.
    """
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    if len(signature) != SIGNATURE_BYTES:
        raise SignatureError(f"signature must be {SIGNATURE_BYTES} bytes, got {len(signature)}")
    try:
        crypto_sign_open(bytes(signature) + bytes(data), bytes(public_key))
    except (BadSignatureError, CryptoError):
        raise SignatureError(
            f"signature does not verify under the key of {party_id_of(bytes(public_key))}: "
            "the data was altered or signed by another key (or the key is not a valid "
            "Ed25519 key)"
        ) from None


def _check_name(name: str) -> str:
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ConfigError(
            f"identity name {name!r} must be 1-128 characters of letters, digits, '.', '_' or "
            "'-', not starting with '.' or '-' (it becomes a file name)"
        )
    return name


class Identity:
    """A party's Ed25519 key pair.

    Parameters
    ----------
    private_key
        The private key.
    name
        A human-readable name (also the key file's stem); the party id if ``None``.

    Attributes
    ----------
    party_id : str
        ``party_id_of(public_key)``.
    name : str
        The party's name.
    public_key : bytes
        The 32 raw public key bytes.
    """

    __slots__ = ("_private", "_secret", "name", "party_id", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey, name: str | None = None) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise KeyFileError(
                f"an Identity needs an Ed25519 private key, got {type(private_key).__name__}"
            )
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.party_id: str = party_id_of(self.public_key)
        self.name: str = _check_name(name) if name is not None else self.party_id
        # libsodium's form of the same key (seed + public key) for signing: Ed25519 signing is
        # deterministic, so the signatures are the ones OpenSSL makes, in about 70 % of the time.
        seed = private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        self._secret: bytes = seed + self.public_key

    @classmethod
    def generate(cls, name: str | None = None) -> Identity:
        """Create a fresh random identity.

        Parameters
        ----------
        name
            Name of the party (file stem when saved); the party id if ``None``.
        """
        return cls(Ed25519PrivateKey.generate(), name)

    @classmethod
    def from_seed(cls, seed: bytes | str, name: str | None = None) -> Identity:
        """Derive an identity deterministically from a seed (tests and simulations only).

        Parameters
        ----------
        seed
            Any bytes (or a string, UTF-8 encoded); equal seeds give equal keys. The private key
            is ``sha256(domain + seed)``, so a guessable seed gives a guessable key: never use
            this for a real party.
        name
            Name of the party; the party id if ``None``.
        """
        raw_seed = seed.encode("utf-8") if isinstance(seed, str) else bytes(seed)
        secret = hashlib.sha256(_SEED_DOMAIN + raw_seed).digest()
        return cls(Ed25519PrivateKey.from_private_bytes(secret), name)

    def sign(self, data: bytes) -> bytes:
        """Sign ``data``; returns the 64-byte Ed25519 signature."""
        return crypto_sign(bytes(data), self._secret)[:SIGNATURE_BYTES]

    @property
    def public_key_b64(self) -> str:
        """The public key as charters write it (standard base64 of the 32 raw bytes)."""
        return public_key_to_b64(self.public_key)

    def public_key_pem(self) -> bytes:
        """The public key as PEM (SubjectPublicKeyInfo), the content of the ``.pub`` file."""
        return self._private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def private_key_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM, the content of the ``.key`` file."""
        return self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def save(self, directory: Path | str, *, overwrite: bool = False) -> Path:
        """Write ``<directory>/<name>.key`` (mode 0600) and ``<name>.pub`` beside it.

        Each file is written to a temporary file in ``directory`` and renamed into place, so a
        crash never leaves a half-written key.

        Parameters
        ----------
        directory
            Where to write; created (mode 0700) if missing.
        overwrite
            Replace existing files of the same name (otherwise refuse).

        Returns
        -------
        Path
            The path of the private key file.

        Raises
        ------
        KeyFileError
            If a key of that name exists (and ``overwrite`` is false) or the files cannot be
            written.
        """
        folder = Path(directory)
        key_path = folder / f"{self.name}{IDENTITY_KEY_SUFFIX}"
        pub_path = folder / f"{self.name}{IDENTITY_PUB_SUFFIX}"
        if not overwrite:
            for path in (key_path, pub_path):
                if path.exists():
                    raise KeyFileError(
                        f"{path} already exists; choose another name or pass --force "
                        "(overwrite=True) to replace it"
                    )
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            _write_atomic(key_path, self.private_key_pem(), IDENTITY_KEY_FILE_MODE)
            _write_atomic(pub_path, self.public_key_pem(), IDENTITY_PUB_FILE_MODE)
        except OSError as exc:
            if isinstance(exc, KeyFileError):
                raise
            raise KeyFileError(f"cannot write the key files in {folder}: {exc}") from exc
        return key_path

    @classmethod
    def load(cls, path: Path | str, name: str | None = None) -> Identity:
        """Load a private key written by :meth:`save` (or any unencrypted Ed25519 PEM key).

        Parameters
        ----------
        path
            The ``.key`` file.
        name
            The party's name; the file's stem if ``None`` (or the party id when the stem is not
            a valid name).

        Raises
        ------
        KeyFileError
            If the file is missing, unreadable, not PEM, encrypted, or not an Ed25519 private
            key.
        """
        file = Path(path)
        data = _read_key_file(file, "private key")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except TypeError as exc:
            raise KeyFileError(
                f"{file} is an encrypted private key; chaos-flwr needs an unencrypted key "
                "(chaos-flwr keygen writes one)"
            ) from exc
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise KeyFileError(
                f"{file} is not a PEM private key ({_first_line(exc)}); point to the '.key' file "
                "written by 'chaos-flwr keygen'"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(
                f"{file} holds a {_key_kind(key)} key, chaos-flwr needs an Ed25519 key; create "
                "one with 'chaos-flwr keygen'"
            )
        if name is None:
            stem = file.name.removesuffix(IDENTITY_KEY_SUFFIX)
            name = stem if _NAME_RE.fullmatch(stem) else None
        return cls(key, name)

    def __repr__(self) -> str:
        return f"Identity(name={self.name!r}, party_id={self.party_id!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Identity):
            return NotImplemented
        return self.public_key == other.public_key and self.name == other.name

    def __hash__(self) -> int:
        return hash((self.public_key, self.name))


def load_public_key(path: Path | str) -> bytes:
    """Read a party's public key from a PEM file.

    Accepts a ``.pub`` file (SubjectPublicKeyInfo) or, for convenience, the party's own ``.key``
    file (its public half is returned).

    Parameters
    ----------
    path
        The PEM file.

    Returns
    -------
    bytes
        The 32 raw public key bytes.

    Raises
    ------
    KeyFileError
        If the file is missing, unreadable, not PEM, or not an Ed25519 key.
    """
    file = Path(path)
    data = _read_key_file(file, "public key")
    if b"PRIVATE KEY" in data:
        return Identity.load(file).public_key
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(
            f"{file} is not a PEM public key ({_first_line(exc)}); point to the '.pub' file "
            "written by 'chaos-flwr keygen'"
        ) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(
            f"{file} holds a {_key_kind(key)} public key, chaos-flwr needs an Ed25519 key; "
            "create one with 'chaos-flwr keygen'"
        )
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _read_key_file(file: Path, what: str) -> bytes:
    try:
        check_local_file(
            file,
            what=what,
            error=KeyFileError,
            max_bytes=IDENTITY_MAX_KEY_FILE_BYTES,
            private=what == "private key",
        )
        with file.open("rb") as handle:
            data = handle.read(IDENTITY_MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError as exc:
        raise KeyFileError(
            f"no {what} file at {file}; create one with 'chaos-flwr keygen --out DIR'"
        ) from exc
    except IsADirectoryError as exc:
        raise KeyFileError(f"{file} is a directory, not a {what} file") from exc
    except PermissionError as exc:
        raise KeyFileError(
            f"cannot read the {what} file {file}: permission denied (check its owner and mode)"
        ) from exc
    except KeyFileError:
        raise
    except OSError as exc:
        raise KeyFileError(f"cannot read the {what} file {file}: {exc}") from exc
    if len(data) > IDENTITY_MAX_KEY_FILE_BYTES:
        raise KeyFileError(
            f"{file} is larger than {IDENTITY_MAX_KEY_FILE_BYTES} bytes, too large for a {what}"
        )
    if not data.strip():
        raise KeyFileError(f"{file} is empty, expected a PEM {what}")
    return data


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _key_kind(key: object) -> str:
    kind = type(key).__name__
    for suffix in ("PrivateKey", "PublicKey"):
        if kind.endswith(suffix) and kind != suffix:
            return kind[: -len(suffix)]
    return kind


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
