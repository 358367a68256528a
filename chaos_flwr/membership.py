"""Membership as a convergent set of signed records.

A federation's membership is not held by anyone: it is the *view* every party computes from the
signed records it holds. Five kinds of record exist:

``join``
    ``subject`` (at ``incarnation``) becomes a member at time ``at``. Signed by the joiner; a
    founder needs nothing else (that is the genesis: founders bootstrap by signing their own
    join), an allowlisted party also needs ``admission.sponsors_required`` signatures of other
    charter parties (its sponsors).
``leave``
    ``subject`` leaves (ends ``incarnation``). Signed by the leaver.
``fail``
    ``subject`` is declared failed (ends ``incarnation``). Signed by ``failure_quorum`` parties
    other than the subject (the neighbours that suspect it). The body carries no timestamp, so
    independent suspicion votes sign identical bytes and any party holding ``k`` of them can
    assemble the same record.
``link_up`` / ``link_down``
    The link ``a``-``b`` (``a < b``, between incarnations ``inc_a``/``inc_b``) is up or down at
    ``epoch``. Up is signed by both ends, down by either end.
``endpoint``
    ``subject`` (at ``incarnation``) can be reached for direct links at ``host``:``port``
    (an IPv4 or IPv6 address or a DNS name, in canonical form), serving with the TLS
    certificate ``cert`` (DER; see :mod:`chaos_flwr.transport.tls`). Signed by the subject
    alone. The highest ``(incarnation, seq, host, port, cert)`` of a subject wins (a changed
    address is announced with a higher ``seq``); the view lists an endpoint only while its
    subject is active at exactly that incarnation (:meth:`RecordSet.endpoint`), so a rejoin
    announces again. A dialler takes addresses only from there, never from the relay.

Validation is *stateless*: a record is valid or not from its own bytes and the charter policy
alone, never from the records already held. That is what makes the view a pure function of the
record set. The view then folds the records deterministically:

- a member's incarnation is the highest incarnation any of its join records carries; its join
  time is the smallest ``at`` among the join records of that incarnation;
- its *end* is its highest end record (leave or fail) by ``(incarnation, leave over fail)``;
  it is ``left`` or ``failed`` (the end's kind) if the end's incarnation is at least the
  member's, else ``active``. Records about an older incarnation can therefore neither kill nor
  resurrect a newer one, and a failed or departed party rejoins with an incarnation above its
  end. An end of a *later* incarnation than the highest join held (a leave that overtook its
  join) already ends the member: only the party itself (leave) or a failure quorum can sign it,
  and an honest one exists only once the party has moved on to that incarnation;
- a link's *version* is ``(epoch, inc_a, inc_b)``; the highest version held wins, and it is
  ``down`` if any link_down of that version exists, else ``up``. A flap is a sequence of
  versions, each ended by its own down record. A link is *live* (an edge of the neighbour graph)
  when it is up and both ends are active at exactly the incarnations it names.

Compaction: the record frontier
-------------------------------
The view depends only on each subject's highest join, highest end and highest endpoint and on
each link's highest record (version ``(epoch, inc_a, inc_b)``, a down over an up of the same
version). A :class:`RecordSet` therefore holds only its *frontier*: the records no held record
supersedes (:func:`supersedes`). At most three records per charter party and one per link are
held, however old the federation (endpoint records live beside the others: they neither
supersede nor are superseded by a join or an end); adding a superseded record changes nothing,
and a record that supersedes held ones replaces them (``docs/internals.md``, "Compaction: the
record frontier", argues why every party still converges to the same frontier and view).

Small clusters: a fail record always needs ``failure_quorum`` signatures. While fewer than
``failure_quorum`` live members other than the suspect remain, no fail record can be formed: the
suspect stays ``active`` in the view (its suspicion is only local, see
:class:`chaos_flwr.monitor.Monitor`). That is deliberate: two halves of a partition must not be
able to expel each other.

Proofs: one signature for the envelope and the record
------------------------------------------------------
A record signature is normally 64 bytes of Ed25519 over :func:`signing_bytes`. A party that
broadcasts a record it signs itself (its leave, a link_down, the countersigned link_up or join,
the fail record it assembled) may instead send an envelope of kind :data:`PROOF_KIND`
(``"own"``) whose payload is ``{"record": {"body": B, "sigs": S}}`` (``S``: the *other* signers'
plain signatures): the envelope's own signature is then its sender's signature of ``B``, and the
receiver holds the record with the envelope's exact bytes in place of that signature (a
*proof*). :func:`validate_record` checks a proof (any signature value that is not 64 bytes) by
opening it as an envelope under the signer's key (signature over the exact bytes, strict
decoding, at most ``MEMBERSHIP_PROOF_MAX_BYTES``), and requiring kind ``own``, the signer as
sender and the canonical encoding of the carried body equal to the record's. So a receiver that
opened the envelope verifies one signature instead of two, and anyone the record is forwarded to
later still checks the sender's signature over bytes that name the body. Why this is sound, and
what it does not change (replay protection, the exact-bytes rule), is argued in
``docs/internals.md`` ("Record proofs").
"""

from __future__ import annotations

import bisect
import hashlib
import ipaddress
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import codec
from .defaults import (
    ENDPOINT_MAX_HOST_CHARS,
    LINK_CERT_MAX_BYTES,
    MEMBERSHIP_MAX_COUNTER,
    MEMBERSHIP_PROOF_MAX_BYTES,
    MEMBERSHIP_SIGNATURE_CACHE_ENTRIES,
)
from .errors import ChaosError, DecodeError, PolicyError, SignatureError, UnknownPartyError
from .identity import SIGNATURE_BYTES, verify_signature
from .wire import DOMAIN as _ENVELOPE_DOMAIN
from .wire import Envelope, open_sealed

__all__ = [
    "KINDS",
    "PROOF_KIND",
    "EndpointInfo",
    "LinkInfo",
    "MemberInfo",
    "Policy",
    "Record",
    "RecordSet",
    "SignatureCache",
    "View",
    "endpoint_address",
    "endpoint_body",
    "fail_body",
    "join_body",
    "leave_body",
    "link_body",
    "parse_address",
    "record_id_of",
    "signing_bytes",
    "supersedes",
    "validate_record",
]

#: Domain separation of record signatures (never confused with envelopes or charters).
_RECORD_DOMAIN = b"chaos-flwr/record/v1\x00"
_VIEW_DOMAIN = b"chaos-flwr/view/v1\x00"

KINDS = ("join", "leave", "fail", "link_up", "link_down", "endpoint")
#: Envelope kind whose signature is also its sender's signature of the record it carries.
PROOF_KIND = "own"
_MEMBER_KINDS = ("join", "leave", "fail")
_LINK_KINDS = ("link_up", "link_down")

ACTIVE = "active"
LEFT = "left"
FAILED = "failed"
UP = "up"
DOWN = "down"

_FIELDS: dict[str, frozenset[str]] = {
    "join": frozenset({"kind", "federation", "subject", "incarnation", "at"}),
    "leave": frozenset({"kind", "federation", "subject", "incarnation"}),
    "fail": frozenset({"kind", "federation", "subject", "incarnation"}),
    "link_up": frozenset({"kind", "federation", "a", "b", "inc_a", "inc_b", "epoch"}),
    "link_down": frozenset({"kind", "federation", "a", "b", "inc_a", "inc_b", "epoch"}),
    "endpoint": frozenset(
        {"kind", "federation", "subject", "incarnation", "seq", "host", "port", "cert"}
    ),
}


# --- policy ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What the charter demands of records, in the form membership checks it.

    Parameters
    ----------
    federation : str
        Name of the federation; records of another federation are refused.
    keyring : Mapping[str, bytes]
        Party id -> raw 32-byte Ed25519 public key of every charter party.
    founders : frozenset[str]
        Party ids that join on their own signature (genesis).
    sponsors_required : int
        Signatures of other charter parties a non-founder's join needs.
    failure_quorum : int
        Signatures of parties other than the subject a fail record needs.
    """

    federation: str
    keyring: Mapping[str, bytes]
    founders: frozenset[str]
    sponsors_required: int
    failure_quorum: int

    @classmethod
    def from_charter(cls, charter: Any, keyring: Mapping[str, bytes] | None = None) -> Policy:
        """Build the policy of a :class:`chaos_flwr.charter.Charter`.

        Parameters
        ----------
        charter
            A verified charter.
        keyring
            Extra keys merged over ``charter.keyring()`` (tests, simulations).
        """
        keys = dict(charter.keyring())
        if keyring:
            keys.update(keyring)
        founders = frozenset(m.party_id for m in charter.founders)
        return cls(
            federation=str(charter.federation),
            keyring=keys,
            founders=founders,
            sponsors_required=int(charter.admission.sponsors_required),
            failure_quorum=int(charter.failure_quorum),
        )


class SignatureCache:
    """Remembers signatures that verified, so one signature is checked once per cache.

    Signature verification is deterministic, so a positive cache is sound. Each
    :class:`RecordSet` owns one unless it is given a shared one (several peers hosted in one
    process then verify each record signature once instead of once per peer).

    Parameters
    ----------
    max_entries : int
        Entries kept; the cache is cleared when it grows past this.

    Attributes
    ----------
    checks : int
        Signature verifications actually performed (cache misses), for measurements.
    """

    def __init__(self, max_entries: int = MEMBERSHIP_SIGNATURE_CACHE_ENTRIES) -> None:
        self._seen: set[tuple[bytes, bytes, bytes]] = set()
        self._max = max_entries
        self.checks = 0

    def verify(self, public_key: bytes, signature: bytes, data: bytes) -> None:
        """Verify ``signature`` over ``data`` under ``public_key`` (once per cache).

        Raises
        ------
        SignatureError
            If the key or signature is malformed or the signature does not verify
            (:func:`chaos_flwr.identity.verify_signature`); failures are never cached.
        """
        entry = (public_key, signature, hashlib.sha256(data).digest())
        if entry in self._seen:
            return
        self.checks += 1
        verify_signature(public_key, signature, data)
        self._remember(entry)

    def trust(self, public_key: bytes, signature: bytes, data: bytes) -> None:
        """Remember a signature its owner just made with the private key of ``public_key``.

        Only for signatures this process produced itself (Ed25519 signing is deterministic and
        always verifies); a party then does not re-verify its own records. Never call it with
        received bytes.
        """
        self._remember((public_key, signature, hashlib.sha256(data).digest()))

    def _remember(self, entry: tuple[bytes, bytes, bytes]) -> None:
        if len(self._seen) >= self._max:
            self._seen.clear()
        self._seen.add(entry)


# --- record bodies -----------------------------------------------------------------------------


def join_body(federation: str, subject: str, incarnation: int, at: float) -> dict[str, Any]:
    """Body of a join record (``at`` is the join time every party will agree on)."""
    return {
        "kind": "join",
        "federation": federation,
        "subject": subject,
        "incarnation": int(incarnation),
        "at": float(at),
    }


def leave_body(federation: str, subject: str, incarnation: int) -> dict[str, Any]:
    """Body of a leave record."""
    return {
        "kind": "leave",
        "federation": federation,
        "subject": subject,
        "incarnation": int(incarnation),
    }


def fail_body(federation: str, subject: str, incarnation: int) -> dict[str, Any]:
    """Body of a fail record (no timestamp: every suspecting party signs the same bytes)."""
    return {
        "kind": "fail",
        "federation": federation,
        "subject": subject,
        "incarnation": int(incarnation),
    }


def link_body(
    kind: str,
    federation: str,
    end1: tuple[str, int],
    end2: tuple[str, int],
    epoch: int,
) -> dict[str, Any]:
    """Body of a link_up or link_down record; the ends are ``(party id, incarnation)``.

    The ends are put in canonical order (``a < b``) whatever order they are given in.
    """
    if kind not in _LINK_KINDS:
        raise PolicyError(f"kind must be link_up or link_down, got {kind!r}")
    (a, inc_a), (b, inc_b) = sorted([end1, end2])
    return {
        "kind": kind,
        "federation": federation,
        "a": a,
        "b": b,
        "inc_a": int(inc_a),
        "inc_b": int(inc_b),
        "epoch": int(epoch),
    }


def endpoint_body(
    federation: str,
    subject: str,
    incarnation: int,
    seq: int,
    address: str,
    cert: bytes,
) -> dict[str, Any]:
    """Body of an endpoint record: ``subject`` serves direct links at ``address``.

    Parameters
    ----------
    address
        ``host:port``; an IPv6 host in brackets (``[::1]:9000``). The host is put in canonical
        form (compressed IP address, lower-case name).
    seq
        Orders the subject's endpoint records of one incarnation (higher supersedes).
    cert
        DER of the party's serve certificate (:class:`chaos_flwr.transport.tls.LinkCredentials`).

    Raises
    ------
    DecodeError
        If the address or another field is malformed (as a receiver would refuse it).
    """
    host, port = parse_address(address)
    body = {
        "kind": "endpoint",
        "federation": federation,
        "subject": subject,
        "incarnation": int(incarnation),
        "seq": int(seq),
        "host": host,
        "port": port,
        "cert": bytes(cert),
    }
    return _check_body(body)


def parse_address(address: object) -> tuple[str, int]:
    """``(canonical host, port)`` of ``host:port`` (IPv6 host in brackets).

    Raises
    ------
    DecodeError
        Not a string ``host:port``, a port outside 1..65535, or a host that is neither an IP
        address nor a DNS name.
    """
    if not isinstance(address, str) or len(address) > ENDPOINT_MAX_HOST_CHARS + 8:
        raise DecodeError(
            f"an endpoint address must be a short 'host:port' string, got {address!r:.80}"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or len(port) > 5:
        raise DecodeError(f"an endpoint address needs a port 1..65535: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise DecodeError(f"only an IPv6 host goes in brackets: {address!r}")
    elif ":" in host:
        raise DecodeError(f"an IPv6 host must be in brackets ([::1]:9000): {address!r}")
    return _canonical_host(host), int(port)


def endpoint_address(host: str, port: int) -> str:
    """``host:port`` of an endpoint (an IPv6 host in brackets); inverse of :func:`parse_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _canonical_host(host: str) -> str:
    if not 0 < len(host) <= ENDPOINT_MAX_HOST_CHARS:
        raise DecodeError(f"an endpoint host must have 1..{ENDPOINT_MAX_HOST_CHARS} characters")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        # no form whose text differs across Python versions (IPv4-mapped) or that names no
        # one host (unspecified, multicast): every party must read the same canonical bytes
        if ip.is_unspecified or ip.is_multicast or getattr(ip, "ipv4_mapped", None):
            raise DecodeError(f"an endpoint host must be one unicast address, got {host!r}")
        return str(ip)
    name = host.lower().rstrip(".")
    labels = name.split(".")
    for label in labels:
        ok = 0 < len(label) <= 63 and label.isascii() and label.replace("-", "").isalnum()
        if not ok or label.startswith("-") or label.endswith("-"):
            raise DecodeError(
                f"an endpoint host is neither an IP address nor a DNS name: {host!r:.80}"
            )
    if labels[-1].isdigit():
        raise DecodeError(f"an endpoint host is neither an IP address nor a DNS name: {host!r:.80}")
    return name


def _check_endpoint(body: Mapping[str, Any]) -> None:
    if not isinstance(body["subject"], str) or not body["subject"]:
        raise DecodeError("record field 'subject' must be a non-empty party id")
    _check_int(body, "incarnation")
    _check_int(body, "seq")
    host, port = body["host"], body["port"]
    if not isinstance(host, str) or _canonical_host(host) != host:
        raise DecodeError("endpoint record field 'host' must be a host in canonical form")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise DecodeError("endpoint record field 'port' must be an integer 1..65535")
    cert = body["cert"]
    if not isinstance(cert, bytes) or not 0 < len(cert) <= LINK_CERT_MAX_BYTES:
        raise DecodeError(f"endpoint record field 'cert' must be 1..{LINK_CERT_MAX_BYTES} bytes")


def signing_bytes(body: Mapping[str, Any]) -> bytes:
    """The exact bytes a record signature covers (domain tag + canonical body)."""
    return _RECORD_DOMAIN + codec.encode(dict(body))


def record_id_of(body: Mapping[str, Any]) -> str:
    """The record id: hex of the first 16 bytes of sha256 over :func:`signing_bytes`."""
    return hashlib.sha256(signing_bytes(body)).hexdigest()[:32]


def _check_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise DecodeError("record field 'body' must be a map")
    kind = body.get("kind")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise DecodeError(f"record field 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    fields = _FIELDS[kind]
    keys = set(body)
    if keys != fields:
        extra = sorted(keys - fields)
        missing = sorted(fields - keys)
        raise DecodeError(f"{kind} record has unknown fields {extra} / missing fields {missing}")
    if not isinstance(body["federation"], str):
        raise DecodeError("record field 'federation' must be a string")
    if kind == "endpoint":
        _check_endpoint(body)
    elif kind in _MEMBER_KINDS:
        if not isinstance(body["subject"], str) or not body["subject"]:
            raise DecodeError("record field 'subject' must be a non-empty party id")
        _check_int(body, "incarnation")
        if kind == "join":
            at = body["at"]
            if not isinstance(at, float) or not math.isfinite(at):
                raise DecodeError("join record field 'at' must be a finite float")
    else:
        a, b = body["a"], body["b"]
        if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
            raise DecodeError("link record fields 'a' and 'b' must be party ids")
        if not a < b:
            raise DecodeError("link record fields 'a' and 'b' must be distinct and a < b")
        _check_int(body, "inc_a")
        _check_int(body, "inc_b")
        _check_int(body, "epoch")
    return body


def _check_int(body: Mapping[str, Any], name: str) -> None:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DecodeError(f"record field {name!r} must be an integer >= 0")
    if value > MEMBERSHIP_MAX_COUNTER:
        raise DecodeError(
            f"record field {name!r} is {value}, above the largest counter a record may carry "
            f"({MEMBERSHIP_MAX_COUNTER}): no honest party gets near it"
        )


# --- records -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """A membership record: a canonical body and the signatures over it.

    Attributes
    ----------
    body : dict
        The signed fields (see the module docstring).
    signatures : dict[str, bytes]
        Signer party id -> Ed25519 signature over :func:`signing_bytes` of the body.
    record_id : str
        :func:`record_id_of` the body (computed, not passed). Two records with the same body
        are the same record, whichever (sufficient) set of signatures each carries.
    signed : bytes
        :func:`signing_bytes` of the body (computed once).
    """

    body: dict[str, Any]
    signatures: dict[str, bytes]
    record_id: str = field(default="", init=False)
    signed: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        data = signing_bytes(self.body)
        object.__setattr__(self, "signed", data)
        object.__setattr__(self, "record_id", hashlib.sha256(data).hexdigest()[:32])

    @classmethod
    def _checked(cls, body: dict[str, Any], signatures: dict[str, bytes]) -> Record:
        """A record of an already checked body and signature map (taken, not copied)."""
        record = cls.__new__(cls)
        data = _RECORD_DOMAIN + codec.encode(body)
        setattr_ = object.__setattr__
        setattr_(record, "body", body)
        setattr_(record, "signatures", signatures)
        setattr_(record, "signed", data)
        setattr_(record, "record_id", hashlib.sha256(data).hexdigest()[:32])
        return record

    @property
    def kind(self) -> str:
        """The record kind."""
        return str(self.body["kind"])

    @property
    def subject(self) -> str:
        """The party the record is about (``"a|b"`` for a link record)."""
        if self.kind in _LINK_KINDS:
            return f"{self.body['a']}|{self.body['b']}"
        return str(self.body["subject"])

    def to_wire(self) -> dict[str, Any]:
        """The record as a codec value (``{"body": ..., "sigs": ...}``)."""
        return {"body": self.body, "sigs": dict(self.signatures)}

    @classmethod
    def from_wire(cls, value: Any) -> Record:
        """Parse a record from a decoded codec value (shape only; see :func:`validate_record`).

        Raises
        ------
        DecodeError
            If the value is not a well-formed record.
        """
        return cls._checked(*cls.wire_parts(value))

    @staticmethod
    def wire_parts(value: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The checked body and a copy of the signature map of a record's codec value.

        What :meth:`from_wire` checks, without computing the record id: a receiver can then
        screen the body (:meth:`RecordSet.covers`) before hashing it. Make the record with
        :meth:`from_parts`.

        Raises
        ------
        DecodeError
            If the value is not a well-formed record.
        """
        if not isinstance(value, dict) or set(value) != {"body", "sigs"}:
            raise DecodeError("a record must be a map with exactly the fields 'body' and 'sigs'")
        body = _check_body(value["body"])
        sigs = value["sigs"]
        if not isinstance(sigs, dict) or not sigs:
            raise DecodeError("record field 'sigs' must be a non-empty map party id -> bytes")
        for signer, sig in sigs.items():
            if not isinstance(sig, bytes):
                raise DecodeError(f"record signature of {signer!r} must be bytes")
        return body, dict(sigs)

    @classmethod
    def from_parts(cls, body: dict[str, Any], signatures: dict[str, bytes]) -> Record:
        """The record of parts :meth:`wire_parts` returned (taken, not copied)."""
        return cls._checked(body, signatures)

    @classmethod
    def from_own(cls, env: Envelope) -> Record:
        """The record an ``own`` envelope carries, with the envelope as its sender's proof.

        ``env`` is a verified envelope (:func:`chaos_flwr.wire.open_sealed`) of kind
        :data:`PROOF_KIND`. Shape only, as :meth:`from_wire`; check it with
        :func:`validate_record` (``envelope=env`` spares decoding the proof again).

        Raises
        ------
        DecodeError
            If the envelope is not an ``own`` envelope of the shape
            ``{"record": {"body", "sigs"}}``, or ``sigs`` names the sender or holds anything but
            64-byte signatures (a proof never nests inside another).
        """
        payload = env.payload
        value = payload.get("record")
        if env.kind != PROOF_KIND or len(payload) != 1 or type(value) is not dict:
            raise DecodeError("own envelope payload must be {'record': {'body', 'sigs'}}")
        if len(value) != 2 or "body" not in value or "sigs" not in value:
            raise DecodeError("a record must be a map with exactly the fields 'body' and 'sigs'")
        sigs = value["sigs"]
        if type(sigs) is not dict or env.sender in sigs:
            raise DecodeError(
                "own envelope field 'sigs' must map the other signers to 64-byte signatures"
            )
        for sig in sigs.values():
            if type(sig) is not bytes or len(sig) != SIGNATURE_BYTES:
                raise DecodeError(
                    "own envelope field 'sigs' must map the other signers to 64-byte signatures"
                )
        signatures = dict(sigs)
        signatures[env.sender] = env.raw
        return cls._checked(_check_body(value["body"]), signatures)

    @classmethod
    def sign(cls, body: Mapping[str, Any], signers: Iterable[Any]) -> Record:
        """Make a record signed by each of ``signers`` (objects with ``party_id`` and ``sign``)."""
        body_d = _check_body(dict(body))
        data = signing_bytes(body_d)
        return cls(body=body_d, signatures={s.party_id: s.sign(data) for s in signers})


def validate_record(
    record: Record,
    policy: Policy,
    cache: SignatureCache | None = None,
    *,
    envelope: Envelope | None = None,
) -> None:
    """Check that ``record`` carries what the charter demands; stateless.

    Parameters
    ----------
    record
        The record to check.
    policy
        The federation's policy.
    cache
        Signature cache to use (a fresh one if ``None``).
    envelope
        The envelope (as returned by :func:`chaos_flwr.wire.open_sealed`) the record arrived
        in, when it is the proof of its sender's signature: it is not decoded again (its
        signature is still checked, through ``cache``).

    Raises
    ------
    DecodeError
        If the body is malformed.
    UnknownPartyError
        If a signer (or the subject of a join) is not a charter party.
    SignatureError
        If any signature does not verify, or a proof (a signature value that is not 64 bytes)
        is not an ``own`` envelope of its signer carrying this record's body.
    PolicyError
        If the record is of another federation or lacks required signatures.
    """
    body = _check_body(record.body)
    if body["federation"] != policy.federation:
        raise PolicyError(
            f"record field 'federation' is {body['federation']!r}, this federation is "
            f"{policy.federation!r}"
        )
    checker = cache if cache is not None else SignatureCache()
    data = record.signed
    for signer, sig in record.signatures.items():
        key = policy.keyring.get(signer)
        if key is None:
            raise UnknownPartyError(
                f"record signer {signer!r} is not a party of the charter; add its key to the "
                "charter allowlist or drop the signature"
            )
        if len(sig) == SIGNATURE_BYTES:
            checker.verify(key, sig, data)
        else:
            _check_proof(record, signer, key, sig, checker, envelope)
    _check_signers(body, set(record.signatures), policy)


def _check_signers(body: dict[str, Any], signers: set[str], policy: Policy) -> None:
    """Check that a (verified) record's signers are the ones its kind and the charter demand."""
    kind = body["kind"]
    if kind == "endpoint":
        if body["subject"] not in policy.keyring:
            raise UnknownPartyError(
                f"endpoint record field 'subject' {body['subject']!r} is not a party of the charter"
            )
        if signers != {body["subject"]}:
            raise PolicyError("an endpoint record is signed by its subject alone")
    elif kind in _MEMBER_KINDS:
        subject = body["subject"]
        if kind == "join":
            if subject not in policy.keyring:
                raise UnknownPartyError(
                    f"join record field 'subject' {subject!r} is neither a founder nor on the "
                    "charter allowlist"
                )
            if subject not in signers:
                raise PolicyError("join record lacks the joiner's own signature ('subject')")
            if subject not in policy.founders:
                sponsors = len(signers - {subject})
                if sponsors < policy.sponsors_required:
                    raise PolicyError(
                        f"join record has {sponsors} sponsor signatures, the charter's "
                        f"admission.sponsors_required is {policy.sponsors_required}"
                    )
        elif kind == "leave":
            if subject not in signers:
                raise PolicyError("leave record lacks the leaver's own signature ('subject')")
        else:
            if subject not in policy.keyring:
                # Else a quorum (of one, if the charter says so) could name parties without end.
                raise UnknownPartyError(
                    f"fail record field 'subject' {subject!r} is not a party of the charter"
                )
            voters = len(signers - {subject})
            if voters < policy.failure_quorum:
                raise PolicyError(
                    f"fail record has {voters} suspecting signatures, the charter's "
                    f"failure_quorum is {policy.failure_quorum}"
                )
    else:
        ends = {body["a"], body["b"]}
        outside = sorted(e for e in ends if e not in policy.keyring)
        if outside:
            # Else one end alone could sign link_downs to ever new names (unbounded links).
            raise UnknownPartyError(f"link record end {outside[0]!r} is not a party of the charter")
        if kind == "link_up" and not ends <= signers:
            raise PolicyError("link_up record needs the signatures of both ends 'a' and 'b'")
        if kind == "link_down" and not ends & signers:
            raise PolicyError("link_down record needs the signature of end 'a' or end 'b'")


def _check_proof(
    record: Record,
    signer: str,
    key: bytes,
    proof: bytes,
    checker: SignatureCache,
    envelope: Envelope | None,
) -> None:
    """Check that ``proof`` is an ``own`` envelope of ``signer`` carrying ``record``'s body."""
    if len(proof) > MEMBERSHIP_PROOF_MAX_BYTES:
        raise SignatureError(
            f"record signature of {signer} is {len(proof)} bytes: neither a {SIGNATURE_BYTES}-"
            f"byte signature nor a proof envelope of at most {MEMBERSHIP_PROOF_MAX_BYTES} bytes"
        )
    if envelope is not None and envelope.raw == proof and envelope.sender == signer:
        env = envelope
        checker.verify(key, env.signature, _ENVELOPE_DOMAIN + proof[:-SIGNATURE_BYTES])
    else:
        try:
            env = open_sealed(
                proof, {signer: key}, max_bytes=MEMBERSHIP_PROOF_MAX_BYTES, verify=checker.verify
            )
        except ChaosError as exc:
            raise SignatureError(
                f"record signature of {signer} is neither a {SIGNATURE_BYTES}-byte signature "
                f"nor a valid proof envelope of {signer}: {exc}"
            ) from None
    if env.kind != PROOF_KIND:
        raise SignatureError(
            f"record signature of {signer} is an envelope of kind {env.kind!r}; only an "
            f"{PROOF_KIND!r} envelope proves a record"
        )
    inner = env.payload.get("record") if env.payload.keys() == {"record"} else None
    body = inner.get("body") if isinstance(inner, dict) else None
    if body is not record.body and (
        not isinstance(body, dict) or signing_bytes(body) != record.signed
    ):
        raise SignatureError(
            f"record signature of {signer} is an {PROOF_KIND!r} envelope that carries another "
            f"record body than {record.kind} {record.record_id}"
        )


# --- the view ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberInfo:
    """One party as the view sees it.

    Attributes
    ----------
    party_id : str
    status : str
        ``"active"``, ``"left"`` or ``"failed"``.
    incarnation : int
        The highest incarnation the party joined with.
    joined_at : float
        Join time of that incarnation (from its join record, so every party agrees).
    """

    party_id: str
    status: str
    incarnation: int
    joined_at: float


@dataclass(frozen=True)
class LinkInfo:
    """One link as the view sees it (the highest version held).

    Attributes
    ----------
    a, b : str
        The ends, ``a < b``.
    state : str
        ``"up"`` or ``"down"``.
    epoch, inc_a, inc_b : int
        The version of the link.
    live : bool
        Up, and both ends active at exactly ``inc_a`` / ``inc_b``.
    """

    a: str
    b: str
    state: str
    epoch: int
    inc_a: int
    inc_b: int
    live: bool


@dataclass(frozen=True)
class EndpointInfo:
    """Where an active member serves direct links, from its verified endpoint record.

    Attributes
    ----------
    party_id : str
    incarnation, seq : int
        The record's incarnation (the member's current one) and sequence number.
    host : str
        Canonical host (IP address or DNS name; an IPv6 address without brackets).
    port : int
    cert : bytes
        DER of the party's serve certificate (a dialler pins it).
    """

    party_id: str
    incarnation: int
    seq: int
    host: str
    port: int
    cert: bytes = field(repr=False)

    @property
    def address(self) -> str:
        """``host:port`` to dial (an IPv6 host in brackets)."""
        return endpoint_address(self.host, self.port)

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> EndpointInfo:
        """The endpoint an endpoint record body names."""
        return cls(
            str(body["subject"]),
            int(body["incarnation"]),
            int(body["seq"]),
            str(body["host"]),
            int(body["port"]),
            bytes(body["cert"]),
        )


class View:
    """Members, neighbour graph, link states and endpoints: a pure function of a record set.

    Built by :meth:`RecordSet.view`; never mutated. ``endpoints`` holds the endpoints of the
    active members (at their current incarnation) only.
    """

    def __init__(
        self,
        members: Mapping[str, MemberInfo],
        links: Mapping[tuple[str, str], LinkInfo],
        endpoints: Mapping[str, EndpointInfo] | None = None,
    ) -> None:
        self.members: Mapping[str, MemberInfo] = dict(sorted(members.items()))
        self.links: Mapping[tuple[str, str], LinkInfo] = dict(sorted(links.items()))
        self.endpoints: Mapping[str, EndpointInfo] = dict(sorted((endpoints or {}).items()))
        nbrs: dict[str, set[str]] = {pid: set() for pid in self.members}
        for (a, b), link in self.links.items():
            if link.live:
                nbrs[a].add(b)
                nbrs[b].add(a)
        self._neighbours = {pid: tuple(sorted(s)) for pid, s in nbrs.items()}
        self._digest: bytes | None = None

    def active(self) -> list[str]:
        """Party ids of the active members, sorted."""
        return [pid for pid, m in self.members.items() if m.status == ACTIVE]

    def is_active(self, party_id: str) -> bool:
        """Whether ``party_id`` is an active member."""
        m = self.members.get(party_id)
        return m is not None and m.status == ACTIVE

    def neighbours(self, party_id: str) -> tuple[str, ...]:
        """Live neighbours of ``party_id`` (sorted; empty for an unknown party)."""
        return self._neighbours.get(party_id, ())

    def graph(self) -> dict[str, tuple[str, ...]]:
        """The neighbour graph of the active members: party id -> live neighbours."""
        return {pid: self._neighbours[pid] for pid in self.active()}

    def watchers(
        self, party_id: str, quorum: int, *, ring: list[str] | None = None
    ) -> tuple[str, ...]:
        """Who watches ``party_id`` for failure: its live neighbours, topped up to ``quorum``.

        When the party has fewer than ``quorum`` live neighbours, the next active members after
        it in sorted-id ring order are added until ``quorum`` watchers exist (or none is left),
        so a sparse graph can still form a fail quorum. Every party computes the same set.
        ``ring`` may pass :meth:`active` when it is already at hand.
        """
        chosen = list(self.neighbours(party_id))
        if len(chosen) < quorum:
            if ring is None:
                ring = self.active()
            have = set(chosen) | {party_id}
            start = bisect.bisect_right(ring, party_id) if ring else 0
            for j in range(len(ring)):
                if len(chosen) >= quorum:
                    break
                pid = ring[(start + j) % len(ring)]
                if pid not in have:
                    chosen.append(pid)
                    have.add(pid)
        return tuple(sorted(chosen))

    def endpoint(self, party_id: str) -> EndpointInfo | None:
        """The endpoint of ``party_id`` if it is active and announced one (this incarnation)."""
        return self.endpoints.get(party_id)

    def to_value(self) -> dict[str, Any]:
        """The view as a codec value (what :attr:`digest` hashes; no ``endpoints`` key when
        no active member announced one, so such views hash as before endpoints existed)."""
        value: dict[str, Any] = {
            "members": [
                [m.party_id, m.status, m.incarnation, m.joined_at] for m in self.members.values()
            ],
            "links": [
                [ln.a, ln.b, ln.state, ln.epoch, ln.inc_a, ln.inc_b, ln.live]
                for ln in self.links.values()
            ],
        }
        if self.endpoints:
            value["endpoints"] = [
                [e.party_id, e.incarnation, e.seq, e.host, e.port, e.cert]
                for e in self.endpoints.values()
            ]
        return value

    @property
    def digest(self) -> bytes:
        """sha256 over the canonical encoding of the view (32 bytes)."""
        if self._digest is None:
            self._digest = hashlib.sha256(_VIEW_DOMAIN + codec.encode(self.to_value())).digest()
        return self._digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, View) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"View(active={self.active()}, digest={self.digest.hex()[:12]})"


def _order(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """Where a record stands among the records about the same thing (higher wins).

    Joins: ``(incarnation, -at)`` (the least join time of the highest incarnation wins). End
    records: ``(incarnation, leave over fail)``. Links: ``(epoch, inc_a, inc_b, down over up)``.
    """
    kind = body["kind"]
    if kind == "join":
        return (body["incarnation"], -body["at"])
    if kind == "endpoint":
        return (body["incarnation"], body["seq"], body["host"], body["port"], body["cert"])
    if kind in _LINK_KINDS:
        return (body["epoch"], body["inc_a"], body["inc_b"], kind == "link_down")
    return (body["incarnation"], kind == "leave")


def supersedes(newer: Mapping[str, Any], older: Mapping[str, Any]) -> bool:
    """Whether a record with body ``newer`` makes one with body ``older`` irrelevant to the view.

    A strict partial order on well-formed bodies of one federation, decided by the two bodies
    alone: a join supersedes the lower joins of its subject and its subject's end records of
    lower incarnations; an end record supersedes the lower end records of its subject; a link
    record supersedes the lower records of its link (orders: see :func:`_order`). The view of a
    set of records equals the view of its frontier, the records no other record of the set
    supersedes (``docs/internals.md``, "Compaction: the record frontier").
    """
    kind, old_kind = newer["kind"], older["kind"]
    if kind == "endpoint" or old_kind == "endpoint":
        return (
            kind == old_kind
            and newer["subject"] == older["subject"]
            and _order(newer) > _order(older)
        )
    if kind in _LINK_KINDS:
        return (
            old_kind in _LINK_KINDS
            and (newer["a"], newer["b"]) == (older["a"], older["b"])
            and _order(newer) > _order(older)
        )
    if old_kind in _LINK_KINDS or newer["subject"] != older["subject"]:
        return False
    if kind == "join":
        if old_kind == "join":
            return _order(newer) > _order(older)
        return bool(newer["incarnation"] > older["incarnation"])
    return old_kind != "join" and _order(newer) > _order(older)


# --- the record set ----------------------------------------------------------------------------


class RecordSet:
    """The frontier of the records a party received, validated and folded into a :class:`View`.

    Only records no held record supersedes are held (see "Compaction" in the module docstring):
    per subject its highest join, highest end and highest endpoint, per link its highest
    record. Folding is incremental: each record changes at most one member entry or one link
    entry (an endpoint record none: endpoints are read at view time).

    Parameters
    ----------
    policy : Policy
        The federation's policy; every record is checked against it before it is held.
    cache : SignatureCache, optional
        Signature cache (shared between peers of one process, or a fresh one).
    """

    def __init__(self, policy: Policy, cache: SignatureCache | None = None) -> None:
        self.policy = policy
        self.cache = cache if cache is not None else SignatureCache()
        self._records: dict[str, Record] = {}
        # The frontier by what it is about: subject -> its highest join / its highest end
        # record, link -> its highest record.
        self._join: dict[str, Record] = {}
        self._end: dict[str, Record] = {}
        self._link_rec: dict[tuple[str, str], Record] = {}
        # subject -> its highest endpoint record
        self._endpoint: dict[str, Record] = {}
        # (party, incarnation) -> links whose held record names that party at that incarnation:
        # only those can change liveness when the party's status or incarnation changes.
        self._links_of: dict[tuple[str, int], set[tuple[str, str]]] = {}
        # Link entries whose liveness may have changed since the last read: (party, old
        # incarnation, new incarnation) of member changes and links with a new version. They
        # are refolded when the links are next read (link(), view()), once per batch of records
        # rather than once per record.
        self._stale_members: list[tuple[str, int | None, int]] = []
        self._stale_links: set[tuple[str, str]] = set()
        self._members: dict[str, MemberInfo] = {}
        self._links: dict[tuple[str, str], LinkInfo] = {}
        self._xor = 0
        # The view and the active list are rebuilt on the next read after a new record; the
        # stale objects are only marked (freeing a view of a large federation is work of its
        # own, done when the next view replaces it).
        self._view: View | None = None
        self._view_fresh = False
        # The active members, kept sorted as statuses change (reading it walks no member).
        self._active: list[str] = []

    def __contains__(self, record_id: object) -> bool:
        return record_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Record]:
        return iter(list(self._records.values()))

    def get(self, record_id: str) -> Record | None:
        """The record with ``record_id`` if it is held (not superseded), or ``None``."""
        return self._records.get(record_id)

    def ids(self) -> frozenset[str]:
        """Ids of all records held (the frontier)."""
        return frozenset(self._records)

    def digest(self) -> bytes:
        """A 32-byte digest of the set of record ids (for anti-entropy; order-free)."""
        return hashlib.sha256(
            self._xor.to_bytes(16, "big") + len(self._records).to_bytes(8, "big")
        ).digest()

    def superseded(self, record: Record) -> bool:
        """Whether a held record supersedes ``record`` (:func:`supersedes`): it would not be held.

        ``record``'s body must be well-formed (:meth:`Record.from_wire` or :func:`_check_body`).
        Cheap (one dictionary look-up or two); needs no signature check.
        """
        return self._superseder(record.body) is not None

    def covers(self, body: Mapping[str, Any]) -> bool:
        """Whether a record with this (well-formed) body is held or superseded: adding it would
        change nothing. Decided from the body alone (no record id, no signature)."""
        kind = body["kind"]
        if kind in _LINK_KINDS:
            top = self._link_rec.get((body["a"], body["b"]))
        elif kind == "endpoint":
            top = self._endpoint.get(body["subject"])
        else:
            top = (self._join if kind == "join" else self._end).get(body["subject"])
        if top is not None and top.body == body:
            return True
        return self._superseder(body) is not None

    def _superseder(self, body: Mapping[str, Any]) -> Record | None:
        kind = body["kind"]
        if kind in _LINK_KINDS:
            held = self._link_rec.get((body["a"], body["b"]))
            return held if held is not None and supersedes(held.body, body) else None
        subject = body["subject"]
        if kind == "endpoint":
            held = self._endpoint.get(subject)
            return held if held is not None and supersedes(held.body, body) else None
        join = self._join.get(subject)
        if join is not None and supersedes(join.body, body):
            return join
        end = self._end.get(subject)
        return end if end is not None and supersedes(end.body, body) else None

    def ended_at(self, party_id: str) -> int | None:
        """Incarnation of the highest end record (leave or fail) held for ``party_id``, if any.

        A party rejoins above it (it may exceed :attr:`MemberInfo.incarnation` when an end
        record overtook its join).
        """
        end = self._end.get(party_id)
        return None if end is None else int(end.body["incarnation"])

    def add(self, record: Record, *, validated: bool = False) -> bool:
        """Validate ``record`` and hold it, unless a held record supersedes it.

        Parameters
        ----------
        record
            The record.
        validated
            The caller has just run :func:`validate_record` on it with this set's policy
            (skips the second check).

        Returns
        -------
        bool
            ``True`` if the record is now held (the records it supersedes are dropped),
            ``False`` if it was already held or a held record supersedes it (nothing changes
            then, and its signatures are not checked).

        Raises
        ------
        ChaosError
            As :func:`validate_record`; the set is unchanged then.
        """
        rid = record.record_id
        if rid in self._records:
            return False
        body = record.body
        if not validated:
            _check_body(body)
        if self._superseder(body) is not None:
            return False
        if not validated:
            validate_record(record, self.policy, self.cache)
        self._records[rid] = record
        self._xor ^= int(rid, 16)
        self._view_fresh = False
        kind = body["kind"]
        if kind in _LINK_KINDS:
            self._hold_link(record)
            return True
        subject = body["subject"]
        if kind == "endpoint":
            old_ep = self._endpoint.get(subject)
            self._endpoint[subject] = record
            if old_ep is not None:
                self._drop(old_ep)
            return True
        table = self._join if kind == "join" else self._end
        old = table.get(subject)
        table[subject] = record
        if old is not None:
            self._drop(old)
        end = self._end.get(subject)
        if kind == "join" and end is not None and supersedes(body, end.body):
            del self._end[subject]
            self._drop(end)
        self._fold_member(subject)
        return True

    def _drop(self, record: Record) -> None:
        """Forget a record a new one supersedes (the caller updates the folding tables)."""
        del self._records[record.record_id]
        self._xor ^= int(record.record_id, 16)

    def _hold_link(self, record: Record) -> None:
        body = record.body
        key = (body["a"], body["b"])
        old = self._link_rec.get(key)
        self._link_rec[key] = record
        if old is not None:
            self._drop(old)
            for end, inc in ((key[0], "inc_a"), (key[1], "inc_b")):
                if old.body[inc] != body[inc]:
                    self._unindex(end, old.body[inc], key)
        self._links_of.setdefault((key[0], body["inc_a"]), set()).add(key)
        self._links_of.setdefault((key[1], body["inc_b"]), set()).add(key)
        self._stale_links.add(key)

    def _unindex(self, party: str, inc: int, key: tuple[str, str]) -> None:
        links = self._links_of.get((party, inc))
        if links is not None:
            links.discard(key)
            if not links:
                del self._links_of[(party, inc)]

    def _fold_member(self, subject: str) -> None:
        join = self._join.get(subject)
        if join is None:
            return  # an end record of a party never seen joining: no member entry (yet)
        top = join.body["incarnation"]
        end = self._end.get(subject)
        status = ACTIVE
        if end is not None and end.body["incarnation"] >= top:
            status = LEFT if end.body["kind"] == "leave" else FAILED
        old = self._members.get(subject)
        new = MemberInfo(subject, status, top, join.body["at"])
        if new == old:
            return
        self._members[subject] = new
        was = old is not None and old.status == ACTIVE
        if was != (status == ACTIVE):
            if was:
                del self._active[bisect.bisect_left(self._active, subject)]
            else:
                bisect.insort(self._active, subject)
        # Liveness of the subject's links depends on its status and incarnation (only), and
        # only links naming the old or the new incarnation can be live before or after.
        self._stale_members.append((subject, None if old is None else old.incarnation, top))

    def _flush_links(self) -> None:
        """Refold every link entry a record since the last read may have changed."""
        keys = self._stale_links
        for subject, old_inc, new_inc in self._stale_members:
            keys.update(self._links_of.get((subject, new_inc), ()))
            if old_inc is not None and old_inc != new_inc:
                keys.update(self._links_of.get((subject, old_inc), ()))
        self._stale_members = []
        self._stale_links = set()
        for key in keys:
            self._refold_link(key)

    def _refold_link(self, key: tuple[str, str]) -> None:
        body = self._link_rec[key].body
        epoch, inc_a, inc_b = body["epoch"], body["inc_a"], body["inc_b"]
        down = body["kind"] == "link_down"
        a, b = key
        ma, mb = self._members.get(a), self._members.get(b)
        live = (
            not down
            and ma is not None
            and mb is not None
            and ma.status == ACTIVE
            and mb.status == ACTIVE
            and ma.incarnation == inc_a
            and mb.incarnation == inc_b
        )
        state = DOWN if down else UP
        held = self._links.get(key)
        if (
            held is not None
            and held.live == live
            and held.state == state
            and (held.epoch, held.inc_a, held.inc_b) == (epoch, inc_a, inc_b)
        ):
            return
        self._links[key] = LinkInfo(a, b, state, epoch, inc_a, inc_b, live)

    def active(self) -> list[str]:
        """The view's active members, sorted (cheap; no full view built; a fresh list)."""
        return list(self._active)

    def member(self, party_id: str) -> MemberInfo | None:
        """The view's entry for ``party_id`` (cheap; no full view built)."""
        return self._members.get(party_id)

    def endpoint_record(self, party_id: str) -> Record | None:
        """The newest endpoint record held of ``party_id`` (any incarnation; ``None``: none)."""
        return self._endpoint.get(party_id)

    def endpoint(self, party_id: str) -> EndpointInfo | None:
        """The endpoint a dialler may use for ``party_id``: from its held (verified) endpoint
        record, only while it is an active member at exactly the record's incarnation."""
        record = self._endpoint.get(party_id)
        member = self._members.get(party_id)
        if record is None or member is None or member.status != ACTIVE:
            return None
        if member.incarnation != record.body["incarnation"]:
            return None
        return EndpointInfo.of(record.body)

    def link(self, a: str, b: str) -> LinkInfo | None:
        """The view's entry for the link between ``a`` and ``b`` (either order)."""
        if self._stale_members or self._stale_links:
            self._flush_links()
        return self._links.get((a, b) if a < b else (b, a))

    def view(self) -> View:
        """The current view (cached until the next new record)."""
        if not self._view_fresh or self._view is None:
            if self._stale_members or self._stale_links:
                self._flush_links()
            endpoints = {p: e for p in self._endpoint if (e := self.endpoint(p)) is not None}
            self._view = View(self._members, self._links, endpoints)
            self._view_fresh = True
        return self._view
