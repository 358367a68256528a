"""Signed round receipts and relay-equivocation evidence (sans-I/O, no clock).

After every round each party signs a *receipt*: "I, ``party``, hold the state of round
``round`` whose digest is ``digest``". The signed bytes are exactly
:func:`receipt_signing_bytes` (the one definition; the Flower parties sign these too)::

    codec.encode({"kind": "receipt", "party": party, "round": round, "digest": digest})

The ``"kind": "receipt"`` field is the domain tag. No other signed message of chaos-flwr can be
mistaken for a receipt: envelopes, membership records, views and charters are all signed over
``b"chaos-flwr/<what>/v1\\x00" + ...`` (first byte ``0x63``), while an encoded map starts with
the map tag ``0x08``; and inside the codec world no other signed map has ``kind == "receipt"``.

A relay (the Flower ServerApp) that sends different aggregates of one round to different groups
of parties makes honest parties sign receipts for different digests of the same round. Two
valid receipts for one round with different digests are *transferable evidence*
(:class:`Equivocation`): anyone with the charter's keyring can check them, and no honest party
accepts a round that has such evidence (:meth:`ReceiptLedger.certified` returns ``None``).

Every receipt check goes through :func:`verify_receipt` (or its boolean form
:func:`receipt_verifies`): the ServerApp's keyring verifier, the Flower parties (a donor's
receipt, a replica's certificate) and :meth:`Receipt.verify` alike.

The ledger does no I/O and reads no clock; refused receipts are raised as typed errors and
appended to :attr:`ReceiptLedger.rejections` (the log), and change nothing else.

Bounded memory
--------------
A ledger holds at most :data:`RECEIPT_LEDGER_MAX_ROUNDS` rounds (receipts and evidence): past
it the oldest round is dropped. Its owner may also set a window (:meth:`ReceiptLedger.window`):
receipts of rounds outside it are ignored unverified and held rounds outside it are dropped.
A party sets ``[held - keep + 1, held + 1]`` around the round it holds, so receipts signed for
far-future rounds by an admitted party cannot evict the ones it needs, and a long federation's
ledger stays the same size. Dropping an old round is safe: rounds only move forward, so a round
below the window is never certified or taken up again (the party itself refuses a certify
below its held round); its equivocation evidence was already reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import codec
from .defaults import PEER_MAX_REJECTIONS_LOGGED
from .errors import (
    ChaosError,
    DecodeError,
    EquivocationError,
    PolicyError,
    SignatureError,
    UnknownPartyError,
)
from .identity import is_party_id, verify_signature

__all__ = [
    "RECEIPT_KIND",
    "Equivocation",
    "Receipt",
    "ReceiptLedger",
    "ReceiptRejection",
    "receipt_signing_bytes",
    "receipt_verifies",
    "verify_receipt",
]

#: The domain tag: the ``kind`` field of every signed receipt body.
RECEIPT_KIND = "receipt"
#: A digest is a SHA-256 (``TrainingState.digest``).
_DIGEST_BYTES = 32
_SIGNATURE_BYTES = 64
#: Bound on an encoded receipt or equivocation (they are small; refuse anything larger unparsed).
_MAX_RECEIPT_BYTES = 1024
_MAX_EVIDENCE_BYTES = 4 * _MAX_RECEIPT_BYTES
_RECEIPT_KEYS = frozenset({"party", "round", "digest", "signature"})
_EVIDENCE_KEYS = frozenset({"kind", "first", "second"})
_EVIDENCE_KIND = "equivocation"
#: Most rounds one ledger holds (receipts and evidence); past it the oldest round is dropped.
RECEIPT_LEDGER_MAX_ROUNDS: int = 256


def receipt_signing_bytes(party: str, round: int, digest: bytes) -> bytes:
    """The exact bytes a party signs for its receipt of ``round``.

    The Flower parties sign exactly these bytes, so a signature made by a Flower party verifies
    here and vice versa.

    Parameters
    ----------
    party
        The signer's party id.
    round
        The round the state belongs to (Flower's ``server_round``).
    digest
        ``TrainingState.digest()`` of the state held after that round.

    Returns
    -------
    bytes
        ``codec.encode({"kind": "receipt", "party": ..., "round": ..., "digest": ...})``.
    """
    return codec.encode({"kind": RECEIPT_KIND, "party": party, "round": round, "digest": digest})


def verify_receipt(
    keyring: Mapping[str, bytes], party: str, round: int, digest: bytes, signature: bytes
) -> None:
    """Check that ``signature`` is ``party``'s receipt for ``(round, digest)``: the one verifier.

    The fields are not checked for shape (a Flower party's blob is checked as it came); only
    the signature over :func:`receipt_signing_bytes` under the keyring's key of ``party``.

    Parameters
    ----------
    keyring
        Party id -> raw Ed25519 public key (the charter's).
    party, round, digest
        What the receipt claims.
    signature
        The receipt's signature blob.

    Raises
    ------
    UnknownPartyError
        If ``party`` is not in the keyring (not named by the charter).
    SignatureError
        If the signature does not verify under the party's key (or is malformed).
    """
    key = keyring.get(party)
    if key is None:
        raise UnknownPartyError(
            f"receipt of round {round} is signed by {party}, which the charter does not name"
        )
    verify_signature(key, signature, receipt_signing_bytes(party, round, digest))


def receipt_verifies(
    keyring: Mapping[str, bytes], party: str, round: int, digest: bytes, signature: bytes
) -> bool:
    """Whether :func:`verify_receipt` accepts the receipt (an unknown party's never does)."""
    try:
        verify_receipt(keyring, party, round, digest, signature)
    except SignatureError:  # UnknownPartyError is a SignatureError
        return False
    return True


def _check_fields(party: Any, round: Any, digest: Any, signature: Any) -> None:
    if not isinstance(party, str) or not is_party_id(party):
        raise DecodeError(f"receipt field 'party' must be a party id, got {party!r}")
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise DecodeError(f"receipt field 'round' must be an integer >= 0, got {round!r}")
    if not isinstance(digest, bytes) or len(digest) != _DIGEST_BYTES:
        raise DecodeError(f"receipt field 'digest' must be {_DIGEST_BYTES} bytes")
    if not isinstance(signature, bytes) or len(signature) != _SIGNATURE_BYTES:
        raise DecodeError(f"receipt field 'signature' must be {_SIGNATURE_BYTES} bytes")


@dataclass(frozen=True)
class Receipt:
    """One party's signed statement that it holds ``digest`` after ``round``.

    Attributes
    ----------
    party : str
        The signer's party id.
    round : int
        The round.
    digest : bytes
        The 32-byte digest of the state held.
    signature : bytes
        Ed25519 signature over :func:`receipt_signing_bytes` (64 bytes).
    """

    party: str
    round: int
    digest: bytes
    signature: bytes

    def __post_init__(self) -> None:
        _check_fields(self.party, self.round, self.digest, self.signature)

    @classmethod
    def sign(cls, identity: Any, round: int, digest: bytes) -> Receipt:
        """Sign a receipt with ``identity`` (anything with ``party_id`` and ``sign``).

        Parameters
        ----------
        identity
            The signer (:class:`chaos_flwr.identity.Identity`).
        round, digest
            What the receipt certifies.

        Returns
        -------
        Receipt
        """
        party = str(identity.party_id)
        return cls(
            party, round, bytes(digest), identity.sign(receipt_signing_bytes(party, round, digest))
        )

    @classmethod
    def from_flower(cls, party: str, round: int, digest: bytes, blob: bytes) -> Receipt:
        """The receipt a Flower party put on its reply (``receipt-round``, ``-digest``, blob).

        Raises
        ------
        DecodeError
            If a field is malformed (e.g. an empty, *unsigned* blob).
        """
        return cls(party, round, bytes(digest), bytes(blob))

    @property
    def signing_bytes(self) -> bytes:
        """The bytes the signature covers."""
        return receipt_signing_bytes(self.party, self.round, self.digest)

    def verify(self, keyring: Mapping[str, bytes]) -> None:
        """Check the signature against ``keyring`` (party id -> raw public key).

        Raises
        ------
        UnknownPartyError
            If the party is not in the keyring (not named by the charter).
        SignatureError
            If the signature does not verify under the party's key.
        """
        verify_receipt(keyring, self.party, self.round, self.digest, self.signature)

    def to_value(self) -> dict[str, Any]:
        """The receipt as a codec value."""
        return {
            "party": self.party,
            "round": self.round,
            "digest": self.digest,
            "signature": self.signature,
        }

    def encode(self) -> bytes:
        """Canonical bytes of the receipt (for shipping it as evidence)."""
        return codec.encode(self.to_value())

    @classmethod
    def from_value(cls, value: Any) -> Receipt:
        """Build a receipt from a decoded codec value; :class:`DecodeError` if malformed."""
        if not isinstance(value, dict) or set(value) != _RECEIPT_KEYS:
            raise DecodeError(f"a receipt is a map with exactly the keys {sorted(_RECEIPT_KEYS)}")
        return cls(value["party"], value["round"], value["digest"], value["signature"])

    @classmethod
    def decode(cls, data: bytes) -> Receipt:
        """Decode :meth:`encode` output strictly.

        Raises
        ------
        DecodeError
            Truncated, oversized, non-canonical or malformed input.
        """
        return cls.from_value(codec.decode(data, max_bytes=_MAX_RECEIPT_BYTES))


@dataclass(frozen=True)
class Equivocation:
    """Two valid receipts for one round that name different digests: transferable evidence.

    When both receipts come from different parties, the relay showed different aggregates to
    them (``culprit == "relay"``); when both come from one party, that party signed two states
    for one round (``culprit`` is its id).

    Attributes
    ----------
    first, second : Receipt
        The conflicting receipts (``first.round == second.round``, digests differ).
    """

    first: Receipt
    second: Receipt

    def __post_init__(self) -> None:
        if self.first.round != self.second.round:
            raise DecodeError("equivocation evidence must name one round twice")
        if self.first.digest == self.second.digest:
            raise DecodeError("equivocation evidence must name two different digests")

    @property
    def round(self) -> int:
        """The round shown two ways."""
        return self.first.round

    @property
    def culprit(self) -> str:
        """``"relay"`` if two parties were shown different states, else the double signer."""
        return self.first.party if self.first.party == self.second.party else "relay"

    def verify(self, keyring: Mapping[str, bytes]) -> None:
        """Check both signatures (anyone with the keyring can: the evidence is transferable).

        Raises
        ------
        SignatureError, UnknownPartyError
            If either receipt does not verify.
        """
        self.first.verify(keyring)
        self.second.verify(keyring)

    def error(self) -> EquivocationError:
        """The typed error that reports this evidence."""
        return EquivocationError(
            f"round {self.round} was shown with two digests: {self.first.party} signed "
            f"{self.first.digest.hex()[:16]}..., {self.second.party} signed "
            f"{self.second.digest.hex()[:16]}... (culprit: {self.culprit})"
        )

    def encode(self) -> bytes:
        """Canonical bytes of the evidence."""
        return codec.encode(
            {
                "kind": _EVIDENCE_KIND,
                "first": self.first.to_value(),
                "second": self.second.to_value(),
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> Equivocation:
        """Decode :meth:`encode` output strictly (:class:`DecodeError` if malformed).

        Signatures are not checked here: call :meth:`verify` with the charter's keyring.
        """
        value = codec.decode(data, max_bytes=_MAX_EVIDENCE_BYTES)
        if (
            not isinstance(value, dict)
            or set(value) != _EVIDENCE_KEYS
            or value["kind"] != _EVIDENCE_KIND
        ):
            raise DecodeError(
                f"equivocation evidence is a map with exactly the keys {sorted(_EVIDENCE_KEYS)} "
                f"and kind {_EVIDENCE_KIND!r}"
            )
        return cls(Receipt.from_value(value["first"]), Receipt.from_value(value["second"]))


@dataclass(frozen=True)
class ReceiptRejection:
    """One refused input of a :class:`ReceiptLedger` (the log)."""

    error: ChaosError
    party: str | None
    round: int | None


@dataclass
class ReceiptLedger:
    """Collects verified receipts per round; detects equivocation; says what is certified.

    Parameters
    ----------
    keyring : Mapping[str, bytes]
        Party id -> raw public key: ``charter.keyring()`` (use :meth:`from_charter`).
    verified : set, optional
        A cache of receipts already verified under the same keyring, shared by ledgers hosted
        in one process (the simulator), so each receipt's signature is checked once there.

    Attributes
    ----------
    equivocations : dict[int, Equivocation]
        The first evidence found for each conflicted round.
    rejections : list[ReceiptRejection]
        Every refused receipt or evidence (the newest ``PEER_MAX_REJECTIONS_LOGGED``).
    floor, ceiling : int or None
        The window (:meth:`window`): receipts of rounds outside it are ignored.
    ignored : int
        Receipts ignored because their round was outside the window.
    """

    keyring: Mapping[str, bytes]
    verified: set[tuple[str, int, bytes, bytes]] | None = None
    equivocations: dict[int, Equivocation] = field(default_factory=dict)
    rejections: list[ReceiptRejection] = field(default_factory=list)
    _rounds: dict[int, dict[bytes, dict[str, Receipt]]] = field(default_factory=dict)
    floor: int | None = None
    ceiling: int | None = None
    ignored: int = 0

    @classmethod
    def from_charter(cls, charter: Any) -> ReceiptLedger:
        """A ledger that trusts exactly the keys the charter names."""
        return cls(dict(charter.keyring()))

    def _reject(self, exc: ChaosError, party: str | None, round: int | None) -> None:
        self.rejections.append(ReceiptRejection(exc, party, round))
        if len(self.rejections) > PEER_MAX_REJECTIONS_LOGGED:
            del self.rejections[: len(self.rejections) - PEER_MAX_REJECTIONS_LOGGED]

    def _verify(self, receipt: Receipt) -> None:
        key = (receipt.party, receipt.round, receipt.digest, receipt.signature)
        cache = self.verified
        if cache is not None and key in cache:
            return
        try:
            receipt.verify(self.keyring)
        except SignatureError as exc:
            self._reject(exc, receipt.party, receipt.round)
            raise
        if cache is not None:
            if len(cache) >= PEER_MAX_REJECTIONS_LOGGED:
                cache.clear()
            cache.add(key)

    def add(self, receipt: Receipt) -> Equivocation | None:
        """Verify and record ``receipt``.

        Parameters
        ----------
        receipt
            A receipt from the wire (any party, any round).

        Returns
        -------
        Equivocation or None
            Evidence if this receipt names another digest than a receipt already held for its
            round (the round is then conflicted for good), else ``None``. Adding a receipt
            already held is a no-op.

        Raises
        ------
        UnknownPartyError, SignatureError
            If the receipt does not verify under the charter's keys; it is logged in
            :attr:`rejections` and nothing else changes.
        """
        if not self._inside(receipt.round):
            self.ignored += 1
            return None
        known = self._rounds.get(receipt.round, {}).get(receipt.digest, {}).get(receipt.party)
        if known == receipt:
            # the very receipt already held (its bytes were verified when it was added): the
            # relay forwards each round's receipts with several messages
            return None
        self._verify(receipt)
        by_digest = self._round(receipt.round)
        held = by_digest.get(receipt.digest, {})
        if receipt.party in held:
            return None
        conflict: Receipt | None = None
        for digest in sorted(by_digest):
            if digest != receipt.digest and by_digest[digest]:
                others = by_digest[digest]
                conflict = others[receipt.party] if receipt.party in others else others[min(others)]
                break
        by_digest.setdefault(receipt.digest, {})[receipt.party] = receipt
        if conflict is None:
            return None
        evidence = Equivocation(conflict, receipt)
        self.equivocations.setdefault(receipt.round, evidence)
        return evidence

    def add_evidence(self, evidence: Equivocation) -> None:
        """Take evidence found elsewhere (e.g. gossiped by another party).

        Both receipts are verified and recorded; the round is conflicted afterwards (evidence
        of a round outside the window is ignored, as its receipts are).

        Raises
        ------
        UnknownPartyError, SignatureError
            If a receipt of the evidence does not verify (logged; nothing changes).
        """
        if not self._inside(evidence.round):
            self.ignored += 1
            return
        for receipt in (evidence.first, evidence.second):
            self._verify(receipt)
        for receipt in (evidence.first, evidence.second):
            by_digest = self._round(receipt.round)
            by_digest.setdefault(receipt.digest, {})[receipt.party] = receipt
        self.equivocations.setdefault(evidence.round, evidence)

    def add_all(self, receipts: Iterable[Receipt]) -> list[Equivocation]:
        """:meth:`add` each receipt; invalid ones are logged and skipped. Returns the evidence."""
        found: list[Equivocation] = []
        for receipt in receipts:
            try:
                ev = self.add(receipt)
            except SignatureError:
                continue
            if ev is not None:
                found.append(ev)
        return found

    def conflicted(self, round: int) -> bool:
        """Whether ``round`` has equivocation evidence."""
        return round in self.equivocations

    def holders(self, round: int, digest: bytes) -> list[str]:
        """Party ids with a verified receipt for ``(round, digest)``, sorted."""
        return sorted(self._rounds.get(round, {}).get(digest, {}))

    def receipts(self, round: int) -> list[Receipt]:
        """Every verified receipt held for ``round`` (sorted by digest, then party)."""
        by_digest = self._rounds.get(round, {})
        return [by_digest[d][p] for d in sorted(by_digest) for p in sorted(by_digest[d])]

    def rounds(self) -> list[int]:
        """Rounds with at least one receipt, ascending."""
        return sorted(self._rounds)

    def certified(self, round: int, quorum: int) -> bytes | None:
        """The digest of ``round`` if at least ``quorum`` parties signed it and no conflict.

        Parameters
        ----------
        round
            The round asked about.
        quorum
            Distinct signers required (>= 1).

        Returns
        -------
        bytes or None
            ``None`` if fewer signers, or the round is conflicted (never accept an
            equivocated round).
        """
        if isinstance(quorum, bool) or not isinstance(quorum, int) or quorum < 1:
            raise PolicyError(f"'quorum' must be an integer >= 1, got {quorum!r}")
        if round in self.equivocations:
            return None
        by_digest = self._rounds.get(round)
        if not by_digest:
            return None
        for digest in sorted(by_digest):
            if len(by_digest[digest]) >= quorum:
                return digest
        return None

    def require_certified(self, round: int, quorum: int) -> bytes:
        """Like :meth:`certified` but raises instead of returning ``None``.

        Raises
        ------
        EquivocationError
            If the round is conflicted (the message names both digests and the culprit).
        PolicyError
            If fewer than ``quorum`` parties signed one digest.
        """
        evidence = self.equivocations.get(round)
        if evidence is not None:
            raise evidence.error()
        digest = self.certified(round, quorum)
        if digest is None:
            raise PolicyError(f"round {round} has fewer than {quorum} receipts for one digest")
        return digest

    def latest_certified(self, quorum: int) -> tuple[int, bytes] | None:
        """The newest ``(round, digest)`` that :meth:`certified` accepts, or ``None``."""
        for rnd in sorted(self._rounds, reverse=True):
            digest = self.certified(rnd, quorum)
            if digest is not None:
                return rnd, digest
        return None

    def _inside(self, round: int) -> bool:
        return (self.floor is None or round >= self.floor) and (
            self.ceiling is None or round <= self.ceiling
        )

    def _round(self, round: int) -> dict[bytes, dict[str, Receipt]]:
        """The receipts held for ``round``, made if new: past the cap the oldest round goes (a
        round older than every held one is then not kept: its receipts count for this call)."""
        by_digest = self._rounds.get(round)
        if by_digest is None:
            if len(self._rounds) >= RECEIPT_LEDGER_MAX_ROUNDS and round < min(self._rounds):
                return {}
            while len(self._rounds) >= RECEIPT_LEDGER_MAX_ROUNDS:
                oldest = min(self._rounds)
                del self._rounds[oldest]
                self.equivocations.pop(oldest, None)
            by_digest = self._rounds[round] = {}
        return by_digest

    def window(self, floor: int, ceiling: int) -> None:
        """Keep only rounds ``floor..ceiling`` (receipts and evidence); ignore others from now.

        Parameters
        ----------
        floor, ceiling
            The oldest and newest round kept (``floor <= ceiling``).

        Raises
        ------
        PolicyError
            If ``floor > ceiling``.
        """
        if floor > ceiling:
            raise PolicyError(f"ledger window {floor}..{ceiling} is empty")
        self.floor, self.ceiling = floor, ceiling
        for rnd in [r for r in self._rounds if not floor <= r <= ceiling]:
            del self._rounds[rnd]
        for rnd in [r for r in self.equivocations if not floor <= r <= ceiling]:
            del self.equivocations[rnd]

    def forget_before(self, round: int) -> None:
        """Drop receipts (not evidence) of rounds older than ``round`` (bounded memory)."""
        for rnd in [r for r in self._rounds if r < round]:
            del self._rounds[rnd]
