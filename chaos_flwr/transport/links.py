"""Authenticated, encrypted direct links over grpc mutual TLS (see :mod:`.tls`).

:class:`LinkServer` serves one generic method (``/chaos.Link/Call``: request bytes in, reply
streamed back in chunks) to peers that proved a party identity: the TLS handshake demands a
client certificate and proves its key; the handler then checks the certificate's binding
against the charter keyring and asks ``authorize`` (e.g. "active in my view") before the
request is read. :class:`LinkDialer` dials a party at the endpoint its signed record names and
pins the serve certificate that record carries.

Every refusal is a :class:`~chaos_flwr.errors.ChaosError` subclass: the server sends its class
name in the grpc status details (``"LinkBusyError: ..."``) and the dialler raises the same
class (:func:`typed_error`). Limits enforced here: requests served at once
(``LINK_MAX_CONCURRENT_REQUESTS``; grpc's own RPC limit at twice that is a backstop), and per
party (``LINK_MAX_CONCURRENT_PER_PEER``); the request message size
(``LINK_MAX_REQUEST_BYTES``, refused by grpc before it is read). The dialler is checked as
the call starts, before its request is read (a stream handler), so a dialler no party vouches
for is refused at once and cannot hold a slot by never sending its request; an authenticated
one has ``LINK_REQUEST_READ_S`` to send it. A TLS handshake has ``LINK_HANDSHAKE_S``; a
connection with no call in progress is closed after ``LINK_IDLE_CONNECTION_S``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from ..defaults import (
    LINK_DIALER_MAX_CHANNELS,
    LINK_HANDSHAKE_S,
    LINK_IDLE_CONNECTION_S,
    LINK_MAX_CONCURRENT_PER_PEER,
    LINK_MAX_CONCURRENT_REQUESTS,
    LINK_MAX_REPLY_BYTES,
    LINK_MAX_REPLY_FRAME_BYTES,
    LINK_MAX_REQUEST_BYTES,
    LINK_MAX_TRACKED_PEERS,
    LINK_PEER_WINDOW_BYTES,
    LINK_PEER_WINDOW_S,
    LINK_REQUEST_READ_S,
    TRANSPORT_CHUNK_BYTES,
    TRANSPORT_STOP_GRACE_S,
)
from ..errors import (
    ChaosError,
    DecodeError,
    EndpointError,
    LinkAuthError,
    LinkBusyError,
    LinkQuotaError,
    NotMemberError,
    OversizeError,
    ReplyTooLargeError,
    RequestTooLargeError,
    ShardIntegrityError,
    StoreError,
    TransportError,
)
from ..membership import EndpointInfo, Policy, View, parse_address
from .shaping import Shaper
from .tls import (
    LINK_SERVER_NAME,
    LinkCredentials,
    link_root_pem,
    peer_spki,
    serve_cert_pem_of,
    verify_dial_cert,
)

__all__ = [
    "LinkAccess",
    "LinkDialer",
    "LinkHandler",
    "LinkLimits",
    "LinkServer",
    "PeerQuota",
    "typed_error",
]

_SERVICE = "chaos.Link"
_METHOD = f"/{_SERVICE}/Call"
_log = logging.getLogger(__name__)

#: Serves one authenticated request: ``(peer party id, request bytes) -> reply bytes``.
LinkHandler = Callable[[str, bytes], Awaitable[bytes]]

#: The error classes a refusal names (and the dialler raises again).
_TYPED: dict[str, type[ChaosError]] = {
    cls.__name__: cls
    for cls in (
        DecodeError,
        EndpointError,
        LinkAuthError,
        LinkBusyError,
        LinkQuotaError,
        NotMemberError,
        OversizeError,
        ReplyTooLargeError,
        RequestTooLargeError,
        ShardIntegrityError,
        StoreError,
    )
}

_CODES: dict[type[ChaosError], grpc.StatusCode] = {
    LinkAuthError: grpc.StatusCode.UNAUTHENTICATED,
    NotMemberError: grpc.StatusCode.PERMISSION_DENIED,
    LinkBusyError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    LinkQuotaError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ReplyTooLargeError: grpc.StatusCode.OUT_OF_RANGE,
    StoreError: grpc.StatusCode.NOT_FOUND,
}


def _code(exc: ChaosError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INVALID_ARGUMENT


def typed_error(err: grpc.aio.AioRpcError, where: str) -> ChaosError:
    """The typed error a failed link call stands for.

    A refusal names its class in the details; grpc's own refusals map to
    :class:`~chaos_flwr.errors.RequestTooLargeError` (message above the server's limit),
    :class:`~chaos_flwr.errors.LinkBusyError` (grpc's RPC limit) and
    :class:`~chaos_flwr.errors.LinkAuthError` (a failed TLS handshake: the peer is not the
    holder of the pinned certificate); anything else is a
    :class:`~chaos_flwr.errors.TransportError`.
    """
    details = err.details() or ""
    name, sep, message = details.partition(": ")
    cls = _TYPED.get(name) if sep else None
    if cls is not None:
        return cls(f"{where}: {message}")
    code = err.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return RequestTooLargeError(f"{where}: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" in details:
        return LinkBusyError(f"{where}: {details}")
    if "handshake failed" in details.lower():
        return LinkAuthError(f"{where}: TLS handshake failed: {details}")
    return TransportError(f"{where}: {code.name} ({details})")


def _identity(data: bytes) -> bytes:
    return data


class LinkServer:
    """A grpc mutual-TLS server of one party's links.

    Parameters
    ----------
    creds
        The party's link credentials (its serve certificate is presented to diallers).
    keyring
        Party id -> Ed25519 key of the charter parties (callable: read per request).
    authorize
        Raises a :class:`~chaos_flwr.errors.ChaosError` (e.g.
        :class:`~chaos_flwr.errors.NotMemberError`) if an authenticated party may not be served.
    readers
        Returns ``{SPKI digest: name}`` of the non-member link keys this server also serves
        (the relay's read grant, :mod:`chaos_flwr.flower.grant`): a dialler whose certificate
        holds such a key is served under that name, unbound to any party (read per request).
    listen
        ``host:port`` (port 0 picks a free one; see :attr:`address`).
    max_concurrent, max_request_bytes, chunk_bytes
        Requests served at once, largest request message, reply chunk size.
    shaper
        Paces replies (one-way delay, then each chunk through this party's uplink; tests and
        benchmarks).

    Attributes
    ----------
    refused : dict[str, int]
        Refusals by error class name (for tests and logs).
    """

    def __init__(
        self,
        creds: LinkCredentials,
        keyring: Callable[[], Mapping[str, bytes]],
        authorize: Callable[[str], None],
        listen: str,
        *,
        max_concurrent: int = LINK_MAX_CONCURRENT_REQUESTS,
        max_request_bytes: int = LINK_MAX_REQUEST_BYTES,
        chunk_bytes: int = TRANSPORT_CHUNK_BYTES,
        shaper: Shaper | None = None,
        readers: Callable[[], Mapping[bytes, str]] | None = None,
    ) -> None:
        self.creds = creds
        self._shaper = shaper
        self._readers = readers
        self._keyring = keyring
        self._authorize = authorize
        self._listen = listen
        self._max_concurrent = max_concurrent
        self._max_request = max_request_bytes
        self._chunk = chunk_bytes
        self._active = 0
        self._active_of: dict[str, int] = {}
        self._server: grpc.aio.Server | None = None
        self._handler: LinkHandler | None = None
        self.address: str | None = None
        self.refused: dict[str, int] = {}
        #: Most requests in service at once so far.
        self.peak_concurrent = 0

    async def start(self, handler: LinkHandler) -> str:
        """Listen and serve ``handler``; returns the bound address.

        Raises
        ------
        TransportError
            The port cannot be bound.
        """
        self._handler = handler
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self._max_request),
            ("grpc.max_send_message_length", max(self._chunk, 1) + 1024),
            ("grpc.so_reuseport", 0),
            ("grpc.server_handshake_timeout_ms", int(LINK_HANDSHAKE_S * 1000)),
            ("grpc.max_connection_idle_ms", int(LINK_IDLE_CONNECTION_S * 1000)),
        ]
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=2 * self._max_concurrent)
        # a stream handler runs as the call starts: the dialler is checked before its request
        # is read (the dialler's unary-stream call is the same on the wire)
        rpc = grpc.stream_stream_rpc_method_handler(
            self._serve, request_deserializer=None, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, {"Call": rpc}),)
        )
        creds = grpc.ssl_server_credentials(
            [(self.creds.key_pem, self.creds.serve_cert_pem)],
            root_certificates=link_root_pem(),
            require_client_auth=True,
        )
        host = self._listen.rpartition(":")[0]
        try:
            bound = server.add_secure_port(self._listen, creds)
        except RuntimeError as err:
            raise TransportError(f"link server cannot listen on {self._listen}: {err}") from None
        if bound == 0:
            raise TransportError(f"link server cannot listen on {self._listen}; pick a free port")
        await server.start()
        self._server = server
        self.address = f"{host}:{bound}"
        return self.address

    def _refuse(self, exc: ChaosError) -> tuple[grpc.StatusCode, str]:
        name = type(exc).__name__
        self.refused[name] = self.refused.get(name, 0) + 1
        return _code(exc), f"{name}: {exc}"

    def _peer(self, context: grpc.aio.ServicerContext[bytes, bytes]) -> str:
        auth = context.auth_context() or {}
        certs = auth.get("x509_pem_cert") or [b""]
        try:
            party = verify_dial_cert(certs[0], self.creds.federation, dict(self._keyring()))
        except (LinkAuthError, NotMemberError):
            # no charter party vouches for this key: served only if it is a pinned reader
            # (the relay's grant). A key a charter party's binding names is always that
            # party's, granted or not, so a grant can neither take a member's standing nor
            # give an evicted one back its reads.
            granted = self._readers() if self._readers is not None else {}
            reader = granted.get(peer_spki(certs[0]) or b"")
            if reader is None:
                raise
            return reader
        self._authorize(party)
        return party

    def _admit(self, party: str) -> None:
        """Take a slot for ``party``'s call, or refuse it (:class:`LinkBusyError`)."""
        if self._active >= self._max_concurrent:
            raise LinkBusyError(
                f"this donor already serves {self._max_concurrent} link requests; retry"
            )
        if self._active_of.get(party, 0) >= LINK_MAX_CONCURRENT_PER_PEER:
            raise LinkBusyError(
                f"this donor already serves {LINK_MAX_CONCURRENT_PER_PEER} link requests of "
                f"{party}; retry"
            )
        self._active += 1
        self._active_of[party] = self._active_of.get(party, 0) + 1
        self.peak_concurrent = max(self.peak_concurrent, self._active)

    def _release(self, party: str) -> None:
        self._active -= 1
        left = self._active_of.pop(party, 1) - 1
        if left > 0:
            self._active_of[party] = left

    async def _read(self, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        """The call's one request message, within ``LINK_REQUEST_READ_S``."""
        try:
            request = await asyncio.wait_for(context.read(), LINK_REQUEST_READ_S)
        except TimeoutError:
            raise TransportError(f"no request within {LINK_REQUEST_READ_S:g} s") from None
        if not isinstance(request, bytes):  # the dialler closed without a request
            raise DecodeError("the call carried no request")
        return request

    async def _serve(
        self, _requests: object, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        try:
            party = self._peer(context)
            self._admit(party)
        except ChaosError as exc:
            await context.abort(*self._refuse(exc))
            return
        try:
            assert self._handler is not None
            try:
                request = await self._read(context)
                reply = await self._handler(party, request)
            except ChaosError as exc:
                await context.abort(*self._refuse(exc))
                return
            view = memoryview(reply)
            if self._shaper is not None:
                await asyncio.sleep(self._shaper.delay_to(party))
            for start in range(0, len(view), self._chunk):
                chunk = bytes(view[start : start + self._chunk])
                if self._shaper is not None:
                    await self._shaper.pace_send(party, len(chunk))
                yield chunk
        finally:
            self._release(party)

    async def close(self) -> None:
        """Stop serving (a short grace for calls in flight)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(TRANSPORT_STOP_GRACE_S)


class LinkDialer:
    """Calls parties' link servers with this party's dial certificate.

    Parameters
    ----------
    creds
        This party's link credentials (the dial certificate proves its identity).
    max_reply_bytes
        Largest reply accepted (the donors' per-request limit plus framing).
    """

    def __init__(
        self, creds: LinkCredentials, *, max_reply_bytes: int = LINK_MAX_REPLY_FRAME_BYTES
    ) -> None:
        self.creds = creds
        self._max = max_reply_bytes
        # (address, serve certificate) -> channel, least recently used first
        self._channels: dict[tuple[str, bytes], grpc.aio.Channel] = {}
        self._key_of: dict[str, tuple[str, bytes]] = {}  # party -> its channel's key
        # calls in flight per channel (by id), and channels let go while calls were on them:
        # closed when their last call ends (closing cancels a channel's calls)
        self._busy: dict[int, int] = {}
        self._retired: dict[int, grpc.aio.Channel] = {}

    async def _channel(self, address: str, cert_der: bytes, party: str) -> grpc.aio.Channel:
        """The channel to ``address``; closes ``party``'s channel to an endpoint it left, and
        the least recently used past ``LINK_DIALER_MAX_CHANNELS``."""
        key = (address, cert_der)
        channel = self._channels.pop(key, None)
        if channel is None:  # a certificate that does not parse raises before any change
            creds = grpc.ssl_channel_credentials(
                root_certificates=serve_cert_pem_of(cert_der),
                private_key=self.creds.key_pem,
                certificate_chain=self.creds.dial_cert_pem,
            )
            options: list[tuple[str, Any]] = [
                ("grpc.ssl_target_name_override", LINK_SERVER_NAME),
                ("grpc.max_receive_message_length", self._max),
                ("grpc.max_send_message_length", self._max),
                ("grpc.enable_http_proxy", 0),
            ]
            channel = grpc.aio.secure_channel(address, creds, options=options)
        stale: list[grpc.aio.Channel] = []
        old = self._key_of.get(party) if party else None
        if old is not None and old != key and old in self._channels:
            stale.append(self._channels.pop(old))
        if party:
            self._key_of[party] = key
        self._channels[key] = channel
        while len(self._channels) > LINK_DIALER_MAX_CHANNELS:
            stale.append(self._channels.pop(next(iter(self._channels))))
        live = set(self._channels)
        self._key_of = {p: k for p, k in self._key_of.items() if k in live}
        for gone in stale:
            if self._busy.get(id(gone)):
                self._retired[id(gone)] = gone
            else:
                await gone.close()
        return channel

    async def request(
        self, address: str, cert_der: bytes, data: bytes, *, timeout: float, party: str = ""
    ) -> bytes:
        """Send ``data`` to the link server at ``address`` that must hold ``cert_der``'s key
        (``party``'s endpoint, when given: its channel to an older endpoint is closed).

        Raises
        ------
        ChaosError
            The class the server refused with, :class:`~chaos_flwr.errors.LinkAuthError` if
            the handshake failed, :class:`~chaos_flwr.errors.TransportError` otherwise (see
            :func:`typed_error`); a reply above ``max_reply_bytes`` is a
            :class:`~chaos_flwr.errors.ReplyTooLargeError`.
        """
        channel = await self._channel(address, cert_der, party)
        stub = channel.unary_stream(
            _METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        parts: list[bytes] = []
        size = 0
        cid = id(channel)
        self._busy[cid] = self._busy.get(cid, 0) + 1
        try:
            async for chunk in stub(data, timeout=timeout):
                size += len(chunk)
                if size > self._max:
                    raise ReplyTooLargeError(
                        f"link reply from {address} passed {self._max} bytes; dropped"
                    )
                parts.append(chunk)
        except grpc.aio.AioRpcError as err:
            raise typed_error(err, f"link to {address}") from None
        finally:
            await self._done(cid)
        return b"".join(parts)

    async def _done(self, cid: int) -> None:
        """A call on channel ``cid`` ended: close the channel if it was let go meanwhile."""
        left = self._busy.pop(cid, 1) - 1
        if left > 0:
            self._busy[cid] = left
        elif cid in self._retired:
            await self._retired.pop(cid).close()

    async def close(self) -> None:
        """Close every channel."""
        channels = [*self._channels.values(), *self._retired.values()]
        self._channels, self._retired = {}, {}
        for channel in channels:
            await channel.close()


@dataclass(frozen=True)
class LinkAccess:
    """What a party needs for authenticated links: its credentials, policy and view.

    Parameters
    ----------
    creds
        The party's link key and certificates.
    policy
        The federation's policy (name and charter keyring).
    view
        Returns the party's current view (e.g. ``records.view``); read per request, so a
        member that leaves or fails is refused from then on.
    """

    creds: LinkCredentials
    policy: Policy
    view: Callable[[], View]

    def authorize(self, party: str) -> None:
        """Raise :class:`~chaos_flwr.errors.NotMemberError` unless ``party`` is active in the
        view, or is a newcomer its own signature alone admits: a charter party the view has
        never listed (not one that left or was failed: leaving or failing ends its reads),
        that is a founder or joins where ``admission.sponsors_required`` is 0. Its charter key
        vouched for its link key, and its join needs no one else, so serving it before that
        join reaches this donor gives nothing away. That is how a joiner that came while the
        members train pulls from their daemons."""
        view = self.view()
        if view.is_active(party):
            return
        policy = self.policy
        newcomer = party in policy.keyring and party not in view.members
        if newcomer and (party in policy.founders or policy.sponsors_required == 0):
            return
        raise NotMemberError(f"{party} is not an active member in this donor's view")

    def may_ask(self, party: str) -> None:
        """Raise :class:`~chaos_flwr.errors.NotMemberError` unless ``party`` may be let into a
        call by a server that also countersigns joins: one :meth:`authorize` serves, or any
        other charter party (a joiner asking for its sponsors' signatures, or a party that
        left or was failed joining again). Such a server checks :meth:`authorize` again for
        every request but a countersign (:mod:`chaos_flwr.countersign`)."""
        if party not in self.policy.keyring:
            raise NotMemberError(f"{party} is no charter party")

    def endpoint(self, party: str, offered: str | None = None) -> EndpointInfo:
        """The endpoint to dial ``party`` at: from its verified endpoint record only.

        Parameters
        ----------
        offered
            An address that arrived some other way (the relay); it must be the signed one.

        Raises
        ------
        EndpointError
            ``party`` is not active or announced no endpoint for its incarnation, or
            ``offered`` is not the address its record signs.
        """
        ep = self.view().endpoint(party)
        if ep is None:
            raise EndpointError(
                f"no verified endpoint record of an active member {party}: not dialled"
            )
        if offered is not None:
            try:
                host_port = parse_address(offered)
            except DecodeError as exc:
                raise EndpointError(f"offered address for {party} is malformed: {exc}") from None
            if host_port != (ep.host, ep.port):
                raise EndpointError(
                    f"address {offered!r:.80} offered for {party} is not the one its endpoint "
                    f"record signs ({ep.address}): not dialled"
                )
        return ep


@dataclass(frozen=True)
class LinkLimits:
    """A donor's limits (defaults: ``LINK_*`` in :mod:`chaos_flwr.defaults`)."""

    max_concurrent: int = LINK_MAX_CONCURRENT_REQUESTS
    max_request_bytes: int = LINK_MAX_REQUEST_BYTES
    max_reply_bytes: int = LINK_MAX_REPLY_BYTES
    peer_window_bytes: int = LINK_PEER_WINDOW_BYTES
    peer_window_s: float = LINK_PEER_WINDOW_S


class PeerQuota:
    """Reply bytes per peer per fixed window (``limits.peer_window_*``; ``clock``: seconds)."""

    def __init__(self, limits: LinkLimits, clock: Callable[[], float]) -> None:
        self._limits, self._clock = limits, clock
        self._windows: dict[str, tuple[float, int]] = {}

    def charge(self, peer: str, nbytes: int) -> None:
        """Count ``nbytes`` to ``peer``'s window.

        Raises
        ------
        LinkQuotaError
            The window would pass ``peer_window_bytes`` (nothing is counted then).
        """
        now = self._clock()
        start, used = self._windows.get(peer, (now, 0))
        if now - start >= self._limits.peer_window_s:
            start, used = now, 0
        if used + nbytes > self._limits.peer_window_bytes:
            raise LinkQuotaError(
                f"{peer} asked {used + nbytes} bytes in {self._limits.peer_window_s:g} s, above "
                f"{self._limits.peer_window_bytes}; retry in the next window"
            )
        if peer not in self._windows and len(self._windows) >= LINK_MAX_TRACKED_PEERS:
            self._windows.clear()  # only a long-lived churn of ids gets here
        self._windows[peer] = (start, used + nbytes)
