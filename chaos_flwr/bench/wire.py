"""``chaos-flwr bench wire``: the cost of the envelope hot path.

Times, with ``time.perf_counter`` over ``repeats`` iterations per payload size (median of
``rounds`` runs reported):

``seal_us``
    :func:`chaos_flwr.wire.seal` (canonical encoding + one Ed25519 signature);
``open_us``
    :func:`chaos_flwr.wire.open_sealed` (framing, key lookup, one Ed25519 verification,
    strict canonical decoding);
``guard_us``
    :meth:`ReplayGuard.check` + :meth:`ReplayGuard.accept` of a fresh sequence number;
``roundtrip_us``
    seal + open + guard, the cost one message adds at both ends;
and, as floors, the bare Ed25519 ``sign_us`` / ``verify_us`` of the same bytes.

The payload of size ``n`` is a realistic peer message: a list of signed-record-like maps whose
encoding totals about ``n`` bytes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ..identity import Identity, verify_signature
from ..wire import DOMAIN, ReplayGuard, open_sealed, seal
from .settings import (
    WIRE_BENCH_MIN_REPEATS,
    WIRE_BENCH_PAYLOAD_BYTES,
    WIRE_BENCH_REPEATS,
    WIRE_BENCH_ROUNDS,
)

__all__ = ["run_wire"]


def _payload(target_bytes: int) -> dict[str, Any]:
    record = {
        "body": {"kind": "join", "subject": "p0123456789abcdef", "incarnation": 1, "at": 2.5},
        "sigs": {"p0123456789abcdef": b"s" * 64},
    }
    records: list[Any] = []
    payload: dict[str, Any] = {"records": records, "rd": b"d" * 32}
    # each record encodes to about 180 bytes; below that, a padding field sets the size
    while (len(records) + 1) * 180 + 60 <= target_bytes:
        records.append(record)
    if not records:
        payload["pad"] = b"x" * max(0, target_bytes - 60)
    return payload


def _time(fn: Callable[[int], object], repeats: int, rounds: int) -> float:
    samples = []
    for r in range(rounds):
        base = r * repeats
        start = time.perf_counter()
        for i in range(repeats):
            fn(base + i)
        samples.append((time.perf_counter() - start) / repeats)
    return statistics.median(samples) * 1e6


def _size_row(alice: Identity, size: int, repeats: int, rounds: int) -> dict[str, Any]:
    """Time the hot path for one payload size (one row of ``run_wire``'s result)."""
    keyring = {alice.party_id: alice.public_key}
    payload = _payload(size)
    runs = max(WIRE_BENCH_MIN_REPEATS, repeats * 1024 // max(1024, size))
    data = seal(alice, incarnation=0, seq=0, timestamp=0.0, kind="rec", payload=payload)
    head = DOMAIN + data[:-64]
    signature = data[-64:]
    envs = [
        open_sealed(
            seal(alice, incarnation=0, seq=i, timestamp=0.0, kind="rec", payload=payload),
            keyring,
        )
        for i in range(runs * rounds)
    ]
    guard = ReplayGuard()

    def do_seal(i: int, payload: dict[str, Any] = payload) -> object:
        return seal(alice, incarnation=0, seq=i, timestamp=0.0, kind="rec", payload=payload)

    def do_open(i: int, data: bytes = data) -> object:
        return open_sealed(data, keyring)

    def do_guard(i: int, envs: list[Any] = envs, guard: ReplayGuard = guard) -> object:
        guard.check(envs[i], 0.0)
        guard.accept(envs[i])
        return None

    round_guard = ReplayGuard()

    def do_round(i: int, payload: dict[str, Any] = payload, g: ReplayGuard = round_guard) -> object:
        raw = seal(alice, incarnation=0, seq=i, timestamp=0.0, kind="rec", payload=payload)
        env = open_sealed(raw, keyring)
        g.check(env, 0.0)
        g.accept(env)
        return env

    def do_sign(i: int, head: bytes = head) -> object:
        return alice.sign(head)

    def do_verify(i: int, head: bytes = head, sig: bytes = signature) -> object:
        verify_signature(alice.public_key, sig, head)
        return None

    return {
        "payload_bytes": size,
        "repeats": runs,
        "envelope_bytes": len(data),
        "seal_us": round(_time(do_seal, runs, rounds), 2),
        "open_us": round(_time(do_open, runs, rounds), 2),
        "guard_us": round(_time(do_guard, runs, rounds), 2),
        "roundtrip_us": round(_time(do_round, runs, rounds), 2),
        "sign_us": round(_time(do_sign, runs, rounds), 2),
        "verify_us": round(_time(do_verify, runs, rounds), 2),
    }


def run_wire(
    sizes: tuple[int, ...] = WIRE_BENCH_PAYLOAD_BYTES,
    *,
    repeats: int = WIRE_BENCH_REPEATS,
    rounds: int = WIRE_BENCH_ROUNDS,
) -> dict[str, Any]:
    """Measure the envelope hot path.

    Parameters
    ----------
    sizes
        Approximate payload sizes in bytes.
    repeats, rounds
        Iterations per timed run (for payloads up to 1 KiB; larger ones run proportionally
        fewer, at least ``WIRE_BENCH_MIN_REPEATS``), and runs per figure (median reported).

    Returns
    -------
    dict
        ``{"sizes": [{"payload_bytes", "repeats", "envelope_bytes", "seal_us", "open_us",
        "guard_us", "roundtrip_us", "sign_us", "verify_us"}, ...], "repeats", "rounds"}``.
    """
    alice = Identity.from_seed(b"bench-wire-alice")
    rows = [_size_row(alice, size, repeats, rounds) for size in sizes]
    return {"sizes": rows, "repeats": repeats, "rounds": rounds}
