"""The in-process carrier: a deterministic FIFO router between endpoints in one process.

:class:`MemoryNetwork` moves opaque bytes between party ids and never parses them. Endpoints are
anything with a ``party_id`` and ``handle(data, now) -> outgoing`` (a
:class:`~chaos_flwr.peer.Peer`, or a test double); what ``handle`` returns (objects with ``to``
and ``data``) is queued and delivered in turn, first in, first out, until the network is quiet.

Faults are deterministic: crashed parties neither send nor receive, cut pairs drop traffic both
ways, and a seeded random generator drops or duplicates a chosen fraction of deliveries. The same
seed and the same calls give the same deliveries, so a failing test replays exactly.

Time is the caller's: :meth:`MemoryNetwork.run` delivers at ``now``; :meth:`MemoryNetwork.tick`
advances nothing by itself, it calls each endpoint's ``tick(now)`` if it has one.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ..defaults import MEMORY_CARRIER_MAX_DELIVERIES
from ..errors import ConfigError, TransportError

__all__ = ["Endpoint", "MemoryNetwork"]


class _OutgoingLike(Protocol):
    @property
    def to(self) -> str: ...

    @property
    def data(self) -> bytes: ...


class Endpoint(Protocol):
    """What the memory network delivers to."""

    @property
    def party_id(self) -> str: ...

    def handle(self, data: bytes, now: float) -> Sequence[_OutgoingLike]: ...


class MemoryNetwork:
    """Deterministic FIFO delivery between in-process endpoints.

    Parameters
    ----------
    seed : int
        Seed of the drop/duplicate decisions.
    drop : float
        Fraction of deliveries dropped, in [0, 1).
    duplicate : float
        Fraction of deliveries made twice, in [0, 1).
    max_deliveries : int
        Most deliveries one :meth:`run` makes before it raises (a message storm is a bug).

    Attributes
    ----------
    delivered : int
        Deliveries made so far (duplicates counted).
    dropped : int
        Envelopes dropped (crash, cut, unknown destination or random drop).
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        drop: float = 0.0,
        duplicate: float = 0.0,
        max_deliveries: int = MEMORY_CARRIER_MAX_DELIVERIES,
    ) -> None:
        for name, value in (("drop", drop), ("duplicate", duplicate)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"memory network option {name!r} must be in [0, 1), got {value}")
        self.drop = drop
        self.duplicate = duplicate
        self.max_deliveries = max_deliveries
        self._rng = random.Random(seed)
        self._endpoints: dict[str, Endpoint] = {}
        self._queue: deque[tuple[str, str, bytes]] = deque()
        self._crashed: set[str] = set()
        self._cut: set[frozenset[str]] = set()
        self.delivered = 0
        self.dropped = 0

    # --- membership of the network -----------------------------------------------------------

    def attach(self, endpoint: Endpoint) -> None:
        """Connect ``endpoint`` under its ``party_id`` (replacing one with the same id)."""
        self._endpoints[endpoint.party_id] = endpoint

    def detach(self, party_id: str) -> None:
        """Disconnect ``party_id``; traffic to it is dropped from now on."""
        self._endpoints.pop(party_id, None)

    def endpoints(self) -> dict[str, Endpoint]:
        """The attached endpoints by party id."""
        return dict(self._endpoints)

    # --- faults ------------------------------------------------------------------------------

    def crash(self, party_id: str) -> None:
        """Drop everything to and from ``party_id`` until :meth:`restart`."""
        self._crashed.add(party_id)

    def restart(self, party_id: str) -> None:
        """Undo :meth:`crash` (attach a fresh endpoint first to model a new process)."""
        self._crashed.discard(party_id)

    def is_crashed(self, party_id: str) -> bool:
        """Whether ``party_id`` is crashed."""
        return party_id in self._crashed

    def partition(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        """Cut every pair between ``side_a`` and ``side_b`` (both directions)."""
        side_b = list(side_b)
        for a in side_a:
            for b in side_b:
                if a != b:
                    self._cut.add(frozenset((a, b)))

    def heal(self) -> None:
        """Remove every cut."""
        self._cut.clear()

    # --- moving bytes ------------------------------------------------------------------------

    def send(self, src: str, outgoing: Iterable[_OutgoingLike]) -> None:
        """Queue what ``src`` wants to send (delivered by :meth:`run`)."""
        for out in outgoing:
            self._queue.append((src, out.to, out.data))

    def pending(self) -> int:
        """Envelopes queued and not yet delivered."""
        return len(self._queue)

    def run(self, now: float) -> int:
        """Deliver until the queue is empty; replies are queued and delivered too.

        Parameters
        ----------
        now
            The time handed to every ``handle`` call.

        Returns
        -------
        int
            Deliveries made by this call.

        Raises
        ------
        TransportError
            If more than ``max_deliveries`` deliveries are needed (a message storm).
        """
        made = 0
        while self._queue:
            src, dst, data = self._queue.popleft()
            endpoint = self._endpoints.get(dst)
            if (
                endpoint is None
                or src in self._crashed
                or dst in self._crashed
                or frozenset((src, dst)) in self._cut
                or (self.drop and self._rng.random() < self.drop)
            ):
                self.dropped += 1
                continue
            copies = 2 if self.duplicate and self._rng.random() < self.duplicate else 1
            for _ in range(copies):
                made += 1
                if made > self.max_deliveries:
                    raise TransportError(
                        f"more than {self.max_deliveries} deliveries in one run "
                        "(max_deliveries): the endpoints are in a message storm"
                    )
                self.send(dst, endpoint.handle(data, now))
        self.delivered += made
        return made

    def tick(self, now: float) -> int:
        """Call ``tick(now)`` on every live endpoint that has one (in party-id order), then run.

        Returns
        -------
        int
            Deliveries made.
        """
        for pid, endpoint in sorted(self._endpoints.items()):
            tick: Any = getattr(endpoint, "tick", None)
            if pid not in self._crashed and callable(tick):
                self.send(pid, tick(now))
        return self.run(now)
