"""Links between two members: connect (a two-party link_up) and disconnect (a one-party link_down).

The initiator of a connect signs a link_up body for the next epoch and sends it (``link_req``);
the other end countersigns it only for the epoch after the one it holds, then applies and
broadcasts the complete record. Either end takes a link
down alone. A pending request is re-sent every ``PEER_RETRY_INTERVAL_S`` until its record is
held, and dropped once either end is no longer an active member.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .defaults import PEER_RETRY_INTERVAL_S
from .errors import PolicyError, StaleIncarnationError
from .membership import ACTIVE, UP, link_body, record_id_of, signing_bytes
from .peer_core import Outgoing, PeerCore
from .wire import Envelope

__all__ = ["LinkNegotiation", "PendingLink"]


@dataclass
class PendingLink:
    """A link_up this party signed and asked ``other`` to countersign."""

    body: dict[str, Any]
    sig: bytes
    other: str
    sent_at: float


class LinkNegotiation:
    """Both ends of connect-link and the one end of disconnect-link.

    ``peer`` is the end it acts for; ``pending`` is that peer's table of the link requests it
    made, by record id (kept up to date here); ``accept_link`` is asked about each request
    another member makes (``None``: accept every active member).
    """

    def __init__(
        self,
        peer: PeerCore,
        pending: dict[str, PendingLink],
        accept_link: Callable[[str], bool] | None,
    ) -> None:
        self._peer = peer
        self._pending = pending
        self._accept_link = accept_link

    def connect(self, other: str, now: float) -> list[Outgoing]:
        """Sign a link_up with ``other`` and ask it to countersign (see ``Peer.connect``)."""
        peer = self._peer
        other_m = peer._active_other(other, "connect")
        link = peer.records.link(peer.party_id, other)
        epoch = link.epoch + 1 if link is not None else 1
        body = link_body(
            "link_up",
            peer.policy.federation,
            (peer.party_id, peer.incarnation),
            (other, other_m.incarnation),
            epoch,
        )
        sig = peer._sign(signing_bytes(body))
        self._pending[record_id_of(body)] = PendingLink(body, sig, other, now)
        return [peer._send(other, "link_req", {"body": body, "sig": sig}, now)]

    def disconnect(self, other: str, now: float) -> list[Outgoing]:
        """Sign and broadcast a link_down for the link to ``other`` (see ``Peer.disconnect``)."""
        peer = self._peer
        link = peer.records.link(peer.party_id, other)
        if link is None or link.state != UP or other == peer.party_id:
            raise PolicyError(f"there is no up link between {peer.party_id} and {other!r}")
        end_self = (peer.party_id, link.inc_a if link.a == peer.party_id else link.inc_b)
        end_other = (other, link.inc_b if link.a == peer.party_id else link.inc_a)
        body = link_body("link_down", peer.policy.federation, end_self, end_other, link.epoch)
        targets = peer.records.active()
        record, out = peer._broadcast_own(targets, body, {}, now, first=other)
        peer._apply([record], now, validated=True)
        return out

    def on_link_req(self, env: Envelope, now: float) -> list[Outgoing]:
        """The other end asks for a link: countersign, apply and broadcast the record."""
        peer = self._peer
        body, sig = peer._body_and_sig(env, "link_up")
        if {body["a"], body["b"]} != {peer.party_id, env.sender}:
            raise PolicyError("link request fields 'a'/'b' are not the sender and this party")
        inc_self = body["inc_a"] if body["a"] == peer.party_id else body["inc_b"]
        inc_other = body["inc_b"] if body["a"] == peer.party_id else body["inc_a"]
        if inc_self != peer.incarnation or inc_other != env.incarnation:
            raise StaleIncarnationError("link request names incarnations that are not current")
        rid = record_id_of(body)
        if rid in peer.records:
            record = peer.records.get(rid)
            return peer._records_to(env.sender, [record], now) if record is not None else []
        peer._active_other(env.sender, "accept a link")
        held = peer.records.link(peer.party_id, env.sender)
        expected = held.epoch + 1 if held is not None else 1
        if body["epoch"] != expected:
            # Only the next epoch: a peer never countersigns a jump (a flooder could otherwise
            # spend this party's record budget on link_ups at ever higher epochs). A request
            # made on an older view is refused and retried once the views agree.
            raise PolicyError(
                f"link request for epoch {body['epoch']}; this party holds the link at epoch "
                f"{expected - 1} and countersigns only epoch {expected}"
            )
        if self._accept_link is not None and not self._accept_link(env.sender):
            raise PolicyError(f"this party does not accept a link with {env.sender}")
        peer.records.cache.verify(peer._keyring[env.sender], sig, signing_bytes(body))
        targets = peer.records.active()
        record, out = peer._broadcast_own(targets, body, {env.sender: sig}, now, first=env.sender)
        peer._apply([record], now, validated=True)
        return out

    def retries(self, now: float) -> list[Outgoing]:
        """Re-send the link requests that are due; drop those whose other end is gone."""
        peer = self._peer
        out: list[Outgoing] = []
        for rid, link in list(self._pending.items()):
            other = peer.records.member(link.other)
            moot = peer.records.covers(link.body)  # held, or superseded before it arrived
            if moot or not peer.is_member or other is None or other.status != ACTIVE:
                del self._pending[rid]  # an end is gone or the link moved on: the request is moot
                continue
            if now - link.sent_at < PEER_RETRY_INTERVAL_S:
                continue
            link.sent_at = now
            out.append(
                peer._send(link.other, "link_req", {"body": link.body, "sig": link.sig}, now)
            )
        return out
