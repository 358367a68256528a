"""A party's Chaos runtime inside a ClientApp process: :class:`Party`.

It feeds the relayed envelopes to its protocol peer, holds the certified state it is sent (and
stores it with its signed receipt), signs and checks receipts, and answers the membership
actions of churn scenarios and operators (:meth:`Party.leave`, :meth:`Party.connect`,
:meth:`Party.disconnect`). Its pulls are in :mod:`.joiner` and :mod:`.donor`; its durable state
in :mod:`chaos_flwr.flower.durable`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from chaos_flwr import codec
from chaos_flwr.defaults import FLOWER_JOIN_RETRY_S
from chaos_flwr.errors import ChaosError, ConfigError, StoreError
from chaos_flwr.flower import durable, gossipfile, grant
from chaos_flwr.flower.client import donor, endpoint, joiner, proofs, witness
from chaos_flwr.flower.client.autolink import links_to_ask
from chaos_flwr.flower.client.joiner import JoinerPull
from chaos_flwr.flower.client.settings import LEFT_MARKER
from chaos_flwr.flower.client.verified import VerifiedRounds
from chaos_flwr.flower.relay import PeerProtocol
from chaos_flwr.flower.schema import RELAY_SPKI_KEY, OutgoingLike, party_record
from chaos_flwr.receipts import receipt_signing_bytes, receipt_verifies
from chaos_flwr.state import TrainingState, from_array_record, to_array_record
from chaos_flwr.store import ReplicaStore

if TYPE_CHECKING:
    from chaos_flwr.receipts import Equivocation, ReceiptLedger
    from chaos_flwr.rounds import RoundGuard
    from chaos_flwr.transport.tls import LinkCredentials

__all__ = ["Party"]

#: Errors a party keeps (:attr:`Party.errors`, newest last); older ones are dropped.
PARTY_MAX_ERRORS: int = 256
#: Phases whose messages may carry an audit job: a round's certify (the first ask, to its
#: rota auditors) and later train messages (a retry, to the spare rota positions too).
AUDITED = frozenset({"certify", "relay"})
#: Finished pulls' figures a party keeps (:attr:`Party.joins_done`, newest last).
PARTY_MAX_JOINS_DONE: int = 16


@dataclass
class Party(VerifiedRounds):
    """One party's Chaos runtime inside a ClientApp process.

    Parameters
    ----------
    party_id:
        The party's id (``identity.party_id_of(public key)``).
    peer:
        The sans-I/O protocol peer fed with every envelope the relay delivers; ``None`` for a
        relay-only party (it routes nothing and speaks no membership protocol).
    signer:
        Signs receipts (``Identity.sign``); ``None`` means receipts go out *unsigned* (empty
        receipt blob), and a verifying server does not count them.
    clock:
        Wall clock handed to the peer as ``now``.
    store:
        The party's replica store: every certified state is written there (with the party's
        signed receipt as its certificate) and :meth:`restore` takes it up after a restart.
    """

    party_id: str
    peer: PeerProtocol | None = None
    signer: Callable[[bytes], bytes] | None = None
    clock: Callable[[], float] = time.time
    held_round: int = -1
    held_digest: bytes = b""
    held_arrays: ArrayRecord | None = None
    errors: list[str] = field(default_factory=list)
    pending: list[OutgoingLike] = field(default_factory=list)
    store: ReplicaStore | None = None
    left: bool = False
    keyring: Mapping[str, bytes] | None = None
    held_state: TrainingState | None = None
    joining: JoinerPull | None = None
    joins_done: list[ConfigRecord] = field(default_factory=list)
    _join_asked: tuple[float | None, tuple[str, ...]] = field(default=(None, ()), repr=False)
    evidence: list[Equivocation] = field(default_factory=list)
    auto_link: bool = True
    state_dir: Path | None = None
    direct_addr: str = ""
    link_creds: LinkCredentials | None = field(default=None, repr=False)
    _links_asked: set[tuple[str, int, int]] = field(default_factory=set, repr=False)
    _ledger: ReceiptLedger | None = field(default=None, repr=False)
    _evidence_sent: int = field(default=0, repr=False)
    _bytes: bytes = field(default=b"", repr=False)
    _bytes_round: int = field(default=-1, repr=False)
    lifetime: str = ""
    _saved_as: tuple[int, int] | None = field(default=None, repr=False)
    #: Verifiable rounds (:mod:`.proofs`): the round guard, the party's commitment of the
    #: round it trained (round, update digest), audits it signed and not yet sent, audits it
    #: keeps of the states it holds, and the newest round it rolled back from (-1: none).
    guard: RoundGuard | None = field(default=None, repr=False)
    committed: tuple[int, bytes] | None = None
    audits_out: list[bytes] = field(default_factory=list)
    audits_kept: list[bytes] = field(default_factory=list)
    rolled_from: int = -1
    diverged: dict[str, int] = field(default_factory=dict)
    #: Of the held state's certify: the rota of its auditors as this party's view had it, and
    #: the digest of its commitments (an audit job must name exactly those).
    held_rota: list[str] = field(default_factory=list)
    held_commits: bytes = b""
    #: Negative audits it signed or acted on (evidence a restarted ServerApp is told of).
    refutations: list[bytes] = field(default_factory=list)
    _saved_held: tuple[int, list[str], bytes] | None = field(default=None, repr=False)
    #: The gossip-heard records file as last taken up (:mod:`chaos_flwr.flower.gossipfile`).
    gossip_seen: tuple[int, int, int] | None = field(default=None, repr=False)

    # -- durable state (chaos_flwr.flower.durable) -----------------------------------------------
    def saved(self) -> durable.SavedParty:
        """What this party must keep until its next message (see :mod:`.durable`)."""
        peer = self.peer
        replay_of = getattr(peer, "replay_state", None)
        replay = replay_of() if replay_of is not None else {}
        records = getattr(peer, "records", None)
        return durable.SavedParty(
            party_id=self.party_id,
            lifetime=self.lifetime,
            incarnation=int(getattr(peer, "incarnation", 0)),
            seq=int(getattr(peer, "seq", 0)),
            replay=replay,
            records=[r.to_wire() for r in records or ()],
            pending=[(o.to, bytes(o.data)) for o in self.pending],
            join_asked=self._join_asked,
            links_asked=sorted(self._links_asked),
            joining=None if self.joining is None else self.joining.to_value(),
            joins_done=[dict(c.items()) for c in self.joins_done],
            receipts=durable.ledger_receipts(self._ledger),
            evidence=[ev.encode() for ev in self.evidence],
            evidence_sent=self._evidence_sent,
            charter=bytes(getattr(peer, "federation_tag", b"")),
            rounds=self._rounds_saved(),
        )

    def take_up(self, saved: durable.SavedParty, *, same_life: bool) -> None:
        """Take up a saved state: the ledger and evidence always; when ``same_life`` also the
        pending envelopes and the join progress (a real restart starts those afresh).

        Raises
        ------
        chaos_flwr.errors.StoreError
            The join pull or a receipt in the saved state is unreadable.
        """
        from chaos_flwr.receipts import Equivocation, Receipt, ReceiptLedger

        if self.keyring is not None and saved.receipts:
            self._ledger = ReceiptLedger(dict(self.keyring))
            try:
                self._ledger.add_all([Receipt.decode(b) for b in saved.receipts])
                self.evidence = []
                witness.keep_evidence(self, [Equivocation.decode(b) for b in saved.evidence])
            except ChaosError as exc:
                raise StoreError(f"saved party state: bad receipt or evidence ({exc})") from exc
            dropped = max(0, len(saved.evidence) - len(self.evidence))
            self._evidence_sent = min(max(0, saved.evidence_sent - dropped), len(self.evidence))
        self._take_up_rounds(saved.rounds)
        if not same_life:
            return
        from chaos_flwr.peer import Outgoing

        self.pending = [Outgoing(to, data) for to, data in saved.pending]
        self._join_asked = saved.join_asked
        self._links_asked = set(saved.links_asked)
        self.joins_done = [ConfigRecord(d) for d in saved.joins_done[-PARTY_MAX_JOINS_DONE:]]
        try:
            self.joining = saved.joiner_pull()
        except StoreError as exc:  # only the pull is lost: it starts again on the next step
            self.joining = None
            self.errors.append(f"{exc}; the pull starts again")

    def note_state_file(self) -> None:
        """Take the state file as it is now (or its absence) as the one this party was built
        from: a save by another process after this makes it not :meth:`is_current`. Called by
        the factory when it has built the party, within the party's turn."""
        if self.state_dir is not None and self.peer is not None:
            self._saved_as = durable.state_file_stamp(self.state_dir)

    def is_current(self) -> bool:
        """Whether the state file is still the one this party object was built from or last
        saved (another process of the same party, e.g. a second simulation worker, a
        ClientApp beside the party daemon, has not saved since)."""
        if self._saved_as is None or self.state_dir is None:
            return True
        return durable.state_file_stamp(self.state_dir) == self._saved_as

    def persist(self) -> None:
        """Save the party's state to its state directory (before a reply leaves the process).

        A failed save is noted in :attr:`errors` and the old file is removed, so the next
        process starts as a real restart (fresh incarnation) instead of reusing sequence
        numbers this one already sent.
        """
        if self.state_dir is None or self.peer is None:
            return
        try:
            durable.save(self.state_dir, self.saved(), seal=self.signer)
            self._saved_as = durable.state_file_stamp(self.state_dir)
        except (StoreError, OSError) as exc:
            self.errors.append(f"StoreError: {exc}")
            durable.LOG.warning("chaos-flwr: %s", exc)
            with contextlib.suppress(OSError):
                (self.state_dir / durable.STATE_FILE).unlink()
            # this object goes on with the numbers it sent; a save by another process since
            # (a fresh incarnation, as no file is left) makes it take that one up
            self._saved_as = durable.state_file_stamp(self.state_dir)

    # -- membership actions (churn scenarios, operators) ----------------------------------------
    def _need_peer(self, action: str) -> PeerProtocol:
        if self.peer is None:
            raise ConfigError(
                f"party {self.party_id} has no protocol peer (unsigned run); it cannot {action}"
            )
        return self.peer

    def leave(self) -> None:
        """Leave the federation: sign a leave record (sent with the party's next reply).

        From then on the party answers nothing more as a member: its train/evaluate handlers
        reply with an error, it sends no receipt and serves no shards; relay messages are still
        answered so that the leave record gets out.

        Raises
        ------
        chaos_flwr.errors.PolicyError
            The party is not an active member.
        chaos_flwr.errors.ConfigError
            The party has no protocol peer (unsigned run).
        """
        peer = self._need_peer("leave")
        action = getattr(peer, "leave", None)
        if action is None:
            raise ConfigError(f"the peer of {self.party_id} has no leave action")
        self.pending.extend(action(self.clock()))
        self.left = True
        if self.state_dir is not None:  # leaving is durable: a restart does not rejoin
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                (self.state_dir / LEFT_MARKER).write_text(f"{self.party_id}\n")
            except OSError as exc:
                self.errors.append(f"StoreError: cannot write the leave marker: {exc}")

    def connect(self, other_party_id: str) -> None:
        """Ask ``other_party_id`` for a link (a signed link-up record, both ends sign).

        Raises
        ------
        chaos_flwr.errors.PolicyError
            Either end is not an active member, or ``other_party_id`` is this party.
        """
        peer = self._need_peer("connect")
        self.pending.extend(peer.connect(other_party_id, self.clock()))  # type: ignore[attr-defined]

    def disconnect(self, other_party_id: str) -> None:
        """Take the link to ``other_party_id`` down (a signed link-down record).

        Raises
        ------
        chaos_flwr.errors.PolicyError
            There is no up link between the two parties.
        """
        peer = self._need_peer("disconnect")
        self.pending.extend(peer.disconnect(other_party_id, self.clock()))  # type: ignore[attr-defined]

    def _receipt(self) -> bytes:
        if self.signer is None or self.held_round < 0 or self.left:
            return b""
        return self.signer(receipt_signing_bytes(self.party_id, self.held_round, self.held_digest))

    def unfinal(self, rnd: int, digest: bytes, audits: object) -> str:
        """Why this party may not pull ``(rnd, digest)`` ("": it may): :func:`.proofs.unfinal`."""
        return proofs.unfinal(self, rnd, digest, audits)

    def hold(
        self, state: TrainingState, arrays: ArrayRecord | None = None, digest: bytes = b""
    ) -> None:
        """Take up ``state`` (its checks passed): hold it, store it with the signed receipt.

        ``digest`` is the state's digest when the caller has just checked it (the state is
        then hashed once per message, not once per step: hashing a 64 MiB model costs about
        40 ms).
        """
        self._hold(state, arrays, digest)

    def _hold(
        self, state: TrainingState, arrays: ArrayRecord | None = None, digest: bytes = b""
    ) -> None:
        self.held_round = state.round
        self.held_digest = digest or state.digest()
        self.held_state = state
        self.held_arrays = arrays if arrays is not None else to_array_record(state)
        if self.store is not None:
            try:
                self.store.put(state, certificate=self._receipt(), digest=self.held_digest)
            except StoreError as exc:  # the replica stays in memory only; say so
                self.errors.append(f"StoreError: {exc}")

    def _own_receipt_ok(self, state: TrainingState, certificate: bytes) -> bool:
        """Whether ``certificate`` is this party's signed receipt for ``state``."""
        if self.keyring is None:  # no keyring to check with: the store's digest check is all
            return True
        return receipt_verifies(
            self.keyring, self.party_id, state.round, state.digest(), certificate
        )

    def restore(self) -> bool:
        """Take up the newest replica of the party's store (a restart with its disk).

        The replica must hash to its digest (the store checks) and carry this party's own
        signed receipt for it (its certificate). Returns whether a replica was taken up. A
        corrupt or uncertified replica is noted in :attr:`errors` and ignored: the party then
        holds nothing and rejoins as a joiner. A replica of an older round makes the party a
        joiner that catches up (the ServerApp has it pull the current state).
        """
        if self.store is None:
            return False
        try:
            # never the round it rolled back from (refuted): the newest replica below it
            rounds = [r for r in self.store.rounds() if r != self.rolled_from]
            state = self.store.get(max(rounds)) if rounds else None
            cert = self.store.certificate(state.round) if state is not None else b""
        except StoreError as exc:
            self.errors.append(f"StoreError: {exc}")
            return False
        if state is None:
            return False
        if not self._own_receipt_ok(state, cert):
            self.errors.append(
                f"StoreError: replica of round {state.round} does not carry this party's "
                "signed receipt; ignored"
            )
            return False
        self.held_round = state.round
        self.held_digest = state.digest()
        self.held_state = state
        self.held_arrays = to_array_record(state)
        self._apply_saved_held()
        return True

    # -- pulls (chaos_flwr.flower.client.donor / .joiner) ------------------------------------------
    def serve(self, record: ConfigRecord, request: ConfigRecord) -> ConfigRecord | None:
        """Answer a pull request from the held replica (:func:`.donor.serve`)."""
        return donor.serve(self, record, request)

    def join_step(
        self, record: ConfigRecord, control: ConfigRecord, replies: Mapping[str, ConfigRecord]
    ) -> tuple[ConfigRecord, dict[str, ConfigRecord]]:
        """One relay step of this party's pull (it is the joiner): :func:`.joiner.join_step`."""
        return joiner.join_step(self, record, control, replies)

    def check_receipts(self, record: ConfigRecord | None) -> bool:
        """Compare the receipts the relay forwards with this party's own
        (:func:`.witness.check_receipts`); whether it holds equivocation evidence (it then
        refuses to train)."""
        return witness.check_receipts(self, record)

    def _auto_links(self, now: float) -> list[OutgoingLike]:
        """A member links up with every active member it has no live link with
        (:func:`~chaos_flwr.flower.client.autolink.links_to_ask`)."""
        peer = self.peer
        if not self.auto_link or peer is None or self.left or not getattr(peer, "is_member", 0):
            return []
        return links_to_ask(peer, self.party_id, self._links_asked, self.errors, now)

    def ask_to_join(self, record: ConfigRecord, now: float) -> list[OutgoingLike]:
        """A non-member asks for a sponsored join when it hears from the relay.

        Sponsors: the active members the relay lists (a hint; the join record needs their
        signatures anyway), else the charter's founders. Asked again, of the new list, when
        the list changes and the party is still not a member after ``FLOWER_JOIN_RETRY_S``.
        """
        peer = self.peer
        if peer is None or self.left or getattr(peer, "is_member", True):
            return []
        hint = record.get("members", [])
        members = [m for m in hint if isinstance(m, str)] if isinstance(hint, list) else []
        policy = getattr(peer, "policy", None)
        keys = set(self.keyring or {})
        sponsors = sorted(m for m in members if m != self.party_id and (not keys or m in keys))
        if not sponsors and policy is not None:
            sponsors = sorted(set(policy.founders) - {self.party_id})
        if not sponsors:
            return []
        asked_at, asked = self._join_asked
        if asked_at is not None and (
            now - asked_at < FLOWER_JOIN_RETRY_S or set(asked) == set(sponsors)
        ):
            return []
        request = getattr(peer, "request_join", None)
        if request is None:
            return []
        try:
            out: list[OutgoingLike] = list(request(now, sponsors))
        except ChaosError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return []
        self._join_asked = (now, tuple(sponsors))
        return out

    def _receipt_ok(self, party: str, rnd: int, digest: bytes, blob: bytes) -> bool:
        if self.keyring is None:
            return True  # an unsigned run: nothing to check receipts with
        return receipt_verifies(self.keyring, party, rnd, digest, blob)

    def process(
        self,
        record: ConfigRecord | None,
        arrays: ArrayRecord | None,
        content: RecordDict | None = None,
    ) -> ConfigRecord:
        """Handle the Chaos record of one incoming message; return the reply's Chaos record.

        ``content`` is the message's RecordDict (audit material rides on train messages).
        """
        now = self.clock()
        if record is not None:
            self.take_envelopes(record)
        gossipfile.take_heard(self, now)  # what its daemon heard from other parties' daemons
        outgoing: list[OutgoingLike] = list(self.pending)
        self.pending.clear()
        if record is not None and self.peer is not None:
            outgoing.extend(self.ask_to_join(record, now))
            outgoing.extend(self._auto_links(now))
            outgoing.extend(endpoint.announce(self, now))
        if self.peer is not None:
            outgoing.extend(self.peer.tick(now))
        if record is not None and record.get("phase") in ("relay", "hello"):
            proofs.take_refutations(self, record)
        if record is not None and record.get("phase") == "hello":
            policy = getattr(self.peer, "policy", None)
            fed = getattr(policy, "federation", None)
            spki = record.get(RELAY_SPKI_KEY)
            why = grant.take_hello(self.state_dir, fed, spki, left=self.left)
            if why:
                self.errors.append(why)
        if record is not None and record.get("phase") == "certify" and arrays is not None:
            self._certify(record, arrays)
        if record is not None and content is not None and record.get("phase") in AUDITED:
            proofs.audit(self, record, content)  # of the state it just took up, or a retry
        receipt = self._receipt()
        out = party_record(
            self.party_id,
            outgoing,
            receipt_round=-1 if self.left else self.held_round,
            receipt_digest=b"" if self.left else self.held_digest,
            receipt=receipt,
        )
        self.check_receipts(record)
        if self.audits_out:
            out["audits"] = list(self.audits_out)
            self.audits_out.clear()
        if record is not None and record.get("sync"):
            out["audits-held"] = self.audits_of_held() + self.refutations
            if not self.left and self.held_state is not None:  # a resume's pull asks no sizes
                out["held-bytes"] = self.held_state.serialized_size()
        if len(self.evidence) > self._evidence_sent:
            out["evidence"] = [ev.encode() for ev in self.evidence]
            self._evidence_sent = len(self.evidence)
        if record is not None and record.get("sync") and self.peer is not None:
            # a (re)started ServerApp rebuilds its view from the records the parties hold;
            # records carry their own signatures, so this needs no envelope
            held = getattr(self.peer, "records", None)
            out["records"] = [codec.encode(r.to_wire()) for r in held or ()]
        del self.errors[:-PARTY_MAX_ERRORS]  # the newest only: garbage input cannot grow it
        del self.joins_done[:-PARTY_MAX_JOINS_DONE]
        return out

    def take_news(self, record: ConfigRecord) -> None:
        """Take up what a message brings before a join step looks at the view (a newcomer's
        first message may be one): its envelopes, the records this party's daemon heard, and
        the relay's refutations (a held state audited false is rolled back first)."""
        self.take_envelopes(record)
        gossipfile.take_heard(self, self.clock())
        proofs.take_refutations(self, record)

    def take_envelopes(self, record: ConfigRecord) -> None:
        """Handle a message's relayed envelopes now, once (taken off ``record``; what they make
        the peer send waits in :attr:`pending`): a joiner's join step sees their view."""
        envelopes = _envelopes(record)
        record.pop("env", None)
        if self.peer is None:
            return
        now = self.clock()
        for data in envelopes:
            try:
                self.pending.extend(self.peer.handle(data, now))
            except ChaosError as exc:  # a bad envelope changes nothing; note and go on
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def take_certified(self, record: ConfigRecord, arrays: ArrayRecord | None) -> None:
        """Take up the state a certify names before training on it (an initial state whose
        certify rides on the first round's train message); the same certify is then not
        taken again when the message's record is processed."""
        if arrays is not None:
            self._certify(record, arrays)

    def _certify(self, record: ConfigRecord, arrays: ArrayRecord) -> None:
        """Take up a certified state: a signing party only when its proof holds
        (:func:`.proofs.take_certify`); an unsigned party's receipts prove nothing, so it
        takes what it is sent. A certify of the state it holds changes nothing."""
        if self.left or (record.get("round"), record.get("digest")) == (
            self.held_round,
            self.held_digest,
        ):
            return
        if proofs.guard_of(self) is not None:
            proofs.take_certify(self, record, arrays)
            return
        rnd = record.get("round", -1)
        sstate = record.get("strategy-state", b"")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            return
        if isinstance(sstate, bytes):
            self._hold(from_array_record(arrays, round=rnd, strategy_state=sstate), arrays)


def _envelopes(record: ConfigRecord) -> Sequence[bytes]:
    env = record.get("env", [])
    if not isinstance(env, list):
        return []
    return [e for e in env if isinstance(e, bytes)]
