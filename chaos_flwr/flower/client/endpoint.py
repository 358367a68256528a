"""A party's direct links on Flower: the endpoint it signs, and the access it dials with.

A signed party configured with ``chaos-direct-addr`` announces that address in a signed
endpoint record (:meth:`chaos_flwr.peer.Peer.announce_endpoint`) once it is an active member,
and again whenever its address or link certificate changes: the record rides out with its next
reply and converges through the relay like every other record, and a donor is dialled only at
the endpoint its verified record names. Every signed party (a donor or not) dials with the same
credentials (:mod:`chaos_flwr.flower.linkfile`) and its own view
(:class:`~chaos_flwr.transport.links.LinkAccess`), so links are mutually authenticated and
encrypted and a donor serves only members active in its view.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from chaos_flwr.errors import ChaosError
from chaos_flwr.flower.relay import PeerProtocol
from chaos_flwr.flower.schema import OutgoingLike

if TYPE_CHECKING:
    from chaos_flwr.transport.links import LinkAccess
    from chaos_flwr.transport.tls import LinkCredentials

__all__ = ["LinkedParty", "announce", "credentials", "link_access"]


class LinkedParty(Protocol):
    """What this module uses of a :class:`~chaos_flwr.flower.client.party.Party`."""

    peer: PeerProtocol | None
    state_dir: Path | None
    link_creds: LinkCredentials | None
    direct_addr: str
    left: bool
    errors: list[str]


def credentials(party: LinkedParty) -> LinkCredentials | None:
    """The party's link credentials (``None`` for an unsigned party); made once per process."""
    peer: Any = party.peer
    if peer is None or not hasattr(peer, "identity") or not hasattr(peer, "policy"):
        return None
    if party.link_creds is None:
        from chaos_flwr.flower.linkfile import link_credentials

        party.link_creds = link_credentials(party.state_dir, peer.identity, peer.policy.federation)
    return party.link_creds


def link_access(party: LinkedParty) -> LinkAccess | None:
    """What the party dials donors with: its credentials, policy and live view (``None``:
    unsigned, or the credentials cannot be had; the pull then uses the relay only)."""
    try:
        creds = credentials(party)
    except ChaosError as exc:
        party.errors.append(f"{type(exc).__name__}: {exc}")
        return None
    if creds is None:
        return None
    from chaos_flwr.transport.links import LinkAccess

    peer: Any = party.peer
    return LinkAccess(creds, peer.policy, peer.view)


def announce(party: LinkedParty, now: float) -> list[OutgoingLike]:
    """The party's endpoint record when its view lacks the current one (nothing otherwise)."""
    peer: Any = party.peer
    if not party.direct_addr or peer is None or party.left or not getattr(peer, "is_member", 0):
        return []
    try:
        creds = credentials(party)
        if creds is None:
            return []
        return list(peer.announce_endpoint(party.direct_addr, creds.serve_cert_der, now))
    except ChaosError as exc:
        party.errors.append(f"{type(exc).__name__}: {exc}")
        return []
