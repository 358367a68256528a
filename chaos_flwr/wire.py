"""Signed envelopes: the exact bytes are signed, and verified before anything inside is trusted.

Every protocol message between parties travels as one **envelope**. The frame is::

    offset  size  field
    0       4     magic  b"CHFE"
    4       1     version (1)
    5       17    sender party id, ASCII ("p" + 16 lowercase hex digits)
    22      4     body length n, unsigned big-endian
    26      n     body: codec.encode({"fed", "inc", "kind", "payload", "seq", "to", "ts"})
    26+n    64    Ed25519 signature over  DOMAIN + frame[0 : 26+n]

``DOMAIN`` is ``b"chaos-flwr/envelope/v1\\x00"``, so an envelope signature can never be taken for
a record or charter signature (those have their own domains). The signature covers the header
too, so the sender cannot be swapped.

``fed`` names the federation the envelope is meant for: the sealer's charter digest (32 bytes;
empty for an unbound envelope). It is signed with the rest, so a receiver that passes its own
charter digest as ``federation`` to :func:`open_sealed` refuses an envelope from another
federation (:class:`~chaos_flwr.errors.FederationMismatchError`), even one signed by a key
both charters list. :class:`~chaos_flwr.peer.Peer` seals and opens with its charter's digest.

:func:`open_sealed` works in a fixed order and stops at the first failure: the size limit
(:class:`~chaos_flwr.errors.OversizeError`), the fixed header and the length
(:class:`~chaos_flwr.errors.DecodeError`), the sender's key
(:class:`~chaos_flwr.errors.UnknownPartyError`), the signature
(:class:`~chaos_flwr.errors.SignatureError`); only a verified body is decoded, strictly and
canonically (:class:`~chaos_flwr.errors.DecodeError`). Opening is pure: it changes no state.

Replay protection is separate (:class:`ReplayGuard`) because it is state: ``check`` never
mutates, ``accept`` records an envelope once the receiver has acted on it.

Sans-I/O: nothing here reads a clock; time comes in as ``now``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from . import codec
from .defaults import (
    WIRE_MAX_AGE_S,
    WIRE_MAX_CLOCK_SKEW_S,
    WIRE_MAX_ENVELOPE_BYTES,
    WIRE_REPLAY_WINDOW,
)
from .errors import (
    DecodeError,
    EncodeError,
    FederationMismatchError,
    OversizeError,
    ReplayError,
    SignatureError,
    StaleIncarnationError,
    UnknownPartyError,
)
from .identity import PARTY_ID_LENGTH, SIGNATURE_BYTES, Identity, is_party_id, verify_signature

__all__ = [
    "DOMAIN",
    "HEADER_BYTES",
    "MAGIC",
    "OVERHEAD_BYTES",
    "VERSION",
    "Envelope",
    "ReplayGuard",
    "SealOptions",
    "open_sealed",
    "peek_sender",
    "seal",
]

#: First bytes of every envelope.
MAGIC = b"CHFE"
#: Frame version this build writes and reads.
VERSION = 1
#: Domain separation prefix of envelope signatures.
DOMAIN = b"chaos-flwr/envelope/v1\x00"

_PREFIX = MAGIC + bytes([VERSION])
_SENDER_AT = len(_PREFIX)
_LEN_AT = _SENDER_AT + PARTY_ID_LENGTH
_U32 = struct.Struct(">I")
#: Size of the fixed header (magic, version, sender, body length).
HEADER_BYTES = _LEN_AT + _U32.size
#: Bytes an envelope adds to its body (header + signature).
OVERHEAD_BYTES = HEADER_BYTES + SIGNATURE_BYTES
_BODY_KEYS = frozenset({"fed", "inc", "kind", "payload", "seq", "to", "ts"})
_INT_MAX = 2**63 - 1
_MAX_FED_BYTES = 64


@dataclass(frozen=True, slots=True)
class Envelope:
    """A verified, decoded envelope.

    Attributes
    ----------
    sender : str
        Party id of the signer (read from the header, proven by the signature).
    incarnation : int
        The sender's incarnation (grows each time it rejoins after a failure).
    seq : int
        The sender's sequence number within the incarnation.
    timestamp : float
        The sender's clock when it sealed the envelope, in seconds.
    kind : str
        Message type (interpreted by the peer layer).
    to : str | None
        Intended receiver's party id, or ``None`` for a message meant for any receiver.
    payload : dict[str, Any]
        The message content (codec values).
    raw : bytes
        The exact bytes received (for forwarding unchanged).
    federation : bytes
        The charter digest the sender sealed it for (empty: unbound).
    """

    sender: str
    incarnation: int
    seq: int
    timestamp: float
    kind: str
    to: str | None
    payload: dict[str, Any]
    raw: bytes
    federation: bytes = b""

    @property
    def signature(self) -> bytes:
        """The 64-byte signature at the end of :attr:`raw`."""
        return self.raw[-SIGNATURE_BYTES:]


class SealOptions(TypedDict, total=False):
    """The optional keywords of :func:`seal` (see there): ``to``, ``federation``, ``max_bytes``."""

    to: str | None
    federation: bytes
    max_bytes: int


_SEAL_OPTIONS = frozenset(SealOptions.__annotations__)


def seal(
    identity: Identity,
    *,
    incarnation: int,
    seq: int,
    timestamp: float,
    kind: str,
    payload: Mapping[str, Any],
    **options: Unpack[SealOptions],
) -> bytes:
    """Build and sign an envelope.

    Parameters
    ----------
    identity
        The sender (signs the envelope; its party id goes in the header).
    incarnation, seq
        The sender's incarnation and sequence number (non-negative 64-bit integers).
    timestamp
        The sender's ``now`` in seconds (finite).
    kind
        Message type, a non-empty string.
    payload
        The message content: a mapping of codec values.
    to
        Receiver's party id, or ``None``.
    federation
        The charter digest of the federation it is meant for (signed; ``b""``: unbound).
    max_bytes
        Refuse to build an envelope larger than this (receivers refuse it anyway).

    Returns
    -------
    bytes
        The envelope.

    Raises
    ------
    EncodeError
        If a field is out of range or the payload holds a value the codec cannot encode.
    OversizeError
        If the envelope would exceed ``max_bytes``.
    """
    if not options.keys() <= _SEAL_OPTIONS:
        unknown = sorted(options.keys() - _SEAL_OPTIONS)
        raise TypeError(f"seal() got unexpected keyword arguments {unknown}")
    to = options.get("to")
    federation = options.get("federation", b"")
    max_bytes = options.get("max_bytes", WIRE_MAX_ENVELOPE_BYTES)
    ts = _checked_header(incarnation, seq, timestamp, kind, to, federation)
    if not isinstance(payload, Mapping):
        raise EncodeError(
            f"envelope field 'payload' must be a mapping, got {type(payload).__name__}"
        )
    try:
        body = codec.encode(
            {
                "fed": federation,
                "inc": incarnation,
                "kind": kind,
                "payload": payload,
                "seq": seq,
                "to": to,
                "ts": ts,
            }
        )
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"envelope field 'payload' cannot be encoded: {exc}") from exc
    size = OVERHEAD_BYTES + len(body)
    if size > max_bytes:
        raise OversizeError(
            f"envelope of kind {kind!r} would be {size} bytes, the limit is {max_bytes}; "
            "split the payload"
        )
    head = _PREFIX + identity.party_id.encode("ascii") + _U32.pack(len(body)) + body
    return head + identity.sign(DOMAIN + head)


def _checked_header(
    incarnation: int, seq: int, timestamp: float, kind: str, to: str | None, federation: bytes
) -> float:
    """Check the fields :func:`seal` puts beside the payload; returns the timestamp as float."""
    if type(incarnation) is not int or not 0 <= incarnation <= _INT_MAX:
        raise EncodeError(
            f"envelope field 'incarnation' must be an int in [0, 2**63), got {incarnation!r}"
        )
    if type(seq) is not int or not 0 <= seq <= _INT_MAX:
        raise EncodeError(f"envelope field 'seq' must be an int in [0, 2**63), got {seq!r}")
    ts = float(timestamp)
    if not math.isfinite(ts):
        raise EncodeError(f"envelope field 'timestamp' must be finite, got {timestamp!r}")
    if not isinstance(kind, str) or not kind:
        raise EncodeError(f"envelope field 'kind' must be a non-empty string, got {kind!r}")
    if to is not None and not is_party_id(to):
        raise EncodeError(f"envelope field 'to' must be a party id or None, got {to!r}")
    if type(federation) is not bytes or len(federation) > _MAX_FED_BYTES:
        raise EncodeError(
            f"envelope field 'federation' must be at most {_MAX_FED_BYTES} bytes, "
            f"got {federation!r:.40}"
        )
    return ts


def peek_sender(data: bytes | bytearray | memoryview) -> str:
    """Read the claimed sender from the fixed header, without verifying anything.

    For routing and logging only: the claim is proven by :func:`open_sealed`, not here.

    Raises
    ------
    DecodeError
        If the bytes do not start with a well-formed header.
    """
    raw = bytes(data[:HEADER_BYTES])
    _check_prefix(raw, len(data))
    return _sender_of(raw)


def open_sealed(
    data: bytes | bytearray | memoryview,
    keyring: Mapping[str, bytes],
    *,
    federation: bytes | None = None,
    max_bytes: int = WIRE_MAX_ENVELOPE_BYTES,
    verify: Callable[[bytes, bytes, bytes], None] | None = None,
) -> Envelope:
    """Verify and decode an envelope.

    Parameters
    ----------
    data
        The bytes as received.
    keyring
        Party id -> raw 32-byte Ed25519 public key of every party this receiver knows.
    federation
        This receiver's charter digest: a verified envelope sealed for another federation is
        refused. ``None`` accepts any (observers that only read signed records).
    max_bytes
        Refuse larger input before looking at it.
    verify
        ``verify(public_key, signature, signed_bytes)`` raising
        :class:`~chaos_flwr.errors.SignatureError`; default
        :func:`chaos_flwr.identity.verify_signature`. A peer passes its own
        :meth:`chaos_flwr.membership.SignatureCache.verify`, so a signature it has verified
        (here, or as the proof of a record, see :mod:`chaos_flwr.membership`) is not checked twice
        by that peer; the signature is always checked before anything inside is used.

    Returns
    -------
    Envelope
        The verified envelope.

    Raises
    ------
    OversizeError
        If ``data`` is longer than ``max_bytes``.
    DecodeError
        If the frame is truncated, has trailing bytes, a wrong magic or version, or a body that
        is not a canonical envelope body.
    UnknownPartyError
        If the sender is not in ``keyring``.
    SignatureError
        If the signature does not verify under the sender's key.
    FederationMismatchError
        If ``federation`` is given and the (verified) envelope names another federation.
    """
    size = len(data)
    if size > max_bytes:
        raise OversizeError(
            f"envelope is {size} bytes, the limit is {max_bytes}; it was refused unread"
        )
    raw = data if type(data) is bytes else bytes(data)
    sender, key, end = _frame_of(raw, size, keyring)
    head = raw[:end]
    try:
        (verify or verify_signature)(key, raw[end:], DOMAIN + head)
    except SignatureError as exc:
        raise SignatureError(f"envelope from {sender} refused: {exc}") from None
    env = _body_of(raw, head[HEADER_BYTES:], sender)
    if federation is not None and env.federation != federation:
        theirs = env.federation.hex()[:16] or "(none)"
        raise FederationMismatchError(
            f"envelope from {sender} was sealed for federation {theirs}, this receiver's "
            f"charter digest is {federation.hex()[:16]}: it belongs to another federation"
        )
    return env


def _frame_of(raw: bytes, size: int, keyring: Mapping[str, bytes]) -> tuple[str, bytes, int]:
    """Check the frame around the body; returns the sender, its key and where the body ends."""
    if size < OVERHEAD_BYTES or raw[:_SENDER_AT] != _PREFIX:
        _check_prefix(raw, size)  # raises, naming what is wrong
    # A sender id the keyring knows is a well-formed party id: the full check (and its error
    # messages) is only needed for one it does not know.
    sender_raw = raw[_SENDER_AT:_LEN_AT]
    key = None
    if sender_raw.isascii():
        sender = sender_raw.decode("ascii")
        key = keyring.get(sender)
    if key is None:
        sender = _sender_of(raw)
    (body_len,) = _U32.unpack_from(raw, _LEN_AT)
    end = HEADER_BYTES + body_len
    if end + SIGNATURE_BYTES != size:
        raise DecodeError(
            f"envelope from {sender} declares a {body_len}-byte body, so it must be "
            f"{end + SIGNATURE_BYTES} bytes long, but it is {size}"
            + (" (truncated)" if size < end + SIGNATURE_BYTES else " (trailing bytes)")
        )
    if key is None:
        raise UnknownPartyError(
            f"envelope from {sender}, a party this receiver has no key for; add it to the "
            "charter's allowlist (or the receiver's keyring)"
        )
    return sender, key, end


def _check_prefix(raw: bytes, size: int) -> None:
    if size < OVERHEAD_BYTES:
        raise DecodeError(
            f"envelope is {size} bytes, shorter than the {OVERHEAD_BYTES}-byte header and "
            "signature (truncated)"
        )
    if raw[:_SENDER_AT] != _PREFIX:
        if raw[: len(MAGIC)] != MAGIC:
            raise DecodeError("input is not a chaos-flwr envelope (bad magic bytes)")
        raise DecodeError(
            f"envelope version {raw[len(MAGIC)]} is not supported (this build reads {VERSION}); "
            "upgrade chaos-flwr on both ends"
        )


def _sender_of(raw: bytes) -> str:
    sender_raw = raw[_SENDER_AT:_LEN_AT]
    try:
        sender = sender_raw.decode("ascii")
    except UnicodeDecodeError:
        raise DecodeError("envelope header field 'sender' is not ASCII") from None
    if not is_party_id(sender):
        raise DecodeError(f"envelope header field 'sender' {sender!r} is not a party id")
    return sender


def _body_of(raw: bytes, body_raw: bytes, sender: str) -> Envelope:
    body = codec.decode(body_raw)
    if type(body) is not dict or body.keys() != _BODY_KEYS:
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise DecodeError(
            f"envelope body from {sender} must be a map with keys {sorted(_BODY_KEYS)}, got {got}"
        )
    fed = body["fed"]
    inc = body["inc"]
    seq = body["seq"]
    ts = body["ts"]
    kind = body["kind"]
    to = body["to"]
    payload = body["payload"]
    if type(fed) is not bytes or len(fed) > _MAX_FED_BYTES:
        raise DecodeError(f"envelope field 'federation' from {sender} is not a charter digest")
    if type(inc) is not int or inc < 0:
        raise DecodeError(f"envelope field 'incarnation' from {sender} is {inc!r}, not an int >= 0")
    if type(seq) is not int or seq < 0:
        raise DecodeError(f"envelope field 'seq' from {sender} is {seq!r}, not an int >= 0")
    if type(ts) is not float or not math.isfinite(ts):
        raise DecodeError(f"envelope field 'timestamp' from {sender} is {ts!r}, not a finite float")
    if type(kind) is not str or not kind:
        raise DecodeError(f"envelope field 'kind' from {sender} is {kind!r}, not a string")
    if to is not None and not is_party_id(to):
        raise DecodeError(f"envelope field 'to' from {sender} is {to!r}, not a party id")
    if type(payload) is not dict:
        raise DecodeError(
            f"envelope field 'payload' from {sender} is a {type(payload).__name__}, not a map"
        )
    return Envelope(sender, inc, seq, ts, kind, to, payload, raw, fed)


class ReplayGuard:
    """Refuses replayed, reordered-too-far and stale-incarnation envelopes.

    Per sender it remembers the highest incarnation seen and, within it, the highest sequence
    number and which of the ``window`` numbers below it were seen (a bitmap, as in IPsec).
    Within an incarnation, envelopes may arrive out of order inside the window, never twice;
    a number older than the window is refused. A higher incarnation starts afresh; a lower one
    is refused.

    **The state lives in memory only.** A receiver that restarts with an empty guard would accept
    a replay of any envelope its senders sent in their current incarnations (records and votes
    are idempotent sets, but a replayed heartbeat could make a crashed party look alive for a
    while, and a replayed probe gets answered). The core does no I/O, so persisting it is the
    caller's job: take :meth:`snapshot` (plain ints, codec-encodable) whenever convenient, store
    it, and rebuild with :meth:`from_snapshot` on restart (``Peer(replay_state=...)`` /
    :meth:`chaos_flwr.peer.Peer.replay_state`). A snapshot older than the crash is still safe
    for everything it covers; envelopes newer than it are the only exposure.

    Parameters
    ----------
    window
        Sequence numbers remembered per sender (>= 1).
    max_skew_s
        Refuse envelopes stamped more than this many seconds after ``now`` (``None``: off).
    max_age_s
        Refuse envelopes stamped more than this many seconds before ``now`` (``None``: off).
    """

    __slots__ = ("_state", "max_age_s", "max_skew_s", "window")

    def __init__(
        self,
        window: int = WIRE_REPLAY_WINDOW,
        *,
        max_skew_s: float | None = WIRE_MAX_CLOCK_SKEW_S,
        max_age_s: float | None = WIRE_MAX_AGE_S,
    ) -> None:
        if type(window) is not int or window < 1:
            raise EncodeError(f"ReplayGuard field 'window' must be an int >= 1, got {window!r}")
        for name, value in (("max_skew_s", max_skew_s), ("max_age_s", max_age_s)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise EncodeError(
                    f"ReplayGuard field {name!r} must be a finite number >= 0 or None, "
                    f"got {value!r}"
                )
        self.window = window
        self.max_skew_s = max_skew_s
        self.max_age_s = max_age_s
        # sender -> [incarnation, highest seq, bitmap (bit i: highest - i was seen)]
        self._state: dict[str, list[int]] = {}

    def check(self, env: Envelope, now: float) -> None:
        """Raise if ``env`` must be refused; never changes the guard.

        Raises
        ------
        StaleIncarnationError
            If the sender has been seen at a higher incarnation.
        ReplayError
            If this sequence number was already accepted, is older than the window, or the
            timestamp is outside the allowed skew or age.
        """
        if self.max_skew_s is not None and env.timestamp > now + self.max_skew_s:
            raise ReplayError(
                f"envelope field 'timestamp' from {env.sender} is {env.timestamp}, more than "
                f"{self.max_skew_s} s after now ({now}); check the sender's clock"
            )
        if self.max_age_s is not None and env.timestamp < now - self.max_age_s:
            raise ReplayError(
                f"envelope field 'timestamp' from {env.sender} is {env.timestamp}, more than "
                f"{self.max_age_s} s before now ({now}); it is too old to accept"
            )
        self._check_seq(env)

    def accept(self, env: Envelope) -> None:
        """Record ``env`` as seen (call after :meth:`check` passed and the envelope was used).

        The sequence checks of :meth:`check` are repeated, so a duplicate can never be recorded
        twice; on failure nothing changes.

        Raises
        ------
        StaleIncarnationError, ReplayError
            As :meth:`check` (the time checks excepted).
        """
        state = self._check_seq(env)
        if state is None or env.incarnation > state[0]:
            self._state[env.sender] = [env.incarnation, env.seq, 1]
            return
        highest = state[1]
        if env.seq > highest:
            shift = env.seq - highest
            state[2] = (
                ((state[2] << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
            )
            state[1] = env.seq
        else:
            state[2] |= 1 << (highest - env.seq)

    def _check_seq(self, env: Envelope) -> list[int] | None:
        state = self._state.get(env.sender)
        if state is None:
            return None
        incarnation, highest, seen = state
        if env.incarnation < incarnation:
            raise StaleIncarnationError(
                f"envelope field 'incarnation' from {env.sender} is {env.incarnation}, but "
                f"incarnation {incarnation} was already seen; the sender restarted since"
            )
        if env.incarnation > incarnation or env.seq > highest:
            return state
        age = highest - env.seq
        if age >= self.window:
            raise ReplayError(
                f"envelope field 'seq' from {env.sender} is {env.seq}, older than the replay "
                f"window ({self.window} below the highest seen, {highest})"
            )
        if seen >> age & 1:
            raise ReplayError(
                f"envelope from {env.sender} (incarnation {env.incarnation}, seq {env.seq}) "
                "was already accepted (replay)"
            )
        return state

    def position(self, sender: str) -> tuple[int, int] | None:
        """``(incarnation, highest seq)`` accepted from ``sender``, or ``None`` if none yet."""
        state = self._state.get(sender)
        return None if state is None else (state[0], state[1])

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """A copy of the whole state: sender -> (incarnation, highest seq, seen bitmap)."""
        return {sender: (s[0], s[1], s[2]) for sender, s in self._state.items()}

    @classmethod
    def from_snapshot(
        cls,
        snapshot: Mapping[str, Any],
        window: int = WIRE_REPLAY_WINDOW,
        *,
        max_skew_s: float | None = WIRE_MAX_CLOCK_SKEW_S,
        max_age_s: float | None = WIRE_MAX_AGE_S,
    ) -> ReplayGuard:
        """Rebuild a guard from :meth:`snapshot` (tuples or lists, e.g. after a codec round trip).

        Raises
        ------
        DecodeError
            If an entry is not ``party id -> (incarnation, seq, bitmap)`` of non-negative ints
            with a bitmap that fits the window.
        """
        guard = cls(window, max_skew_s=max_skew_s, max_age_s=max_age_s)
        if not isinstance(snapshot, Mapping):
            raise DecodeError("replay snapshot must be a map party id -> [inc, seq, bitmap]")
        for sender, entry in snapshot.items():
            if not isinstance(sender, str) or not is_party_id(sender):
                raise DecodeError(f"replay snapshot key {sender!r} is not a party id")
            if (
                not isinstance(entry, tuple | list)
                or len(entry) != 3
                or any(type(v) is not int or v < 0 for v in entry)
                or entry[2] >= 1 << window
            ):
                raise DecodeError(
                    f"replay snapshot entry of {sender} must be [incarnation, seq, bitmap] "
                    f"(non-negative ints, bitmap below 2**{window}), got {entry!r:.80}"
                )
            guard._state[sender] = [entry[0], entry[1], entry[2]]
        return guard

    def __len__(self) -> int:
        return len(self._state)
