"""The sans-I/O protocol peer: membership, monitor and wire composed into one state machine.

A :class:`Peer` never touches a socket or a clock. Its driver (a test, the simulator, an asyncio
carrier, a Flower handler) feeds it every envelope that arrives with :meth:`Peer.handle` and calls
:meth:`Peer.tick` regularly; both return the :class:`Outgoing` envelopes to deliver, and the
driver delivers each ``Outgoing.data`` to the party ``Outgoing.to``. Actions (:meth:`bootstrap`,
:meth:`request_join`, :meth:`leave`, :meth:`connect`, :meth:`disconnect`) return envelopes too.

Observing changes: every record the peer newly holds appends an :class:`AppliedChange` to
:attr:`Peer.applied` (and calls ``on_apply`` if given) *before* the call that applied it returns.
Bad input never raises out of :meth:`handle`: it appends a :class:`Rejection` (with the typed
:class:`~chaos_flwr.errors.ChaosError`) to :attr:`Peer.rejections` and changes nothing else.

Fan-out
-------
Records are broadcast *directly* by the party that completes them to every active member it
knows (one envelope sealed once, ``to=None``, the same bytes to each destination), so an event
takes one network hop to reach every member. Anti-entropy repairs whatever a loss or partition
dropped: heartbeats carry the digest of the record-id set; a party whose digest differs is sent
an inventory (``inv``), and the two sides exchange the records the other lacks.

A record the broadcaster signs itself goes out as an ``own`` envelope (``{"record": {"body",
"sigs"}}``, ``sigs`` holding the *other* signers' signatures): the envelope's signature is also
the broadcaster's record signature, and receivers hold the record with the envelope's bytes as
that signature's proof (see :mod:`chaos_flwr.membership`, "Proofs"). Each receiver then checks
one signature fewer per event, and still checks every signature itself. ``own`` envelopes do
not count as signs of life for the monitor (their bytes travel on inside records).

Flows (envelope kinds in brackets)
----------------------------------
- **Genesis** (:meth:`bootstrap`): a founder signs its own join and sends it to the other
  founders (``rec``).
- **Scale-out** (:meth:`request_join`): the joiner signs its join body and asks each sponsor
  (``join_req``). A sponsor that is an active member countersigns; if its signature completes
  the record it applies and broadcasts it and sends the joiner every record it holds (``rec``),
  otherwise it returns its signature (``join_sig``). The joiner assembles the record once it has
  ``sponsors_required`` signatures and hands it to its sponsors (``join_done``), who apply,
  broadcast and sync the joiner the same way.
- **Scale-in** (:meth:`leave`): the leaver signs a leave record and broadcasts it.
- **Connect-link** (:meth:`connect`): the initiator signs a link_up body (next epoch) and sends
  it (``link_req``); the other end countersigns, applies and broadcasts the complete record.
- **Disconnect-link** (:meth:`disconnect`): either end signs a link_down for the link's current
  version and broadcasts it.
- **Failure**: the monitor suspects a watched party after ``suspicion_timeout_s`` of silence;
  the peer signs a fail body (no timestamp, so all voters sign the same bytes) and sends its
  vote (``vote``) to the suspect's watchers. Every watcher that holds ``failure_quorum`` votes
  assembles the fail record and applies it; the lowest-id signer of the record it assembled
  broadcasts it to all active members (two hops in all, ``k * |watchers| + n`` envelopes instead
  of ``k * n``). Who watches whom is :meth:`chaos_flwr.membership.View.watchers`: the live
  neighbours, topped up in id-ring order when a party has fewer than ``failure_quorum``.
- **Liveness and estimates**: heartbeats (``hb``) go every ``heartbeat_interval_s`` to the
  parties that watch this one, its neighbours and one more member in round-robin order (for
  anti-entropy); probes (``probe``/``probe_ack``) measure round-trip times.

Pending joins, link requests and votes are re-sent every ``PEER_RETRY_INTERVAL_S`` until the
record they aim at is held.

Driving a peer (simulators, carriers)
-------------------------------------
- ``now`` must not go backwards for one peer; it stamps outgoing envelopes (``timestamp``).
- Deliver each ``Outgoing`` at most as sent: the bytes are opaque; several ``Outgoing`` of one
  broadcast share one ``bytes`` object. Loss, duplication and reordering are tolerated
  (duplicates are refused as replays and logged in :attr:`Peer.rejections` as ``ReplayError``).
- A crash is: stop calling the peer. A restart is a *new* ``Peer`` object for the same
  identity with a higher ``incarnation`` (the old sequence numbers would be refused as
  replays), which then calls :meth:`Peer.request_join` (or :meth:`Peer.bootstrap` for a
  founder). A party that left or was declared failed stops heartbeating and voting
  (``tick`` returns only retries) but still accepts records sent to it.
- Convergence check: two active members hold the same records iff
  ``peer.records.digest()`` is equal; equal records give equal ``peer.view().digest``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from .defaults import (
    MEMBERSHIP_PROOF_MAX_BYTES,
    PEER_ANTI_ENTROPY_INTERVAL_S,
    PEER_MAX_RECORDS_PER_MESSAGE,
    PEER_MAX_REJECTIONS_LOGGED,
    PEER_PROBE_EVERY_HEARTBEATS,
    PEER_RETRY_INTERVAL_S,
    WIRE_MAX_ENVELOPE_BYTES,
)
from .errors import (
    ChaosError,
    CharterError,
    DecodeError,
    PolicyError,
    StaleIncarnationError,
)
from .identity import SIGNATURE_BYTES
from .membership import (
    ACTIVE,
    PROOF_KIND,
    UP,
    Policy,
    Record,
    RecordSet,
    SignatureCache,
    View,
    fail_body,
    join_body,
    leave_body,
    link_body,
    record_id_of,
    signing_bytes,
    validate_record,
)
from .monitor import Monitor, Resources
from .wire import DOMAIN as _ENVELOPE_DOMAIN
from .wire import Envelope, ReplayGuard, open_sealed, seal

__all__ = ["AppliedChange", "Outgoing", "Peer", "Rejection"]

_FEDERATION_NAME_DOMAIN = b"chaos-flwr/federation-name/v1\x00"
# Upper bounds of an own envelope's size: frame, fixed fields and a record body (a federation
# name up to 256 bytes), plus one entry per other signature (key, party id, 64-byte value).
_OWN_BASE_BYTES = 1024
_OWN_PER_SIG_BYTES = 96


def _federation_tag(charter: Any) -> bytes:
    digest = getattr(charter, "digest", None)
    if isinstance(digest, bytes) and digest:
        return digest
    return hashlib.sha256(_FEDERATION_NAME_DOMAIN + str(charter.federation).encode()).digest()


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


@dataclass
class _PendingJoin:
    body: dict[str, Any]
    sigs: dict[str, bytes]
    sponsors: tuple[str, ...]
    sent_at: float
    done: Record | None = None
    synced: bool = False


@dataclass
class _PendingLink:
    body: dict[str, Any]
    sig: bytes
    other: str
    sent_at: float


@dataclass
class _Vote:
    body: dict[str, Any]
    sigs: dict[str, bytes]
    mine: bool
    sent_at: float


class Peer:
    """One party's protocol state machine (sans-I/O).

    Parameters
    ----------
    identity : chaos_flwr.identity.Identity
        This party's key pair (anything with ``party_id``, ``public_key`` and ``sign``).
    charter : chaos_flwr.charter.Charter
        The verified charter: federation, keyring, admission and failure policy, timings.
    incarnation : int, optional
        This party's incarnation. A restarted party that was declared failed or left must use a
        higher one than before; :meth:`request_join` raises it past what the view shows.
    keyring : Mapping[str, bytes], optional
        Extra party id -> public key entries merged over ``charter.keyring()``.
    signature_cache : SignatureCache, optional
        A signature cache shared by peers hosted in one process (each record signature is then
        verified once per process); default: a private one.
    accept_link : Callable[[str], bool], optional
        Asked when another party requests a link; default: accept every active member.
    resources : Resources, optional
        What this party declares about itself in heartbeats.
    on_apply : Callable[[AppliedChange], None], optional
        Called for every :class:`AppliedChange`, as it is appended to :attr:`applied`.
    max_envelope_bytes : int, optional
        Larger envelopes are refused unparsed (``OversizeError`` in :attr:`rejections`).
    replay_state : Mapping, optional
        A :meth:`replay_state` saved by an earlier run of this party: the replay guard starts
        from it instead of empty (the guard is in memory only; see
        :class:`chaos_flwr.wire.ReplayGuard`). ``DecodeError`` if malformed.
    seq : int, optional
        The last sequence number sealed at ``incarnation`` (:attr:`seq`) by an earlier process
        of this same party life: sealing continues above it, so receivers' replay guards accept
        it. Leave 0 with a fresh incarnation.

    Attributes
    ----------
    party_id : str
    incarnation : int
    applied : list[AppliedChange]
        Every record newly held, in order.
    rejections : list[Rejection]
        Every refused input (the newest ``PEER_MAX_REJECTIONS_LOGGED``).
    monitor : Monitor
        Liveness, link estimates and the resource table.
    records : RecordSet
        The records held.
    """

    def __init__(
        self,
        identity: Any,
        charter: Any,
        *,
        incarnation: int = 0,
        keyring: Mapping[str, bytes] | None = None,
        signature_cache: SignatureCache | None = None,
        accept_link: Callable[[str], bool] | None = None,
        resources: Resources | None = None,
        on_apply: Callable[[AppliedChange], None] | None = None,
        max_envelope_bytes: int = WIRE_MAX_ENVELOPE_BYTES,
        replay_state: Mapping[str, Any] | None = None,
        seq: int = 0,
    ) -> None:
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise PolicyError(f"'seq' must be an integer >= 0, got {seq!r}")
        if isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation < 0:
            raise PolicyError(f"'incarnation' must be an integer >= 0, got {incarnation!r}")
        verified = getattr(charter, "is_verified", True)
        if callable(verified):
            verified = verified()
        if not verified:
            raise CharterError(
                "the charter is not signed by its founders; verify it first "
                "(chaos-flwr charter verify) and pass the verified charter"
            )
        self.identity = identity
        self.charter = charter
        self.party_id: str = str(identity.party_id)
        self.incarnation = incarnation
        self.policy = Policy.from_charter(charter, keyring)
        #: What every envelope of this peer is sealed for and checked against: the charter
        #: digest (a charter-like object without one: a digest of the federation name).
        self.federation_tag: bytes = _federation_tag(charter)
        self._keyring = dict(self.policy.keyring)
        if self.party_id not in self._keyring:
            self._keyring[self.party_id] = bytes(identity.public_key)
        self.records = RecordSet(self.policy, signature_cache)
        self.monitor = Monitor(
            self.party_id,
            suspicion_timeout_s=float(charter.suspicion_timeout_s),
            heartbeat_interval_s=float(charter.heartbeat_interval_s),
            probe_interval_s=float(charter.heartbeat_interval_s) * PEER_PROBE_EVERY_HEARTBEATS,
        )
        self.applied: list[AppliedChange] = []
        self.rejections: list[Rejection] = []
        self.on_apply = on_apply
        self._accept_link = accept_link
        self._resources = resources
        if resources is not None:
            self.monitor.declare(self.party_id, resources)
        self._guard = (
            ReplayGuard() if replay_state is None else ReplayGuard.from_snapshot(replay_state)
        )
        self._max_envelope = max_envelope_bytes
        self._seq = seq
        self._joins: dict[str, _PendingJoin] = {}
        self._links: dict[str, _PendingLink] = {}
        self._votes: dict[str, _Vote] = {}
        self._ae_sent: dict[str, float] = {}
        self._rr = 0
        self._dirty = True
        self._hb_targets: tuple[str, ...] = ()
        self._founders = tuple(sorted(self.policy.founders))

    # --- observation -------------------------------------------------------------------------

    def view(self) -> View:
        """The current view (a pure function of :attr:`records`)."""
        return self.records.view()

    @property
    def is_member(self) -> bool:
        """Whether this party is an active member at its current incarnation."""
        m = self.records.member(self.party_id)
        return m is not None and m.status == ACTIVE and m.incarnation == self.incarnation

    def replay_state(self) -> dict[str, list[int]]:
        """The replay guard's state, codec-encodable, for the caller to persist.

        Pass it back as ``Peer(..., replay_state=...)`` after a restart so envelopes accepted
        before the restart are still refused as replays (the core itself does no I/O).
        """
        return {sender: list(entry) for sender, entry in self._guard.snapshot().items()}

    @property
    def seq(self) -> int:
        """The last sequence number sealed at the current incarnation (persist it with
        :attr:`incarnation` to continue this life in another process: ``Peer(seq=...)``)."""
        return self._seq

    def load_records(self, values: Sequence[Any], now: float) -> int:
        """Take up records saved by an earlier process of this party (their wire form).

        Each record is validated (signatures included) exactly as one received; a bad one
        raises before anything is applied. Returns how many were new.

        Raises
        ------
        DecodeError, SignatureError, PolicyError
            A record is malformed or does not verify under the charter.
        """
        return len(self._apply(self._check_records(list(values)), now))

    def declare_resources(self, resources: Resources) -> None:
        """Set what this party declares in its heartbeats (compute speed, free memory)."""
        self._resources = resources
        self.monitor.declare(self.party_id, resources)

    # --- actions -----------------------------------------------------------------------------

    def bootstrap(self, now: float) -> list[Outgoing]:
        """Found the federation: a founder signs its own join (the genesis record).

        Returns
        -------
        list[Outgoing]
            The genesis record for the other founders.

        Raises
        ------
        PolicyError
            If this party is not a founder of the charter.
        """
        if self.party_id not in self.policy.founders:
            raise PolicyError(
                f"party {self.party_id} is not a founder; only founders bootstrap, others use "
                "request_join(now, sponsors)"
            )
        self._bump_incarnation()
        body = join_body(self.policy.federation, self.party_id, self.incarnation, now)
        targets = set(self._founders) | set(self.records.active())
        record, out = self._broadcast_own(targets, body, {}, now)
        self._apply([record], now, validated=True)
        return out

    def request_join(self, now: float, sponsors: Sequence[str]) -> list[Outgoing]:
        """Ask ``sponsors`` (active members) to countersign this party's join.

        Ask more sponsors than ``admission.sponsors_required`` to tolerate some being slow or
        gone: the first replies that complete the record win. Pending requests are re-sent by
        :meth:`tick` until the join record is held.

        Raises
        ------
        PolicyError
            If ``sponsors`` is empty, names this party, or this party is already active.
        """
        asked = tuple(sorted(set(sponsors)))
        if not asked or self.party_id in asked:
            raise PolicyError("'sponsors' must name at least one other party")
        if self.is_member:
            raise PolicyError(f"party {self.party_id} is already an active member")
        self._bump_incarnation()
        self._joins.clear()  # a new request supersedes any earlier one
        body = join_body(self.policy.federation, self.party_id, self.incarnation, now)
        rid = record_id_of(body)
        sig = self._sign(signing_bytes(body))
        pending = _PendingJoin(body=body, sigs={self.party_id: sig}, sponsors=asked, sent_at=now)
        self._joins[rid] = pending
        if self.policy.sponsors_required == 0:
            pending.done = Record(body=body, signatures=dict(pending.sigs))
            self._apply([pending.done], now)
            return self._broadcast(asked, "join_done", {"record": pending.done.to_wire()}, now)
        return self._broadcast(asked, "join_req", {"body": body, "sig": sig}, now)

    def leave(self, now: float) -> list[Outgoing]:
        """Leave the federation (scale-in): sign a leave record and broadcast it.

        Raises
        ------
        PolicyError
            If this party is not an active member.
        """
        if not self.is_member:
            raise PolicyError(f"party {self.party_id} is not an active member; nothing to leave")
        targets = self.records.active()
        body = leave_body(self.policy.federation, self.party_id, self.incarnation)
        record, out = self._broadcast_own(targets, body, {}, now)
        self._apply([record], now, validated=True)
        return out

    def connect(self, other: str, now: float) -> list[Outgoing]:
        """Ask ``other`` for a link (connect-link); it countersigns and broadcasts the record.

        Raises
        ------
        PolicyError
            If either end is not an active member, or ``other`` is this party.
        """
        other_m = self._active_other(other, "connect")
        link = self.records.link(self.party_id, other)
        epoch = link.epoch + 1 if link is not None else 1
        body = link_body(
            "link_up",
            self.policy.federation,
            (self.party_id, self.incarnation),
            (other, other_m.incarnation),
            epoch,
        )
        sig = self._sign(signing_bytes(body))
        self._links[record_id_of(body)] = _PendingLink(body, sig, other, now)
        return [self._send(other, "link_req", {"body": body, "sig": sig}, now)]

    def disconnect(self, other: str, now: float) -> list[Outgoing]:
        """Take the link to ``other`` down (disconnect-link) and broadcast the record.

        Raises
        ------
        PolicyError
            If there is no up link between this party and ``other``.
        """
        link = self.records.link(self.party_id, other)
        if link is None or link.state != UP or other == self.party_id:
            raise PolicyError(f"there is no up link between {self.party_id} and {other!r}")
        end_self = (self.party_id, link.inc_a if link.a == self.party_id else link.inc_b)
        end_other = (other, link.inc_b if link.a == self.party_id else link.inc_a)
        body = link_body("link_down", self.policy.federation, end_self, end_other, link.epoch)
        targets = self.records.active()
        record, out = self._broadcast_own(targets, body, {}, now, first=other)
        self._apply([record], now, validated=True)
        return out

    # --- driving -----------------------------------------------------------------------------

    def handle(self, data: bytes, now: float) -> list[Outgoing]:
        """Process one received envelope.

        Parameters
        ----------
        data
            The envelope bytes as the carrier delivered them.
        now
            The current time in seconds (the driver's clock).

        Returns
        -------
        list[Outgoing]
            Envelopes to deliver in response. Never raises for bad input: a forged, altered,
            replayed, stale, misaddressed, oversized, undecodable or policy-violating envelope
            is appended to :attr:`rejections` and changes nothing else.
        """
        env: Envelope | None = None
        try:
            env = open_sealed(
                data,
                self._keyring,
                federation=self.federation_tag,
                max_bytes=self._max_envelope,
                verify=self.records.cache.verify,
            )
            if env.sender == self.party_id:
                raise PolicyError("envelope claims to come from this party itself")
            if env.to is not None and env.to != self.party_id:
                raise PolicyError(f"envelope field 'to' is {env.to!r}, not this party")
            self._guard.check(env, now)
            known = self.records.member(env.sender)
            if known is not None and env.incarnation < known.incarnation:
                raise StaleIncarnationError(
                    f"envelope from {env.sender} has incarnation {env.incarnation}, the view "
                    f"holds incarnation {known.incarnation}"
                )
            handler = self._handlers.get(env.kind)
            if handler is None:
                raise DecodeError(f"envelope field 'kind' {env.kind!r} is not a peer message")
            out = handler(self, env, now)
            self._guard.accept(env)
            if env.kind != PROOF_KIND:
                self.monitor.heard_from(env.sender, now)
            return out
        except ChaosError as exc:
            self._reject(exc, now, env)
            return []

    def tick(self, now: float) -> list[Outgoing]:
        """Advance timers: heartbeats, probes, suspicion votes, anti-entropy and retries.

        Call it at least every ``heartbeat_interval_s`` (more often is harmless).

        Parameters
        ----------
        now
            The current time in seconds.

        Returns
        -------
        list[Outgoing]
            Envelopes to deliver.
        """
        out: list[Outgoing] = []
        if self._dirty:
            self._recompute(now)
        out.extend(self._retries(now))
        if not self.is_member:
            return out
        view = self.records.view()
        for suspect in self.monitor.check(now):
            m = view.members.get(suspect)
            if m is None or m.status != ACTIVE:
                continue
            out.extend(self._vote(fail_body(self.policy.federation, suspect, m.incarnation), now))
        if self.monitor.heartbeat_due(now):
            targets = set(self._hb_targets)
            pool = sorted((set(view.active()) | set(self._founders)) - {self.party_id})
            if pool:
                self._rr = (self._rr + 1) % len(pool)
                targets.add(pool[self._rr])
            res = self._resources
            payload: dict[str, Any] = {
                "rd": self.records.digest(),
                "res": None
                if res is None
                else [float(res.compute_speed), int(res.free_memory_bytes), float(res.at)],
            }
            out.extend(self._broadcast(targets, "hb", payload, now))
        for pid, nonce in self.monitor.probes_due(now):
            out.append(self._send(pid, "probe", {"nonce": nonce}, now))
        return out

    # --- internals: sending ------------------------------------------------------------------

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

    # --- internals: state --------------------------------------------------------------------

    def _reject(self, exc: ChaosError, now: float, env: Envelope | None) -> None:
        self.rejections.append(
            Rejection(
                at=now,
                error=exc,
                sender=env.sender if env is not None else None,
                kind=env.kind if env is not None else None,
            )
        )
        if len(self.rejections) > PEER_MAX_REJECTIONS_LOGGED:
            del self.rejections[: len(self.rejections) - PEER_MAX_REJECTIONS_LOGGED]

    def _bump_incarnation(self) -> None:
        mine = self.records.member(self.party_id)
        if mine is not None and mine.status != ACTIVE and mine.incarnation >= self.incarnation:
            self.incarnation = mine.incarnation + 1

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

    def _check_records(self, values: Any) -> list[Record]:
        """Parse and validate every record not yet held; raises before anything is applied."""
        if not isinstance(values, list):
            raise DecodeError("message field 'records' must be a list")
        fresh: dict[str, Record] = {}
        for value in values:
            record = Record.from_wire(value)
            if record.record_id in self.records or record.record_id in fresh:
                continue
            validate_record(record, self.policy, self.records.cache)
            fresh[record.record_id] = record
        return list(fresh.values())

    def _apply(
        self, records: Iterable[Record], now: float, *, validated: bool = False
    ) -> list[Record]:
        new = []
        for record in records:
            if self.records.add(record, validated=validated):
                new.append(record)
                change = AppliedChange(record.record_id, record.kind, record.subject, now)
                self.applied.append(change)
                if self.on_apply is not None:
                    self.on_apply(change)
                self._links.pop(record.record_id, None)
                self._votes.pop(record.record_id, None)
        if new:
            self._dirty = True
        return new

    def _recompute(self, now: float) -> None:
        """Refresh who this party watches and heartbeats to, after the view changed."""
        self._dirty = False
        view = self.records.view()
        if not self.is_member:
            self.monitor.watch((), now)
            self._hb_targets = ()
            return
        k = self.policy.failure_quorum
        ring = view.active()
        watched = set(view.neighbours(self.party_id))
        for pid in ring:
            if (
                pid != self.party_id
                and len(view.neighbours(pid)) < k
                and self.party_id in view.watchers(pid, k, ring=ring)
            ):
                watched.add(pid)
        self.monitor.watch(watched, now)
        self._hb_targets = tuple(sorted(set(view.watchers(self.party_id, k, ring=ring)) | watched))

    def _vote_targets(self, subject: str) -> set[str]:
        """Where votes about ``subject`` go: its watchers (they assemble the fail record)."""
        view = self.records.view()
        return set(view.watchers(subject, self.policy.failure_quorum)) - {subject}

    def _vote(self, body: dict[str, Any], now: float) -> list[Outgoing]:
        rid = record_id_of(body)
        if rid in self.records:
            return []
        vote = self._votes.get(rid)
        if vote is None:
            vote = self._votes[rid] = _Vote(body=body, sigs={}, mine=True, sent_at=now)
        vote.mine = True
        vote.sent_at = now
        sig = vote.sigs.get(self.party_id)
        if sig is None:
            sig = vote.sigs[self.party_id] = self._sign(signing_bytes(body))
        out = self._broadcast(
            self._vote_targets(body["subject"]), "vote", {"body": body, "sig": sig}, now
        )
        out.extend(self._maybe_assemble(rid, now))
        return out

    def _maybe_assemble(self, rid: str, now: float) -> list[Outgoing]:
        """Assemble the fail record once a quorum of votes is held.

        Every party holding the quorum applies the record; the lowest-id signer of the record it
        assembled also broadcasts it to all active members (one broadcast in the common case;
        anti-entropy covers the rare case where that signer is gone).
        """
        vote = self._votes.get(rid)
        if vote is None:
            return []
        voters = set(vote.sigs) - {vote.body["subject"]}
        if len(voters) < self.policy.failure_quorum:
            return []
        record = Record(body=vote.body, signatures=dict(vote.sigs))
        targets = set(self.records.active()) - {vote.body["subject"]}
        if not self._apply([record], now) or min(voters) != self.party_id:
            return []
        # The broadcast carries the quorum: this party's envelope and k - 1 other votes.
        others = sorted(voters - {self.party_id})[: self.policy.failure_quorum - 1]
        quorum = Record(
            body=vote.body,
            signatures={self.party_id: vote.sigs[self.party_id]}
            | {v: vote.sigs[v] for v in others},
        )
        return self._share(targets, quorum, now)

    def _retries(self, now: float) -> list[Outgoing]:
        out: list[Outgoing] = []
        for rid, join in list(self._joins.items()):
            if join.synced:
                del self._joins[rid]
                continue
            if now - join.sent_at < PEER_RETRY_INTERVAL_S:
                continue
            join.sent_at = now
            if join.done is not None:
                out.extend(
                    self._broadcast(
                        join.sponsors, "join_done", {"record": join.done.to_wire()}, now
                    )
                )
            else:
                missing = [s for s in join.sponsors if s not in join.sigs]
                sig = join.sigs[self.party_id]
                out.extend(
                    self._broadcast(missing, "join_req", {"body": join.body, "sig": sig}, now)
                )
        for rid, link in list(self._links.items()):
            other = self.records.member(link.other)
            if not self.is_member or other is None or other.status != ACTIVE:
                del self._links[rid]  # an end is gone: the request is moot
                continue
            if now - link.sent_at < PEER_RETRY_INTERVAL_S:
                continue
            link.sent_at = now
            out.append(
                self._send(link.other, "link_req", {"body": link.body, "sig": link.sig}, now)
            )
        for rid, vote in list(self._votes.items()):
            subject = self.records.member(vote.body["subject"])
            if (
                subject is None
                or subject.status != ACTIVE
                or subject.incarnation != vote.body["incarnation"]
            ):
                del self._votes[rid]  # that incarnation is over (or unknown): nothing to vote on
                continue
            if self.is_member and vote.mine and now - vote.sent_at >= PEER_RETRY_INTERVAL_S:
                vote.sent_at = now
                out.extend(
                    self._broadcast(
                        self._vote_targets(vote.body["subject"]),
                        "vote",
                        {"body": vote.body, "sig": vote.sigs[self.party_id]},
                        now,
                    )
                )
        return out

    # --- internals: message handlers ---------------------------------------------------------

    def _on_rec(self, env: Envelope, now: float) -> list[Outgoing]:
        self._apply(self._check_records(env.payload.get("records")), now, validated=True)
        for rid, join in self._joins.items():
            # A sponsor's sync after our join record exists: the join has landed.
            if env.sender in join.sponsors and rid in self.records:
                join.synced = True
        return []

    def _on_own(self, env: Envelope, now: float) -> list[Outgoing]:
        record = Record.from_own(env)
        if record.record_id in self.records:
            return []
        validate_record(record, self.policy, self.records.cache, envelope=env)
        self._apply([record], now, validated=True)
        return []

    def _on_hb(self, env: Envelope, now: float) -> list[Outgoing]:
        rd = env.payload.get("rd")
        res = env.payload.get("res")
        if not isinstance(rd, bytes):
            raise DecodeError("heartbeat field 'rd' must be bytes")
        declared: Resources | None = None
        if res is not None:
            if (
                not isinstance(res, list)
                or len(res) != 3
                or not isinstance(res[0], float)
                or not isinstance(res[1], int)
                or not isinstance(res[2], float)
            ):
                raise DecodeError("heartbeat field 'res' must be [compute, memory, at]")
            declared = Resources(res[0], res[1], res[2])
            self.monitor.declare(env.sender, declared)
        if rd == self.records.digest():
            return []
        last = self._ae_sent.get(env.sender, -math.inf)
        if now - last < PEER_ANTI_ENTROPY_INTERVAL_S:
            return []
        self._ae_sent[env.sender] = now
        return [self._send(env.sender, "inv", {"ids": sorted(self.records.ids())}, now)]

    def _on_inv(self, env: Envelope, now: float) -> list[Outgoing]:
        ids = env.payload.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise DecodeError("inventory field 'ids' must be a list of record ids")
        theirs = set(ids)
        mine = self.records.ids()
        out: list[Outgoing] = []
        give = [r for rid in sorted(mine - theirs) if (r := self.records.get(rid)) is not None]
        if give:
            out.extend(self._records_to(env.sender, give, now))
        want = sorted(theirs - mine)
        if want:
            out.append(self._send(env.sender, "fetch", {"ids": want}, now))
        return out

    def _on_fetch(self, env: Envelope, now: float) -> list[Outgoing]:
        ids = env.payload.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise DecodeError("fetch field 'ids' must be a list of record ids")
        give = [r for rid in ids if (r := self.records.get(rid)) is not None]
        return self._records_to(env.sender, give, now) if give else []

    def _on_join_req(self, env: Envelope, now: float) -> list[Outgoing]:
        body, sig = self._body_and_sig(env, "join")
        if body["subject"] != env.sender or body["incarnation"] != env.incarnation:
            raise PolicyError("join request field 'subject'/'incarnation' is not the sender's")
        if not self.is_member:
            raise PolicyError(f"party {self.party_id} is not an active member; cannot sponsor")
        known = self.records.member(env.sender)
        if known is not None and known.incarnation >= env.incarnation:
            if known.status == ACTIVE:
                # Already joined: just sync the joiner again.
                return self._records_to(env.sender, list(self.records), now)
            raise PolicyError(
                f"incarnation {known.incarnation} of {env.sender} has {known.status}; rejoin "
                "with a higher 'incarnation'"
            )
        rid = record_id_of(body)
        self.records.cache.verify(self._keyring[env.sender], sig, signing_bytes(body))
        mine = self._sign(signing_bytes(body))
        record = Record(body=body, signatures={env.sender: sig, self.party_id: mine})
        try:
            validate_record(record, self.policy, self.records.cache)
        except PolicyError:
            return [self._send(env.sender, "join_sig", {"id": rid, "sig": mine}, now)]
        return self._sponsor_apply(record, env.sender, now)

    def _sponsor_apply(self, record: Record, joiner: str, now: float) -> list[Outgoing]:
        targets = set(self.records.active()) - {joiner}
        new = self._apply([record], now)
        out: list[Outgoing] = []
        if new:
            out.extend(self._share(targets, record, now))
        out.extend(self._records_to(joiner, list(self.records), now))
        return out

    def _on_join_sig(self, env: Envelope, now: float) -> list[Outgoing]:
        rid = env.payload.get("id")
        sig = env.payload.get("sig")
        if not isinstance(rid, str) or not isinstance(sig, bytes):
            raise DecodeError("join signature fields 'id' (str) and 'sig' (bytes) are required")
        join = self._joins.get(rid)
        if join is None or join.done is not None:
            return []
        if env.sender not in join.sponsors:
            raise PolicyError(f"party {env.sender} was not asked to sponsor this join")
        self.records.cache.verify(self._keyring[env.sender], sig, signing_bytes(join.body))
        join.sigs[env.sender] = sig
        if len(join.sigs) - 1 < self.policy.sponsors_required:
            return []
        join.done = Record(body=join.body, signatures=dict(join.sigs))
        self._apply([join.done], now)
        signed = [s for s in join.sponsors if s in join.sigs]
        return self._broadcast(signed, "join_done", {"record": join.done.to_wire()}, now)

    def _on_join_done(self, env: Envelope, now: float) -> list[Outgoing]:
        records = self._check_records([env.payload.get("record")])
        record = records[0] if records else None
        if record is None:
            value = env.payload.get("record")
            existing = Record.from_wire(value)
            if existing.kind != "join" or existing.subject != env.sender:
                raise PolicyError("join_done must carry the sender's own join record")
            return self._records_to(env.sender, list(self.records), now)
        if record.kind != "join" or record.subject != env.sender:
            raise PolicyError("join_done must carry the sender's own join record")
        if not self.is_member:
            raise PolicyError(f"party {self.party_id} is not an active member; cannot sponsor")
        return self._sponsor_apply(record, env.sender, now)

    def _on_link_req(self, env: Envelope, now: float) -> list[Outgoing]:
        body, sig = self._body_and_sig(env, "link_up")
        if {body["a"], body["b"]} != {self.party_id, env.sender}:
            raise PolicyError("link request fields 'a'/'b' are not the sender and this party")
        inc_self = body["inc_a"] if body["a"] == self.party_id else body["inc_b"]
        inc_other = body["inc_b"] if body["a"] == self.party_id else body["inc_a"]
        if inc_self != self.incarnation or inc_other != env.incarnation:
            raise StaleIncarnationError("link request names incarnations that are not current")
        rid = record_id_of(body)
        if rid in self.records:
            record = self.records.get(rid)
            return self._records_to(env.sender, [record], now) if record is not None else []
        self._active_other(env.sender, "accept a link")
        if self._accept_link is not None and not self._accept_link(env.sender):
            raise PolicyError(f"this party does not accept a link with {env.sender}")
        self.records.cache.verify(self._keyring[env.sender], sig, signing_bytes(body))
        targets = self.records.active()
        record, out = self._broadcast_own(targets, body, {env.sender: sig}, now, first=env.sender)
        self._apply([record], now, validated=True)
        return out

    def _on_vote(self, env: Envelope, now: float) -> list[Outgoing]:
        body, sig = self._body_and_sig(env, "fail")
        if body["subject"] == env.sender:
            raise PolicyError("a party cannot vote for its own failure")
        rid = record_id_of(body)
        if rid in self.records:
            return []
        self.records.cache.verify(self._keyring[env.sender], sig, signing_bytes(body))
        vote = self._votes.get(rid)
        if vote is None:
            vote = self._votes[rid] = _Vote(body=body, sigs={}, mine=False, sent_at=now)
        vote.sigs[env.sender] = sig
        return self._maybe_assemble(rid, now)

    def _on_probe(self, env: Envelope, now: float) -> list[Outgoing]:
        nonce = env.payload.get("nonce")
        if isinstance(nonce, bool) or not isinstance(nonce, int):
            raise DecodeError("probe field 'nonce' must be an integer")
        return [self._send(env.sender, "probe_ack", {"nonce": nonce}, now)]

    def _on_probe_ack(self, env: Envelope, now: float) -> list[Outgoing]:
        nonce = env.payload.get("nonce")
        if isinstance(nonce, bool) or not isinstance(nonce, int):
            raise DecodeError("probe_ack field 'nonce' must be an integer")
        self.monitor.probe_answered(env.sender, nonce, now)
        return []

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

    _handlers: ClassVar[dict[str, Callable[[Peer, Envelope, float], list[Outgoing]]]] = {
        "rec": _on_rec,
        PROOF_KIND: _on_own,
        "hb": _on_hb,
        "inv": _on_inv,
        "fetch": _on_fetch,
        "join_req": _on_join_req,
        "join_sig": _on_join_sig,
        "join_done": _on_join_done,
        "link_req": _on_link_req,
        "vote": _on_vote,
        "probe": _on_probe,
        "probe_ack": _on_probe_ack,
    }
