"""A member's automatic links: :func:`links_to_ask`.

Every active member links up with every other it has no live link with (the lower id asks;
a link someone took down stays down). Links are what :meth:`Party.disconnect` drops and what
the monitor's failure votes follow.
"""

from __future__ import annotations

from typing import Any

from chaos_flwr.errors import ChaosError
from chaos_flwr.flower.schema import OutgoingLike

__all__ = ["links_to_ask"]

#: (other party, its incarnation, this party's incarnation) of a link already asked for.
LinkAsked = tuple[str, int, int]


def links_to_ask(
    peer: Any, party_id: str, asked: set[LinkAsked], errors: list[str], now: float
) -> list[OutgoingLike]:
    """The link requests ``peer`` (a member's protocol peer) sends now.

    ``asked`` holds the links asked for before; it is updated in place: entries under
    incarnations that are gone (they can never match again) are dropped, new asks added, so
    it stays bounded by the view. A refused ask is noted in ``errors`` and not retried under
    the same incarnations.
    """
    records = getattr(peer, "records", None)
    connect = getattr(peer, "connect", None)
    if records is None or connect is None:
        return []
    mine = getattr(peer, "incarnation", 0)
    stale = {
        k for k in asked if k[2] != mine or getattr(records.member(k[0]), "incarnation", 0) != k[1]
    }
    asked -= stale
    out: list[OutgoingLike] = []
    for other in records.view().active():
        if other <= party_id:
            continue
        link = records.link(party_id, other)
        if link is not None and (link.live or link.state != "up"):
            continue
        key = (other, getattr(records.member(other), "incarnation", 0), mine)
        if key in asked:
            continue
        asked.add(key)
        try:
            out.extend(connect(other, now))
        except ChaosError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return out
