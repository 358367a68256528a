"""Direct peer links over ``grpc.aio``: bytes in, bytes out, one server per party on 127.0.0.1.

No protobuf schema: one generic unary-stream method (``/chaos.Carrier/Call``) with identity
(de)serialisers carries the request bytes in and streams the reply back in chunks of
``TRANSPORT_CHUNK_BYTES`` (streaming keeps each HTTP/2 message small, lets a shaper pace the
reply chunk by chunk, and lets a cancelled request stop the sender). Messages up to
``TRANSPORT_MAX_MESSAGE_BYTES`` pass.

Peers are found in a *directory* (party id -> ``host:port``). The sender's party id travels in
the ``chaos-from`` metadata key; it is a claim, not an authentication: the layers above sign
their envelopes and verify them before trusting anything.

Delivery is at most once, never retried (see :mod:`chaos_flwr.transport.base`). A peer that is
unknown, not listening, stopped, too slow, or whose handler raised gives
:class:`~chaos_flwr.errors.TransportError`.

Push streams (one-way messages)
-------------------------------
For small fire-and-forget messages (protocol envelopes) a unary call per message costs more
than the work it carries. :meth:`GrpcCarrier.push` instead queues an *item* (opaque bytes) for a
destination and returns at once; one persistent client stream per destination
(``/chaos.Carrier/Push``) carries the queued items, every item queued before the stream's writer
runs again going out in one HTTP/2 message (a *batch*: each item prefixed by its u32 big-endian
length). The receiving carrier hands each batch, in order, to the ``push_handler`` given to
:meth:`GrpcCarrier.start`. Items to one destination arrive in the order they were pushed, at most
once: if the stream breaks, the items in flight are lost and counted in
:attr:`GrpcCarrier.push_lost` (the next push opens a new stream). Pushes are not shaped.

With a :class:`~chaos_flwr.transport.shaping.Shaper`, every request waits out the one-way delay
and the sender's uplink; every reply waits out the one-way delay once and then each chunk passes
the replying party's uplink (and pair cap) and the receiving party's downlink.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import grpc.aio

from ..defaults import (
    TRANSPORT_CHUNK_BYTES,
    TRANSPORT_HOST,
    TRANSPORT_MAX_MESSAGE_BYTES,
    TRANSPORT_PUSH_DRAIN_SPINS,
    TRANSPORT_REQUEST_TIMEOUT_S,
    TRANSPORT_STOP_GRACE_S,
)
from ..errors import ConfigError, TransportError
from .base import Carrier, Handler
from .shaping import Shaper

__all__ = ["GrpcCarrier", "PushHandler", "grpc_options", "pack_batch", "unpack_batch"]

_SERVICE = "chaos.Carrier"
_METHOD = f"/{_SERVICE}/Call"
_PUSH = f"/{_SERVICE}/Push"
_U32 = struct.Struct(">I")

#: Receives one pushed batch: ``(source id, items in push order)``; runs on the event loop.
PushHandler = Callable[[str, list[bytes]], None]


def pack_batch(items: list[bytes]) -> bytes:
    """One push batch: every item prefixed by its length (u32 big-endian)."""
    parts: list[bytes] = []
    for item in items:
        parts.append(_U32.pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def _split(items: list[bytes], max_bytes: int) -> list[list[bytes]]:
    """Cut ``items`` into runs whose batches stay within ``max_bytes``."""
    runs: list[list[bytes]] = [[]]
    size = 0
    for item in items:
        cost = len(item) + _U32.size
        if runs[-1] and size + cost > max_bytes:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += cost
    return runs


def unpack_batch(data: bytes) -> list[bytes]:
    """The items of a push batch (inverse of :func:`pack_batch`).

    Raises
    ------
    TransportError
        If the batch is truncated.
    """
    items: list[bytes] = []
    view = memoryview(data)
    at, end = 0, len(data)
    while at < end:
        if at + _U32.size > end:
            raise TransportError(f"push batch truncated at byte {at} of {end} (length prefix)")
        (size,) = _U32.unpack_from(data, at)
        at += _U32.size
        if at + size > end:
            raise TransportError(f"push batch truncated at byte {at} of {end} (item of {size})")
        items.append(bytes(view[at : at + size]))
        at += size
    return items


_FROM_KEY = "chaos-from"
_log = logging.getLogger(__name__)


def grpc_options(max_message_bytes: int = TRANSPORT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel and server options: large messages, no proxy, keepalive off."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_http_proxy", 0),
        ("grpc.so_reuseport", 0),
    ]


def _identity(data: bytes) -> bytes:
    return data


class GrpcCarrier(Carrier):
    """A party's grpc.aio carrier.

    Parameters
    ----------
    party_id : str
        This party's id (sent as ``chaos-from``).
    directory : Mapping[str, str], optional
        Party id -> ``host:port`` of the peers' carriers (more can be added with
        :meth:`add_peer`).
    port : int, optional
        Port to listen on at ``host`` (0 picks a free one; see :attr:`address`).
    host : str, optional
        Address to listen on: loopback by default; a network namespace's own address when the
        party runs inside one (``--wan netns``).
    shaper : Shaper or None, optional
        Paces this party's links (see the module docstring).
    chunk_bytes : int, optional
        Size of streamed reply chunks.
    max_message_bytes : int, optional
        Largest request or reply.
    request_timeout_s : float, optional
        Default bound of one :meth:`request`.
    """

    def __init__(
        self,
        party_id: str,
        directory: Mapping[str, str] | None = None,
        *,
        port: int = 0,
        host: str = TRANSPORT_HOST,
        shaper: Shaper | None = None,
        chunk_bytes: int = TRANSPORT_CHUNK_BYTES,
        max_message_bytes: int = TRANSPORT_MAX_MESSAGE_BYTES,
        request_timeout_s: float = TRANSPORT_REQUEST_TIMEOUT_S,
    ) -> None:
        if not party_id:
            raise ConfigError("party_id: a carrier needs a non-empty party id")
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes: must be >= 1, got {chunk_bytes}")
        self.party_id = party_id
        self.directory: dict[str, str] = dict(directory or {})
        self.shaper = shaper
        self._port = port
        self.host = host
        self._chunk = chunk_bytes
        self._max = max_message_bytes
        self._timeout = request_timeout_s
        self._server: grpc.aio.Server | None = None
        self._handler: Handler | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._push_handler: PushHandler | None = None
        self._outbox: dict[str, list[bytes]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._pushers: dict[str, asyncio.Task[None]] = {}
        self.address: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        #: Pushed items that went out in a batch / were lost with a broken stream.
        self.pushed = 0
        self.push_lost = 0
        #: Push batches written and received.
        self.batches_sent = 0
        self.batches_received = 0

    def add_peer(self, party_id: str, address: str) -> None:
        """Add or replace ``party_id``'s address (closes a stale channel to it)."""
        if self.directory.get(party_id) != address:
            old = self._channels.pop(party_id, None)
            if old is not None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # no loop: the channel is dropped with its loop
                    loop = None
                if loop is not None:
                    self._closing.add(loop.create_task(old.close()))
        self.directory[party_id] = address

    # --- serving -----------------------------------------------------------------------------

    async def start(self, handler: Handler, *, push_handler: PushHandler | None = None) -> None:
        """Listen on :attr:`host` and serve ``handler``; sets :attr:`address`.

        Parameters
        ----------
        handler
            Serves requests (:meth:`request`).
        push_handler
            Receives pushed batches (:meth:`push`); without one, push streams are refused.

        Raises
        ------
        TransportError
            If the port cannot be bound.
        """
        if self._server is not None:
            raise TransportError(f"carrier {self.party_id!r} is already started")
        self._handler = handler
        self._push_handler = push_handler
        server = grpc.aio.server(options=grpc_options(self._max))
        rpc = grpc.unary_stream_rpc_method_handler(
            self._serve, request_deserializer=None, response_serializer=None
        )
        push = grpc.stream_unary_rpc_method_handler(
            self._serve_push, request_deserializer=None, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, {"Call": rpc, "Push": push}),)
        )
        try:
            port = server.add_insecure_port(f"{self.host}:{self._port}")
        except RuntimeError as err:
            raise TransportError(
                f"port: cannot listen on {self.host}:{self._port} ({err}); pick a free port"
            ) from None
        if port == 0:
            raise TransportError(
                f"port: cannot listen on {self.host}:{self._port}; pick a free port"
            )
        await server.start()
        self._server = server
        self.address = f"{self.host}:{port}"

    async def _serve(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        meta = dict(context.invocation_metadata() or ())
        src = meta.get(_FROM_KEY)
        if not isinstance(src, str) or not src:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"missing {_FROM_KEY} metadata")
            return
        assert self._handler is not None
        self.bytes_received += len(request)
        if self.shaper is not None:
            await self.shaper.pace_recv(len(request))
        try:
            reply = await self._handler(src, request)
        except Exception as err:  # the peer sees a TransportError naming the cause
            _log.debug("handler failed for a request from %s", src, exc_info=True)
            await context.abort(grpc.StatusCode.INTERNAL, f"handler failed: {err!r}")
            return
        view = memoryview(reply)
        if self.shaper is not None:
            await asyncio.sleep(self.shaper.delay_to(src))
        for start in range(0, len(view), self._chunk):
            chunk = bytes(view[start : start + self._chunk])
            if self.shaper is not None:
                await self.shaper.pace_send(src, len(chunk))
            self.bytes_sent += len(chunk)
            yield chunk

    async def _serve_push(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        meta = dict(context.invocation_metadata() or ())
        src = meta.get(_FROM_KEY)
        if not isinstance(src, str) or not src:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"missing {_FROM_KEY} metadata")
            return b""
        if self._push_handler is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this carrier takes no pushes")
            return b""
        try:
            async for batch in requests:
                self.bytes_received += len(batch)
                self.batches_received += 1
                try:
                    items = unpack_batch(batch)
                except TransportError as err:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                    return b""
                self._push_handler(src, items)
        except asyncio.CancelledError:
            # The server is stopping while the sender's stream is still open: the stream simply
            # ends here (anything unread is lost, as at-most-once allows).
            return b""
        return b""

    # --- calling -----------------------------------------------------------------------------

    def _channel(self, dst: str) -> grpc.aio.Channel:
        channel = self._channels.get(dst)
        if channel is None:
            address = self.directory.get(dst)
            if address is None:
                raise TransportError(
                    f"peer {dst!r} is not in {self.party_id!r}'s directory; add its address"
                )
            channel = grpc.aio.insecure_channel(address, options=grpc_options(self._max))
            self._channels[dst] = channel
        return channel

    async def request(self, dst: str, data: bytes, *, timeout: float | None = None) -> bytes:
        """Send ``data`` to ``dst`` and return the reply (see :class:`Carrier`).

        Raises
        ------
        TransportError
            Unknown or unreachable peer, timeout, oversize message, or remote handler failure.
        """
        if len(data) > self._max:
            raise TransportError(
                f"request to {dst!r} is {len(data)} bytes, above max_message_bytes ({self._max})"
            )
        channel = self._channel(dst)
        call_timeout = self._timeout if timeout is None else timeout
        if self.shaper is not None:
            await asyncio.sleep(self.shaper.delay_to(dst))
            await self.shaper.pace_send(dst, len(data))
        stub = channel.unary_stream(
            _METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        parts: list[bytes] = []
        try:
            call = stub(data, metadata=((_FROM_KEY, self.party_id),), timeout=call_timeout)
            self.bytes_sent += len(data)
            async for chunk in call:
                if self.shaper is not None:
                    await self.shaper.pace_recv(len(chunk))
                parts.append(chunk)
        except grpc.aio.AioRpcError as err:
            raise TransportError(
                f"request from {self.party_id!r} to peer {dst!r} at {self.directory.get(dst)} "
                f"failed: {err.code().name} ({err.details()})"
            ) from None
        reply = b"".join(parts)
        self.bytes_received += len(reply)
        return reply

    def push(self, dst: str, item: bytes) -> None:
        """Queue ``item`` for ``dst``'s push handler and return at once (see the module docs).

        Must be called on the running event loop. Items to one destination keep their order;
        delivery is at most once (a broken stream loses its items, counted in
        :attr:`push_lost`).

        Raises
        ------
        TransportError
            If ``dst`` is not in the directory or ``item`` is larger than the message limit.
        """
        if len(item) + _U32.size > self._max:
            raise TransportError(
                f"push to {dst!r} is {len(item)} bytes, above max_message_bytes ({self._max})"
            )
        box = self._outbox.get(dst)
        if box is None:
            if dst not in self.directory:
                raise TransportError(
                    f"peer {dst!r} is not in {self.party_id!r}'s directory; add its address"
                )
            box = self._outbox[dst] = []
        box.append(item)
        wake = self._wakeups.get(dst)
        if wake is None:
            wake = self._wakeups[dst] = asyncio.Event()
        wake.set()
        if dst not in self._pushers:
            task = asyncio.get_running_loop().create_task(self._pusher(dst, wake))
            self._pushers[dst] = task

    def pending(self) -> int:
        """Items queued by :meth:`push` and not yet written to a stream."""
        return sum(len(box) for box in self._outbox.values())

    async def _pusher(self, dst: str, wake: asyncio.Event) -> None:
        """Write ``dst``'s queued items to one persistent stream, a batch per wake-up."""
        call: Any = None
        try:
            while True:
                await wake.wait()
                wake.clear()
                items = self._outbox.get(dst)
                if not items:
                    continue
                self._outbox[dst] = []
                if call is None:
                    stub = self._channel(dst).stream_unary(
                        _PUSH, request_serializer=_identity, response_deserializer=_identity
                    )
                    call = stub(metadata=((_FROM_KEY, self.party_id),))
                chunks = _split(items, self._max)
                for chunk in chunks:
                    batch = pack_batch(chunk)
                    try:
                        await call.write(batch)
                    except (grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
                        self.push_lost += len(chunk)
                        _log.debug("push stream to %s broke", dst, exc_info=True)
                        call = None
                        continue
                    self.pushed += len(chunk)
                    self.batches_sent += 1
                    self.bytes_sent += len(batch)
        finally:
            if call is not None:
                try:
                    await call.done_writing()
                    await call
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
                    pass

    async def end_pushes(self) -> None:
        """Let queued pushes go out, then end every push stream this carrier opened.

        Peers that stop together call this on all carriers before :meth:`close`, so no server
        stops while a stream to it is still open. Pushing again opens new streams.
        """
        for _ in range(TRANSPORT_PUSH_DRAIN_SPINS):
            if not self.pending():
                break
            await asyncio.sleep(0)
        pushers, self._pushers = list(self._pushers.values()), {}
        for task in pushers:
            task.cancel()
        for task in pushers:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        """Stop the server (short grace for in-flight calls) and close all channels."""
        await self.end_pushes()
        server, self._server = self._server, None
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
        closing, self._closing = self._closing, set()
        for task in closing:
            await task
        if server is not None:
            await server.stop(TRANSPORT_STOP_GRACE_S)
