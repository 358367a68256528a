"""The pull's messages: what a puller asks a holder, what the holder answers (one class each).

A pull of a certified state is a negotiation between the party that needs the state (a joiner,
or a restarted ServerApp) and the parties that hold it. It has three requests and three
replies; every carrier (Flower's relay, a direct grpc link, a test) moves them as plain values
(:meth:`to_value` / :func:`read_request` / :func:`read_reply`), and every field is checked on the
way in, with a :class:`~chaos_flwr.errors.DecodeError` naming it.

=======================  ============================================================
request                  reply
=======================  ============================================================
:class:`SizeRequest`     :class:`SizeReply` (state size, and the holder's direct link)
:class:`ManifestRequest` :class:`ManifestReply` for the shard shape the puller planned
                         (:class:`SizeReply` instead when the holder's size differs)
:class:`ShardsRequest`   :class:`ShardsReply` (the byte ranges asked for)
=======================  ============================================================

The puller plans; the holder is *told* the shard shape and never plans. :func:`serve` is the
holder's whole side: a pure function of its replica bytes and the request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from chaos_flwr.defaults import PLANNER_MAX_SHARDS
from chaos_flwr.errors import ChaosError, DecodeError
from chaos_flwr.state import Manifest

__all__ = [
    "PULL_MAX_RANGES",
    "ManifestReply",
    "ManifestRequest",
    "Op",
    "Reply",
    "Request",
    "ShardsReply",
    "ShardsRequest",
    "SizeReply",
    "SizeRequest",
    "read_reply",
    "read_request",
    "serve",
]

#: Most byte ranges one shards request may name (a plan never has more shards than this).
PULL_MAX_RANGES: int = PLANNER_MAX_SHARDS


class Op(StrEnum):
    """What a request asks for (its ``op`` field on the wire)."""

    SIZE = "size"
    MANIFEST = "manifest"
    SHARDS = "shards"


def _int(value: Mapping[str, object], key: str, *, least: int = 0) -> int:
    got = value.get(key)
    if not isinstance(got, int) or isinstance(got, bool) or got < least:
        raise DecodeError(f"pull message field {key!r} must be an int >= {least}, got {got!r}")
    return got


def _ints(value: Mapping[str, object], key: str) -> tuple[int, ...]:
    got = value.get(key)
    if not isinstance(got, list | tuple) or len(got) > PULL_MAX_RANGES:
        raise DecodeError(f"pull message field {key!r} must be a list of <= {PULL_MAX_RANGES}")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in got):
        raise DecodeError(f"pull message field {key!r} must hold ints >= 0")
    return tuple(got)


def _direct(value: Mapping[str, object]) -> str:
    got = value.get("direct", "")
    if not isinstance(got, str):
        raise DecodeError(f"pull message field 'direct' must be a str, got {type(got).__name__}")
    return got


@dataclass(frozen=True)
class SizeRequest:
    """Ask a holder for the state's size (and, in its reply, its direct address)."""

    def to_value(self) -> dict[str, object]:
        """The request as plain values."""
        return {"op": Op.SIZE.value}


@dataclass(frozen=True)
class ManifestRequest:
    """Ask a holder for the manifest of the state cut as the puller planned.

    Attributes
    ----------
    total:
        The state size the plan was made for.
    shard_bytes, num_shards:
        The shard shape (``num_shards`` shards of ``shard_bytes``, the last one shorter).
    """

    total: int
    shard_bytes: int
    num_shards: int

    def to_value(self) -> dict[str, object]:
        """The request as plain values."""
        return {
            "op": Op.MANIFEST.value,
            "total": self.total,
            "shard-bytes": self.shard_bytes,
            "num-shards": self.num_shards,
        }


@dataclass(frozen=True)
class ShardsRequest:
    """Ask a holder for shards: ``index[i]`` is bytes ``[start[i], end[i])`` of the state."""

    index: tuple[int, ...]
    start: tuple[int, ...]
    end: tuple[int, ...]

    def to_value(self) -> dict[str, object]:
        """The request as plain values."""
        return {
            "op": Op.SHARDS.value,
            "index": list(self.index),
            "start": list(self.start),
            "end": list(self.end),
        }


Request = SizeRequest | ManifestRequest | ShardsRequest


@dataclass(frozen=True)
class SizeReply:
    """The holder's state size and its direct replica server (``""``: relay only)."""

    total: int
    direct: str = ""

    def to_value(self) -> dict[str, object]:
        """The reply as plain values."""
        return {"total": self.total, **({"direct": self.direct} if self.direct else {})}


@dataclass(frozen=True)
class ManifestReply:
    """The manifest (:meth:`~chaos_flwr.state.Manifest.to_bytes`) of the shape asked for."""

    total: int
    manifest: bytes
    direct: str = ""

    def to_value(self) -> dict[str, object]:
        """The reply as plain values."""
        extra = {"direct": self.direct} if self.direct else {}
        return {"total": self.total, "manifest": self.manifest, **extra}


@dataclass(frozen=True)
class ShardsReply:
    """Shards asked for: ``data[i]`` is shard ``index[i]``."""

    index: tuple[int, ...]
    data: tuple[bytes, ...]

    def to_value(self) -> dict[str, object]:
        """The reply as plain values."""
        return {"index": list(self.index), "data": list(self.data)}


Reply = SizeReply | ManifestReply | ShardsReply


def read_request(value: Mapping[str, object]) -> Request:
    """A request from plain values (a holder reads what the relay hands it).

    Raises
    ------
    DecodeError
        Unknown ``op``, a missing or mistyped field, lists of different lengths, a range with
        ``start > end``, more than :data:`PULL_MAX_RANGES` ranges.
    """
    op = value.get("op")
    if op == Op.SIZE:
        return SizeRequest()
    if op == Op.MANIFEST:
        num_shards = _int(value, "num-shards")
        if num_shards > PULL_MAX_RANGES:  # a holder hashes once per shard: bounded work
            raise DecodeError(f"pull request field 'num-shards' must be <= {PULL_MAX_RANGES}")
        return ManifestRequest(
            _int(value, "total"), _int(value, "shard-bytes", least=1), num_shards
        )
    if op == Op.SHARDS:
        index, start, end = _ints(value, "index"), _ints(value, "start"), _ints(value, "end")
        if not len(index) == len(start) == len(end):
            raise DecodeError("pull request lists 'index'/'start'/'end' must have one length")
        if any(s > e for s, e in zip(start, end, strict=True)):
            raise DecodeError("pull request ranges must have 0 <= start <= end")
        return ShardsRequest(index, start, end)
    ops = ", ".join(o.value for o in Op)
    raise DecodeError(f"pull request field 'op' must be one of {ops}, got {op!r}")


def read_reply(value: Mapping[str, object]) -> Reply:
    """A reply from plain values (the puller reads what a holder sent).

    Raises
    ------
    DecodeError
        A reply of no known shape, or a mistyped field.
    """
    if "index" in value or "data" in value:
        index, data = _ints(value, "index"), value.get("data")
        if not isinstance(data, list | tuple) or len(data) != len(index):
            raise DecodeError("pull reply field 'data' must be a list as long as 'index'")
        if not all(isinstance(d, bytes) for d in data):
            raise DecodeError("pull reply field 'data' must hold bytes")
        return ShardsReply(index, tuple(data))
    total, direct = _int(value, "total"), _direct(value)
    if "manifest" in value:
        raw = value.get("manifest")
        if not isinstance(raw, bytes):
            raise DecodeError("pull reply field 'manifest' must be bytes")
        return ManifestReply(total, raw, direct)
    return SizeReply(total, direct)


def serve(state: bytes, request: Request, *, direct_addr: str = "") -> Reply:
    """A holder's answer to ``request`` over its replica bytes ``state`` (pure).

    A shards request may ask for at most the state's size in all (no amplification: a small
    request never makes a holder send more than one copy of its state).

    Parameters
    ----------
    direct_addr:
        The holder's direct replica server (``host:port``), named in size and manifest replies.

    Raises
    ------
    DecodeError
        A range past the state's end, more bytes in all than the state holds, or a shard shape
        that does not cut the state.
    """
    total = len(state)
    if isinstance(request, SizeRequest):
        return SizeReply(total, direct_addr)
    if isinstance(request, ManifestRequest):
        if request.total != total:
            return SizeReply(total, direct_addr)  # the puller planned for another size
        try:
            manifest = Manifest.build(state, request.shard_bytes, num_shards=request.num_shards)
        except (ChaosError, ValueError) as exc:
            raise DecodeError(f"pull request shard shape does not cut the state: {exc}") from exc
        return ManifestReply(total, manifest.to_bytes(), direct_addr)
    if any(e > total for e in request.end):
        raise DecodeError(f"pull request ranges must end within the state ({total} bytes)")
    if sum(e - s for s, e in zip(request.start, request.end, strict=True)) > total:
        raise DecodeError(f"pull request asks for more than the state's {total} bytes in all")
    data = tuple(state[s:e] for s, e in zip(request.start, request.end, strict=True))
    return ShardsReply(request.index, data)
