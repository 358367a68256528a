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
whose certificate is bound to a charter key and that is an active member of the party's view.
The view is the one the party's ClientApps saved last (``<state-dir>/party.state``, checked
against the party's own seal), read again whenever that file changes (:class:`SavedView`);
until one exists it serves nobody. Limits (concurrent requests, request size, reply bytes per
request and per peer) are the named ``LINK_*`` defaults. It stops on SIGTERM or SIGINT and
logs its start, each change of the view it serves by, and its totals at exit.

Its link certificates are made (or renewed, when they expire within a day) when it starts,
and are valid for :data:`~chaos_flwr.defaults.LINK_CERT_VALIDITY_S` (30 days): restart it
within that time (the systemd unit in ``docs/deployment.md`` does, weekly).

Not yet in the daemon (issue #16): the ClientApp's local socket to it, gossip over the
direct links, and link probes; the ClientApp keeps its protocol state in the state directory.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ChaosError
from chaos_flwr.flower.direct import DirectServer, StoreSource
from chaos_flwr.flower.linkfile import link_credentials
from chaos_flwr.membership import Policy, View
from chaos_flwr.transport.links import LinkAccess

__all__ = ["SavedView", "party_link", "serve_party"]

LOG = logging.getLogger(__name__)


class SavedView:
    """The party's view as its processes saved it last (a callable for
    :class:`~chaos_flwr.transport.links.LinkAccess`).

    Parameters
    ----------
    state_dir
        The party's state directory.
    identity
        The party's identity: the saved file must carry its seal.
    charter
        The federation's verified charter.

    Notes
    -----
    The file is read again when its inode, size or modification time changes; a file that
    does not read (torn, foreign, malformed) leaves the last good view in force, and with no
    good view yet the view is empty (every peer is refused as a non-member).
    """

    def __init__(self, state_dir: Path, identity: Any, charter: Any) -> None:
        from chaos_flwr.flower.durable import STATE_FILE

        self._path = Path(state_dir) / STATE_FILE
        self._dir = Path(state_dir)
        self._identity, self._charter = identity, charter
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._view: View = View({}, {})
        self.errors = 0

    def __call__(self) -> View:
        with self._lock:
            try:
                st = self._path.stat()
            except OSError:
                return self._view
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if key != self._seen:
                self._seen = key
                self._reload()
            return self._view

    def _reload(self) -> None:
        import time

        from chaos_flwr.flower.durable import load
        from chaos_flwr.peer import Peer

        try:
            saved = load(self._dir, str(self._identity.party_id), seal=self._identity.sign)
            if saved is None:
                return
            peer = Peer(self._identity, self._charter)
            own = saved.sealed and saved.charter == peer.federation_tag
            peer.load_records(saved.records, time.time(), sealed=own)
        except ChaosError as exc:
            self.errors += 1
            LOG.warning("chaos-flwr party: saved view not taken (%s); serving by the last", exc)
            return
        view = peer.view()
        if view.digest != self._view.digest:
            LOG.info(
                "chaos-flwr party: serving by a view of %d active member(s)", len(view.active())
            )
        self._view = view


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
) -> DirectServer:
    """Serve the party's replicas on ``listen`` until ``stop`` is set (the daemon's body).

    Says ``serving <address> as <party id> (link certificate <sha256 prefix>)`` once
    listening, and returns the stopped server (its counters).

    Raises
    ------
    ConfigError
        The link credentials cannot be saved in ``state_dir``.
    TransportError
        ``listen`` cannot be bound.
    """
    link = party_link(state_dir, identity, charter)
    source = StoreSource(Path(state_dir) / "replicas")
    server = DirectServer(source, listen, link=link)
    address = server.start()
    fingerprint = hashlib.sha256(link.creds.serve_cert_der).hexdigest()[:16]
    say(f"serving {address} as {identity.party_id} (link certificate {fingerprint})")
    try:
        stop.wait()
    finally:
        server.stop()
        source.close()
    return server
