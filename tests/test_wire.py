"""Tests of chaos_flwr.wire: envelope framing, signatures, rejections and the replay guard."""

from __future__ import annotations

import os
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos_flwr import codec
from chaos_flwr.errors import (
    ChaosError,
    DecodeError,
    EncodeError,
    FederationMismatchError,
    OversizeError,
    ReplayError,
    SignatureError,
    StaleIncarnationError,
    UnknownPartyError,
)
from chaos_flwr.identity import Identity
from chaos_flwr.wire import (
    DOMAIN,
    Envelope,
    ReplayGuard,
    open_sealed,
    peek_sender,
    seal,
)

#: Hypothesis examples per fuzz test; CI raises it with CHAOS_FUZZ_EXAMPLES.
FUZZ_EXAMPLES = int(os.environ.get("CHAOS_FUZZ_EXAMPLES", "2000"))

ALICE = Identity.from_seed(b"wire-alice", name="alice")
BOB = Identity.from_seed(b"wire-bob", name="bob")
MALLORY = Identity.from_seed(b"wire-mallory", name="mallory")
KEYRING = {ALICE.party_id: ALICE.public_key, BOB.party_id: BOB.public_key}


def _seal(
    seq: int = 1,
    *,
    inc: int = 0,
    ts: float = 10.0,
    who: Identity = ALICE,
    payload: dict[str, Any] | None = None,
    to: str | None = None,
    kind: str = "hb",
) -> bytes:
    return seal(
        who,
        incarnation=inc,
        seq=seq,
        timestamp=ts,
        kind=kind,
        payload={"n": seq} if payload is None else payload,
        to=to,
    )


def _frame(who: Identity, body: bytes, *, sender: bytes | None = None) -> bytes:
    """Build a frame by hand from the layout documented in wire's module docstring."""
    sid = who.party_id.encode("ascii") if sender is None else sender
    head = b"CHFE" + b"\x01" + sid + struct.pack(">I", len(body)) + body
    return head + who.sign(DOMAIN + head)


def _body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "fed": b"",
        "inc": 0,
        "kind": "hb",
        "payload": {},
        "seq": 1,
        "to": None,
        "ts": 1.0,
    }
    body.update(overrides)
    return body


# --- round trips -------------------------------------------------------------------------------


def test_roundtrip_preserves_every_field() -> None:
    payload = {"records": [{"a": 1, "b": b"\x00\xff", "c": [None, True, 2.5]}], "z": "é"}
    data = _seal(7, inc=3, ts=123.25, payload=payload, to=BOB.party_id, kind="rec")
    env = open_sealed(data, KEYRING)
    assert env == Envelope(ALICE.party_id, 3, 7, 123.25, "rec", BOB.party_id, payload, data)
    assert env.signature == data[-64:]
    assert peek_sender(data) == ALICE.party_id


def test_roundtrip_from_bytearray_and_memoryview() -> None:
    data = _seal(2)
    assert open_sealed(bytearray(data), KEYRING).seq == 2
    env = open_sealed(memoryview(data), KEYRING)
    assert env.raw == data
    assert type(env.raw) is bytes


def test_seal_is_deterministic_and_int_timestamp_becomes_float() -> None:
    a = seal(ALICE, incarnation=0, seq=1, timestamp=5, kind="k", payload={})
    b = seal(ALICE, incarnation=0, seq=1, timestamp=5.0, kind="k", payload={})
    assert a == b
    env = open_sealed(a, KEYRING)
    assert type(env.timestamp) is float
    assert env.timestamp == 5.0


def test_size_overhead_is_header_plus_signature() -> None:
    data = _seal(1, payload={})
    body = codec.encode(_body(payload={}, ts=10.0))
    assert len(data) == 4 + 1 + 17 + 4 + len(body) + 64


# --- rejections --------------------------------------------------------------------------------


def test_every_single_byte_flip_is_refused() -> None:
    data = _seal(1, payload={"x": "y" * 8})
    for i in range(len(data)):
        for mask in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= mask
            with pytest.raises((DecodeError, SignatureError)):
                open_sealed(bytes(bad), KEYRING)


def test_every_truncation_is_decode_error() -> None:
    data = _seal(1)
    for n in range(len(data)):
        with pytest.raises(DecodeError, match="truncated"):
            open_sealed(data[:n], KEYRING)


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(DecodeError, match="trailing"):
        open_sealed(_seal(1) + b"\x00", KEYRING)


def test_size_limit_is_checked_before_anything_else() -> None:
    data = _seal(1)
    with pytest.raises(OversizeError, match="limit"):
        open_sealed(data, KEYRING, max_bytes=len(data) - 1)
    assert open_sealed(data, KEYRING, max_bytes=len(data)).seq == 1
    # garbage that is also too large reports the size, not the garbage
    with pytest.raises(OversizeError):
        open_sealed(b"\xff" * 1000, KEYRING, max_bytes=999)


def test_bad_magic_and_version() -> None:
    data = _seal(1)
    with pytest.raises(DecodeError, match="magic"):
        open_sealed(b"XXXX" + data[4:], KEYRING)
    with pytest.raises(DecodeError, match="version 2"):
        open_sealed(data[:4] + b"\x02" + data[5:], KEYRING)


def test_unknown_sender() -> None:
    data = _seal(1, who=MALLORY)
    with pytest.raises(UnknownPartyError, match=MALLORY.party_id):
        open_sealed(data, KEYRING)


def test_malformed_sender_header() -> None:
    body = codec.encode(_body())
    with pytest.raises(DecodeError, match="sender"):
        open_sealed(_frame(ALICE, body, sender=b"P" * 17), KEYRING)
    with pytest.raises(DecodeError, match="ASCII"):
        open_sealed(_frame(ALICE, body, sender=b"\xff" * 17), KEYRING)


def test_forged_signature_wrong_key_and_swapped_sender() -> None:
    # Mallory signs but claims to be Alice.
    forged = _frame(MALLORY, codec.encode(_body()), sender=ALICE.party_id.encode())
    with pytest.raises(SignatureError, match="does not verify"):
        open_sealed(forged, KEYRING)
    # The receiver holds the wrong key for Alice.
    data = _seal(1)
    with pytest.raises(SignatureError):
        open_sealed(data, {ALICE.party_id: BOB.public_key})
    # Alice's envelope relabelled as Bob's: the header is signed too.
    swapped = data[:5] + BOB.party_id.encode() + data[22:]
    with pytest.raises(SignatureError):
        open_sealed(swapped, KEYRING)


def test_signature_is_checked_before_the_body_is_decoded() -> None:
    garbage_body = b"\xfe\xfe\xfe"
    good = _frame(ALICE, garbage_body)
    with pytest.raises(DecodeError):
        open_sealed(good, KEYRING)  # correctly signed, so the body gets decoded
    bad_sig = good[:-64] + bytes(64)
    with pytest.raises(SignatureError):
        open_sealed(bad_sig, KEYRING)  # never decoded: the signature fails first
    with pytest.raises(UnknownPartyError):
        open_sealed(_frame(MALLORY, garbage_body), KEYRING)


def test_envelope_is_bound_to_its_federation() -> None:
    ours, theirs = bytes(range(32)), bytes(range(1, 33))
    data = seal(ALICE, incarnation=0, seq=1, timestamp=1.0, kind="hb", payload={}, federation=ours)
    assert open_sealed(data, KEYRING, federation=ours).federation == ours
    assert open_sealed(data, KEYRING).federation == ours  # an observer may read any
    with pytest.raises(FederationMismatchError, match="another federation"):
        open_sealed(data, KEYRING, federation=theirs)
    unbound = seal(ALICE, incarnation=0, seq=2, timestamp=1.0, kind="hb", payload={})
    assert open_sealed(unbound, KEYRING).federation == b""
    with pytest.raises(FederationMismatchError, match=r"\(none\)"):
        open_sealed(unbound, KEYRING, federation=ours)
    # The tag is signed: rewriting it breaks the signature, so it is refused as a forgery.
    swapped = data.replace(ours, theirs)
    assert swapped != data
    with pytest.raises(SignatureError):
        open_sealed(swapped, KEYRING, federation=theirs)
    # A forged or altered envelope is refused before its federation is even looked at.
    with pytest.raises(SignatureError):
        open_sealed(data[:-1] + bytes([data[-1] ^ 1]), KEYRING, federation=theirs)
    with pytest.raises(EncodeError, match="federation"):
        seal(
            ALICE, incarnation=0, seq=3, timestamp=1.0, kind="hb", payload={}, federation=b"x" * 65
        )


def test_signature_of_another_domain_does_not_verify() -> None:
    body = codec.encode(_body())
    head = b"CHFE\x01" + ALICE.party_id.encode() + struct.pack(">I", len(body)) + body
    with pytest.raises(SignatureError):
        open_sealed(head + ALICE.sign(head), KEYRING)  # signed without the domain prefix


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (_body(inc=True), "incarnation"),
        (_body(inc=-1), "incarnation"),
        (_body(seq=-5), "seq"),
        (_body(seq=1.0), "seq"),
        (_body(ts=1), "timestamp"),
        (_body(ts=float("inf")), "timestamp"),
        (_body(kind=""), "kind"),
        (_body(kind=3), "kind"),
        (_body(to="bob"), "to"),
        (_body(payload=[1]), "payload"),
        (_body(fed="digest"), "federation"),
        (_body(fed=b"x" * 65), "federation"),
        (_body(extra=1), "keys"),
        ({k: v for k, v in _body().items() if k != "to"}, "keys"),
        ([1, 2], "map"),
    ],
)
def test_signed_but_malformed_body_is_decode_error(body: Any, field: str) -> None:
    with pytest.raises(DecodeError, match=field):
        open_sealed(_frame(ALICE, codec.encode(body)), KEYRING)


def test_signed_but_non_canonical_body_is_decode_error() -> None:
    canonical = codec.encode({"a": 1, "b": 2})
    # swap the two entries: keys out of order
    entry_a = canonical[5 : 5 + 5 + 1 + 9]
    entry_b = canonical[5 + 15 :]
    unsorted = canonical[:5] + entry_b + entry_a
    assert codec.encode({"b": 2, "a": 1}) == canonical  # the encoder always sorts
    body = codec.encode(_body(payload={}))
    # put the unsorted map as the payload by replacing the empty map encoding
    empty_map = b"\x08\x00\x00\x00\x00"
    assert body.count(empty_map) == 1
    with pytest.raises(DecodeError, match="order"):
        open_sealed(_frame(ALICE, body.replace(empty_map, unsorted)), KEYRING)
    with pytest.raises(DecodeError, match="trailing"):
        open_sealed(_frame(ALICE, body + b"\x00"), KEYRING)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"incarnation": -1}, "incarnation"),
        ({"incarnation": True}, "incarnation"),
        ({"incarnation": 2**63}, "incarnation"),
        ({"seq": -1}, "seq"),
        ({"seq": 1.5}, "seq"),
        ({"timestamp": float("nan")}, "timestamp"),
        ({"timestamp": float("-inf")}, "timestamp"),
        ({"kind": ""}, "kind"),
        ({"to": "not-a-party"}, "to"),
        ({"payload": [1, 2]}, "payload"),
        ({"payload": {"s": {1, 2}}}, "payload"),
        ({"payload": {"n": 2**64}}, "payload"),
        ({"payload": {"f": float("nan")}}, "payload"),
    ],
)
def test_seal_refuses_bad_fields(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {
        "incarnation": 0,
        "seq": 0,
        "timestamp": 0.0,
        "kind": "k",
        "payload": {},
    }
    args.update(kwargs)
    with pytest.raises(EncodeError, match=field):
        seal(ALICE, **args)


def test_seal_refuses_oversize() -> None:
    with pytest.raises(OversizeError, match="split the payload"):
        seal(
            ALICE,
            incarnation=0,
            seq=0,
            timestamp=0.0,
            kind="big",
            payload={"b": b"x" * 1000},
            max_bytes=500,
        )


def test_peek_sender_refuses_garbage() -> None:
    with pytest.raises(DecodeError):
        peek_sender(b"short")
    with pytest.raises(DecodeError, match="magic"):
        peek_sender(b"\x00" * 200)


# --- replay guard ------------------------------------------------------------------------------


def _env(seq: int, inc: int = 0, *, who: Identity = ALICE, ts: float = 10.0) -> Envelope:
    return open_sealed(_seal(seq, inc=inc, who=who, ts=ts), KEYRING)


def _refused_unchanged(guard: ReplayGuard, env: Envelope, exc: type[Exception], match: str) -> None:
    before = guard.snapshot()
    with pytest.raises(exc, match=match):
        guard.check(env, now=10.0)
    assert guard.snapshot() == before
    with pytest.raises(exc, match=match):
        guard.accept(env)
    assert guard.snapshot() == before


def test_guard_accepts_once_and_check_does_not_record() -> None:
    guard = ReplayGuard(window=8)
    env = _env(1)
    guard.check(env, now=10.0)
    guard.check(env, now=10.0)  # check alone records nothing
    assert guard.snapshot() == {}
    guard.accept(env)
    assert guard.position(ALICE.party_id) == (0, 1)
    _refused_unchanged(guard, env, ReplayError, "already accepted")


def test_guard_out_of_order_inside_window_each_once() -> None:
    guard = ReplayGuard(window=8)
    for seq in (10, 4, 7, 3, 11, 9):
        e = _env(seq)
        guard.check(e, now=10.0)
        guard.accept(e)
    assert guard.position(ALICE.party_id) == (0, 11)
    for seq in (10, 4, 7, 11, 9):
        _refused_unchanged(guard, _env(seq), ReplayError, "already accepted")
    # 11 - 8 = 3 is one past the window's bottom (4): refused as too old
    _refused_unchanged(guard, _env(3), ReplayError, "older than the replay window")
    _refused_unchanged(guard, _env(2), ReplayError, "older than the replay window")
    # unseen numbers inside the window are still accepted
    for seq in (5, 6, 8):
        guard.accept(_env(seq))


def test_guard_jump_past_window_forgets_old_bitmap() -> None:
    guard = ReplayGuard(window=4)
    guard.accept(_env(1))
    guard.accept(_env(100))
    _refused_unchanged(guard, _env(1), ReplayError, "older")
    _refused_unchanged(guard, _env(96), ReplayError, "older")
    guard.accept(_env(97))
    guard.accept(_env(99))
    _refused_unchanged(guard, _env(100), ReplayError, "already")


def test_guard_incarnations() -> None:
    guard = ReplayGuard(window=8)
    guard.accept(_env(50, inc=1))
    guard.accept(_env(0, inc=2))  # a restart starts over at seq 0
    assert guard.position(ALICE.party_id) == (2, 0)
    _refused_unchanged(guard, _env(51, inc=1), StaleIncarnationError, "incarnation")
    _refused_unchanged(guard, _env(0, inc=2), ReplayError, "already")
    assert issubclass(StaleIncarnationError, ReplayError)


def test_guard_senders_are_independent() -> None:
    guard = ReplayGuard()
    guard.accept(_env(5))
    guard.accept(_env(5, who=BOB))
    assert len(guard) == 2
    assert guard.position(BOB.party_id) == (0, 5)
    assert guard.position(MALLORY.party_id) is None


def test_guard_time_limits_name_the_timestamp() -> None:
    guard = ReplayGuard(max_skew_s=2.0, max_age_s=30.0)
    guard.check(_env(1, ts=12.0), now=10.0)  # exactly at the skew limit
    guard.check(_env(1, ts=-20.0), now=10.0)  # exactly at the age limit
    for ts, what in ((12.5, "after now"), (-20.5, "too old")):
        env = _env(1, ts=ts)
        with pytest.raises(ReplayError, match="'timestamp'.*" + what):
            guard.check(env, now=10.0)
        assert guard.snapshot() == {}
    plain = ReplayGuard()
    plain.check(_env(1, ts=1e9), now=0.0)  # off by default


@pytest.mark.parametrize(
    "kwargs", [{"window": 0}, {"window": 1.5}, {"max_skew_s": -1.0}, {"max_age_s": float("nan")}]
)
def test_guard_refuses_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(EncodeError, match="ReplayGuard"):
        ReplayGuard(**kwargs)


_ENVS: dict[tuple[int, int], Envelope] = {}


def _cached_env(inc: int, seq: int) -> Envelope:
    key = (inc, seq)
    if key not in _ENVS:
        _ENVS[key] = _env(seq, inc)
    return _ENVS[key]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.integers(1, 6),
    events=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 14)), max_size=40),
)
def test_guard_matches_reference_model(window: int, events: list[tuple[int, int]]) -> None:
    """Against the specification: a higher incarnation resets; within one, a number is accepted
    iff it was never accepted and is above (highest - window)."""
    guard = ReplayGuard(window=window)
    model_inc: int | None = None
    seen: set[int] = set()
    for inc, seq in events:
        env = _cached_env(inc, seq)
        if model_inc is None or inc > model_inc:
            expected = True
        elif inc < model_inc:
            expected = False
        else:
            expected = seq not in seen and seq > max(seen) - window
        before = guard.snapshot()
        try:
            guard.check(env, now=0.0)
            guard.accept(env)
            accepted = True
        except ReplayError:
            accepted = False
            assert guard.snapshot() == before
        assert accepted == expected, (inc, seq, model_inc, sorted(seen))
        if accepted:
            if model_inc is None or inc > model_inc:
                model_inc, seen = inc, set()
            seen.add(seq)


# --- fuzzing: nothing but ChaosError escapes ----------------------------------------------------

_VALID = [
    _seal(1),
    _seal(2, payload={"records": [{"k": b"\x01" * 40, "l": [1, 2.0, None]}]}, to=BOB.party_id),
]


def _open_only_chaos(data: bytes) -> Envelope | None:
    try:
        return open_sealed(data, KEYRING, max_bytes=4096)
    except ChaosError:
        return None


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(data: bytes) -> None:
    _open_only_chaos(data)
    _open_only_chaos(b"CHFE\x01" + data)
    _open_only_chaos(b"CHFE\x01" + ALICE.party_id.encode() + data)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(
    base=st.sampled_from(_VALID),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=4,
    ),
    filler=st.binary(min_size=1, max_size=8),
)
def test_fuzz_mutated_envelopes(base: bytes, edits: list[tuple[str, int]], filler: bytes) -> None:
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
    result = _open_only_chaos(bytes(data))
    if result is not None:
        assert bytes(data) == base  # only the untouched envelope may open


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_correctly_signed_random_bodies(body: bytes) -> None:
    """The signature holds, so the body decoder itself is exposed to arbitrary bytes."""
    _open_only_chaos(_frame(ALICE, body))


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "inc": st.integers(0, 5) | _scalars,
            "kind": st.text(max_size=4) | _scalars,
            "payload": st.dictionaries(st.text(max_size=3), _values, max_size=3) | _scalars,
            "seq": st.integers(0, 5) | _scalars,
            "to": st.just(BOB.party_id) | _scalars,
            "ts": st.floats(allow_nan=False) | _scalars,
        },
        optional={"x": _scalars},
    )
)
def test_fuzz_correctly_signed_structured_bodies(body: dict[str, Any]) -> None:
    env = _open_only_chaos(_frame(ALICE, codec.encode(body)))
    if env is not None:
        assert env.payload == body["payload"]
        assert env.seq == body["seq"]
        assert env.incarnation == body["inc"]
