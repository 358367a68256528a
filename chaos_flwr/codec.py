"""Canonical binary encoding for everything chaos-flwr signs or hashes.

Signatures are only meaningful over bytes that every party produces identically, so values are
encoded in one canonical form: map keys sorted, integers and floats in fixed width, no
alternatives. The decoder is strict and bounded: it refuses anything the encoder would not have
produced (unsorted or duplicate keys, trailing bytes, lengths past the end, over-deep nesting),
raising :class:`~chaos_flwr.errors.DecodeError`.

Supported values: ``None``, ``bool``, ``int`` (signed 64-bit), ``float`` (IEEE-754 double, not
NaN), ``str``, ``bytes``, ``list``/``tuple`` (decoded as ``list``) and ``dict`` with ``str`` keys.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from .defaults import CODEC_MAX_DEPTH
from .errors import DecodeError, OversizeError

__all__ = ["decode", "encode"]

_NONE = 0x00
_FALSE = 0x01
_TRUE = 0x02
_INT = 0x03
_FLOAT = 0x04
_STR = 0x05
_BYTES = 0x06
_LIST = 0x07
_MAP = 0x08

_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")
_U32 = struct.Struct(">I")
_INT_MIN = -(2**63)
_INT_MAX = 2**63 - 1
_LEN_MAX = 2**32 - 1


def encode(value: Any) -> bytes:
    """Encode ``value`` canonically.

    Parameters
    ----------
    value
        A tree of the supported types (see the module docstring).

    Returns
    -------
    bytes
        The canonical encoding; equal values always give equal bytes.

    Raises
    ------
    TypeError
        If the tree holds an unsupported type or a non-``str`` map key.
    ValueError
        If an integer does not fit in 64 bits, a float is NaN, or a length exceeds 2**32 - 1.
    """
    out = bytearray()
    _encode_into(out, value, 0)
    return bytes(out)


def _encode_into(out: bytearray, value: Any, depth: int) -> None:
    if depth > CODEC_MAX_DEPTH:
        raise ValueError(f"value nests deeper than {CODEC_MAX_DEPTH} levels")
    if value is None:
        out.append(_NONE)
    elif value is True:
        out.append(_TRUE)
    elif value is False:
        out.append(_FALSE)
    elif isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise ValueError(f"integer {value} does not fit in a signed 64-bit field")
        out.append(_INT)
        out += _I64.pack(value)
    elif isinstance(value, float):
        if math.isnan(value):
            raise ValueError("NaN has no canonical encoding")
        out.append(_FLOAT)
        out += _F64.pack(value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        _put_len(out, _STR, len(raw))
        out += raw
    elif isinstance(value, bytes | bytearray | memoryview):
        raw_b = bytes(value)
        _put_len(out, _BYTES, len(raw_b))
        out += raw_b
    elif isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"map keys must be str, got {type(key).__name__}")
            items.append((key.encode("utf-8"), item))
        items.sort(key=lambda kv: kv[0])
        _put_len(out, _MAP, len(items))
        for key_raw, item in items:
            _put_len(out, _STR, len(key_raw))
            out += key_raw
            _encode_into(out, item, depth + 1)
    elif isinstance(value, Sequence):
        _put_len(out, _LIST, len(value))
        for item in value:
            _encode_into(out, item, depth + 1)
    else:
        raise TypeError(f"cannot encode a value of type {type(value).__name__}")


def _put_len(out: bytearray, tag: int, n: int) -> None:
    if n > _LEN_MAX:
        raise ValueError(f"length {n} exceeds the 32-bit limit")
    out.append(tag)
    out += _U32.pack(n)


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int | None = None) -> Any:
    """Decode canonical bytes produced by :func:`encode`.

    Parameters
    ----------
    data
        The encoded bytes; all of them must be consumed.
    max_bytes
        Refuse input longer than this without parsing it (``None``: no limit).

    Returns
    -------
    Any
        The decoded tree (lists for sequences, dicts for maps).

    Raises
    ------
    OversizeError
        If ``data`` is longer than ``max_bytes``.
    DecodeError
        If the bytes are truncated, malformed, not canonical, or have trailing bytes.
    """
    view = memoryview(data)
    if max_bytes is not None and len(view) > max_bytes:
        raise OversizeError(f"input is {len(view)} bytes, the limit is {max_bytes}")
    value, pos = _decode_at(view, 0, 0)
    if pos != len(view):
        raise DecodeError(f"{len(view) - pos} trailing bytes after the encoded value")
    return value


def _need(view: memoryview, pos: int, n: int) -> None:
    if pos + n > len(view):
        have = len(view) - pos
        raise DecodeError(f"truncated input: need {n} bytes at offset {pos}, have {have}")


def _decode_at(view: memoryview, pos: int, depth: int) -> tuple[Any, int]:
    if depth > CODEC_MAX_DEPTH:
        raise DecodeError(f"input nests deeper than {CODEC_MAX_DEPTH} levels")
    _need(view, pos, 1)
    tag = view[pos]
    pos += 1
    if tag == _NONE:
        return None, pos
    if tag == _FALSE:
        return False, pos
    if tag == _TRUE:
        return True, pos
    if tag == _INT:
        _need(view, pos, 8)
        return _I64.unpack_from(view, pos)[0], pos + 8
    if tag == _FLOAT:
        _need(view, pos, 8)
        number = _F64.unpack_from(view, pos)[0]
        if math.isnan(number):
            raise DecodeError("NaN is not a canonical float")
        return number, pos + 8
    if tag in (_STR, _BYTES, _LIST, _MAP):
        _need(view, pos, 4)
        n = _U32.unpack_from(view, pos)[0]
        pos += 4
        if tag == _STR:
            _need(view, pos, n)
            return _utf8(view[pos : pos + n], pos), pos + n
        if tag == _BYTES:
            _need(view, pos, n)
            return bytes(view[pos : pos + n]), pos + n
        # Every element takes at least one byte: a count past the end is malformed.
        _need(view, pos, n)
        if tag == _LIST:
            items = []
            for _ in range(n):
                item, pos = _decode_at(view, pos, depth + 1)
                items.append(item)
            return items, pos
        result: dict[str, Any] = {}
        previous: bytes | None = None
        for _ in range(n):
            _need(view, pos, 5)
            if view[pos] != _STR:
                raise DecodeError(f"map key at offset {pos} is not a string")
            klen = _U32.unpack_from(view, pos + 1)[0]
            pos += 5
            _need(view, pos, klen)
            key_raw = bytes(view[pos : pos + klen])
            if previous is not None and key_raw <= previous:
                raise DecodeError(f"map keys not in strictly increasing order at offset {pos}")
            previous = key_raw
            key = _utf8(memoryview(key_raw), pos)
            pos += klen
            result[key], pos = _decode_at(view, pos, depth + 1)
        return result, pos
    raise DecodeError(f"unknown type tag 0x{tag:02x} at offset {pos - 1}")


def _utf8(raw: memoryview, pos: int) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"invalid UTF-8 in string at offset {pos}") from exc
