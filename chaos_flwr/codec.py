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
_TAG_I64 = struct.Struct(">Bq").pack
_TAG_F64 = struct.Struct(">Bd").pack
_TAG_LEN = struct.Struct(">BI").pack
_unpack_i64 = _I64.unpack_from
_unpack_f64 = _F64.unpack_from
_unpack_u32 = _U32.unpack_from
_INT_MIN = -(2**63)
_INT_MAX = 2**63 - 1
_LEN_MAX = 2**32 - 1
#: Map keys repeat a lot (field names): their encodings and decodings are memoised.
_KEY_CACHE_MAX = 4096
_enc_keys: dict[str, tuple[bytes, bytes]] = {}
_dec_keys: dict[bytes, str] = {}


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


def _key_parts(key: str) -> tuple[bytes, bytes]:
    """(raw UTF-8 bytes, full encoding) of a map key, memoised."""
    parts = _enc_keys.get(key)
    if parts is None:
        if not isinstance(key, str):
            raise TypeError(f"map keys must be str, got {type(key).__name__}")
        raw = key.encode("utf-8")
        if len(raw) > _LEN_MAX:
            raise ValueError(f"length {len(raw)} exceeds the 32-bit limit")
        parts = (raw, _TAG_LEN(_STR, len(raw)) + raw)
        if type(key) is str:
            if len(_enc_keys) >= _KEY_CACHE_MAX:
                _enc_keys.clear()
            _enc_keys[key] = parts
    return parts


def _encode_into(out: bytearray, value: Any, depth: int) -> None:
    if depth > CODEC_MAX_DEPTH:
        raise ValueError(f"value nests deeper than {CODEC_MAX_DEPTH} levels")
    kind = type(value)
    # Fast paths for the exact built-in types; subclasses take the general path below.
    if kind is str:
        raw = value.encode("utf-8")
        if len(raw) > _LEN_MAX:
            raise ValueError(f"length {len(raw)} exceeds the 32-bit limit")
        out += _TAG_LEN(_STR, len(raw))
        out += raw
    elif kind is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise ValueError(f"integer {value} does not fit in a signed 64-bit field")
        out += _TAG_I64(_INT, value)
    elif kind is dict:
        if len(value) > _LEN_MAX:
            raise ValueError(f"length {len(value)} exceeds the 32-bit limit")
        items = [(_key_parts(k), v) for k, v in value.items()]
        items.sort(key=lambda kv: kv[0][0])
        out += _TAG_LEN(_MAP, len(items))
        inner = depth + 1
        for (_, key_enc), item in items:
            out += key_enc
            _encode_into(out, item, inner)
    elif kind is list or kind is tuple:
        if len(value) > _LEN_MAX:
            raise ValueError(f"length {len(value)} exceeds the 32-bit limit")
        out += _TAG_LEN(_LIST, len(value))
        inner = depth + 1
        for item in value:
            _encode_into(out, item, inner)
    elif kind is bytes:
        if len(value) > _LEN_MAX:
            raise ValueError(f"length {len(value)} exceeds the 32-bit limit")
        out += _TAG_LEN(_BYTES, len(value))
        out += value
    elif value is None:
        out.append(_NONE)
    elif value is True:
        out.append(_TRUE)
    elif value is False:
        out.append(_FALSE)
    elif kind is float:
        if value != value:
            raise ValueError("NaN has no canonical encoding")
        out += _TAG_F64(_FLOAT, value)
    else:
        _encode_general(out, value, depth)


def _encode_general(out: bytearray, value: Any, depth: int) -> None:
    if isinstance(value, int):
        _encode_into(out, int(value), depth)
    elif isinstance(value, float):
        if math.isnan(value):
            raise ValueError("NaN has no canonical encoding")
        out += _TAG_F64(_FLOAT, float(value))
    elif isinstance(value, str):
        _encode_into(out, str(value), depth)
    elif isinstance(value, bytes | bytearray | memoryview):
        _encode_into(out, bytes(value), depth)
    elif isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"map keys must be str, got {type(key).__name__}")
        _encode_into(out, {str(k): v for k, v in value.items()}, depth)
    elif isinstance(value, Sequence):
        _encode_into(out, list(value), depth)
    else:
        raise TypeError(f"cannot encode a value of type {type(value).__name__}")


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
    if max_bytes is not None and len(data) > max_bytes:
        raise OversizeError(f"input is {len(data)} bytes, the limit is {max_bytes}")
    raw = data if type(data) is bytes else bytes(data)
    value, pos = _decode_at(raw, 0, 0)
    if pos != len(raw):
        raise DecodeError(f"{len(raw) - pos} trailing bytes after the encoded value")
    return value


def _truncated(data: bytes, pos: int, n: int) -> DecodeError:
    have = len(data) - pos
    return DecodeError(f"truncated input: need {n} bytes at offset {pos}, have {have}")


def _decode_at(data: bytes, pos: int, depth: int) -> tuple[Any, int]:
    if depth > CODEC_MAX_DEPTH:
        raise DecodeError(f"input nests deeper than {CODEC_MAX_DEPTH} levels")
    size = len(data)
    if pos >= size:
        raise _truncated(data, pos, 1)
    tag = data[pos]
    pos += 1
    if tag == _INT:
        if pos + 8 > size:
            raise _truncated(data, pos, 8)
        return _unpack_i64(data, pos)[0], pos + 8
    if tag in _SIZED:
        if pos + 4 > size:
            raise _truncated(data, pos, 4)
        n = _unpack_u32(data, pos)[0]
        pos += 4
        # Every element takes at least one byte: a count past the end is malformed.
        end = pos + n
        if end > size:
            raise _truncated(data, pos, n)
        if tag == _STR:
            return _utf8(data, pos, end), end
        if tag == _BYTES:
            return data[pos:end], end
        inner = depth + 1
        if tag == _LIST:
            items: list[Any] = []
            append = items.append
            for _ in range(n):
                item, pos = _decode_at(data, pos, inner)
                append(item)
            return items, pos
        result: dict[str, Any] = {}
        previous = b""
        for i in range(n):
            if pos + 5 > size:
                raise _truncated(data, pos, 5)
            if data[pos] != _STR:
                raise DecodeError(f"map key at offset {pos} is not a string")
            klen = _unpack_u32(data, pos + 1)[0]
            pos += 5
            kend = pos + klen
            if kend > size:
                raise _truncated(data, pos, klen)
            key_raw = data[pos:kend]
            if i and key_raw <= previous:
                raise DecodeError(f"map keys not in strictly increasing order at offset {pos}")
            previous = key_raw
            key = _dec_keys.get(key_raw)
            if key is None:
                key = _utf8(data, pos, kend)
                if len(_dec_keys) >= _KEY_CACHE_MAX:
                    _dec_keys.clear()
                _dec_keys[key_raw] = key
            result[key], pos = _decode_at(data, kend, inner)
        return result, pos
    if tag == _NONE:
        return None, pos
    if tag == _FALSE:
        return False, pos
    if tag == _TRUE:
        return True, pos
    if tag == _FLOAT:
        if pos + 8 > size:
            raise _truncated(data, pos, 8)
        number = _unpack_f64(data, pos)[0]
        if number != number:
            raise DecodeError("NaN is not a canonical float")
        return number, pos + 8
    raise DecodeError(f"unknown type tag 0x{tag:02x} at offset {pos - 1}")


_SIZED = frozenset({_STR, _BYTES, _LIST, _MAP})


def _utf8(data: bytes, start: int, end: int) -> str:
    try:
        return data[start:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"invalid UTF-8 in string at offset {start}") from exc
