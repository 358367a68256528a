"""Joins and sponsorship: a joiner collecting countersignatures, and a sponsor answering it.

The joiner signs its join body and asks its sponsors (``join_req``); a sponsor countersigns and,
if that completes the record, applies, broadcasts and syncs it to the joiner, otherwise it
returns its signature (``join_sig``). The joiner assembles the record once it holds
``sponsors_required`` signatures and hands it to its sponsors (``join_done``). Pending requests
are re-sent every ``PEER_RETRY_INTERVAL_S`` until a sponsor's sync shows the join has landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .defaults import PEER_RETRY_INTERVAL_S
from .errors import DecodeError, PolicyError, UnknownPartyError
from .membership import ACTIVE, Record, join_body, record_id_of, signing_bytes, validate_record
from .peer_core import Outgoing, PeerCore
from .wire import Envelope

__all__ = ["JoinNegotiation", "PendingJoin"]


@dataclass
class PendingJoin:
    """A join this party asked its sponsors to countersign, until they have synced it."""

    body: dict[str, Any]
    sigs: dict[str, bytes]
    sponsors: tuple[str, ...]
    sent_at: float
    done: Record | None = None
    synced: bool = False


class JoinNegotiation:
    """Both sides of a join: the joiner's request and retries, and the sponsor's answers.

    ``peer`` is the party it acts for (as joiner or as sponsor); ``pending`` is that peer's
    table of its own join requests by record id, which this object keeps up to date.
    """

    def __init__(self, peer: PeerCore, pending: dict[str, PendingJoin]) -> None:
        self._peer = peer
        self._pending = pending

    def request(self, now: float, sponsors: Sequence[str]) -> list[Outgoing]:
        """Sign this party's join and ask ``sponsors`` for theirs (see ``Peer.request_join``)."""
        peer = self._peer
        asked = tuple(sorted(set(sponsors)))
        if not asked or peer.party_id in asked:
            raise PolicyError("'sponsors' must name at least one other party")
        if peer.is_member:
            raise PolicyError(f"party {peer.party_id} is already an active member")
        peer._bump_incarnation()
        self._pending.clear()  # a new request supersedes any earlier one
        body = join_body(peer.policy.federation, peer.party_id, peer.incarnation, now)
        rid = record_id_of(body)
        sig = peer._sign(signing_bytes(body))
        pending = PendingJoin(body=body, sigs={peer.party_id: sig}, sponsors=asked, sent_at=now)
        self._pending[rid] = pending
        if peer.policy.sponsors_required == 0:
            pending.done = Record(body=body, signatures=dict(pending.sigs))
            peer._apply([pending.done], now)
            return peer._broadcast(asked, "join_done", {"record": pending.done.to_wire()}, now)
        return peer._broadcast(asked, "join_req", {"body": body, "sig": sig}, now)

    def synced_by(self, sender: str) -> None:
        """``sender`` sent records: if it sponsors a join that is now held, that join landed."""
        for rid, join in self._pending.items():
            if sender in join.sponsors and rid in self._peer.records:
                join.synced = True

    def retries(self, now: float) -> list[Outgoing]:
        """Re-send every pending join that is due; forget those the sponsors have synced."""
        peer = self._peer
        out: list[Outgoing] = []
        for rid, join in list(self._pending.items()):
            if join.synced:
                del self._pending[rid]
                continue
            if now - join.sent_at < PEER_RETRY_INTERVAL_S:
                continue
            join.sent_at = now
            if join.done is not None:
                out.extend(
                    peer._broadcast(
                        join.sponsors, "join_done", {"record": join.done.to_wire()}, now
                    )
                )
            else:
                missing = [s for s in join.sponsors if s not in join.sigs]
                sig = join.sigs[peer.party_id]
                out.extend(
                    peer._broadcast(missing, "join_req", {"body": join.body, "sig": sig}, now)
                )
        return out

    def on_join_req(self, env: Envelope, now: float) -> list[Outgoing]:
        """A joiner asks this party to sponsor it: countersign (and complete, if it can)."""
        peer = self._peer
        body, sig = peer._body_and_sig(env, "join")
        if body["subject"] != env.sender or body["incarnation"] != env.incarnation:
            raise PolicyError("join request field 'subject'/'incarnation' is not the sender's")
        if not peer.is_member:
            raise PolicyError(f"party {peer.party_id} is not an active member; cannot sponsor")
        known = peer.records.member(env.sender)
        if known is not None and known.incarnation >= env.incarnation:
            if known.status == ACTIVE:
                # Already joined: just sync the joiner again.
                return peer._records_to(env.sender, list(peer.records), now)
            raise PolicyError(
                f"incarnation {known.incarnation} of {env.sender} has {known.status}; rejoin "
                "with a higher 'incarnation'"
            )
        rid = record_id_of(body)
        peer.records.cache.verify(peer._keyring[env.sender], sig, signing_bytes(body))
        mine = peer._sign(signing_bytes(body))
        record = Record(body=body, signatures={env.sender: sig, peer.party_id: mine})
        try:
            validate_record(record, peer.policy, peer.records.cache)
        except PolicyError:
            return [peer._send(env.sender, "join_sig", {"id": rid, "sig": mine}, now)]
        return self._sponsor_apply(record, env.sender, now)

    def on_join_sig(self, env: Envelope, now: float) -> list[Outgoing]:
        """A sponsor's countersignature: assemble the record once enough are held."""
        rid = env.payload.get("id")
        sig = env.payload.get("sig")
        if not isinstance(rid, str) or not isinstance(sig, bytes):
            raise DecodeError("join signature fields 'id' (str) and 'sig' (bytes) are required")
        join = self._pending.get(rid)
        if join is None or join.done is not None:
            return []
        return self._take(join, env.sender, sig, now)

    def pending_request(self) -> tuple[dict[str, Any], dict[str, bytes]] | None:
        """The pending join's body and signatures, while it is not complete."""
        for join in self._pending.values():
            if join.done is None:
                return join.body, dict(join.sigs)
        return None

    def take_sig(self, sponsor: str, sig: bytes, now: float) -> list[Outgoing]:
        """``sponsor``'s signature of this party's join, asked for some other way than a
        ``join_req`` (so ``sponsor`` counts as asked); checked even when the join is complete
        already (nothing more is sent then)."""
        join = next(iter(self._pending.values()), None)  # a new request replaces the old
        if join is None:
            raise PolicyError(f"party {self._peer.party_id} has no join pending")
        if sponsor not in self._peer._keyring:
            raise UnknownPartyError(f"{sponsor!r} is no charter party; it sponsors nothing")
        join.sponsors = tuple(sorted({*join.sponsors, sponsor}))
        return self._take(join, sponsor, sig, now)

    def _take(self, join: PendingJoin, sender: str, sig: bytes, now: float) -> list[Outgoing]:
        peer = self._peer
        if sender not in join.sponsors:
            raise PolicyError(f"party {sender} was not asked to sponsor this join")
        peer.records.cache.verify(peer._keyring[sender], sig, signing_bytes(join.body))
        join.sigs[sender] = sig
        if join.done is not None or len(join.sigs) - 1 < peer.policy.sponsors_required:
            return []
        join.done = Record(body=join.body, signatures=dict(join.sigs))
        peer._apply([join.done], now)
        signed = [s for s in join.sponsors if s in join.sigs]
        return peer._broadcast(signed, "join_done", {"record": join.done.to_wire()}, now)

    def on_join_done(self, env: Envelope, now: float) -> list[Outgoing]:
        """A joiner hands over its complete join record: apply, broadcast and sync it."""
        peer = self._peer
        records = peer._check_records([env.payload.get("record")])
        record = records[0] if records else None
        if record is None:
            value = env.payload.get("record")
            existing = Record.from_wire(value)
            if existing.kind != "join" or existing.subject != env.sender:
                raise PolicyError("join_done must carry the sender's own join record")
            return peer._records_to(env.sender, list(peer.records), now)
        if record.kind != "join" or record.subject != env.sender:
            raise PolicyError("join_done must carry the sender's own join record")
        if not peer.is_member:
            raise PolicyError(f"party {peer.party_id} is not an active member; cannot sponsor")
        return self._sponsor_apply(record, env.sender, now)

    def _sponsor_apply(self, record: Record, joiner: str, now: float) -> list[Outgoing]:
        peer = self._peer
        targets = set(peer.records.active()) - {joiner}
        new = peer._apply([record], now)
        out: list[Outgoing] = []
        if new:
            out.extend(peer._share(targets, record, now))
        out.extend(peer._records_to(joiner, list(peer.records), now))
        return out
