"""Verifiable rounds: signed update commitments, audit receipts and the certify checks
(sans-I/O, no clock).

A ServerApp computes each round's aggregate, but it holds no authority over it. Every piece of
a round that a party takes up is signed by parties:

- a **commitment** (:class:`Commitment`), signed by a trainer in its train reply: "for
  federation F, round r, I trained from the state ``(r - 1, base digest)`` and sent an update
  whose digest is U, of weight w, while my view had digest V";
- an **audit** (:class:`Audit`), signed by an auditor the server cannot choose
  (:func:`auditors_of`: a rota over the signed active view by round number): "I recomputed the
  aggregate of round r from its base and its committed updates with the federation's rule, and
  it is (or is not) the state whose digest is D".

A certify of round r carries its proof (:class:`CertifyProof`): its base, the commitments it was
aggregated from, the rule it was aggregated with, and the audits of its base round.
:class:`RoundGuard` is a party's check of that proof before it takes up and signs the state; it
raises a typed error and changes nothing when the proof does not hold. The rules (docs/
internals.md, "Verifiable rounds", has the argument):

1. the base is the state the party holds and ``r == base round + 1``; ``r`` is above every
   round the party signed (it never signs two states of one round, a far-future round is
   refused, a skipped round is refused);
2. every commitment verifies under the charter's keyring, names this federation, round and
   base, comes from a charter party the party's view does not list as gone (left or failed;
   a party whose join record is still on its way is not refused), one per party, and there
   are at least the charter's ``min_updates``;
3. the rule named is the federation's (:meth:`chaos_flwr.charter.Charter.round_policy`);
4. the base is *final*: its round is 0 (the genesis), or the auditors of its round signed that
   it is right (at least ``auditors`` of them, from the first ``auditors + AUDIT_ROTA_SPARE``
   rota positions of the party's view). An audit that says the base is false refutes it: the
   party rolls back to the state before it (:meth:`RoundGuard.refute`).

Signed bytes are domain-tagged codec maps like receipts (``"kind": "update"`` /
``"kind": "audit"``); no other signed message of chaos-flwr has those kinds.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from . import codec
from .defaults import AUDIT_ROTA_SPARE, ROUNDS_MAX_AUDITS_KEPT
from .errors import ChaosError, DecodeError, EquivocationError, ProofError, SignatureError
from .identity import is_party_id, verify_signature

__all__ = [
    "AUDIT_KIND",
    "UPDATE_KIND",
    "Audit",
    "CertifyProof",
    "Commitment",
    "RoundGuard",
    "auditors_of",
    "keep_audit",
    "open_audit",
]

_S = TypeVar("_S", bound="_Signed")
_A = TypeVar("_A")

#: Domain tag of a signed update commitment.
UPDATE_KIND = "update"
#: Domain tag of a signed audit receipt.
AUDIT_KIND = "audit"
_DIGEST = 32
_SIG = 64
#: Bound on an encoded commitment or audit (refused unparsed when larger).
_MAX_SIGNED_BYTES = 1024


def _bytes32(value: Any, what: str, *, empty_ok: bool = False) -> bytes:
    if not isinstance(value, bytes) or not (len(value) == _DIGEST or (empty_ok and not value)):
        raise DecodeError(f"{what} must be {_DIGEST} bytes")
    return value


def _round(value: Any, what: str, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DecodeError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _decode_map(blob: Any, what: str, keys: frozenset[str]) -> dict[str, Any]:
    if not isinstance(blob, bytes):
        raise DecodeError(f"{what} must be bytes")
    obj = codec.decode(blob, max_bytes=_MAX_SIGNED_BYTES)
    if not isinstance(obj, dict) or set(obj) != keys:
        raise DecodeError(f"{what} must be a map with keys {sorted(keys)}")
    return obj


def _signer(obj: dict[str, Any], what: str) -> tuple[str, bytes]:
    """The ``party`` and ``sig`` fields of a decoded signed map, checked."""
    party, sig = obj["party"], obj["sig"]
    if not isinstance(party, str) or not is_party_id(party):
        raise DecodeError(f"{what} field 'party' must be a party id")
    if not isinstance(sig, bytes) or len(sig) != _SIG:
        raise DecodeError(f"{what} field 'sig' must be {_SIG} bytes")
    return party, sig


def _verify(keyring: Mapping[str, bytes], party: str, signature: bytes, body: bytes) -> None:
    key = keyring.get(party)
    if key is None:
        raise SignatureError(f"{party} is not a party of the charter")
    verify_signature(key, signature, body)


class _Signed:
    """What a signed round object shares: its signed bytes (its ``body()``, domain-tagged by
    ``kind``), signing, and its encoding (the body without the tag, with the signature)."""

    signature: bytes

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def signing_bytes(self) -> bytes:
        """The exact bytes its signer signs."""
        return codec.encode(self.body())

    def signed(self: _S, sign: Any) -> _S:
        """This object signed with ``sign`` (``Identity.sign``)."""
        signed: _S = replace(cast(Any, self), signature=bytes(sign(self.signing_bytes())))
        return signed

    def encode(self) -> bytes:
        """The encoded object (what messages carry; :meth:`decode` reads it)."""
        body = self.body()
        del body["kind"]
        return codec.encode({**body, "sig": self.signature})


@dataclass(frozen=True)
class Commitment(_Signed):
    """A trainer's signed commitment to its update of one round (module docstring).

    Attributes
    ----------
    party, federation:
        The trainer and the federation tag (the charter's digest).
    round:
        The round the update is for.
    base_round, base_digest:
        The state it trained from (``round - 1`` for a well-formed commitment).
    update:
        Digest of what it sent (:func:`chaos_flwr.flower.updates.update_digest`).
    weight:
        Its weight (the number of examples the aggregation weighs it by).
    view:
        Digest of the trainer's membership view when it trained (``View.digest``).
    signature:
        Ed25519 over :meth:`signing_bytes`.
    """

    party: str
    federation: bytes
    round: int
    base_round: int
    base_digest: bytes
    update: bytes
    weight: int
    view: bytes
    signature: bytes = b""

    _KEYS = frozenset(
        {"party", "federation", "round", "base", "base-digest", "update", "weight", "view", "sig"}
    )

    def body(self) -> dict[str, Any]:
        return {
            "kind": UPDATE_KIND,
            "party": self.party,
            "federation": self.federation,
            "round": self.round,
            "base": self.base_round,
            "base-digest": self.base_digest,
            "update": self.update,
            "weight": self.weight,
            "view": self.view,
        }

    @classmethod
    def decode(cls, blob: Any) -> Commitment:
        """Parse an encoded commitment; :class:`DecodeError` names a bad field."""
        obj = _decode_map(blob, "commitment", cls._KEYS)
        party, sig = _signer(obj, "commitment")
        weight = _round(obj["weight"], "commitment field 'weight'")
        return cls(
            party=party,
            federation=_bytes32(obj["federation"], "commitment field 'federation'"),
            round=_round(obj["round"], "commitment field 'round'", low=1),
            base_round=_round(obj["base"], "commitment field 'base'"),
            base_digest=_bytes32(obj["base-digest"], "commitment field 'base-digest'"),
            update=_bytes32(obj["update"], "commitment field 'update'"),
            weight=weight,
            view=_bytes32(obj["view"], "commitment field 'view'", empty_ok=True),
            signature=sig,
        )

    def verify(self, keyring: Mapping[str, bytes]) -> None:
        """Raise :class:`SignatureError` unless the trainer's key signed this commitment."""
        _verify(keyring, self.party, self.signature, self.signing_bytes())


@dataclass(frozen=True)
class Audit(_Signed):
    """An auditor's signed verdict on the aggregate of one round (module docstring).

    Attributes
    ----------
    party, federation:
        The auditor and the federation tag.
    round, digest:
        The round and the certified state's digest it audited.
    ok:
        Whether its recomputation from the committed updates gives that state.
    recomputed:
        The digest it computed (equal to ``digest`` when exact; it differs when ``ok`` is
        false, or when the rule's arithmetic is not bitwise reproducible but within tolerance).
    signature:
        Ed25519 over :meth:`signing_bytes`.
    """

    party: str
    federation: bytes
    round: int
    digest: bytes
    ok: bool
    recomputed: bytes
    signature: bytes = b""

    _KEYS = frozenset({"party", "federation", "round", "digest", "ok", "recomputed", "sig"})

    def body(self) -> dict[str, Any]:
        return {
            "kind": AUDIT_KIND,
            "party": self.party,
            "federation": self.federation,
            "round": self.round,
            "digest": self.digest,
            "ok": self.ok,
            "recomputed": self.recomputed,
        }

    @classmethod
    def decode(cls, blob: Any) -> Audit:
        """Parse an encoded audit; :class:`DecodeError` names a bad field."""
        obj = _decode_map(blob, "audit", cls._KEYS)
        party, sig = _signer(obj, "audit")
        ok = obj["ok"]
        if not isinstance(ok, bool):
            raise DecodeError("audit field 'ok' must be a bool")
        return cls(
            party=party,
            federation=_bytes32(obj["federation"], "audit field 'federation'"),
            round=_round(obj["round"], "audit field 'round'", low=1),
            digest=_bytes32(obj["digest"], "audit field 'digest'"),
            ok=ok,
            recomputed=_bytes32(obj["recomputed"], "audit field 'recomputed'", empty_ok=True),
            signature=sig,
        )

    def verify(self, keyring: Mapping[str, bytes]) -> None:
        """Raise :class:`SignatureError` unless the auditor's key signed this audit."""
        _verify(keyring, self.party, self.signature, self.signing_bytes())


def open_audit(blob: Any, federation: bytes, keyring: Mapping[str, bytes]) -> Audit:
    """Decode an audit and check it names ``federation`` and verifies under ``keyring``.

    Raises
    ------
    DecodeError, ProofError, SignatureError
        Malformed, of another federation, or not its auditor's signature.
    """
    audit = Audit.decode(blob)
    if audit.federation != federation:
        raise ProofError(f"audit of {audit.party} names another federation")
    audit.verify(keyring)
    return audit


def keep_audit(
    audits: dict[tuple[int, bytes], dict[str, _A]], key: tuple[int, bytes], party: str, audit: _A
) -> None:
    """Keep ``audit`` of ``party`` under ``key``, at most ``ROUNDS_MAX_AUDITS_KEPT`` per party:
    past that the party's oldest-kept one goes. One member's flood of audits (of far-future
    rounds, say) evicts only its own; an honest auditor signs one per round in play."""
    audits.setdefault(key, {})[party] = audit
    mine = [k for k, by in audits.items() if party in by]
    for old in mine[: max(0, len(mine) - ROUNDS_MAX_AUDITS_KEPT)]:
        del audits[old][party]
        if not audits[old]:
            del audits[old]


def auditors_of(round_: int, active: Sequence[str], count: int | None) -> list[str]:
    """The rota of auditors of ``round_``: ``count`` consecutive parties of the sorted active
    view starting at position ``round_ mod n`` (``None``: all of them).

    The ServerApp cannot choose them: the view is the parties' signed records and the round
    number is fixed by the base (``r == base + 1``).
    """
    members = sorted(active)
    n = len(members)
    if n == 0 or count == 0:
        return []
    k = n if count is None else min(count, n)
    start = round_ % n
    return [members[(start + i) % n] for i in range(k)]


@dataclass(frozen=True)
class CertifyProof:
    """What a certify message claims about the state it carries (module docstring).

    ``base_round == -1`` (and an empty ``base_digest``) is the genesis: the initial state of a
    federation, round 0, taken only by a party that holds and signed nothing.
    """

    round: int
    digest: bytes
    base_round: int
    base_digest: bytes
    rule_id: bytes
    commitments: tuple[bytes, ...] = ()
    audits: tuple[bytes, ...] = ()

    @property
    def genesis(self) -> bool:
        return self.base_round < 0


@dataclass
class RoundGuard:
    """A party's check of certify proofs and its memory of audits (module docstring).

    Parameters
    ----------
    party:
        This party's id.
    federation:
        The federation tag commitments and audits must name.
    keyring:
        Party id -> raw public key (the charter's).
    rule_id, min_updates, auditors:
        The charter's round policy (``auditors`` ``None`` = every active member; 0 = no audits).

    Attributes
    ----------
    audits:
        ``(round, digest) -> {auditor: Audit}`` of the verified audits it has seen (bounded:
        ``ROUNDS_MAX_AUDITS_KEPT`` per auditor, :func:`keep_audit`).
    window:
        ``(low, high)``: audits of rounds outside are ignored unkept (its owner sets it around
        the round it holds), so far-future audits signed by a member evict nothing.
    """

    party: str
    federation: bytes
    keyring: Mapping[str, bytes]
    rule_id: bytes = b""
    min_updates: int = 1
    auditors: int | None = 0
    audits: dict[tuple[int, bytes], dict[str, Audit]] = field(default_factory=dict)
    window: tuple[int, int] | None = None

    # -- audits ---------------------------------------------------------------------------------
    def note_audits(self, blobs: Iterable[Any]) -> list[str]:
        """Verify and keep audits (forwarded by the relay); returns the errors of bad ones."""
        errors: list[str] = []
        for blob in blobs:
            try:
                audit = open_audit(blob, self.federation, self.keyring)
            except ChaosError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            low, high = self.window or (0, 2**63)
            if not low <= audit.round <= high:
                continue  # far from the rounds the party holds: it evicts nothing
            keep_audit(self.audits, (audit.round, audit.digest), audit.party, audit)
        return errors

    def verdict(
        self, round_: int, digest: bytes, active: Sequence[str], also: Collection[str] = ()
    ) -> bool | None:
        """``True`` if the state is final (genesis, audits off, or enough rota auditors signed
        it right), ``False`` if a rota auditor signed it false, ``None`` while undecided.

        The rota is taken from ``active`` (the view now) and ``also`` (the rota the party
        noted when it took the state up: a member that left since still counts)."""
        if round_ == 0 or self.auditors == 0:
            return True
        spare = 0 if self.auditors is None else AUDIT_ROTA_SPARE
        k = None if self.auditors is None else self.auditors + spare
        rota = set(auditors_of(round_, active, k)) | set(also)
        need = len(auditors_of(round_, active, self.auditors))
        seen = self.audits.get((round_, digest), {})
        if any(not a.ok for p, a in seen.items() if p in rota):
            return False
        good = sum(1 for p, a in seen.items() if p in rota and a.ok)
        return True if need and good >= need else None

    # -- the certify check ----------------------------------------------------------------------
    def check(
        self,
        proof: CertifyProof,
        *,
        held: tuple[int, bytes] | None,
        max_signed: int,
        active: Sequence[str],
        rollback: bool = False,
        ended: Collection[str] = (),
        rota: Collection[str] = (),
    ) -> list[Commitment]:
        """Check a certify's proof; return its verified commitments.

        Parameters
        ----------
        held:
            ``(round, digest)`` of the state the party holds (``None``: nothing).
        max_signed:
            The newest round the party signed a receipt for (-1: none).
        active:
            The active members of the party's view.
        ended:
            Parties the party's view lists as gone (left or failed): their commitments are
            refused. A charter party the view does not list yet (its join record still on its
            way, as in a federation's first rounds) is not refused: its signature is checked.
        rota:
            The rota of the base round the party noted when it took the base up.
        rollback:
            The party rolled back from a refuted state: the round is then its newest signed
            round + 1 (not its base + 1, a number it already signed).

        Raises
        ------
        ProofError
            The proof does not hold (its message names the rule broken).
        EquivocationError
            An auditor of its base signed that the base is false.
        """
        if proof.round <= max_signed:
            raise ProofError(
                f"certify of round {proof.round}: this party already signed round {max_signed}"
            )
        if proof.rule_id != self.rule_id:
            raise ProofError(f"certify of round {proof.round} names another aggregation rule")
        if proof.genesis:
            if proof.round != 0 or held is not None or max_signed >= 0:
                raise ProofError(
                    f"certify of round {proof.round} without a base: only round 0, to a party "
                    "that holds nothing, starts a federation"
                )
            return []
        if held is None or (proof.base_round, proof.base_digest) != held:
            raise ProofError(
                f"certify of round {proof.round} builds on round {proof.base_round}, not on the "
                f"state this party holds (round {held[0] if held else -1})"
            )
        expected = max_signed + 1 if rollback else proof.base_round + 1
        if proof.round != expected:
            raise ProofError(
                f"certify of round {proof.round} on base round {proof.base_round}: a round is "
                f"exactly its base + 1 (after a rollback: the newest signed + 1), here {expected}"
            )
        self.note_audits(proof.audits)
        verdict = self.verdict(proof.base_round, proof.base_digest, active, rota)
        if verdict is False:
            raise EquivocationError(
                f"round {proof.base_round} (the base) was audited false; it is refuted"
            )
        if verdict is None:
            raise ProofError(
                f"certify of round {proof.round}: its base round {proof.base_round} is not "
                "final (no audit receipts from its auditors)"
            )
        return self.commitments(proof, ended)

    def rota_of(self, round_: int, active: Sequence[str]) -> list[str]:
        """The rota positions whose audits of ``round_`` count (auditors + spare, or all)."""
        spare = 0 if self.auditors is None else AUDIT_ROTA_SPARE
        return auditors_of(round_, active, None if self.auditors is None else self.auditors + spare)

    def commitments(self, proof: CertifyProof, ended: Collection[str] = ()) -> list[Commitment]:
        """The proof's commitments, verified (rule 2 of the module docstring), sorted by party.

        Raises
        ------
        ProofError
            A commitment is malformed, unsigned, of a non-member, for another round or base,
            a second one of a party, or there are too few.
        """
        if len(proof.commitments) > len(self.keyring):
            raise ProofError(f"certify of round {proof.round}: more commitments than parties")
        gone = set(ended)
        out: dict[str, Commitment] = {}
        for blob in proof.commitments:
            try:
                c = Commitment.decode(blob)
            except DecodeError as exc:
                raise ProofError(f"certify of round {proof.round}: {exc}") from exc
            if c.party in out:
                raise ProofError(f"certify of round {proof.round}: two updates of {c.party}")
            if c.federation != self.federation:
                raise ProofError(f"commitment of {c.party} names another federation")
            if (c.round, c.base_round, c.base_digest) != (
                proof.round,
                proof.base_round,
                proof.base_digest,
            ):
                raise ProofError(
                    f"commitment of {c.party} is for round {c.round} on base {c.base_round}, "
                    f"not for round {proof.round} on base {proof.base_round}"
                )
            if c.party in gone:
                raise ProofError(f"commitment of {c.party}: it left or failed in this view")
            try:
                c.verify(self.keyring)
            except SignatureError as exc:
                raise ProofError(f"commitment of {c.party}: {exc}") from exc
            out[c.party] = c
        if len(out) < self.min_updates:
            raise ProofError(
                f"certify of round {proof.round} carries {len(out)} update commitment(s); the "
                f"charter asks for at least {self.min_updates}"
            )
        return [out[p] for p in sorted(out)]
