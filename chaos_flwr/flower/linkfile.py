"""A party's link credentials in its state directory, shared by all of its processes.

An institution's party runs in several processes: the party daemon (``chaos-flwr party``)
serves its replicas over authenticated links, and Flower's ClientApp processes dial donors
and sign the party's endpoint record, which pins the serve certificate. They must present one
link key, so the credentials (:class:`~chaos_flwr.transport.tls.LinkCredentials`) live in the
party's state directory, in ``link.credentials`` (mode 0600; the link key is as private as the
directory's replicas). The first process that needs them makes them and publishes the file
with a hard link, which never replaces one another process published first; every other
process reads that file.

A file that is malformed or of another party or federation is replaced by fresh credentials.
Only the process that serves renews credentials whose certificates expire within
:data:`LINK_RENEW_BEFORE_S` (``renew=True``: the party daemon when it starts, or the
simulation ClientApp that starts the in-process server); the party's next message then
announces the new certificate in a new endpoint record. A ClientApp that only dials keeps
using the file the daemon serves with, so the two never disagree. After any replace the file
is read back, so two processes that replaced it at once both use what is on disk. Reads are
bounded (:data:`LINK_FILE_MAX_BYTES`) and type-checked.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from pathlib import Path
from typing import Any

from cryptography import x509

from chaos_flwr import codec
from chaos_flwr.errors import ChaosError, ConfigError, DecodeError
from chaos_flwr.localfile import read_local_file
from chaos_flwr.transport.tls import LinkCredentials, binding_expires

__all__ = ["LINK_FILE", "link_credentials", "read_link_file"]

#: The credentials' file name in a party's state directory.
LINK_FILE = "link.credentials"
#: Largest credentials file read (a key and two certificates in PEM take about 2.5 KB).
LINK_FILE_MAX_BYTES: int = 16 * 1024
#: Credentials whose certificates expire sooner than this are replaced (1 day).
LINK_RENEW_BEFORE_S: float = 24 * 3600.0
_FORMAT = 1
_FIELDS = ("format", "party", "federation", "key", "serve", "dial")


def _encode(creds: LinkCredentials) -> bytes:
    return codec.encode(
        {
            "format": _FORMAT,
            "party": creds.party_id,
            "federation": creds.federation,
            "key": creds.key_pem,
            "serve": creds.serve_cert_pem,
            "dial": creds.dial_cert_pem,
        }
    )


def _decode(raw: bytes) -> LinkCredentials:
    value: Any = codec.decode(raw, max_bytes=LINK_FILE_MAX_BYTES)
    if not isinstance(value, dict) or set(value) != set(_FIELDS) or value["format"] != _FORMAT:
        raise DecodeError(f"link credentials must be a map of {', '.join(_FIELDS)} (format 1)")
    for name in ("party", "federation"):
        if not isinstance(value[name], str):
            raise DecodeError(f"link credentials field {name!r} must be a string")
    for name in ("key", "serve", "dial"):
        if not isinstance(value[name], bytes):
            raise DecodeError(f"link credentials field {name!r} must be bytes")
    creds = LinkCredentials(
        party_id=value["party"],
        federation=value["federation"],
        key_pem=value["key"],
        serve_cert_pem=value["serve"],
        dial_cert_pem=value["dial"],
    )
    return creds


def _expires_at(creds: LinkCredentials) -> datetime.datetime:
    """The earlier expiry of the two certificates (DecodeError if either does not parse)."""
    try:
        certs = [
            x509.load_pem_x509_certificate(p) for p in (creds.serve_cert_pem, creds.dial_cert_pem)
        ]
    except ValueError as exc:
        raise DecodeError(f"a link certificate does not parse: {exc}") from None
    return min(c.not_valid_after_utc for c in certs)


def read_link_file(state_dir: Path) -> LinkCredentials | None:
    """The credentials saved in ``state_dir`` (``None``: no file).

    Raises
    ------
    DecodeError
        The file is malformed or its certificates do not parse.
    ConfigError
        The file is not a regular file, is too large or unreadable.
    """
    try:
        raw = read_local_file(
            state_dir / LINK_FILE,
            what="link credentials",
            error=ConfigError,
            max_bytes=LINK_FILE_MAX_BYTES,
        )
    except FileNotFoundError:
        return None
    creds = _decode(raw)
    _expires_at(creds)
    return creds


def _usable(creds: LinkCredentials | None, party_id: str, federation: str, renew: bool) -> bool:
    if creds is None or (creds.party_id, creds.federation) != (party_id, federation):
        return False
    if binding_expires(creds.dial_cert_pem) is None:  # an older binding: no peer accepts it
        return False
    left = _expires_at(creds) - datetime.datetime.now(datetime.UTC)
    return left.total_seconds() > (LINK_RENEW_BEFORE_S if renew else 0.0)


def _publish(state_dir: Path, creds: LinkCredentials, *, replace: bool) -> None:
    """Write the file: a private temporary file, then a hard link (fails if another process
    published first) or, to ``replace`` an unusable one, a rename."""
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f".tmp-link-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(_encode(creds))
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, state_dir / LINK_FILE)
        else:
            os.link(tmp, state_dir / LINK_FILE)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def link_credentials(
    state_dir: Path | None, identity: Any, federation: str, *, renew: bool = False
) -> LinkCredentials:
    """This party's link credentials: read from ``state_dir``, made (and saved) if missing or
    unusable (module docstring). Without a state directory they are made fresh.

    Parameters
    ----------
    identity
        The party's identity (``party_id`` and ``sign``: it signs the dial certificate's
        binding).
    federation
        The federation's name (the charter's).
    renew
        Replace credentials that expire within :data:`LINK_RENEW_BEFORE_S` (the serving
        process only; module docstring).

    Raises
    ------
    ConfigError
        The credentials cannot be written to ``state_dir``.
    """
    if state_dir is None:
        return LinkCredentials.create(identity, federation)
    party_id = str(identity.party_id)
    try:
        held = read_link_file(state_dir)
    except ChaosError:
        held = None  # malformed: replaced below
        replace = True
    else:
        replace = held is not None
    if _usable(held, party_id, federation, renew):
        assert held is not None
        return held
    fresh = LinkCredentials.create(identity, federation)
    try:
        try:
            _publish(state_dir, fresh, replace=replace)
        except FileExistsError:  # another process published first: use its credentials
            theirs = read_link_file(state_dir)
            if theirs is not None and _usable(theirs, party_id, federation, renew):
                return theirs
            _publish(state_dir, fresh, replace=True)
    except OSError as exc:
        raise ConfigError(f"cannot save link credentials in {state_dir}: {exc}") from exc
    on_disk = read_link_file(state_dir)  # another replace may have won: what is there counts
    return on_disk if on_disk is not None else fresh
