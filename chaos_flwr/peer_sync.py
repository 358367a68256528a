"""Heartbeats and anti-entropy: signs of life that carry the record digest, and the repair.

Heartbeats (``hb``) go to the parties that watch this one, its neighbours and one more member in
round-robin order; each carries the digest of the record-id set and the declared resources. A
party whose digest differs is sent an inventory (``inv``, at most once per
``PEER_ANTI_ENTROPY_INTERVAL_S`` per party), and the two sides exchange the records the other
lacks (``rec``, asked for with ``fetch``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .defaults import PEER_ANTI_ENTROPY_INTERVAL_S
from .errors import DecodeError
from .membership import View
from .monitor import Resources
from .peer_core import Outgoing, PeerCore
from .wire import Envelope

__all__ = ["AntiEntropy"]


class AntiEntropy:
    """Sending heartbeats and repairing record sets that differ.

    ``peer`` is the party whose heartbeats it sends and whose record set it repairs; it keeps
    the round-robin position and when it last offered each party an inventory.
    """

    def __init__(self, peer: PeerCore) -> None:
        self._peer = peer
        self._inv_sent: dict[str, float] = {}
        self._rr = 0

    def heartbeat(self, targets: Iterable[str], view: View, now: float) -> list[Outgoing]:
        """One heartbeat to ``targets`` and the next member in round-robin order."""
        peer = self._peer
        dests = set(targets)
        pool = sorted((set(view.active()) | set(peer._founders)) - {peer.party_id})
        if pool:
            self._rr = (self._rr + 1) % len(pool)
            dests.add(pool[self._rr])
        res = peer._resources
        payload: dict[str, Any] = {
            "rd": peer.records.digest(),
            "res": None
            if res is None
            else [float(res.compute_speed), int(res.free_memory_bytes), float(res.at)],
        }
        return peer._broadcast(dests, "hb", payload, now)

    def on_hb(self, env: Envelope, now: float) -> list[Outgoing]:
        """A heartbeat: note the sender's resources; offer an inventory if digests differ."""
        peer = self._peer
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
            peer.monitor.declare(env.sender, declared)
        if rd == peer.records.digest():
            return []
        last = self._inv_sent.get(env.sender, -math.inf)
        if now - last < PEER_ANTI_ENTROPY_INTERVAL_S:
            return []
        self._inv_sent[env.sender] = now
        return [peer._send(env.sender, "inv", {"ids": sorted(peer.records.ids())}, now)]

    def offer(self, other: str, now: float) -> list[Outgoing]:
        """Offer ``other`` this party's inventory now (a view divergence was seen; at most once
        per ``PEER_ANTI_ENTROPY_INTERVAL_S`` per party, like a differing heartbeat's)."""
        peer = self._peer
        last = self._inv_sent.get(other, -math.inf)
        if other == peer.party_id or now - last < PEER_ANTI_ENTROPY_INTERVAL_S:
            return []
        self._inv_sent[other] = now
        return [peer._send(other, "inv", {"ids": sorted(peer.records.ids())}, now)]

    def on_inv(self, env: Envelope, now: float) -> list[Outgoing]:
        """An inventory: send the records it lacks, fetch those this party lacks."""
        peer = self._peer
        ids = env.payload.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise DecodeError("inventory field 'ids' must be a list of record ids")
        theirs = set(ids)
        mine = peer.records.ids()
        out: list[Outgoing] = []
        give = [r for rid in sorted(mine - theirs) if (r := peer.records.get(rid)) is not None]
        if give:
            out.extend(peer._records_to(env.sender, give, now))
        want = sorted(theirs - mine)
        if want:
            out.append(peer._send(env.sender, "fetch", {"ids": want}, now))
        return out

    def on_fetch(self, env: Envelope, now: float) -> list[Outgoing]:
        """A fetch: send the asked-for records this party holds."""
        peer = self._peer
        ids = env.payload.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise DecodeError("fetch field 'ids' must be a list of record ids")
        give = [r for rid in ids if (r := peer.records.get(rid)) is not None]
        return peer._records_to(env.sender, give, now) if give else []
