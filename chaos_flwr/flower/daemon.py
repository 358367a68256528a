"""The party daemon: one long-lived process per institution that serves its replicas over
authenticated direct links (``chaos-flwr party``).

Flower's deployment engine starts a ClientApp process per message, so whatever must outlive a
message runs beside the SuperNode, in this process::

    chaos-flwr party --key inst1.key --charter charter.yaml \\
        --state-dir /var/lib/chaos/inst1 --listen 0.0.0.0:9300

The SuperNode's ``node_config`` names the same key, charter and state directory, and sets
``chaos-direct-addr`` to the address other institutions reach this one at (e.g.
``inst1.example.org:9300``): the ClientApp signs that address and the daemon's serve
certificate into the party's endpoint record (:mod:`chaos_flwr.flower.client.endpoint`).
Both processes share the party's link credentials through the state directory
(:mod:`chaos_flwr.flower.linkfile`).

What the daemon serves, and to whom: byte ranges and manifests of the replicas in
``<state-dir>/replicas`` (only a ``(round, digest)`` it holds), over mutual TLS, to a peer
whose certificate is bound to a charter key and that is an active member of the party's view,
and to a restarted ServerApp while the party's grant holds (:mod:`chaos_flwr.flower.grant`).
The view is the one the party saved last (``<state-dir>/party.state``, checked
against the party's own seal), read again whenever that file changes (:class:`SavedView`);
until one exists it serves nobody. Limits (concurrent requests, request size, reply bytes per
request and per peer) are the named ``LINK_*`` defaults. It stops on SIGTERM or SIGINT and
logs its start, each change of the view it serves by, and its totals at exit.

Its link certificates are made (or renewed, when they expire within a day) when it starts,
and are valid for :data:`~chaos_flwr.defaults.LINK_CERT_VALIDITY_S` (30 days): restart it
within that time (the systemd unit in ``docs/deployment.md`` does, weekly).

It also gossips (:mod:`chaos_flwr.flower.gossiper`): every few seconds it asks a few
members' daemons for the records it lacks, answers theirs, suspects a daemon it heard and
then did not for :data:`~chaos_flwr.defaults.GOSSIP_SUSPECT_S`, and writes what it learned to
``<state-dir>/gossip.records``, which the party's next ClientApp message takes up. So views
converge and a crashed party is declared failed while the ServerApp is down, and records a
relay withholds reach the party anyway.

It holds the party too (unless started with ``--no-local``): it listens on
``<state-dir>/party.sock`` (mode 0600, its own user and root only) and answers the party's
``query.chaos`` messages (relay, certify, join and pull) on the party it keeps built, so the
ClientApp process that Flower's deployment engine starts for such a message builds nothing
and hands the message over in a local call (:mod:`chaos_flwr.flower.client.service`). Train
and evaluate messages are still handled in the ClientApp, which trains; both take the party's
turn (:mod:`chaos_flwr.flower.client.lock`) and take up what the other saved, so the party
stays one life (one incarnation) across them. What this saves is the party's rebuild from
disk (``chaos-flwr bench rebuild``: its ``daemon`` row against ``sealed``), not the ClientApp
process's start (about 1.2 s of Flower imports here).

And it countersigns a charter party's own join when that party asks over a link
(:mod:`chaos_flwr.countersign`, :meth:`.gossiper.Gossiper.countersign`), with the checks a
sponsor makes on a request through the relay, while its SuperNode trains (a SuperNode runs
one ClientApp at a time, ``tests/test_flower_message_concurrency.py``): so a joiner that needs
a sponsor and comes during training trains in that round
(:mod:`chaos_flwr.flower.server.latejoin`). A record its signature completes is held and
gossiped on, and its link server lets any charter party into a call for that (every other
request is still for members only).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chaos_flwr.defaults import GOSSIP_INTERVAL_S, GOSSIP_SUSPECT_S
from chaos_flwr.errors import ChaosError
from chaos_flwr.flower.direct import DirectServer, StoreSource
from chaos_flwr.flower.grant import RelayGrants
from chaos_flwr.flower.linkfile import link_credentials
from chaos_flwr.gossip import Gossip
from chaos_flwr.membership import Policy, Record, View
from chaos_flwr.transport.links import LinkAccess

if TYPE_CHECKING:
    from chaos_flwr.flower.client.service import PartyService
    from chaos_flwr.flower.local_socket import LocalServer

__all__ = ["SavedView", "party_link", "serve_party"]

LOG = logging.getLogger(__name__)


class SavedView:
    """The party's records as its processes saved them last, with what its daemon heard by
    gossip (a callable for :class:`~chaos_flwr.transport.links.LinkAccess`: the view served
    by).

    Parameters
    ----------
    state_dir
        The party's state directory.
    identity
        The party's identity: the saved file must carry its seal.
    charter
        The federation's verified charter.

    Attributes
    ----------
    gossip : Gossip
        The party's gossip state (:mod:`chaos_flwr.gossip`); use it under :attr:`lock`.

    Notes
    -----
    The file is read again when its inode, size or modification time changes; every record
    in it is verified and added to the records held (a newer record supersedes an older one,
    so a leave or a fail ends a membership for good). A file that does not read (torn,
    foreign, malformed) adds nothing; with no good file and nothing heard, the view is empty
    (every peer is refused as a non-member).
    """

    def __init__(self, state_dir: Path, identity: Any, charter: Any) -> None:
        from chaos_flwr.flower.durable import STATE_FILE

        self._path = Path(state_dir) / STATE_FILE
        self._dir = Path(state_dir)
        self._identity = identity
        self.lock = threading.RLock()
        self._seen: tuple[int, int, int] | None = None
        policy = Policy.from_charter(charter)
        self.gossip = Gossip(str(identity.party_id), identity.sign, policy)
        self.saved_ids: frozenset[str] = frozenset()
        self.errors = 0

    def __call__(self) -> View:
        with self.lock:
            try:
                st = self._path.stat()
            except OSError:
                return self.gossip.view()
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if key != self._seen:
                self._seen = key
                self._reload()
            return self.gossip.view()

    def _reload(self) -> None:
        from chaos_flwr.flower.durable import load

        try:
            saved = load(self._dir, str(self._identity.party_id), seal=self._identity.sign)
            if saved is None:
                return
            records = [Record.from_wire(value) for value in saved.records]
        except ChaosError as exc:
            self.errors += 1
            LOG.warning("chaos-flwr party: saved view not taken (%s); serving by the last", exc)
            return
        before = self.gossip.view().digest
        self.gossip.take(records)
        self.saved_ids = frozenset(r.record_id for r in records)
        view = self.gossip.view()
        if view.digest != before:
            LOG.info(
                "chaos-flwr party: serving by a view of %d active member(s)", len(view.active())
            )

    def unsaved(self) -> list[Record]:
        """Records held that the party's saved state lacks (what gossip brought)."""
        with self.lock:
            return [r for r in self.gossip.records if r.record_id not in self.saved_ids]


def party_link(state_dir: Path, identity: Any, charter: Any) -> LinkAccess:
    """The link access a party serves with: its shared credentials (renewed here if they
    expire within a day: the server is the one that renews) and its saved view."""
    policy = Policy.from_charter(charter)
    creds = link_credentials(state_dir, identity, policy.federation, renew=True)
    return LinkAccess(creds, policy, SavedView(state_dir, identity, charter))


def serve_party(
    state_dir: Path,
    identity: Any,
    charter: Any,
    listen: str,
    *,
    stop: threading.Event,
    say: Callable[[str], None] = print,
    gossip: bool = True,
    gossip_interval_s: float = GOSSIP_INTERVAL_S,
    suspect_s: float = GOSSIP_SUSPECT_S,
    local: bool = True,
) -> DirectServer:
    """Serve the party's replicas on ``listen`` and gossip with the other parties' daemons
    until ``stop`` is set (the daemon's body).

    Says ``serving <address> as <party id> (link certificate <sha256 prefix>)`` once
    listening, and the gossip totals at exit; returns the stopped server (its counters).
    ``gossip_interval_s`` spaces the gossip rounds; a daemon heard and then silent for
    ``suspect_s`` is suspected (:mod:`chaos_flwr.gossip`). With ``local``, it also holds the
    party and answers its ClientApps' ``query.chaos`` messages on ``<state-dir>/party.sock``
    (:mod:`chaos_flwr.flower.client.service`), and says how many at exit.

    Raises
    ------
    ConfigError
        The link credentials cannot be saved in ``state_dir``, or another daemon already
        answers on its local socket.
    TransportError
        ``listen`` cannot be bound.
    """
    from chaos_flwr.flower.gossiper import Gossiper

    link = party_link(state_dir, identity, charter)
    gossiper = None
    if gossip:
        saved = link.view
        assert isinstance(saved, SavedView)
        saved.gossip.suspect_after_s = suspect_s
        gossiper = Gossiper(saved, link, Path(state_dir), interval_s=gossip_interval_s)
    source = StoreSource(Path(state_dir) / "replicas")
    server = DirectServer(
        source, listen, link=link, gossip=gossiper.answer if gossiper is not None else None,
        readers=RelayGrants(Path(state_dir), link.creds.federation),
        countersign=gossiper.countersign if gossiper is not None else None,
    )  # fmt: skip
    service, local_server = _local_service(Path(state_dir), str(identity.party_id), local)
    try:
        address = server.start()
    except BaseException:
        if local_server is not None:
            local_server.stop()
        raise
    fingerprint = hashlib.sha256(link.creds.serve_cert_der).hexdigest()[:16]
    where = f"; ClientApps at {local_server.path}" if local_server is not None else ""
    say(f"serving {address} as {identity.party_id} (link certificate {fingerprint}){where}")
    if gossiper is not None:
        gossiper.start()
    try:
        stop.wait()
    finally:
        if gossiper is not None:
            gossiper.stop()
            say(gossiper.totals())
        if local_server is not None and service is not None:
            local_server.stop()
            say(
                f"local socket: {service.answered} message(s) answered, "
                f"{local_server.refused} refused"
            )
        server.stop()
        source.close()
    return server


def _local_service(
    state_dir: Path, party_id: str, local: bool
) -> tuple[PartyService | None, LocalServer | None]:
    """The party service on ``<state-dir>/party.sock``, listening (none without ``local``)."""
    if not local:
        return None, None
    from chaos_flwr.flower.client.service import PartyService
    from chaos_flwr.flower.local_socket import LOCAL_SOCKET_FILE, LocalServer

    state_dir.mkdir(parents=True, exist_ok=True)
    service = PartyService(state_dir, party_id)
    server = LocalServer(state_dir / LOCAL_SOCKET_FILE, service)
    server.start()
    return service, server
