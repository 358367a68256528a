"""A restarted ServerApp's pull of the newest certified state from its holders.

A restarted ServerApp rebuilds the newest certified state by driving the same
:class:`~chaos_flwr.pull.PullNegotiation` a joiner drives (:func:`pull_state`): sizes from
every holder, the manifest of the shape it planned from one (checked against the digest the
receipts certify before anything is requested), then every holder's shards at once. Through
the relay that is one exchange of Flower messages per decision. Holders whose signed endpoint
records the ServerApp holds (their party daemons) are dialled directly instead, with a link
key made for this run (:func:`relay_link`) that the hello asked the parties to grant reads
(:mod:`chaos_flwr.flower.grant`): the manifest and their shards then need no exchange at all,
and a link that fails falls back to the relay for its share. A holder that errs or misses a
deadline is reported lost and its shards are re-planned over the others; the assembled bytes
are checked against the certified digest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from chaos_flwr.errors import ChaosError, TransferError
from chaos_flwr.flower.fetch import carry_direct
from chaos_flwr.flower.grant import RELAY_READER
from chaos_flwr.flower.relay import exchange
from chaos_flwr.flower.schema import (
    CHAOS_MESSAGE_TYPE,
    CHAOS_RECORD_KEY,
    PULL_DATA_KEY,
    server_record,
)
from chaos_flwr.identity import Identity
from chaos_flwr.membership import Policy, View, parse_address
from chaos_flwr.pull.messages import Reply, read_reply
from chaos_flwr.pull.negotiation import PullNegotiation, Status
from chaos_flwr.state import to_array_record
from chaos_flwr.transport.links import LinkAccess
from chaos_flwr.transport.tls import LinkCredentials

__all__ = [
    "FLOWER_RESUME_MAX_EXCHANGES",
    "PullReport",
    "RelayAsker",
    "pull_state",
    "relay_link",
]

#: Most exchanges a restarted ServerApp's pull may take (sizes, manifest, shards, re-plans).
FLOWER_RESUME_MAX_EXCHANGES: int = 64


@dataclass
class PullReport:
    """How a pull went: bytes per donor (``direct``: the part over direct links, and the
    donors whose link failed), donors lost, exchanges used, its seconds."""

    shares: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    exchanges: int = 0
    seconds: float = 0.0
    strategy_state: bytes = b""
    direct: dict[str, int] = field(default_factory=dict)
    direct_failed: list[str] = field(default_factory=list)


def relay_link(policy: Policy, view: Callable[[], View]) -> LinkAccess:
    """The restarted ServerApp's link access for one run: a fresh link key (no charter key
    vouches for it: a party's link server serves it only on the grant the hello asks for)
    and the view it resolves the holders' signed endpoints in."""
    creds = LinkCredentials.create(Identity.generate(RELAY_READER), policy.federation)
    return LinkAccess(creds, policy, view)


def _address(value: str) -> str:
    parse_address(value)  # DecodeError if malformed; the signed endpoint decides the rest
    return value


@dataclass(frozen=True)
class RelayAsker:
    """The resume pull's carrier: one exchange of pull requests with the holders' nodes.

    Attributes
    ----------
    grid:
        The ServerApp's Grid.
    server_round, digest:
        The certified state pulled (named in every request's Chaos record).
    timeout_s, poll_interval_s, clock, sleep:
        Each exchange's deadline and polling.
    on_reply:
        Called with every reply before its pull data is read (the caller absorbs the party's
        Chaos record: relay envelopes, receipt).
    """

    grid: Grid
    server_round: int
    digest: bytes
    timeout_s: float
    poll_interval_s: float
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    on_reply: Callable[[int, Message], None] | None

    def __call__(
        self, requests: dict[int, ConfigRecord]
    ) -> tuple[dict[int, ConfigRecord], set[int]]:
        msgs = []
        for node, req in requests.items():
            record = server_record(
                [], phase="pull", server_round=self.server_round, digest=self.digest
            )
            content = RecordDict({CHAOS_RECORD_KEY: record, PULL_DATA_KEY: req})
            msgs.append(
                Message(
                    content,
                    dst_node_id=node,
                    message_type=CHAOS_MESSAGE_TYPE,
                    ttl=self.timeout_s,
                )
            )
        res = exchange(
            self.grid, msgs, timeout_s=self.timeout_s, poll_interval_s=self.poll_interval_s,
            clock=self.clock, sleep=self.sleep,
        )  # fmt: skip
        out: dict[int, ConfigRecord] = {}
        for node, reply in res.replies.items():
            if self.on_reply is not None:
                self.on_reply(node, reply)  # the party's Chaos record (envelopes, receipt)
            rec = reply.content.get(PULL_DATA_KEY) if reply.has_content() else None
            if isinstance(rec, ConfigRecord):
                out[node] = rec
        failed = set(res.errors) | res.missing | (set(res.replies) - set(out))
        return out, failed


def pull_state(
    ask: RelayAsker,
    holders: Sequence[tuple[int, str]],
    *,
    min_shard_bytes: int,
    total_hint: int | None = None,
    link: LinkAccess | None = None,
) -> tuple[ArrayRecord, PullReport]:
    """Pull the state certified as ``(ask.server_round, ask.digest)`` from ``holders`` at once.

    The ServerApp drives the same :class:`~chaos_flwr.pull.negotiation.PullNegotiation` a
    joiner does: one exchange per decision (sizes from every holder, the manifest of the planned
    shape from one, then every holder's shards at once; a lost holder's shards are re-planned
    over the others).

    Parameters
    ----------
    ask:
        The carrier (grid, deadlines, the reply hook).
    holders:
        ``(node id, party id)`` of parties whose verified receipts name that state.
    min_shard_bytes:
        Smallest shard of the plan.
    total_hint:
        The state's size in bytes as the holders told it (their hello replies), or ``None``:
        with it the pull skips its size step (the manifest is asked at once; a holder whose
        size differs says so and the shape is planned again).
    link:
        The ServerApp's link access (:func:`relay_link`): holders with a signed endpoint in
        its view are dialled directly (``None``: the relay only).

    Raises
    ------
    chaos_flwr.errors.TransferError
        No live holder has the missing shards, or no holder answered.
    """
    t0 = ask.clock()
    report = PullReport()
    node_of = {party: node for node, party in holders}
    party_of = {node: party for node, party in holders}
    view = link.view() if link is not None else None
    endpoints = {p: ep.address for _, p in holders if view and (ep := view.endpoint(p))}
    pull = PullNegotiation(
        ask.server_round, ask.digest, [p for _, p in holders], min_shard_bytes=min_shard_bytes,
        total_hint=total_hint, direct=bool(endpoints), address_ok=_address, addresses=endpoints,
    )  # fmt: skip
    decision = pull.start(ask.clock())
    for _ in range(FLOWER_RESUME_MAX_EXCHANGES):
        if link is not None:
            decision = carry_direct(pull, decision, link, clock=ask.clock, timeout_s=ask.timeout_s)
        if decision.status != Status.WANT:
            break
        requests = {node_of[d]: ConfigRecord(r.to_value()) for d, r in decision.relay.items()}  # type: ignore[arg-type]
        got, failed = ask(requests)
        report.exchanges += 1
        replies: dict[str, Reply | None] = {}
        for node, rec in got.items():
            try:
                replies[party_of[node]] = read_reply(rec)
            except ChaosError:
                replies[party_of[node]] = None
        decision = pull.on_replies(replies, {party_of[n] for n in failed}, ask.clock())
    report.lost = list(pull.lost)
    report.shares = dict(pull.received)
    report.direct = dict(pull.direct_bytes)
    report.direct_failed = sorted(pull.direct_failed)
    report.seconds = ask.clock() - t0
    if decision.status != Status.DONE or pull.state is None:
        raise TransferError(f"resume pull of round {ask.server_round} failed: {pull.error}")
    report.strategy_state = pull.state.strategy_state
    return to_array_record(pull.state), report
