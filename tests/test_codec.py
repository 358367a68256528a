"""Tests of chaos_flwr.codec: canonical round trips, strict refusals, fuzzing."""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos_flwr import codec
from chaos_flwr.defaults import CODEC_MAX_DEPTH
from chaos_flwr.errors import ChaosError, DecodeError, OversizeError

#: Hypothesis examples per fuzz test (CHAOS_FUZZ_EXAMPLES; default 700: with test_wire.py and
#: test_fuzz_decoders.py CI runs over 10,000 cases in total).
FUZZ_EXAMPLES = int(os.environ.get("CHAOS_FUZZ_EXAMPLES", "700"))

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10)
)
values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=16,
)
#: Seeds of the mutation fuzzer: every type, nesting, and maps with several keys.
CORPUS = [
    codec.encode(v)
    for v in (
        None,
        True,
        -(2**63),
        -0.0,
        "héllo",
        b"\x00\xff",
        [1, [2, [3, []]]],
        {"a": 1, "b": {"c": [None, 1.5, "x"]}, "d": b"", "é": False},
        {"records": [{"body": {"kind": "join", "at": 1.0}, "sigs": {"p1": b"s" * 8}}]},
        [{"": ""}, {"k": {}}, [[], {}]],
    )
]


def _same(a: Any, b: Any) -> bool:
    """Equality that also tells 0.0 from -0.0 and bool from int."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _nested(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


# --- round trips -------------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(values)
def test_roundtrip_and_reencode_identical(value: Any) -> None:
    data = codec.encode(value)
    back = codec.decode(data)
    assert _same(back, value)
    assert codec.encode(back) == data


def _reference(value: Any) -> bytes:
    """A deliberately naive encoder written from the format (tag, big-endian fields, sorted
    keys); the optimised codec must produce the same bytes."""
    if value is None:
        return b"\x00"
    if isinstance(value, bool):
        return b"\x02" if value else b"\x01"
    if isinstance(value, int):
        return b"\x03" + value.to_bytes(8, "big", signed=True)
    if isinstance(value, float):
        return b"\x04" + struct.pack(">d", value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"\x05" + len(raw).to_bytes(4, "big") + raw
    if isinstance(value, bytes):
        return b"\x06" + len(value).to_bytes(4, "big") + value
    if isinstance(value, list):
        return b"\x07" + len(value).to_bytes(4, "big") + b"".join(_reference(v) for v in value)
    assert isinstance(value, dict)
    entries = sorted((k.encode("utf-8"), v) for k, v in value.items())
    return (
        b"\x08"
        + len(entries).to_bytes(4, "big")
        + b"".join(b"\x05" + len(k).to_bytes(4, "big") + k + _reference(v) for k, v in entries)
    )


@settings(max_examples=500, deadline=None)
@given(values)
def test_encoding_matches_reference(value: Any) -> None:
    assert codec.encode(value) == _reference(value)


def test_subclasses_encode_as_their_base_types() -> None:
    import collections
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    class Name(str):
        pass

    assert codec.encode(Level.HIGH) == codec.encode(3)
    assert codec.encode(Name("x")) == codec.encode("x")
    assert codec.encode({Name("k"): 1}) == codec.encode({"k": 1})
    assert codec.encode(collections.OrderedDict(b=1, a=2)) == codec.encode({"a": 2, "b": 1})
    assert codec.encode(range(3)) == codec.encode([0, 1, 2])


def test_tuples_and_bytearrays_normalise() -> None:
    assert codec.decode(codec.encode((1, 2))) == [1, 2]
    assert codec.encode((1, 2)) == codec.encode([1, 2])
    back = codec.decode(codec.encode(bytearray(b"ab")))
    assert type(back) is bytes
    assert back == b"ab"
    assert codec.encode(memoryview(b"ab")) == codec.encode(b"ab")


def test_map_order_does_not_change_bytes() -> None:
    a = {"b": 1, "a": 2, "é": 3, "z": {"y": 1, "x": 2}}
    b = {"z": {"x": 2, "y": 1}, "é": 3, "a": 2, "b": 1}
    assert codec.encode(a) == codec.encode(b)
    assert list(codec.decode(codec.encode(a))) == ["a", "b", "z", "é"]  # UTF-8 byte order


def test_types_are_distinguished() -> None:
    encodings = {codec.encode(v) for v in (None, False, True, 0, 0.0, -0.0, "", b"", [], {})}
    assert len(encodings) == 10
    assert codec.decode(codec.encode(True)) is True
    assert type(codec.decode(codec.encode(1))) is int
    assert math.copysign(1.0, codec.decode(codec.encode(-0.0))) == -1.0


def test_layout_is_stable() -> None:
    """The wire format is fixed (signatures depend on it): pin a few encodings."""
    assert codec.encode(None) == b"\x00"
    assert codec.encode(False) == b"\x01"
    assert codec.encode(True) == b"\x02"
    assert codec.encode(-2) == b"\x03" + struct.pack(">q", -2)
    assert codec.encode(1.5) == b"\x04" + struct.pack(">d", 1.5)
    assert codec.encode("hé") == b"\x05" + struct.pack(">I", 3) + "hé".encode()
    assert codec.encode(b"\x00") == b"\x06\x00\x00\x00\x01\x00"
    assert codec.encode([None]) == b"\x07\x00\x00\x00\x01\x00"
    assert codec.encode({"a": None}) == b"\x08\x00\x00\x00\x01" + b"\x05\x00\x00\x00\x01a\x00"


# --- encoder refusals --------------------------------------------------------------------------


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30])
def test_encode_int_out_of_range(value: int) -> None:
    with pytest.raises(ValueError, match="64-bit"):
        codec.encode(value)


def test_int_bounds_roundtrip() -> None:
    for value in (2**63 - 1, -(2**63), 0, -1):
        assert codec.decode(codec.encode(value)) == value


def test_encode_nan_refused_inf_accepted() -> None:
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        codec.encode({"x": [float("nan")]})
    assert codec.decode(codec.encode(float("inf"))) == float("inf")
    assert codec.decode(codec.encode(float("-inf"))) == float("-inf")


@pytest.mark.parametrize("value", [{1: "a"}, {"a": {(1,): 2}}, {1, 2}, object(), 1j])
def test_encode_unsupported_types(value: Any) -> None:
    with pytest.raises(TypeError):
        codec.encode(value)


def test_depth_limit_both_ways() -> None:
    deepest = _nested(CODEC_MAX_DEPTH + 1)  # innermost list at depth CODEC_MAX_DEPTH
    data = codec.encode(deepest)
    assert codec.decode(data) == deepest
    with pytest.raises(ValueError, match="deeper"):
        codec.encode(_nested(CODEC_MAX_DEPTH + 2))
    # the same too-deep structure written by hand is refused by the decoder
    too_deep = b"\x07\x00\x00\x00\x01" * (CODEC_MAX_DEPTH + 1) + b"\x07\x00\x00\x00\x00"
    with pytest.raises(DecodeError, match="deeper"):
        codec.decode(too_deep)
    assert codec.decode(too_deep[5:]) == deepest


# --- decoder refusals --------------------------------------------------------------------------


def test_unsorted_and_duplicate_keys_refused() -> None:
    def entry(key: str) -> bytes:
        return b"\x05" + struct.pack(">I", len(key)) + key.encode() + b"\x00"

    head = b"\x08" + struct.pack(">I", 2)
    assert codec.decode(head + entry("a") + entry("b")) == {"a": None, "b": None}
    with pytest.raises(DecodeError, match="increasing order"):
        codec.decode(head + entry("b") + entry("a"))
    with pytest.raises(DecodeError, match="increasing order"):
        codec.decode(head + entry("a") + entry("a"))


def test_non_string_map_key_refused() -> None:
    data = b"\x08\x00\x00\x00\x01" + codec.encode(1) + b"\x00"
    with pytest.raises(DecodeError, match="not a string"):
        codec.decode(data)


def test_nan_refused_on_decode() -> None:
    for bits in (b"\x7f\xf8\x00\x00\x00\x00\x00\x00", b"\xff\xf0\x00\x00\x00\x00\x00\x01"):
        with pytest.raises(DecodeError, match="NaN"):
            codec.decode(b"\x04" + bits)


def test_trailing_bytes_refused() -> None:
    with pytest.raises(DecodeError, match="trailing"):
        codec.decode(codec.encode({"a": 1}) + b"\x00")


def test_every_truncation_refused() -> None:
    data = codec.encode({"a": [1, 2.5, "xyz", b"q", None, {"b": True}]})
    for n in range(len(data)):
        with pytest.raises(DecodeError):
            codec.decode(data[:n])


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x09",
        b"\xff",
        b"\x05\x00\x00\x00\x05ab",  # string length past the end
        b"\x07\xff\xff\xff\xff\x00",  # list count past the end
        b"\x08\x00\x00\x00\x02",  # map count past the end
        b"\x05\x00\x00\x00\x01\xff",  # invalid UTF-8
        b"\x05\x00\x00\x00\x03\xed\xa0\x80",  # an encoded surrogate
        b"\x05\x00\x00\x00\x02\xc0\x80",  # overlong encoding of NUL
        b"\x08\x00\x00\x00\x01\x05\x00\x00\x00\x01\xff\x00",  # invalid UTF-8 in a key
        b"\x03\x00\x00",  # short int
    ],
)
def test_malformed_refused(data: bytes) -> None:
    with pytest.raises(DecodeError):
        codec.decode(data)


def test_max_bytes_checked_first() -> None:
    data = codec.encode("x" * 100)
    with pytest.raises(OversizeError, match="limit"):
        codec.decode(data, max_bytes=len(data) - 1)
    assert codec.decode(data, max_bytes=len(data)) == "x" * 100
    with pytest.raises(OversizeError):
        codec.decode(b"\xff" * 50, max_bytes=10)  # garbage, but too big is reported first


def test_decode_accepts_buffer_types() -> None:
    data = codec.encode({"k": b"v"})
    assert codec.decode(bytearray(data)) == {"k": b"v"}
    assert codec.decode(memoryview(data)) == {"k": b"v"}


# --- fuzzing: nothing but ChaosError escapes; whatever decodes is canonical ---------------------


def _decode_checked(data: bytes) -> None:
    try:
        value = codec.decode(data, max_bytes=1 << 16)
    except ChaosError:
        return
    # Canonical: accepted bytes are exactly the encoding of the value they decode to.
    assert codec.encode(value) == data


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_checked(data)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(
    st.sampled_from([b"\x07", b"\x08"]),
    st.integers(0, 6),
    st.binary(max_size=120),
)
def test_fuzz_random_containers(tag: bytes, count: int, rest: bytes) -> None:
    _decode_checked(tag + struct.pack(">I", count) + rest)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(
    st.sampled_from(CORPUS),
    st.lists(
        st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=3,
    ),
    st.binary(min_size=1, max_size=4),
)
def test_fuzz_mutated_encodings(base: bytes, edits: list[tuple[str, int]], filler: bytes) -> None:
    data = bytearray(base)
    for op, where in edits:
        if not data:
            break
        i = where % len(data)
        if op == "flip":
            data[i] ^= 1 << (where % 8)
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = filler
        else:
            del data[i]
    _decode_checked(bytes(data))
