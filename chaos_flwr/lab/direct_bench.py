"""``chaos-flwr bench direct-pull``: a joiner's pull over authenticated direct links from donors
whose uplinks are paced, against the planner's lower bound.

Each donor is a :class:`~chaos_flwr.flower.direct.DirectServer` on 127.0.0.1 (mutual TLS, a
signed endpoint record) whose replies are paced by a token bucket at its uplink rate (the
transport's :class:`~chaos_flwr.transport.shaping.Shaper`, with a tbf-like burst); the joiner
is the Flower party's own :class:`~chaos_flwr.flower.client.joiner.JoinerPull` (manifest,
planned shares, a fetch that times the links as it goes), told the state's size and the
donors' endpoints, as a joiner that holds the view is. The bound is the water-filling bound
of the donors' rates (the joiner's downlink is not capped here). What it measures is the pull
itself: the planner's shares, the pull queue's rates and the links' per-request costs; not
Flower's messages (the ``flower-wan`` bench measures whole joins on the testbed).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chaos_flwr.defaults import DIRECT_BENCH_REPEATS
from chaos_flwr.errors import ConfigError
from chaos_flwr.flower.client.donor import serve_request
from chaos_flwr.flower.client.joiner import JoinerPull
from chaos_flwr.flower.direct import BytesSource, DirectServer
from chaos_flwr.identity import Identity
from chaos_flwr.membership import Policy, Record, RecordSet, endpoint_body, join_body
from chaos_flwr.planner import Donor, lower_bound
from chaos_flwr.state import TrainingState
from chaos_flwr.transport.links import LinkAccess
from chaos_flwr.transport.shaping import Shaper, parse_profile
from chaos_flwr.transport.tls import LinkCredentials

__all__ = ["DIRECT_BENCH_BURST_BYTES", "measure_direct_pull"]

#: Token-bucket burst of each donor's paced uplink (as the testbed's tbf links).
DIRECT_BENCH_BURST_BYTES: int = 32 * 1024
#: Relay steps a repeat may take before it counts as failed (all donors are direct: 1).
DIRECT_BENCH_MAX_STEPS: int = 8
_FED = "direct-bench"
_ROUND = 1


def _parties(n: int) -> tuple[list[Identity], Identity, RecordSet]:
    """``n`` donors and a joiner (founders of a bench federation), and their join records."""
    donors = [Identity.from_seed(f"direct-bench/{i}", f"donor{i}") for i in range(n)]
    joiner = Identity.from_seed("direct-bench/joiner", "joiner")
    keys = {i.party_id: i.public_key for i in [*donors, joiner]}
    rs = RecordSet(Policy(_FED, keys, frozenset(keys), sponsors_required=1, failure_quorum=2))
    for i in [*donors, joiner]:
        rs.add(Record.sign(join_body(_FED, i.party_id, 0, 0.0), [i]))
    return donors, joiner, rs


def _one_pull(
    data: bytes, digest: bytes, donors: Sequence[Identity], joiner: Identity, rs: RecordSet
) -> tuple[JoinerPull, float, int]:
    """Run one pull to completion; returns it, its wall time and the relay steps it took."""
    link = LinkAccess(LinkCredentials.create(joiner, _FED), rs.policy, rs.view)
    pull = JoinerPull(_ROUND, digest, [d.party_id for d in donors], total_hint=len(data), link=link)
    t0 = time.monotonic()
    status, requests = pull.start(0.0)
    steps = 0
    while status == "want" and steps < DIRECT_BENCH_MAX_STEPS:  # a fallback through a relay
        steps += 1
        replies = {d: serve_request(data, r) for d, r in requests.items()}
        status, requests = pull.step(replies, set(), float(steps))
    elapsed = time.monotonic() - t0
    if status != "done":
        raise ConfigError(f"direct-pull bench: the pull ended {status!r}: {pull.error}")
    return pull, elapsed, steps


def _run_figures(pull: JoinerPull, elapsed: float, steps: int, bound: float) -> dict[str, Any]:
    stats = dict(pull.stats().items())
    names = {d: i for i, d in enumerate(pull.negotiation.donors)}
    rates = pull.negotiation.rates()  # measured on this pull's links
    return {
        "pull_s": elapsed,
        "ratio_to_bound": elapsed / bound if bound > 0 else None,
        "relay_steps": steps,
        "num_shards": stats.get("num-shards"),
        "received_mb": [round(pull.received.get(d, 0) / 1e6, 3) for d in names],
        "link_rate_mb_s": [round(rates.get(d, 0.0) / 1e6, 3) for d in names],
        "direct_failed": sorted(pull.negotiation.direct_failed),
        "phase_s": {k: stats.get(f"direct-{k}-s") for k in ("manifest", "fetch")},
    }


def measure_direct_pull(
    model_mib: float,
    rates_mb_s: Sequence[float],
    *,
    repeats: int = DIRECT_BENCH_REPEATS,
    burst_bytes: int = DIRECT_BENCH_BURST_BYTES,
    say: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Pull a state of ``model_mib`` MiB from donors with uplinks ``rates_mb_s`` (MB/s),
    ``repeats`` times; figures per run and their medians.

    Raises
    ------
    ConfigError
        A bad size, rate or repeat count, or a pull that did not finish.
    """
    if not 0 < model_mib <= 1024 or repeats < 1 or not rates_mb_s:
        raise ConfigError("direct-pull bench: model-mib in (0, 1024], repeats >= 1, rates given")
    if not all(0 < r < 1e4 for r in rates_mb_s):
        raise ConfigError(f"direct-pull bench: rates must be in (0, 10000) MB/s: {rates_mb_s}")
    rng = np.random.default_rng(7)
    arrays = {"w": rng.standard_normal(int(model_mib * 2**18)).astype(np.float32)}
    state = TrainingState(arrays, _ROUND)
    data, digest = state.to_bytes(), state.digest()
    donors, joiner, rs = _parties(len(rates_mb_s))
    profile = parse_profile(
        {"parties": {d.party_id: {"up_mb_s": r} for d, r in zip(donors, rates_mb_s, strict=True)}}
    )
    bound = lower_bound(
        len(data),
        [Donor(id=d.party_id, bandwidth=r * 1e6) for d, r in zip(donors, rates_mb_s, strict=True)],
    )
    servers: list[DirectServer] = []
    runs: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    try:
        for d in donors:
            creds = LinkCredentials.create(d, _FED)
            link = LinkAccess(creds, rs.policy, rs.view)
            shaper = Shaper(profile, d.party_id, burst=burst_bytes)
            server = DirectServer(BytesSource(_ROUND, digest, data), link=link, shaper=shaper)
            servers.append(server)
            address = server.start()
            body = endpoint_body(_FED, d.party_id, 0, 1, address, creds.serve_cert_der)
            rs.add(Record.sign(body, [d]))
        for k in range(repeats):
            pull, elapsed, steps = _one_pull(data, digest, donors, joiner, rs)
            if pull.state is None or pull.state.digest() != digest:
                raise ConfigError("direct-pull bench: the pulled state is not the one served")
            runs.append(_run_figures(pull, elapsed, steps, bound))
            say(f"run {k + 1}/{repeats}: {elapsed:.3f} s, {elapsed / bound:.2f}x the bound")
    finally:
        for server in servers:
            server.stop()
    pulls = [r["pull_s"] for r in runs]
    return {
        "bench": "direct-pull",
        "model_bytes": len(data),
        "rates_mb_s": list(rates_mb_s),
        "burst_bytes": burst_bytes,
        "repeats": repeats,
        "lower_bound_s": bound,
        "median_pull_s": statistics.median(pulls),
        "median_ratio_to_bound": statistics.median(pulls) / bound if bound > 0 else None,
        "runs": runs,
        "loadavg": {"before": load_before, "after": os.getloadavg()[0]},
    }
