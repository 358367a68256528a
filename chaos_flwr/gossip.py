"""Gossip between parties over direct links, without the relay (sans-I/O): :class:`Gossip`.

Every party that runs a daemon (:mod:`chaos_flwr.flower.daemon`) and announced a signed
endpoint asks a few of its peers, every gossip interval, for what they hold: it sends the
digest of its record set (the anti-entropy digest of :meth:`RecordSet.digest`), and a peer
whose digest differs answers with its records (each verified here before it is held, so a
peer can add nothing the charter does not sign). Both sides also carry their failure votes.
So views converge while the ServerApp is down, and a relay that withholds records from one
party is bypassed by its neighbours.

Failure detection over the links: a peer counts as *heard* when a gossip exchange with it
succeeds in either direction (an authenticated link whose far end is that party's key; a
typed refusal is an answer too). A member this party has heard (in its current incarnation)
since it started, then has not heard for ``suspect_after_s`` *and* failed to reach
``suspect_misses`` times in a row, is suspected: this party signs the fail body of its
incarnation (the same bytes every suspecting party signs, so no vote can equivocate; no
envelope, so the party's sequence numbers are not touched) and carries the vote. Votes are
current suspicions, not history: a vote not renewed (by its signer's gossip, or by this
party's own next round) within ``suspect_after_s`` is dropped, and hearing the suspect drops
every vote about it; whoever holds ``failure_quorum`` current votes holds the fail record and
gossips it like any other. A party never heard (no daemon, or never reachable) is never
suspected here; the relay's failure detection still covers it.

A daemon also countersigns a charter party's own join on request (:meth:`Gossip.countersign`,
:mod:`chaos_flwr.countersign`): a record its signature completes is held, and gossiped on.

The class does no I/O and reads no clock: ``now`` comes in, values to send go out. The
daemon's carrier dials, serves, writes files and serialises calls (one lock).

Wire values (codec maps): request ``{"gossip": digest, "endpoint": the asker's own endpoint
record (optional)}``; reply ``{"digest": bytes,
"records": [record, ..] (only when the digests differ), "votes": [{"body", "signer",
"sig"}, ..]}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .countersign import COUNTERSIGN_KEY, countersign
from .defaults import (
    GOSSIP_FANOUT,
    GOSSIP_MAX_RECORDS,
    GOSSIP_MAX_VOTES,
    GOSSIP_SUSPECT_MISSES,
    GOSSIP_SUSPECT_S,
)
from .errors import ChaosError, DecodeError, FloodError, PolicyError, UnknownPartyError
from .membership import (
    ACTIVE,
    EndpointInfo,
    Policy,
    Record,
    RecordSet,
    View,
    fail_body,
    record_id_of,
    signing_bytes,
)

__all__ = ["COUNTERSIGN_INTERVAL_S", "Gossip"]

#: Fewest seconds between two joins of one party that a daemon countersigns (each is a new
#: record it holds and gossips; a join is a party's new incarnation, which is rare). The same
#: join may be asked again at will (a second call with the complete record, a retry).
COUNTERSIGN_INTERVAL_S: float = 60.0

#: Request key naming a gossip request (its value: the asker's record-set digest).
GOSSIP_KEY = "gossip"


class Gossip:
    """One party's side of gossip: its record set, whom it heard when, and failure votes.

    Parameters
    ----------
    party_id
        This party's id.
    sign
        Signs a fail body with the party's key (``Identity.sign``).
    policy
        The federation's policy: every record and vote is checked against it.
    fanout
        Peers asked per gossip round.
    suspect_after_s
        Silence (seconds without a gossip exchange) after which a heard peer is suspected
        (with ``suspect_misses`` failed asks in a row); also how long a vote stays current.
    suspect_misses
        Failed asks in a row (see :meth:`missed`) a suspicion needs.

    Attributes
    ----------
    records : RecordSet
        The records held: the party's own saved ones and those learned by gossip.
    refused : dict[str, int]
        Records and votes refused, by error class name.
    """

    def __init__(
        self,
        party_id: str,
        sign: Callable[[bytes], bytes],
        policy: Policy,
        *,
        fanout: int = GOSSIP_FANOUT,
        suspect_after_s: float = GOSSIP_SUSPECT_S,
        suspect_misses: int = GOSSIP_SUSPECT_MISSES,
    ) -> None:
        self.party_id, self._sign, self.policy = party_id, sign, policy
        self.fanout, self.suspect_after_s = fanout, suspect_after_s
        self.suspect_misses = suspect_misses
        self.records = RecordSet(policy)
        self.refused: dict[str, int] = {}
        # member -> (its incarnation when heard, when), and failed asks in a row since
        self._heard: dict[str, tuple[int, float]] = {}
        self._missed: dict[str, int] = {}
        # fail record id -> (its body, signer -> (signature, when it was last renewed))
        self._votes: dict[str, tuple[dict[str, Any], dict[str, tuple[bytes, float]]]] = {}
        self._turn = 0
        self._countersigned: dict[str, tuple[str, float]] = {}  # party -> (join id, when)

    # -- what it holds ------------------------------------------------------------------------
    def view(self) -> View:
        """The view of the records held."""
        return self.records.view()

    def take(self, records: Iterable[Record]) -> int:
        """Hold ``records`` (each validated; a bad one is counted in :attr:`refused` and
        skipped). Returns how many were new."""
        new = 0
        for record in records:
            try:
                new += self.records.add(record)
            except ChaosError as exc:
                self._refuse(exc)
        return new

    def heard(self, party: str) -> float | None:
        """When ``party`` was last heard over a link (``None``: never since the start)."""
        got = self._heard.get(party)
        return None if got is None else got[1]

    def _hear(self, party: str, now: float) -> None:
        """``party`` answered or asked: alive now; every vote about it is dropped."""
        m = self.view().members.get(party)
        if m is None or m.status != ACTIVE:
            return  # not a member it could suspect (the link authorised it, though)
        self._heard[party] = (m.incarnation, now)
        self._missed.pop(party, None)
        for rid, (body, _) in list(self._votes.items()):
            if body["subject"] == party:
                del self._votes[rid]

    def missed(self, party: str) -> None:
        """An ask of ``party`` got no answer at all (no typed refusal either)."""
        if party in self._heard:
            self._missed[party] = self._missed.get(party, 0) + 1

    def _refuse(self, exc: ChaosError) -> None:
        name = type(exc).__name__
        self.refused[name] = self.refused.get(name, 0) + 1

    def countersign(self, src: str, value: Any, now: float) -> tuple[dict[str, Any], bool]:
        """Countersign ``src``'s own join (:func:`~chaos_flwr.countersign.countersign`, which
        raises what it refuses); a record that is now complete is held. Returns the reply,
        and whether the record is new here (``src`` is then a member in this view).

        Raises
        ------
        FloodError
            This party countersigned another join of ``src`` less than
            :data:`COUNTERSIGN_INTERVAL_S` ago (the same join is signed again at will).
        """
        done = countersign(self.records, self.party_id, self._sign, src, value)
        rid = record_id_of(value[COUNTERSIGN_KEY])  # a checked join body
        last = self._countersigned.get(src)
        if last is not None and last[0] != rid and now - last[1] < COUNTERSIGN_INTERVAL_S:
            raise FloodError(
                f"{src} had another join countersigned {now - last[1]:.0f} s ago; one per "
                f"{COUNTERSIGN_INTERVAL_S:g} s"
            )
        if last is None or last[0] != rid:
            self._countersigned[src] = (rid, now)  # src is a charter party: bounded by it
        return done.reply, done.record is not None and self.take([done.record]) > 0

    # -- a gossip round ----------------------------------------------------------------------
    def targets(self) -> list[tuple[str, EndpointInfo]]:
        """The peers to ask this round: up to ``fanout`` active members with a signed endpoint,
        taken in turn (every such peer is asked within ``ceil(n / fanout)`` rounds). None while
        this party is not an active member itself."""
        view = self.view()
        if not view.is_active(self.party_id):
            return []
        peers = [
            (p, ep)
            for p in view.active()
            if p != self.party_id and (ep := view.endpoint(p)) is not None
        ]
        if not peers:
            return []
        start = self._turn % len(peers)
        self._turn = start + min(self.fanout, len(peers))
        return (peers[start:] + peers[:start])[: self.fanout]

    def request(self) -> dict[str, Any]:
        """The request value sent to each target: the digest, and this party's own endpoint
        record (so a peer the relay never told where this party is can ask it back)."""
        value: dict[str, Any] = {GOSSIP_KEY: self.records.digest()}
        own = self.records.endpoint_record(self.party_id)
        if own is not None:
            value["endpoint"] = own.to_wire()
        return value

    def on_request(self, src: str, value: Any, now: float) -> dict[str, Any]:
        """Answer ``src``'s request (``src`` is authenticated by the link).

        Raises
        ------
        DecodeError
            ``value`` is not a gossip request.
        PolicyError
            It carries an endpoint record that is not the asker's own.
        """
        if not isinstance(value, dict) or not isinstance(value.get(GOSSIP_KEY), bytes):
            raise DecodeError("gossip request must be a map with 'gossip' (bytes)")
        if "endpoint" in value:
            own = Record.from_wire(value["endpoint"])
            if own.kind != "endpoint" or own.subject != src:
                raise PolicyError("a gossip request carries only the asker's own endpoint")
            self.take([own])
        self._hear(src, now)
        digest = self.records.digest()
        reply: dict[str, Any] = {"digest": digest, "votes": self._vote_values()}
        if value[GOSSIP_KEY] != digest:
            # the newest (a superseding record is held last), should the set pass the bound
            reply["records"] = [r.to_wire() for r in list(self.records)[-GOSSIP_MAX_RECORDS:]]
        return reply

    def on_reply(self, src: str, value: Any, now: float) -> int:
        """Take ``src``'s reply; returns how many records were new.

        Raises
        ------
        DecodeError
            ``value`` is not a gossip reply or carries too many records or votes (nothing
            is taken then).
        """
        if not isinstance(value, dict) or not isinstance(value.get("digest"), bytes):
            raise DecodeError("gossip reply must be a map with 'digest' (bytes)")
        records, votes = value.get("records", []), value.get("votes", [])
        if not isinstance(records, list) or not isinstance(votes, list):
            raise DecodeError("gossip reply fields 'records' and 'votes' must be lists")
        if len(records) > GOSSIP_MAX_RECORDS or len(votes) > GOSSIP_MAX_VOTES:
            raise DecodeError(
                f"gossip reply with {len(records)} records / {len(votes)} votes, above "
                f"{GOSSIP_MAX_RECORDS} / {GOSSIP_MAX_VOTES}"
            )
        self._hear(src, now)
        parsed: list[Record] = []
        for raw in records:
            try:
                parsed.append(Record.from_wire(raw))
            except ChaosError as exc:
                self._refuse(exc)
        new = self.take(parsed)
        for raw in votes:
            try:
                new += self._take_vote(raw, src, now)
            except ChaosError as exc:
                self._refuse(exc)
        return new

    # -- failure votes -------------------------------------------------------------------------
    def tick(self, now: float) -> int:
        """Renew this party's votes on members it still cannot reach, cast new ones, drop the
        votes that are not current. Returns how many votes this party cast now."""
        view = self.view()
        for rid, (body, sigs) in list(self._votes.items()):
            m = view.members.get(body["subject"])
            for signer, (_sig, at) in list(sigs.items()):
                if now - at >= self.suspect_after_s:
                    del sigs[signer]
            if not sigs or m is None or m.status != ACTIVE or m.incarnation != body["incarnation"]:
                del self._votes[rid]
        if not view.is_active(self.party_id):
            return 0
        cast = 0
        for party, (inc, at) in list(self._heard.items()):
            m = view.members.get(party)
            if m is None or m.status != ACTIVE or m.incarnation != inc:
                self._heard.pop(party)  # over: a later incarnation is heard afresh
                self._missed.pop(party, None)
                continue
            silent = now - at >= self.suspect_after_s
            if not silent or self._missed.get(party, 0) < self.suspect_misses:
                continue
            body = fail_body(self.policy.federation, party, inc)
            rid = record_id_of(body)
            sigs = self._votes.setdefault(rid, (body, {}))[1]
            if self.party_id not in sigs:
                cast += 1
                sig = self._sign(signing_bytes(body))
            else:
                sig = sigs[self.party_id][0]
            sigs[self.party_id] = (sig, now)
            self._assemble(rid)
        return cast

    def suspects(self) -> list[str]:
        """Parties this party holds a vote against (its own or others')."""
        return sorted({body["subject"] for body, _ in self._votes.values()})

    def _vote_values(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for body, sigs in self._votes.values():
            out.extend({"body": body, "signer": s, "sig": sig} for s, (sig, _) in sigs.items())
        return out[:GOSSIP_MAX_VOTES]

    def _take_vote(self, raw: Any, src: str, now: float) -> int:
        """Check one vote (a fail body of an active member, signed by another active member)
        and hold it; returns 1 if that completed a fail record. Only its signer renews it
        (``src`` is the signer): a copy another party passes on keeps the time it was first
        held, so parties cannot keep a vote its signer dropped alive between them."""
        if not isinstance(raw, dict) or set(raw) != {"body", "signer", "sig"}:
            raise DecodeError("gossip vote must be a map of 'body', 'signer', 'sig'")
        signer, sig = raw["signer"], raw["sig"]
        if not isinstance(signer, str) or not isinstance(sig, bytes):
            raise DecodeError("gossip vote fields 'signer' (str) and 'sig' (bytes)")
        body = Record.wire_parts({"body": raw["body"], "sigs": {signer: sig}})[0]
        if body["kind"] != "fail" or body["federation"] != self.policy.federation:
            raise PolicyError("a gossip vote must be a fail body of this federation")
        key = self.policy.keyring.get(signer)
        if key is None or signer == body["subject"] or not self.view().is_active(signer):
            raise UnknownPartyError(f"gossip vote signer {signer!r} may not vote on it")
        m = self.view().members.get(body["subject"])
        if m is None or m.status != ACTIVE or m.incarnation != body["incarnation"]:
            return 0  # about nothing current: dropped
        self.records.cache.verify(key, sig, signing_bytes(body))
        rid = record_id_of(body)
        sigs = self._votes.setdefault(rid, (body, {}))[1]
        held = sigs.get(signer)
        sigs[signer] = (sig, now if src == signer or held is None else held[1])
        return self._assemble(rid)

    def _assemble(self, rid: str) -> int:
        body, sigs = self._votes[rid]
        if len(set(sigs) - {body["subject"]}) < self.policy.failure_quorum:
            return 0
        if self.take([Record(body=body, signatures={s: sig for s, (sig, _) in sigs.items()})]):
            del self._votes[rid]
            return 1
        return 0
