"""The party daemon's gossip carrier: :class:`Gossiper` runs gossip rounds over direct links.

The protocol is :class:`chaos_flwr.gossip.Gossip` (sans-I/O); this module does its I/O:

- every ``interval_s`` it asks the round's targets (active members with signed endpoints, a
  few at a time) over the authenticated links, each exchange bounded by ``timeout_s``;
- it answers other daemons' requests (:meth:`answer`, given to the party's
  :class:`~chaos_flwr.flower.direct.DirectServer`);
- after each round it casts the votes the silence of heard peers calls for, and writes the
  records the party's saved state lacks to ``<state-dir>/gossip.records``
  (:mod:`chaos_flwr.flower.gossipfile`), which the party's next ClientApp message takes up.

All calls into the gossip state hold the saved view's lock (the server's event loop and this
thread share it). The clock is the wall clock (``time.time``), as the party's own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos_flwr import codec
from chaos_flwr.defaults import GOSSIP_INTERVAL_S, GOSSIP_TIMEOUT_S, LINK_MAX_REPLY_FRAME_BYTES
from chaos_flwr.errors import StoreError, TransportError
from chaos_flwr.flower.gossipfile import read_heard, write_heard
from chaos_flwr.membership import EndpointInfo
from chaos_flwr.transport.links import LinkAccess, LinkDialer

__all__ = ["Gossiper"]

LOG = logging.getLogger(__name__)


class Gossiper:
    """Gossip rounds of a party daemon (own thread and event loop).

    Parameters
    ----------
    saved
        The daemon's :class:`~chaos_flwr.flower.daemon.SavedView` (holds the gossip state).
    link
        The party's link access (its credentials dial; its view names the endpoints).
    state_dir
        The party's state directory (the gossip records file is written there).
    interval_s, timeout_s
        Seconds between rounds; bound of one exchange.
    clock
        Wall clock (seconds).

    Attributes
    ----------
    rounds, asked, answered, learned, countersigned : int
        Rounds run, exchanges started, requests answered, records and votes taken, joins
        countersigned.
    failed : dict[str, int]
        Failed exchanges, by error class name.
    """

    def __init__(
        self,
        saved: Any,
        link: LinkAccess,
        state_dir: Path,
        *,
        interval_s: float = GOSSIP_INTERVAL_S,
        timeout_s: float = GOSSIP_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.saved, self.link, self.state_dir = saved, link, Path(state_dir)
        self.interval_s, self.timeout_s, self.clock = interval_s, timeout_s, clock
        self.rounds = self.asked = self.answered = self.learned = self.countersigned = 0
        self.failed: dict[str, int] = {}
        self._written: frozenset[str] | None = None
        self._writing = threading.Lock()
        self._down: set[str] = set()
        self._talked: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._take_file()

    def _take_file(self) -> None:
        """Start from the records an earlier run of the daemon heard (verified again)."""
        try:
            heard = read_heard(self.state_dir)
        except StoreError as exc:
            LOG.warning("chaos-flwr party: gossip records file not taken (%s)", exc)
            return
        with self.saved.lock:
            self.saved()  # the saved state first: what it holds is not "heard"
            self.saved.gossip.take(heard)

    # -- serving -----------------------------------------------------------------------------
    def answer(self, src: str, value: Any) -> bytes:
        """The reply to ``src``'s gossip request (``src`` authenticated and authorised:
        :meth:`~chaos_flwr.transport.links.LinkAccess.authorize`).

        Raises
        ------
        DecodeError
            ``value`` is not a gossip request.
        PolicyError
            It carries an endpoint record that is not the asker's own.
        """
        with self.saved.lock:  # (answers run in the link server's executor threads)
            self.saved()
            reply = self.saved.gossip.on_request(src, value, self.clock())
            self.answered += 1
        return codec.encode(reply)

    def countersign(self, src: str, value: Any) -> bytes:
        """The reply to ``src``'s request to countersign its own join
        (:func:`~chaos_flwr.countersign.countersign`); a join it makes complete is held (so
        ``src`` is served as a member from now on), gossiped on, and written for the party.

        Raises
        ------
        ChaosError
            The request is refused (:func:`~chaos_flwr.countersign.countersign`).
        """
        with self.saved.lock:
            self.saved()
            reply, taken = self.saved.gossip.countersign(src, value, self.clock())
            self.countersigned += 1
        LOG.info("chaos-flwr party: countersigned the join of %s%s", src,
                 " (now a member in this view)" if taken else "")  # fmt: skip
        if taken:
            self._write()
        return codec.encode(reply)

    # -- rounds ------------------------------------------------------------------------------
    def start(self) -> None:
        """Run rounds in a thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._main, name="chaos-gossip", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the round in progress (bounded by ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5.0)

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        dialer = LinkDialer(self.link.creds, max_reply_bytes=LINK_MAX_REPLY_FRAME_BYTES)
        try:
            while not self._stop.is_set():
                try:
                    await self.round(dialer)
                except Exception:  # a bug must not end gossip for good: said, then retried
                    LOG.exception("chaos-flwr party: a gossip round failed")
                await asyncio.to_thread(self._stop.wait, self.interval_s)
        finally:
            await dialer.close()

    async def round(self, dialer: LinkDialer) -> int:
        """One gossip round: ask the targets, cast due votes, write what the party lacks.
        Returns the records and votes taken."""
        with self.saved.lock:
            self.saved()
            targets = self.saved.gossip.targets()
            request = codec.encode(self.saved.gossip.request())
        got = await asyncio.gather(*(self._ask(dialer, p, ep, request) for p, ep in targets))
        with self.saved.lock:
            cast = self.saved.gossip.tick(self.clock())
            suspects = self.saved.gossip.suspects()
        if cast and suspects:
            LOG.warning("chaos-flwr party: suspects %s (silent on its link)", ", ".join(suspects))
        self.rounds += 1
        self.learned += sum(got)
        self._write()
        return sum(got)

    async def _ask(self, dialer: LinkDialer, party: str, ep: EndpointInfo, req: bytes) -> int:
        self.asked += 1
        try:
            raw = await dialer.request(
                ep.address, ep.cert, req, timeout=self.timeout_s, party=ep.party_id
            )
            value = codec.decode(raw, max_bytes=LINK_MAX_REPLY_FRAME_BYTES)
            with self.saved.lock:
                new = int(self.saved.gossip.on_reply(party, value, self.clock()))
        except Exception as exc:  # a peer never stops this party's gossip
            name = type(exc).__name__
            self.failed[name] = self.failed.get(name, 0) + 1
            if type(exc) is TransportError:  # no answer at all (a typed refusal is one)
                with self.saved.lock:
                    self.saved.gossip.missed(party)
            if party not in self._down:  # said once per outage
                self._down.add(party)
                LOG.warning("chaos-flwr party: gossip with %s failed (%s: %s)", party, name, exc)
            return 0
        if party in self._down:
            self._down.discard(party)
            LOG.info("chaos-flwr party: gossip with %s works again", party)
        elif party not in self._talked:
            LOG.info("chaos-flwr party: gossiping with %s at %s", party, ep.address)
        self._talked.add(party)
        if new:
            LOG.info("chaos-flwr party: %d record(s) or vote(s) from %s by gossip", new, party)
        return new

    def _write(self) -> None:
        """Write the records the saved state lacks, when they changed since the last write
        (one writer at a time: rounds and countersigns both write)."""
        with self._writing:
            unsaved = self.saved.unsaved()
            ids = frozenset(r.record_id for r in unsaved)
            if ids == self._written:
                return
            try:
                write_heard(self.state_dir, unsaved)
            except StoreError as exc:
                LOG.warning("chaos-flwr party: %s", exc)
                return
            self._written = ids

    def totals(self) -> str:
        """One line of totals for the daemon's exit log."""
        failed = ", ".join(f"{k} {v}" for k, v in sorted(self.failed.items())) or "none"
        refused = ", ".join(f"{k} {v}" for k, v in sorted(self.saved.gossip.refused.items()))
        return (
            f"gossip: {self.rounds} rounds, {self.asked} asked ({failed} failed), "
            f"{self.answered} answered, {self.learned} taken, {self.countersigned} "
            f"join(s) countersigned; refused: {refused or 'none'}"
        )
