"""A record flood into one honest peer: what it holds, and what the flood costs it.

``chaos-flwr bench flood [--records N] [--mode rec|own] [--limits default|none]``
prints one JSON object. Three founders bootstrap in process (signed, as any run); the flooder
(``f2``) mints ``N`` valid link_down records of its link to the honest victim (``f0``), one per
epoch, signed by itself alone, and delivers them to the victim: in ``rec`` envelopes of
``PEER_MAX_RECORDS_PER_MESSAGE`` records (``--mode rec``), or one ``own`` envelope per record
(``--mode own``). Minting and sealing are done before the clock starts. Between flood envelopes
the victim also handles honest traffic (heartbeats and link flaps of ``f1``), so the honest
per-message time is measured during the flood and in a quiet run of the same honest traffic.

Reported: ``held`` (records the victim holds at the end), ``refused`` (``Peer.refused_by`` of the
flooder), ``flood_s`` (time to handle the flood's envelopes), ``honest_us_p50`` /
``quiet_honest_us_p50`` (median time of one honest message, flooded / quiet), ``signature_checks``
and ``peak_mib`` (tracemalloc peak while handling, a separate pass). ``--limits none`` gives the
charter limits so large that nothing is refused (the frontier alone).
"""

from __future__ import annotations

import os
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

from ..charter import Charter
from ..defaults import PEER_MAX_RECORDS_PER_MESSAGE
from ..identity import Identity
from ..membership import Record, link_body
from ..peer import Peer

__all__ = ["run_flood"]

#: Records minted by default (the figure of issue 18).
FLOOD_BENCH_RECORDS = 100_000
#: Honest messages (one flap and one heartbeat per flood envelope, at least this many).
FLOOD_BENCH_HONEST = 200
#: Simulated seconds between two envelopes the victim handles.
FLOOD_BENCH_STEP_S = 0.01
#: A limit that refuses nothing (``--limits none``).
_NO_LIMIT = 10**12


def _peers(limits: str) -> tuple[list[Identity], list[Peer]]:
    ids = [Identity.from_seed(b"flood-bench-%d" % i * 2, name=f"f{i}") for i in range(3)]
    charter = Charter.create("flood-bench", ids, [])
    if limits == "none":
        data = {**charter.model_dump(), "signatures": {}}
        data["limits"] = {"records_per_minute": float(_NO_LIMIT), "record_burst": _NO_LIMIT}
        charter = Charter.from_dict(data, verify=False)
        for i in ids:
            charter = charter.sign(i)
    peers = [Peer(i, charter) for i in ids]
    queue = [(p.party_id, o) for p in peers for o in p.bootstrap(0.0)]
    while queue:
        _src, out = queue.pop()
        dest = next(p for p in peers if p.party_id == out.to)
        queue.extend((dest.party_id, o) for o in dest.handle(out.data, 0.0))
    return ids, peers


def _flood(ids: list[Identity], peers: list[Peer], n: int, mode: str) -> list[bytes]:
    victim, flooder = peers[0], peers[2]
    fed = flooder.policy.federation
    ends = ((flooder.party_id, 0), (victim.party_id, 0))
    records = [
        Record.sign(link_body("link_down", fed, ends[0], ends[1], e), [ids[2]])
        for e in range(1, n + 1)
    ]
    if mode == "own":
        to = [victim.party_id]
        return [flooder._broadcast_own(to, r.body, {}, 0.0)[1][0].data for r in records]
    out = []
    for i in range(0, n, PEER_MAX_RECORDS_PER_MESSAGE):
        chunk = [r.to_wire() for r in records[i : i + PEER_MAX_RECORDS_PER_MESSAGE]]
        out.append(flooder._send(victim.party_id, "rec", {"records": chunk}, 0.0).data)
    return out


def _honest(peers: list[Peer], n: int) -> list[bytes]:
    """``n`` honest envelopes of f1 to the victim: heartbeats and f1's own link flaps."""
    victim, honest = peers[0], peers[1]
    fed = honest.policy.federation
    ends = ((honest.party_id, 0), (victim.party_id, 0))
    out = []
    for i in range(n):
        if i % 2:
            payload = {"rd": honest.records.digest(), "res": None}
            out.append(honest._send(victim.party_id, "hb", payload, 0.0).data)
        else:
            body = link_body("link_down", fed, ends[0], ends[1], i + 1)
            out.append(honest._broadcast_own([victim.party_id], body, {}, 0.0)[1][0].data)
    return out


def _deliver(
    victim: Peer, flood: Sequence[bytes], honest: Sequence[bytes]
) -> tuple[float, list[float]]:
    """Handle flood and honest envelopes interleaved; (flood seconds, honest seconds each)."""
    every = max(1, len(flood) // max(1, len(honest)))
    flood_s = 0.0
    honest_s: list[float] = []
    now = 1.0
    h = 0
    for i, data in enumerate(flood):
        now += FLOOD_BENCH_STEP_S
        start = time.perf_counter()
        victim.handle(data, now)
        flood_s += time.perf_counter() - start
        if i % every == 0 and h < len(honest):
            now += FLOOD_BENCH_STEP_S
            start = time.perf_counter()
            victim.handle(honest[h], now)
            honest_s.append(time.perf_counter() - start)
            h += 1
    for data in honest[h:]:
        now += FLOOD_BENCH_STEP_S
        start = time.perf_counter()
        victim.handle(data, now)
        honest_s.append(time.perf_counter() - start)
    return flood_s, honest_s


def _pass(n: int, mode: str, limits: str, *, traced: bool) -> dict[str, Any]:
    ids, peers = _peers(limits)
    victim = peers[0]
    flood = _flood(ids, peers, n, mode) if n else []
    honest = _honest(peers, max(FLOOD_BENCH_HONEST, 2 * len(flood) if mode == "rec" else 0))
    checks = victim.records.cache.checks
    if traced:
        tracemalloc.start()
    flood_s, honest_s = _deliver(victim, flood, honest)
    peak = tracemalloc.get_traced_memory()[1] if traced else 0
    if traced:
        tracemalloc.stop()
    return {
        "held": len(victim.records),
        "refused": dict(getattr(victim, "refused_by", {})).get(peers[2].party_id, 0),
        "flood_s": round(flood_s, 3),
        "honest_us_p50": round(statistics.median(honest_s) * 1e6, 1),
        "signature_checks": victim.records.cache.checks - checks,
        "peak_mib": round(peak / 2**20, 2),
        "envelopes": len(flood),
    }


def run_flood(n: int, mode: str, limits: str) -> dict[str, Any]:
    """The figures of one flood of ``n`` records (see the module docstring)."""
    quiet = _pass(0, mode, limits, traced=False)
    quiet_mem = _pass(0, mode, limits, traced=True)
    flooded = _pass(n, mode, limits, traced=False)
    flooded_mem = _pass(n, mode, limits, traced=True)
    return {
        "records": n,
        "mode": mode,
        "limits": limits,
        "held": flooded["held"],
        "refused": flooded["refused"],
        "envelopes": flooded["envelopes"],
        "flood_s": flooded["flood_s"],
        "honest_us_p50": flooded["honest_us_p50"],
        "quiet_honest_us_p50": quiet["honest_us_p50"],
        "quiet_held": quiet["held"],
        "signature_checks": flooded["signature_checks"],
        "quiet_signature_checks": quiet["signature_checks"],
        "peak_mib": flooded_mem["peak_mib"],
        "quiet_peak_mib": quiet_mem["peak_mib"],
        "load_1m": round(os.getloadavg()[0], 2),
    }
