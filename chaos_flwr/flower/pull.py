"""Multi-source pull of a certified state through the relay (a restarted ServerApp's side).

The ServerApp that rebuilds the state is the joiner of :class:`chaos_flwr.transfer.PullSession`:
it learns the state size from a holder, plans the shards over all holders with
:func:`chaos_flwr.planner.plan_transfer`, takes the shard manifest from one holder (checked
against the digest the receipts certify before anything is requested), and then asks every
holder for its shards at once, one exchange per batch of requests. A holder that errs or misses
a deadline is reported lost and its shards are re-planned over the others. The assembled bytes
are checked against the certified digest by :meth:`PullSession.assemble`.

Holders serve byte ranges of their replica (:meth:`Donor.serve`) and never pause training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from chaos_flwr.defaults import (
    FLOWER_CHAOS_MESSAGE_TYPE,
    FLOWER_CHAOS_RECORD_KEY,
    FLOWER_JOIN_MAX_DONORS,
    FLOWER_PULL_ASSUMED_BANDWIDTH_BPS,
    FLOWER_PULL_DATA_KEY,
)
from chaos_flwr.errors import ChaosError, DecodeError, ShardIntegrityError
from chaos_flwr.flower.relay import exchange, server_record
from chaos_flwr.planner import Donor as PlanDonor
from chaos_flwr.planner import plan_transfer
from chaos_flwr.state import Manifest, TrainingState, to_array_record
from chaos_flwr.transfer import PullSession, ShardRequest

__all__ = ["PullReport", "pull_state", "serve_request"]


@dataclass
class PullReport:
    """How a pull went: bytes per donor, donors lost, exchanges used."""

    shares: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    exchanges: int = 0
    seconds: float = 0.0
    strategy_state: bytes = b""


def serve_request(
    state_bytes: bytes, request: ConfigRecord, *, direct_addr: str = ""
) -> ConfigRecord:
    """A holder's answer to a pull request (size, manifest or shards) over its replica bytes.

    Parameters
    ----------
    direct_addr:
        The holder's direct replica server (``host:port``, see :mod:`chaos_flwr.flower.direct`);
        when set, the size and size+manifest replies name it under ``direct`` so a joiner can
        fetch its shards without the relay.
    """
    op = request.get("op")
    extra: dict[str, str] = {"direct": direct_addr} if direct_addr else {}
    if op == "size":
        return ConfigRecord({"total": len(state_bytes), **extra})
    if op == "plan-manifest":  # size + manifest in one reply, shaped as the joiner plans
        n, min_shard = request.get("donors"), request.get("min-shard")
        if not isinstance(n, int) or not isinstance(min_shard, int) or n < 1 or min_shard < 1:
            raise DecodeError("pull request fields 'donors'/'min-shard' must be ints >= 1")
        n = min(n, FLOWER_JOIN_MAX_DONORS)
        donors = [
            PlanDonor(id=f"d{i}", bandwidth=FLOWER_PULL_ASSUMED_BANDWIDTH_BPS) for i in range(n)
        ]
        plan = plan_transfer(len(state_bytes), donors, min_shard_bytes=min_shard)
        manifest = Manifest.build(state_bytes, plan.shard_bytes, num_shards=plan.num_shards)
        return ConfigRecord({"total": len(state_bytes), "manifest": manifest.to_bytes(), **extra})
    if op == "manifest":
        shard_bytes, num_shards = request.get("shard-bytes"), request.get("num-shards")
        if not isinstance(shard_bytes, int) or not isinstance(num_shards, int):
            raise DecodeError("pull request fields 'shard-bytes'/'num-shards' must be ints")
        return ConfigRecord(
            {"manifest": Manifest.build(state_bytes, shard_bytes, num_shards=num_shards).to_bytes()}
        )
    if op == "shards":
        idx, starts, ends = request.get("index"), request.get("start"), request.get("end")
        if not (isinstance(idx, list) and isinstance(starts, list) and isinstance(ends, list)):
            raise DecodeError("pull request fields 'index'/'start'/'end' must be lists")
        if not len(idx) == len(starts) == len(ends):
            raise DecodeError("pull request lists 'index'/'start'/'end' must have one length")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in idx):
            raise DecodeError("pull request field 'index' must hold ints")
        data: list[bytes] = []
        for s, e in zip(starts, ends, strict=True):
            if not isinstance(s, int) or not isinstance(e, int) or not 0 <= s <= e:
                raise DecodeError("pull request ranges must be ints with 0 <= start <= end")
            data.append(state_bytes[s:e])
        return ConfigRecord({"index": [int(i) for i in idx], "data": data})
    raise DecodeError(
        f"pull request field 'op' must be size, plan-manifest, manifest or shards, got {op!r}"
    )


def _ask(
    grid: Grid,
    requests: dict[int, ConfigRecord],
    *,
    server_round: int,
    digest: bytes,
    timeout_s: float,
    poll_interval_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    on_reply: Callable[[int, Message], None] | None = None,
) -> tuple[dict[int, ConfigRecord], set[int]]:
    msgs = []
    for node, req in requests.items():
        content = RecordDict(
            {
                FLOWER_CHAOS_RECORD_KEY: server_record(
                    [], phase="pull", server_round=server_round, digest=digest
                ),
                FLOWER_PULL_DATA_KEY: req,
            }
        )
        msgs.append(
            Message(
                content, dst_node_id=node, message_type=FLOWER_CHAOS_MESSAGE_TYPE, ttl=timeout_s
            )
        )
    res = exchange(
        grid, msgs, timeout_s=timeout_s, poll_interval_s=poll_interval_s, clock=clock, sleep=sleep
    )
    out: dict[int, ConfigRecord] = {}
    for node, reply in res.replies.items():
        if on_reply is not None:
            on_reply(node, reply)  # the party's Chaos record (envelopes, receipt) is not lost
        rec = reply.content.get(FLOWER_PULL_DATA_KEY) if reply.has_content() else None
        if isinstance(rec, ConfigRecord):
            out[node] = rec
    failed = set(res.errors) | res.missing | (set(res.replies) - set(out))
    return out, failed


def pull_state(
    grid: Grid,
    holders: Sequence[tuple[int, str]],
    *,
    server_round: int,
    digest: bytes,
    timeout_s: float,
    poll_interval_s: float,
    min_shard_bytes: int,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_reply: Callable[[int, Message], None] | None = None,
) -> tuple[ArrayRecord, PullReport]:
    """Pull the state certified as ``(server_round, digest)`` from ``holders`` in parallel.

    Parameters
    ----------
    holders:
        ``(node id, party id)`` of parties whose verified receipts name that state.
    timeout_s:
        Deadline of each exchange; the whole pull ends when no live holder is left.
    on_reply:
        Called with every reply before its pull data is read (the caller absorbs the party's
        Chaos record: relay envelopes, receipt).

    Raises
    ------
    chaos_flwr.errors.TransferError
        No live holder has the missing shards.
    chaos_flwr.errors.ShardIntegrityError
        The manifest or the assembled state does not match ``digest``.
    """
    t0 = clock()
    report = PullReport()
    ask = dict(
        server_round=server_round,
        digest=digest,
        timeout_s=timeout_s,
        poll_interval_s=poll_interval_s,
        clock=clock,
        sleep=sleep,
        on_reply=on_reply,
    )
    node_of = {party: node for node, party in holders}
    live = list(holders)
    total: int | None = None
    while live and total is None:  # size, from the first holder that answers
        node, party = live[0]
        got, failed = _ask(grid, {node: ConfigRecord({"op": "size"})}, **ask)  # type: ignore[arg-type]
        report.exchanges += 1
        value = got.get(node, ConfigRecord()).get("total")
        if isinstance(value, int) and not isinstance(value, bool):
            total = value
        else:
            live.pop(0)
            report.lost.append(party)
    if total is None:
        raise ShardIntegrityError("no holder answered with the state size; nothing to pull")
    donors = [PlanDonor(id=p, bandwidth=FLOWER_PULL_ASSUMED_BANDWIDTH_BPS) for _, p in live]
    plan = plan_transfer(total, donors, min_shard_bytes=min_shard_bytes)
    manifest: Manifest | None = None
    while live and manifest is None:
        node, party = live[0]
        req = ConfigRecord(
            {"op": "manifest", "shard-bytes": plan.shard_bytes, "num-shards": plan.num_shards}
        )
        got, _ = _ask(grid, {node: req}, **ask)  # type: ignore[arg-type]
        report.exchanges += 1
        raw = got.get(node, ConfigRecord()).get("manifest")
        try:
            if not isinstance(raw, bytes):
                raise DecodeError("no manifest in the reply")
            candidate = Manifest.from_bytes(raw)
            candidate.check_certified(digest, total)
            manifest = candidate
        except (ChaosError, ValueError):
            live.pop(0)
            report.lost.append(party)
    if manifest is None:
        raise ShardIntegrityError("no holder sent a manifest that names the certified digest")
    session = PullSession(
        manifest, plan, [d for d in donors if d.id in {p for _, p in live}],
        now=clock(), expected_digest=digest,
    )  # fmt: skip
    actions = session.poll(clock())
    while not session.done:
        wanted: dict[str, list[ShardRequest]] = {}
        for action in actions:
            if isinstance(action, ShardRequest):
                wanted.setdefault(action.donor, []).append(action)
        actions = []
        if not wanted:
            actions = session.tick(clock())
            if not actions:
                sleep(poll_interval_s)
            continue
        requests = {
            node_of[d]: ConfigRecord(
                {
                    "op": "shards",
                    "index": [r.index for r in rs],
                    "start": [r.start for r in rs],
                    "end": [r.end for r in rs],
                }
            )
            for d, rs in wanted.items()
        }
        got, failed = _ask(grid, requests, **ask)  # type: ignore[arg-type]
        report.exchanges += 1
        party_of = {n: p for p, n in node_of.items()}
        for node, rec in got.items():
            party = party_of[node]
            idx, data = rec.get("index"), rec.get("data")
            if not (isinstance(idx, list) and isinstance(data, list)):
                actions.extend(session.on_donor_lost(party, clock()))
                continue
            for i, chunk in zip(idx, data, strict=False):
                if isinstance(i, int) and isinstance(chunk, bytes):
                    report.shares[party] = report.shares.get(party, 0) + len(chunk)
                    actions.extend(session.on_shard(party, i, chunk, clock()))
        for node in failed:
            report.lost.append(party_of[node])
            actions.extend(session.on_donor_lost(party_of[node], clock()))
        actions.extend(session.tick(clock()))
    state = TrainingState.from_bytes(session.assemble())
    report.seconds = clock() - t0
    report.strategy_state = state.strategy_state
    return to_array_record(state), report
