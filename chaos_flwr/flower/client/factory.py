"""Building a party: :func:`default_party_factory` and the pieces it takes up.

From the SuperNode's settings it loads the identity and the verified charter, builds the
protocol peer (a fresh incarnation, or the saved life continued), takes up the party's saved
state and its newest replica, and starts its direct replica server when one is configured.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flwr.app import Context

from chaos_flwr.errors import ChaosError, ConfigError, StoreError, TransportError
from chaos_flwr.flower.client.party import Party
from chaos_flwr.flower.client.registry import take_restart
from chaos_flwr.flower.client.settings import (
    LEFT_MARKER,
    NODE_CHARTER,
    PartySettings,
    party_settings,
)
from chaos_flwr.flower.relay import PeerProtocol
from chaos_flwr.flower.schema import OutgoingLike
from chaos_flwr.localfile import read_local_file
from chaos_flwr.store import ReplicaStore

if TYPE_CHECKING:
    from chaos_flwr.flower.durable import SavedParty

__all__ = ["build_party", "default_party_factory"]

#: Highest incarnation a party takes up from its incarnation file (far below the wire's
#: 2**63 - 1 bound, far above a clock in milliseconds): a larger one is refused on input.
FLOWER_INCARNATION_MAX: int = 2**62


def default_party_factory(context: Context) -> Party:
    """Build the party of a SuperNode from its settings (see :func:`party_settings`).

    A signed party needs the identity, charter and peer layers; where this build lacks one,
    a :class:`~chaos_flwr.errors.ConfigError` says which (nothing falls back to unsigned).
    """
    return build_party(context)


def build_party(context: Context, *, lifetime: str | None = None) -> Party:
    """:func:`default_party_factory`, for the SuperNode process life ``lifetime`` (default:
    the one this process runs under, :func:`~chaos_flwr.flower.durable.lifetime_token`).

    The party daemon builds a party for the SuperNode of the ClientApp that asks it, so a
    saved state continues the same life (incarnation and sequence numbers kept) rather
    than starting a new one at every hand-over between the ClientApp and the daemon.
    """
    life = _lifetime() if lifetime is None else lifetime
    settings = party_settings(context)
    store = (
        ReplicaStore(settings.state_dir / "replicas", keep_rounds=settings.keep_replicas)
        if settings.state_dir
        else None
    )
    if settings.unsigned:
        party = Party(party_id=f"unsigned-{context.node_id}", store=store)
        party.restore()
        return party
    assert settings.key_path is not None and settings.charter_path is not None
    from chaos_flwr.identity import Identity

    ident = Identity.load(settings.key_path)
    saved, same_life = _saved_state(context, settings, str(ident.party_id), life, ident.sign)
    try:
        peer, out = _build_peer(ident, settings, saved, same_life=same_life)
    except ChaosError as exc:  # a saved record that does not verify: start from the relay
        from chaos_flwr.flower.durable import LOG

        LOG.warning("chaos-flwr: saved party state refused (%s); a fresh incarnation", exc)
        saved, same_life = None, False
        peer, out = _build_peer(ident, settings)
    keyring = dict(peer.policy.keyring) if hasattr(peer, "policy") else None
    party = Party(
        party_id=str(ident.party_id),
        peer=peer,
        signer=ident.sign,
        store=store,
        keyring=keyring,
        state_dir=settings.state_dir,
        lifetime=life,
        direct_addr=_direct_server(settings, peer),
    )
    if saved is not None:
        try:
            party.take_up(saved, same_life=same_life)
        except StoreError as exc:
            from chaos_flwr.flower.durable import LOG

            LOG.warning("chaos-flwr: saved party state partly unreadable (%s)", exc)
            party.errors.append(f"StoreError: {exc}")
    party.note_state_file()  # a save by another process from here on is taken up
    if settings.state_dir is not None and (settings.state_dir / LEFT_MARKER).is_file():
        # it left the federation before this restart: it stays out (delete the marker, or use
        # a fresh state directory, to come back as a joiner)
        party.left = True
        return party
    party.restore()
    party.pending.extend(out)
    return party


def _direct_server(settings: PartySettings, peer: Any) -> str:
    """The direct address this party announces (``""``: relay only).

    If nothing listens on ``chaos-direct-addr`` yet, this process serves the party's replica
    store there over its authenticated links (the simulation engine's workers outlive one
    message). If something does, it is the party daemon (``chaos-flwr party``; the deployment
    engine starts a process per message); should that be wrong, joiners fall back to the
    relay, and every byte is checked against the certified digest either way.
    """
    if not settings.direct_addr or settings.state_dir is None:
        return ""
    from chaos_flwr.flower.daemon import party_link
    from chaos_flwr.flower.direct import ensure_server, listening

    if listening(settings.direct_addr):  # the daemon's, or this process's own server
        return settings.direct_addr
    link = party_link(settings.state_dir, peer.identity, peer.charter)
    with contextlib.suppress(TransportError):  # bound since the check: the daemon's
        ensure_server(settings.state_dir, settings.direct_addr, link=link)
    return settings.direct_addr


def _incarnation(settings: PartySettings) -> int:
    """A fresh incarnation for this start of the party: above every earlier one.

    The saved one (``<state-dir>/incarnation``) plus one, and never below the wall clock in
    milliseconds, so a party restarted *without* its disk still comes back above what the
    federation's view holds for it (its old sequence numbers would be refused as replays).
    """
    saved = -1
    path = settings.state_dir / "incarnation" if settings.state_dir is not None else None
    if path is not None and path.exists():
        raw = read_local_file(path, what="incarnation file", error=ConfigError, max_bytes=64)
        try:
            saved = int(raw.decode("ascii").strip())
        except (ValueError, UnicodeDecodeError):  # unreadable: the clock floor still holds
            saved = -1
        if saved >= FLOWER_INCARNATION_MAX:
            raise ConfigError(
                f"{path} holds incarnation {saved}, past the limit {FLOWER_INCARNATION_MAX}: "
                "not written by chaos-flwr; remove it (the party then restarts above the clock)"
            )
    inc = max(saved + 1, int(time.time() * 1000))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{inc}\n")
        except OSError:
            pass  # the clock floor still keeps the next start above this one
    return inc


def _lifetime() -> str:
    from chaos_flwr.flower.durable import lifetime_token

    return lifetime_token()


def _saved_state(
    context: Context,
    settings: PartySettings,
    party_id: str,
    lifetime: str,
    seal: Callable[[bytes], bytes] | None = None,
) -> tuple[SavedParty | None, bool]:
    """The party's saved state (a bad or foreign-sealed file is discarded with a warning) and
    whether this process continues the life it was saved in (same SuperNode process, no
    forget_party)."""
    restarted = take_restart(context)
    if settings.state_dir is None:
        return None, False
    from chaos_flwr.flower.durable import load_or_discard

    saved = load_or_discard(settings.state_dir, party_id, seal=seal)
    same = saved is not None and not restarted and saved.lifetime == lifetime
    return saved, same


def _own_sealed(saved: SavedParty, peer: Any) -> bool:
    """Whether ``saved`` is this party's own sealed file (its seal checked by
    :func:`~chaos_flwr.flower.durable.load`), saved under the charter ``peer`` runs under:
    then its records need no signature checks (:mod:`chaos_flwr.flower.durable`)."""
    return saved.sealed and bool(saved.charter) and saved.charter == peer.federation_tag


def _build_peer(
    ident: Any, settings: PartySettings, saved: SavedParty | None = None, *, same_life: bool = False
) -> tuple[PeerProtocol, list[OutgoingLike]]:
    """Build the protocol peer from the identity and the verified charter.

    The ``saved`` records and replay state are taken up: from a file sealed by this party
    under this charter without re-verifying their signatures (:func:`_own_sealed`), else
    re-verified one by one (a bad one raises). When ``same_life`` (the life it was saved
    in, continued in a new process) the peer also keeps the saved incarnation and sequence
    number and nothing is bootstrapped.
    Otherwise (a start or a real restart) it gets a fresh incarnation; a founder bootstraps
    the federation's records and a non-founder asks for a sponsored join when it first hears
    from the relay (:meth:`Party.process`).
    """
    try:
        from chaos_flwr.charter import load_charter
    except ImportError as exc:  # the charter layer has not landed in this build
        raise ConfigError(
            f"node_config '{NODE_CHARTER}' is set but this chaos-flwr build has no charter layer "
            "(chaos_flwr.charter); a signed party cannot be built without it"
        ) from exc
    from chaos_flwr.peer import Peer

    assert settings.charter_path is not None
    try:
        charter = load_charter(settings.charter_path)
    except ChaosError as exc:
        raise ConfigError(f"node_config '{NODE_CHARTER}': {exc}") from exc
    if saved is not None and same_life:
        peer = Peer(
            ident, charter, incarnation=saved.incarnation, seq=saved.seq, replay_state=saved.replay
        )
        peer.load_records(saved.records, time.time(), sealed=_own_sealed(saved, peer))
        return peer, []
    replay = saved.replay if saved is not None else None
    peer = Peer(ident, charter, incarnation=_incarnation(settings), replay_state=replay)
    if saved is not None:
        peer.load_records(saved.records, time.time(), sealed=_own_sealed(saved, peer))
    out: list[OutgoingLike] = []
    if charter.is_founder(ident.party_id):
        out.extend(peer.bootstrap(time.time()))
    return peer, out


#: Parties of this process by (enable() call number, run id, node id). Module-level, not on the
