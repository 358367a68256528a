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

Structure
---------
:class:`Peer` dispatches: it opens each envelope, hands it to the handler for its kind, and runs
the timers. The state and the sending primitives are :class:`~chaos_flwr.peer_core.PeerCore`'s;
the negotiations are delegated to :class:`~chaos_flwr.peer_joins.JoinNegotiation` (joins and
sponsorship), :class:`~chaos_flwr.peer_links.LinkNegotiation` (connect/disconnect),
:class:`~chaos_flwr.peer_votes.FailureVotes` (failure votes) and
:class:`~chaos_flwr.peer_sync.AntiEntropy` (heartbeats, inventories, fetches).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .defaults import PEER_PROBE_EVERY_HEARTBEATS, WIRE_MAX_ENVELOPE_BYTES
from .errors import (
    ChaosError,
    CharterError,
    DecodeError,
    FloodError,
    PolicyError,
    StaleIncarnationError,
)
from .membership import (
    PROOF_KIND,
    Policy,
    Record,
    RecordSet,
    SignatureCache,
    View,
    endpoint_body,
    join_body,
    leave_body,
    validate_record,
)
from .monitor import Monitor, Resources
from .peer_core import AppliedChange, Outgoing, PeerCore, Rejection
from .peer_joins import JoinNegotiation, PendingJoin
from .peer_links import LinkNegotiation, PendingLink
from .peer_sync import AntiEntropy
from .peer_votes import FailureVotes, Vote
from .wire import Envelope, ReplayGuard, open_sealed, peek_sender

__all__ = ["AppliedChange", "Outgoing", "Peer", "Rejection", "federation_tag"]

_Handler = Callable[[Envelope, float], list[Outgoing]]
_FEDERATION_NAME_DOMAIN = b"chaos-flwr/federation-name/v1\x00"


def federation_tag(charter: Any) -> bytes:
    """The tag that binds a signed message to its federation: the charter's digest (a
    federation-name hash for a charter-like object without one, as tests build)."""
    digest = getattr(charter, "digest", None)
    if isinstance(digest, bytes) and digest:
        return digest
    return hashlib.sha256(_FEDERATION_NAME_DOMAIN + str(charter.federation).encode()).digest()


class Peer(PeerCore):
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
        The newest ``PEER_APPLIED_WINDOW`` records newly held, in order.
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
        self.party_id = str(identity.party_id)
        self.incarnation = incarnation
        self.policy = Policy.from_charter(charter, keyring)
        self.federation_tag = federation_tag(charter)
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
        self.applied = []
        self.rejections = []
        self.on_apply = on_apply
        self._resources = resources
        if resources is not None:
            self.monitor.declare(self.party_id, resources)
        self._guard = (
            ReplayGuard() if replay_state is None else ReplayGuard.from_snapshot(replay_state)
        )
        self._max_envelope = max_envelope_bytes
        self._seq = seq
        self._dirty = True
        self._joins: dict[str, PendingJoin] = {}
        self._links: dict[str, PendingLink] = {}
        self._votes: dict[str, Vote] = {}
        self._hb_targets: tuple[str, ...] = ()
        self._founders = tuple(sorted(self.policy.founders))
        self._joining = JoinNegotiation(self, self._joins)
        self._linking = LinkNegotiation(self, self._links, accept_link)
        self._voting = FailureVotes(self, self._votes)
        self._sync = AntiEntropy(self)
        #: Envelope kind -> handler: the peer's own, and its collaborators' (bound once).
        self._handlers: dict[str, _Handler] = {
            "rec": self._on_rec,
            PROOF_KIND: self._on_own,
            "hb": self._sync.on_hb,
            "inv": self._sync.on_inv,
            "fetch": self._sync.on_fetch,
            "join_req": self._joining.on_join_req,
            "join_sig": self._joining.on_join_sig,
            "join_done": self._joining.on_join_done,
            "link_req": self._linking.on_link_req,
            "vote": self._voting.on_vote,
            "probe": self._on_probe,
            "probe_ack": self._on_probe_ack,
        }

    # --- observation -------------------------------------------------------------------------

    def view(self) -> View:
        """The current view (a pure function of :attr:`records`)."""
        return self.records.view()

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

    def load_records(self, values: Sequence[Any], now: float, *, sealed: bool = False) -> int:
        """Take up records saved by an earlier process of this party (their wire form).

        Each record is validated (signatures included) exactly as one received; a bad one
        raises before anything is applied. With ``sealed`` the caller has checked that the
        records come from this party's own sealed state file, saved under this very charter
        (:mod:`chaos_flwr.flower.durable`): this party verified each of them before it held
        it, so they are decoded and checked for this federation and its keyring, and their
        signatures are not verified again (a start costs what the file's size costs).
        Returns how many were new.

        Raises
        ------
        DecodeError, SignatureError, PolicyError
            A record is malformed or does not verify under the charter.
            With ``sealed``: a record names another federation or a signer the charter
            lacks (its signatures are not checked).
        """
        if not sealed:
            return len(self._apply(self._check_records(list(values)), now))
        records = [Record.from_wire(value) for value in values]
        federation, keyring = self.policy.federation, self.policy.keyring
        for record in records:
            if (
                record.body["federation"] != federation
                or not record.signatures.keys() <= keyring.keys()
            ):
                raise PolicyError(
                    f"saved record {record.record_id} is of federation "
                    f"{record.body['federation']!r} or signed by a party the charter lacks"
                )
        return len(self._apply(records, now, validated=True))

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
        return self._joining.request(now, sponsors)

    def pending_join(self) -> tuple[dict[str, Any], dict[str, bytes]] | None:
        """The join body this party asked sponsors for and the signatures it holds (its own
        among them), while that join is not complete; ``None`` otherwise."""
        return self._joining.pending_request()

    def take_join_sig(self, sponsor: str, sig: bytes, now: float) -> list[Outgoing]:
        """A signature ``sponsor`` gave this party's join some other way than an envelope (its
        daemon, over a direct link, asked by this party): taken as its ``join_sig`` would be
        (and checked, though nothing more is sent, when the join is complete already).

        Raises
        ------
        PolicyError
            This party asked for no join.
        SignatureError, UnknownPartyError
            ``sig`` does not verify; ``sponsor`` is no charter party.
        SignatureError
            ``sig`` does not verify.
        """
        return self._joining.take_sig(sponsor, sig, now)

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
        return self._linking.connect(other, now)

    def disconnect(self, other: str, now: float) -> list[Outgoing]:
        """Take the link to ``other`` down (disconnect-link) and broadcast the record.

        Raises
        ------
        PolicyError
            If there is no up link between this party and ``other``.
        """
        return self._linking.disconnect(other, now)

    def announce_endpoint(self, address: str, cert: bytes, now: float) -> list[Outgoing]:
        """Announce where this party serves direct links: a signed endpoint record.

        The record names ``address`` (``host:port``, any host) and ``cert`` (the DER of its
        link serve certificate, :class:`chaos_flwr.transport.tls.LinkCredentials`); it
        supersedes this incarnation's earlier endpoint (a higher ``seq``) and is broadcast to
        the active members. Nothing is signed when the view already holds this very endpoint.

        Raises
        ------
        PolicyError
            If this party is not an active member.
        DecodeError
            If ``address`` or ``cert`` is malformed (as a receiver would refuse it).
        """
        if not self.is_member:
            raise PolicyError(f"party {self.party_id} is not an active member; no endpoint")
        held = self.records.endpoint_record(self.party_id)
        seq = 1
        if held is not None and held.body["incarnation"] == self.incarnation:
            seq = int(held.body["seq"]) + 1
        fed = self.policy.federation
        body = endpoint_body(fed, self.party_id, self.incarnation, seq, address, cert)
        if held is not None and seq > 1:
            same = ("host", "port", "cert")
            if all(held.body[k] == body[k] for k in same):
                return []
        record, out = self._broadcast_own(self.records.active(), body, {}, now)
        self._apply([record], now, validated=True)
        return out

    # --- driving -----------------------------------------------------------------------------

    def reconcile(self, other: str, now: float) -> list[Outgoing]:
        """Exchange records with ``other`` (an inventory; it sends what this party lacks and
        fetches what it lacks): called when ``other`` signed a view that differs from this
        party's (:mod:`chaos_flwr.rounds`). Rate-limited per party; a non-party gets nothing."""
        if other not in self._keyring:
            return []
        return self._sync.offer(other, now)

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
            claimed = peek_sender(data)
            if self.budget.spent(claimed, now):
                # The sender signed more records than its budget: while it stays out of budget
                # its envelopes are refused before their signature is checked (an honest party
                # never gets there; a forged header naming it costs it nothing).
                self.budget.refused_by[claimed] = self.budget.refused_by.get(claimed, 0) + 1
                raise FloodError(
                    f"envelope from {claimed} refused unopened: the sender is out of its "
                    "record budget (a flood)",
                    signers=(claimed,),
                    refused=1,
                )
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
            out = handler(env, now)
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
        out.extend(self._joining.retries(now))
        out.extend(self._linking.retries(now))
        out.extend(self._voting.retries(now))
        if not self.is_member:
            return out
        view = self.records.view()
        out.extend(self._voting.suspect(self.monitor.check(now), view, now))
        if self.monitor.heartbeat_due(now):
            out.extend(self._sync.heartbeat(self._hb_targets, view, now))
        for pid, nonce in self.monitor.probes_due(now):
            out.append(self._send(pid, "probe", {"nonce": nonce}, now))
        return out

    # --- internals ---------------------------------------------------------------------------

    def _settled(self, record_id: str) -> None:
        self._links.pop(record_id, None)
        self._votes.pop(record_id, None)

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

    # --- internals: the handlers of records and probes ---------------------------------------

    def _on_rec(self, env: Envelope, now: float) -> list[Outgoing]:
        taken, refused = self._metered_records(env.payload.get("records"), now)
        self._apply(taken, now, validated=True)
        # A sponsor's sync after our join record exists: the join has landed.
        self._joining.synced_by(env.sender)
        if refused:
            # The batch's other records are taken (an honest forwarder may carry a flooder's
            # records); the refusal is logged, and anti-entropy offers those records again.
            self._reject(self._flood_error(refused), now, env)
        return []

    def _on_own(self, env: Envelope, now: float) -> list[Outgoing]:
        record = Record.from_own(env)
        if self.records.covers(record.body):
            return []
        if not self.budget.allows(record.signatures, now):
            raise self._flood_error([record.signatures])
        validate_record(record, self.policy, self.records.cache, envelope=env)
        self.budget.charge(record.signatures, now)
        self._apply([record], now, validated=True)
        return []

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
