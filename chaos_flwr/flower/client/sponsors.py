"""A joiner asks its sponsors' daemons, over their direct links, to countersign its join.

A join request that goes through the relay reaches its sponsors with their next message; while
their SuperNodes train, none comes. Their party daemons serve their links meanwhile and
countersign a charter party's own join (:mod:`chaos_flwr.countersign`). So when a joiner that
is not yet a member starts a pull from holders whose signed endpoints it verified, it first
asks them all at once for their signatures (:func:`ask_sponsors`): with
``admission.sponsors_required`` of them its join record is complete, applied, and handed to its
sponsors (``join_done`` envelopes, through the relay as any); each sponsor whose own signature
completed the record holds it already, so it serves the joiner's pull at once. With more than
one signature required, the complete record goes to each of them again in a second call.

Everything is bounded by :data:`FLOWER_COUNTERSIGN_S` (the calls run in a worker thread:
:func:`~chaos_flwr.flower.fetch.run_links`); a sponsor that refuses, is not
reachable or does not answer in time is noted in the party's errors and the pull goes on (its
donors then refuse a non-member: it falls back as any failed direct pull does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from chaos_flwr import codec
from chaos_flwr.countersign import countersign_request
from chaos_flwr.errors import ChaosError, DecodeError, TransportError
from chaos_flwr.flower.fetch import LINKS_HUNG, run_links
from chaos_flwr.membership import EndpointInfo
from chaos_flwr.transport.links import LinkAccess, LinkDialer

__all__ = ["FLOWER_COUNTERSIGN_S", "ask_sponsors"]

#: Bound (seconds) of a joiner's countersign requests to its sponsors' daemons (all at once;
#: a second call, when more than one signature is required, shares it).
FLOWER_COUNTERSIGN_S: float = 10.0
#: Largest countersign reply taken (a signature in a codec map).
_REPLY_BYTES = 1024


def ask_sponsors(
    party: Any,
    link: LinkAccess,
    sponsors: Sequence[str],
    *,
    timeout_s: float = FLOWER_COUNTERSIGN_S,
) -> list[str]:
    """Ask ``sponsors`` (members whose signed endpoints ``link``'s view holds) to countersign
    the join ``party`` asked for; take each signature (``Peer.take_join_sig``) and queue what
    that sends in ``party.pending``. Returns the sponsors whose signature was taken (none when
    the party has no pending join)."""
    peer = party.peer
    pending = peer.pending_join() if peer is not None else None
    if pending is None:
        return []
    body, sigs = pending
    eps: dict[str, EndpointInfo] = {}
    for sponsor in sponsors:
        try:
            eps[sponsor] = link.endpoint(sponsor)
        except ChaosError as exc:
            party.errors.append(f"countersign of {sponsor} not asked ({type(exc).__name__}: {exc})")
    if not eps:
        return []
    clock = party.clock
    until = clock() + timeout_s
    got = _call_all(link, eps, codec.encode(countersign_request(body, sigs)), timeout_s)
    taken: dict[str, bytes] = {}
    for sponsor, raw in got.items():
        try:
            sig = _signature(raw)
            party.pending.extend(peer.take_join_sig(sponsor, sig, clock()))
        except ChaosError as exc:
            party.errors.append(f"countersign of {sponsor} refused ({type(exc).__name__}: {exc})")
            continue
        taken[sponsor] = sig
    left = until - clock()
    if peer.policy.sponsors_required > 1 and peer.is_member and left > 0:
        # each signer saw an incomplete record: hand them the complete one to hold
        full = codec.encode(countersign_request(body, {**sigs, **taken}))
        _call_all(link, {s: eps[s] for s in taken}, full, left)
    return sorted(taken)


def _signature(raw: bytes | ChaosError) -> bytes:
    if isinstance(raw, ChaosError):
        raise raw
    value = codec.decode(raw, max_bytes=_REPLY_BYTES)
    sig = value.get("sig") if isinstance(value, dict) else None
    if not isinstance(sig, bytes):
        raise DecodeError("a countersign reply must be {sig: bytes}")
    return sig


def _call_all(
    link: LinkAccess, eps: Mapping[str, EndpointInfo], request: bytes, timeout_s: float
) -> dict[str, bytes | ChaosError]:
    """``request`` to every endpoint at once, within ``timeout_s``: each reply or error (a
    :class:`~chaos_flwr.errors.TransportError` for every sponsor when the calls hung, and for
    each one without an answer when they broke)."""
    got: dict[str, bytes | ChaosError] = {}

    async def one(dialer: LinkDialer, sponsor: str, ep: EndpointInfo) -> None:
        try:
            got[sponsor] = await dialer.request(
                ep.address, ep.cert, request, timeout=timeout_s, party=sponsor
            )
        except ChaosError as exc:
            got[sponsor] = exc

    async def main() -> None:
        dialer = LinkDialer(link.creds, max_reply_bytes=_REPLY_BYTES)
        try:
            await asyncio.gather(*(one(dialer, s, ep) for s, ep in eps.items()))
        finally:
            await dialer.close()

    why = run_links(main, timeout_s, "chaos-countersign")
    if why == LINKS_HUNG:  # nothing a worker left behind writes is read
        return {s: TransportError(f"countersign calls: {why}") for s in eps}
    return {s: got.get(s, TransportError(f"countersign calls: {why or 'no answer'}")) for s in eps}
