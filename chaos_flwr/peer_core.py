"""What every part of a peer shares: its state, and the primitives that seal, validate and apply.

:class:`PeerCore` holds one party's keys, records, monitor, replay guard and sequence number,
and the steps every flow is made of: sealing and sending envelopes (one seal per broadcast),
signing record bodies, validating and applying records. :class:`~chaos_flwr.peer.Peer` is a
``PeerCore`` that dispatches envelopes and timers; the negotiations it delegates to
(:mod:`chaos_flwr.peer_joins`, :mod:`chaos_flwr.peer_links`, :mod:`chaos_flwr.peer_votes`,
:mod:`chaos_flwr.peer_sync`) act through a ``PeerCore`` and never import the peer itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .defaults import (
    MEMBERSHIP_PROOF_MAX_BYTES,
    PEER_APPLIED_WINDOW,
    PEER_MAX_RECORDS_PER_MESSAGE,
    PEER_MAX_REJECTIONS_LOGGED,
)
from .errors import ChaosError, DecodeError, FloodError, PolicyError
from .flood import RecordBudget, limits_of
from .identity import SIGNATURE_BYTES
from .membership import ACTIVE, PROOF_KIND, Policy, Record, RecordSet, validate_record
from .monitor import Monitor, Resources
from .wire import DOMAIN as _ENVELOPE_DOMAIN
from .wire import Envelope, ReplayGuard, seal

__all__ = ["AppliedChange", "Outgoing", "PeerCore", "Rejection"]

# Upper bounds of an own envelope's size: frame, fixed fields and a record body (a federation
# name up to 256 bytes), plus one entry per other signature (key, party id, 64-byte value).
_OWN_BASE_BYTES = 1024
_OWN_PER_SIG_BYTES = 96


class Outgoing(NamedTuple):
    """One envelope to deliver (immutable; a named tuple: cheap to make once per destination).

    Attributes
    ----------
    to : str
        Party id of the destination.
    data : bytes
        A sealed envelope (the same bytes object may be shared by several ``Outgoing``).
    """

    to: str
    data: bytes


@dataclass(frozen=True)
class AppliedChange:
    """A record this peer newly holds (its view reflects it from now on).

    Attributes
    ----------
    record_id : str
        The record's id.
    kind : str
        ``join``, ``leave``, ``fail``, ``link_up`` or ``link_down``.
    subject : str
        The party the record is about, or ``"a|b"`` (sorted ends) for a link record.
    at : float
        The ``now`` of the call that applied it.
    """

    record_id: str
    kind: str
    subject: str
    at: float


@dataclass(frozen=True)
class Rejection:
    """An input :meth:`Peer.handle` refused.

    Attributes
    ----------
    at : float
        The ``now`` of the refused call.
    error : ChaosError
        The typed error (its message says what was wrong).
    sender : str or None
        The verified sender, or ``None`` if the envelope did not open.
    kind : str or None
        The envelope kind, or ``None`` if the envelope did not open.
    """

    at: float
    error: ChaosError
    sender: str | None = None
    kind: str | None = None


class PeerCore:
    """One party's protocol state and the primitives its flows are made of (sans-I/O).

    A base class: :class:`~chaos_flwr.peer.Peer` sets up the state declared here (its
    constructor documents every parameter), and the negotiations it delegates to act on the
    peer through these primitives only.
    """

    identity: Any
    charter: Any
    party_id: str
    incarnation: int
    policy: Policy
    #: What every envelope of this peer is sealed for and checked against: the charter
    #: digest (a charter-like object without one: a digest of the federation name).
    federation_tag: bytes
    records: RecordSet
    monitor: Monitor
    #: The newest ``PEER_APPLIED_WINDOW`` records newly held, in order.
    applied: list[AppliedChange]
    rejections: list[Rejection]
    on_apply: Callable[[AppliedChange], None] | None
    _keyring: dict[str, bytes]
    _resources: Resources | None
    _guard: ReplayGuard
    _max_envelope: int
    _seq: int
    _dirty: bool
    _founders: tuple[str, ...]
    _budget: RecordBudget | None = None

    @property
    def budget(self) -> RecordBudget:
        """The per-signer budget metering the new records this peer takes from the network
        (:mod:`chaos_flwr.flood`; limits from the charter's ``limits`` section or the defaults)."""
        if self._budget is None:
            rate, burst = limits_of(self.charter, len(self.policy.keyring))
            self._budget = RecordBudget(self.policy.keyring, rate, burst)
        return self._budget

    @property
    def refused_by(self) -> dict[str, int]:
        """Charter party id -> records refused because every signer was out of budget, plus
        the envelopes of that party refused unopened while it was out of budget."""
        return dict(self.budget.refused_by)

    @property
    def is_member(self) -> bool:
        """Whether this party is an active member at its current incarnation."""
        m = self.records.member(self.party_id)
        return m is not None and m.status == ACTIVE and m.incarnation == self.incarnation

    # --- sending -----------------------------------------------------------------------------

    def _seal(self, kind: str, payload: Mapping[str, Any], now: float, to: str | None) -> bytes:
        self._seq += 1
        return seal(
            self.identity,
            incarnation=self.incarnation,
            seq=self._seq,
            timestamp=float(now),
            kind=kind,
            payload=payload,
            to=to,
            federation=self.federation_tag,
        )

    def _send(self, to: str, kind: str, payload: Mapping[str, Any], now: float) -> Outgoing:
        return Outgoing(to, self._seal(kind, payload, now, to))

    def _broadcast(
        self,
        targets: Iterable[str],
        kind: str,
        payload: Mapping[str, Any],
        now: float,
        *,
        first: str | None = None,
    ) -> list[Outgoing]:
        """One envelope to every target, sorted by id; ``first`` (if a target) goes first."""
        dests = sorted(set(targets) - {self.party_id})
        if not dests:
            return []
        if first is not None and first in dests:
            dests.remove(first)
            dests.insert(0, first)
        data = self._seal(kind, payload, now, None)
        return [Outgoing(d, data) for d in dests]

    def _broadcast_own(
        self,
        targets: Iterable[str],
        body: Mapping[str, Any],
        others: Mapping[str, bytes],
        now: float,
        *,
        first: str | None = None,
    ) -> tuple[Record, list[Outgoing]]:
        """Sign ``body`` by broadcasting it in an ``own`` envelope (its signature is the proof).

        ``others`` are the other signers' plain signatures. Returns the record as this party
        holds it (the envelope's bytes as its own signature) and the envelopes to deliver.
        """
        dests = sorted(set(targets) - {self.party_id})
        if first is not None and first in dests:
            dests.remove(first)
            dests.insert(0, first)
        wire = {"body": dict(body), "sigs": dict(others)}
        payload = {"record": wire}
        data = self._seal(PROOF_KIND, payload, now, None)
        # Self-made (never received): this party does not re-verify its own proof.
        self.records.cache.trust(
            self._keyring[self.party_id],
            data[-SIGNATURE_BYTES:],
            _ENVELOPE_DOMAIN + data[:-SIGNATURE_BYTES],
        )
        record = Record(body=wire["body"], signatures={**others, self.party_id: data})
        # Checked like any record (the charter's rules), without decoding our own envelope.
        mine = Envelope(
            self.party_id,
            self.incarnation,
            self._seq,
            float(now),
            PROOF_KIND,
            None,
            payload,
            data,
            self.federation_tag,
        )
        validate_record(record, self.policy, self.records.cache, envelope=mine)
        return record, [Outgoing(d, data) for d in dests]

    def _share(
        self, targets: Iterable[str], record: Record, now: float, *, first: str | None = None
    ) -> list[Outgoing]:
        """Broadcast a record this party has signed (plainly): as ``own`` when it can.

        It cannot when another signature is itself a proof, or when the other signatures would
        make the envelope larger than a proof may be (a large failure quorum or sponsor count):
        the record then goes out as ``rec`` with every signature plain.
        """
        others = {k: v for k, v in record.signatures.items() if k != self.party_id}
        fits = _OWN_BASE_BYTES + _OWN_PER_SIG_BYTES * len(others) <= MEMBERSHIP_PROOF_MAX_BYTES
        if (
            fits
            and self.party_id in record.signatures
            and all(len(v) == SIGNATURE_BYTES for v in others.values())
        ):
            return self._broadcast_own(targets, record.body, others, now, first=first)[1]
        return self._broadcast(targets, "rec", {"records": [record.to_wire()]}, now, first=first)

    def _records_to(self, to: str, records: Sequence[Record], now: float) -> list[Outgoing]:
        out = []
        for i in range(0, len(records), PEER_MAX_RECORDS_PER_MESSAGE):
            chunk = records[i : i + PEER_MAX_RECORDS_PER_MESSAGE]
            out.append(self._send(to, "rec", {"records": [r.to_wire() for r in chunk]}, now))
        return out

    # --- state -------------------------------------------------------------------------------

    def _reject(self, exc: ChaosError, now: float, env: Envelope | None) -> None:
        # The log keeps the error, not its traceback: the frames would keep every refused
        # input's decoded envelope alive (about 4 KB each, times PEER_MAX_REJECTIONS_LOGGED).
        self.rejections.append(
            Rejection(
                at=now,
                error=exc.with_traceback(None),
                sender=env.sender if env is not None else None,
                kind=env.kind if env is not None else None,
            )
        )
        if len(self.rejections) > PEER_MAX_REJECTIONS_LOGGED:
            del self.rejections[: len(self.rejections) - PEER_MAX_REJECTIONS_LOGGED]

    def _bump_incarnation(self) -> None:
        mine = self.records.member(self.party_id)
        if mine is not None and mine.status != ACTIVE:
            # Above the end record too: it may name a later incarnation than the join held.
            ended = max(mine.incarnation, self.records.ended_at(self.party_id) or 0)
            if ended >= self.incarnation:
                self.incarnation = ended + 1

    def _sign(self, data: bytes) -> bytes:
        """Sign record bytes; the signature goes in this peer's cache (no self re-verify)."""
        sig: bytes = self.identity.sign(data)
        self.records.cache.trust(self._keyring[self.party_id], sig, data)
        return sig

    def _active_other(self, other: str, action: str) -> Any:
        if other == self.party_id:
            raise PolicyError(f"cannot {action} to this party itself")
        if not self.is_member:
            raise PolicyError(f"party {self.party_id} is not an active member; cannot {action}")
        m = self.records.member(other)
        if m is None or m.status != ACTIVE:
            raise PolicyError(f"party {other!r} is not an active member; cannot {action}")
        return m

    def _body_and_sig(self, env: Envelope, kind: str) -> tuple[dict[str, Any], bytes]:
        body = env.payload.get("body")
        sig = env.payload.get("sig")
        if not isinstance(sig, bytes):
            raise DecodeError(f"{env.kind} field 'sig' must be bytes")
        checked = Record.from_wire({"body": body, "sigs": {env.sender: sig}}).body
        if checked["kind"] != kind:
            raise PolicyError(f"{env.kind} must carry a {kind} body, got {checked['kind']!r}")
        if checked["federation"] != self.policy.federation:
            raise PolicyError(
                f"{env.kind} field 'federation' is {checked['federation']!r}, this federation "
                f"is {self.policy.federation!r}"
            )
        return checked, sig

    def _fresh_parts(self, values: Any) -> list[tuple[dict[str, Any], dict[str, bytes]]]:
        """Parse records (shape only, unhashed); keep those the record set does not cover
        (neither held nor superseded by a held one)."""
        if not isinstance(values, list):
            raise DecodeError("message field 'records' must be a list")
        covers = self.records.covers
        return [parts for value in values if not covers((parts := Record.wire_parts(value))[0])]

    def _check_records(self, values: Any) -> list[Record]:
        """Parse and validate every record not yet held; raises before anything is applied."""
        fresh: dict[str, Record] = {}
        for body, sigs in self._fresh_parts(values):
            record = Record.from_parts(body, sigs)
            if record.record_id not in fresh:
                validate_record(record, self.policy, self.records.cache)
                fresh[record.record_id] = record
        return list(fresh.values())

    def _metered_records(
        self, values: Any, now: float
    ) -> tuple[list[Record], list[Mapping[str, bytes]]]:
        """Parse and validate the new records of a received batch, within the signers' budget.

        Returns the records taken and the signature maps of those refused (every signer out of
        budget: refused before they are hashed or their signatures checked, and counted in
        :attr:`refused_by`). Raises, before anything is applied, if a record within budget is
        malformed or does not verify.
        """
        budget = self.budget
        taken: dict[str, Record] = {}
        refused: list[Mapping[str, bytes]] = []
        for body, sigs in self._fresh_parts(values):
            if not budget.allows(sigs, now):
                refused.append(sigs)
                continue
            record = Record.from_parts(body, sigs)
            if record.record_id in taken:
                continue
            validate_record(record, self.policy, self.records.cache)
            budget.charge(sigs, now)
            taken[record.record_id] = record
        return list(taken.values()), refused

    def _flood_error(self, refused: Sequence[Mapping[str, bytes]]) -> FloodError:
        """The typed error naming who signed the records refused for want of budget."""
        signers = sorted({s for sigs in refused for s in sigs})
        return FloodError(
            f"{len(refused)} record(s) refused: every signer is out of its record budget "
            f"(signers: {', '.join(signers)}); they are taken when offered again later",
            signers=tuple(signers),
            refused=len(refused),
        )

    def _apply(
        self, records: Iterable[Record], now: float, *, validated: bool = False
    ) -> list[Record]:
        new = []
        for record in records:
            if self.records.add(record, validated=validated):
                new.append(record)
                change = AppliedChange(record.record_id, record.kind, record.subject, now)
                self.applied.append(change)
                if len(self.applied) > PEER_APPLIED_WINDOW:
                    del self.applied[: len(self.applied) - PEER_APPLIED_WINDOW]
                if self.on_apply is not None:
                    self.on_apply(change)
                self._settled(record.record_id)
        if new:
            self._dirty = True
        return new

    def _settled(self, record_id: str) -> None:
        """A record is now held: drop whatever was pending to reach it (the peer's hook)."""
