"""Failure votes: suspecting a watched party, voting, and assembling the fail record at quorum.

A suspect's watchers each sign the same fail body (no timestamp) and send it to the others
(``vote``). Every watcher that holds ``failure_quorum`` votes assembles the record and applies
it; the lowest-id signer of the record it assembled broadcasts it to every active member. This
party's votes are re-sent every ``PEER_RETRY_INTERVAL_S`` while the suspect's incarnation is
still active and the record not held.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .defaults import PEER_RETRY_INTERVAL_S
from .errors import PolicyError
from .membership import ACTIVE, Record, View, fail_body, record_id_of, signing_bytes
from .peer_core import Outgoing, PeerCore
from .wire import Envelope

__all__ = ["FailureVotes", "Vote"]


@dataclass
class Vote:
    """The votes held for one fail body, and whether (and when) this party cast its own."""

    body: dict[str, Any]
    sigs: dict[str, bytes]
    mine: bool
    sent_at: float


class FailureVotes:
    """Casting, collecting and assembling the votes that declare a party failed.

    ``peer`` is the watcher it votes for; ``pending`` is that peer's table of the votes held
    per fail record id (its own and other watchers'), kept up to date here.
    """

    def __init__(self, peer: PeerCore, pending: dict[str, Vote]) -> None:
        self._peer = peer
        self._pending = pending

    def suspect(self, suspects: Iterable[str], view: View, now: float) -> list[Outgoing]:
        """Vote against each suspect that ``view`` holds as an active member."""
        out: list[Outgoing] = []
        federation = self._peer.policy.federation
        for suspect in suspects:
            m = view.members.get(suspect)
            if m is None or m.status != ACTIVE:
                continue
            out.extend(self._vote(fail_body(federation, suspect, m.incarnation), now))
        return out

    def on_vote(self, env: Envelope, now: float) -> list[Outgoing]:
        """Another watcher's vote: hold it, and assemble the record at quorum."""
        peer = self._peer
        body, sig = peer._body_and_sig(env, "fail")
        if body["subject"] == env.sender:
            raise PolicyError("a party cannot vote for its own failure")
        rid = record_id_of(body)
        if rid in peer.records:
            return []
        peer.records.cache.verify(peer._keyring[env.sender], sig, signing_bytes(body))
        vote = self._pending.get(rid)
        if vote is None:
            vote = self._pending[rid] = Vote(body=body, sigs={}, mine=False, sent_at=now)
        vote.sigs[env.sender] = sig
        return self._maybe_assemble(rid, now)

    def retries(self, now: float) -> list[Outgoing]:
        """Re-send this party's due votes; drop those whose suspect incarnation is over."""
        peer = self._peer
        out: list[Outgoing] = []
        for rid, vote in list(self._pending.items()):
            subject = peer.records.member(vote.body["subject"])
            if (
                subject is None
                or subject.status != ACTIVE
                or subject.incarnation != vote.body["incarnation"]
            ):
                del self._pending[rid]  # that incarnation is over (or unknown): nothing to vote on
                continue
            if peer.is_member and vote.mine and now - vote.sent_at >= PEER_RETRY_INTERVAL_S:
                vote.sent_at = now
                out.extend(
                    peer._broadcast(
                        self._targets(vote.body["subject"]),
                        "vote",
                        {"body": vote.body, "sig": vote.sigs[peer.party_id]},
                        now,
                    )
                )
        return out

    def _targets(self, subject: str) -> set[str]:
        """Where votes about ``subject`` go: its watchers (they assemble the fail record)."""
        peer = self._peer
        view = peer.records.view()
        return set(view.watchers(subject, peer.policy.failure_quorum)) - {subject}

    def _vote(self, body: dict[str, Any], now: float) -> list[Outgoing]:
        peer = self._peer
        rid = record_id_of(body)
        if rid in peer.records:
            return []
        vote = self._pending.get(rid)
        if vote is None:
            vote = self._pending[rid] = Vote(body=body, sigs={}, mine=True, sent_at=now)
        vote.mine = True
        vote.sent_at = now
        sig = vote.sigs.get(peer.party_id)
        if sig is None:
            sig = vote.sigs[peer.party_id] = peer._sign(signing_bytes(body))
        out = peer._broadcast(
            self._targets(body["subject"]), "vote", {"body": body, "sig": sig}, now
        )
        out.extend(self._maybe_assemble(rid, now))
        return out

    def _maybe_assemble(self, rid: str, now: float) -> list[Outgoing]:
        """Assemble the fail record once a quorum of votes is held.

        Every party holding the quorum applies the record; the lowest-id signer of the record it
        assembled also broadcasts it to all active members (one broadcast in the common case;
        anti-entropy covers the rare case where that signer is gone).
        """
        peer = self._peer
        vote = self._pending.get(rid)
        if vote is None:
            return []
        voters = set(vote.sigs) - {vote.body["subject"]}
        if len(voters) < peer.policy.failure_quorum:
            return []
        record = Record(body=vote.body, signatures=dict(vote.sigs))
        targets = set(peer.records.active()) - {vote.body["subject"]}
        if not peer._apply([record], now) or min(voters) != peer.party_id:
            return []
        # The broadcast carries the quorum: this party's envelope and k - 1 other votes.
        others = sorted(voters - {peer.party_id})[: peer.policy.failure_quorum - 1]
        quorum = Record(
            body=vote.body,
            signatures={peer.party_id: vote.sigs[peer.party_id]}
            | {v: vote.sigs[v] for v in others},
        )
        return peer._share(targets, quorum, now)
