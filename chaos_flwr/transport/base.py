"""The carrier interface: opaque request/reply bytes between party ids.

A carrier moves ``bytes`` between parties and never parses them. Each party runs one carrier;
it serves a *handler* (``async (src, data) -> reply``) and calls other parties with
:meth:`Carrier.request`.

Delivery semantics
------------------
* **At most once.** A carrier never retries on its own. :meth:`Carrier.request` either returns
  the reply of exactly one run of the remote handler, or raises
  :class:`~chaos_flwr.errors.TransportError`; after an error the handler may or may not have run
  (a reply can be lost after the work was done), so a caller that retries must make its request
  idempotent (signed envelopes carry sequence numbers; shard requests are pure reads).
* **Ordering.** Requests one task sends to one peer one after the other (awaiting each) are
  handled in that order. Concurrent requests carry no ordering guarantee.
* **Failure.** An unknown, unreachable or stopped peer, a timeout, or a handler that raised
  all surface as :class:`~chaos_flwr.errors.TransportError` naming the peer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from types import TracebackType

__all__ = ["Carrier", "Handler"]

#: Serves one request: ``(source party id, request bytes) -> reply bytes``.
Handler = Callable[[str, bytes], Awaitable[bytes]]


class Carrier(ABC):
    """One party's end of a bytes-in, bytes-out network (see the module docstring)."""

    party_id: str

    @abstractmethod
    async def start(self, handler: Handler) -> None:
        """Begin serving ``handler`` for requests addressed to this party."""

    @abstractmethod
    async def request(self, dst: str, data: bytes, *, timeout: float | None = None) -> bytes:
        """Send ``data`` to ``dst`` and return its handler's reply.

        Raises
        ------
        TransportError
            If ``dst`` is unknown, unreachable, too slow (``timeout``) or its handler failed.
        """

    async def send(self, dst: str, data: bytes, *, timeout: float | None = None) -> None:
        """Send ``data`` to ``dst`` and ignore the reply (same semantics as :meth:`request`)."""
        await self.request(dst, data, timeout=timeout)

    @abstractmethod
    async def close(self) -> None:
        """Stop serving and close every link (idempotent)."""

    async def __aenter__(self) -> Carrier:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
