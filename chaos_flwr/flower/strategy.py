"""``ChaosStrategy``: Chaos phases around any new-style Flower strategy.

Each round has the same two exchanges as the inner strategy (train, evaluate), and Chaos rides
on them, so a churn-free round costs about what the inner strategy's round costs:

1. **train**: the inner strategy's ``configure_train`` samples from a Grid that lists only the
   *eligible* nodes (those whose party holds the current state, by its receipt, and, when a view
   source is given, that the signed view lists as active). Every message carries the relay
   envelopes for its party; other known nodes get a ``query.chaos`` message with theirs in the
   same push. The phase waits for the non-suspect nodes only, and never past its deadline.
2. **certify + evaluate**: the inner strategy's ``configure_evaluate`` messages carry the new
   state; nodes not sampled for evaluation get it in a ``query.chaos`` certify message. Every
   reply carries the party's receipt (round, digest), signed by the party's key.

Replies are stripped of their Chaos record before the inner strategy aggregates them, so the
inner strategy sees exactly what it would have seen without Chaos.

What this strategy does **not** do by itself: decide membership. Nodes that miss a deadline or
answer with an error are *suspects* (not waited for, not sampled) until they answer again; the
membership of the federation is what the parties' signed records say (``view_source``).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log
from flwr.supercore.run import Run

from chaos_flwr.defaults import (
    FLOWER_CHAOS_MESSAGE_TYPE,
    FLOWER_CHAOS_RECORD_KEY,
    FLOWER_CHAOS_TTL_PHASES,
    FLOWER_JOIN_MAX_DONORS,
    FLOWER_JOIN_MAX_STEPS,
    FLOWER_JOIN_MIN_SHARD_BYTES,
    FLOWER_PHASE_TIMEOUT_S,
    FLOWER_POLL_INTERVAL_S,
    FLOWER_PULL_ASSUMED_BANDWIDTH_BPS,
    FLOWER_PULL_DATA_KEY,
    FLOWER_RESUME_MIN_RECEIPTS,
)
from chaos_flwr.errors import ChaosError, DecodeError
from chaos_flwr.flower.client import certified_digest, receipt_bytes
from chaos_flwr.flower.joinpull import donor_key, read_donor_records, start_record
from chaos_flwr.flower.pull import PullReport, RelayAsker, pull_state
from chaos_flwr.flower.relay import (
    ExchangeResult,
    Relay,
    exchange,
    server_record,
    split_chaos,
    with_chaos,
)
from chaos_flwr.planner import Donor as PlanDonor
from chaos_flwr.planner import lower_bound
from chaos_flwr.state import TrainingState

if TYPE_CHECKING:
    from chaos_flwr.flower.serverview import ServerView

__all__ = [
    "ChaosStrategy",
    "JoinLog",
    "MembershipEvent",
    "ReceiptVerifier",
    "RoundLog",
    "keyring_verifier",
]

#: ``(party, round, digest, receipt blob) -> True`` if the receipt is that party's signature.
ReceiptVerifier = Callable[[str, int, bytes, bytes], bool]


def keyring_verifier(keyring: Mapping[str, bytes]) -> ReceiptVerifier:
    """A receipt verifier from a ``party id -> raw Ed25519 public key`` keyring (the charter's).

    A receipt counts only if its party is in the keyring and the blob is that key's signature
    over :func:`~chaos_flwr.flower.client.receipt_bytes`.
    """
    from chaos_flwr.errors import SignatureError
    from chaos_flwr.identity import verify_signature

    keys = dict(keyring)

    def verify(party: str, server_round: int, digest: bytes, receipt: bytes) -> bool:
        key = keys.get(party)
        if key is None:
            return False
        try:
            verify_signature(key, receipt, receipt_bytes(party, server_round, digest))
        except SignatureError:
            return False
        return True

    return verify


@dataclass
class JoinLog:
    """One joiner's pull of the current certified state from its donors (through the relay).

    The joiner plans and verifies; the ServerApp only relays its requests and the donors'
    shard replies (it never assembles the state). Times are measured by the ServerApp's clock.

    Attributes
    ----------
    party, node:
        The joiner's party id and Flower node id.
    server_round, digest:
        The certified state pulled (its round and digest, checked by the joiner against the
        donors' signed receipts and the assembled bytes).
    donors:
        Party ids the joiner pulled from (>= 2 when that many holders were live).
    planned_shards, planned_bytes:
        The planner's shares per donor: shard count and bytes.
    bytes_per_donor:
        Bytes actually received from each donor (differs from the plan after a re-plan).
    shard_bytes, num_shards, total_bytes:
        The plan's shard size and count, and the state's size.
    lost:
        Donors that failed mid-pull (error, no reply, a shard that did not verify).
    pull_s:
        Measured wall time from the first relayed request to the verified state.
    lower_bound_s:
        The planner's lower bound for the same bytes and donors (assumed link rates, measured
        relay round trips as latency); ``pull_s / lower_bound_s`` is :attr:`delay_ratio`.
    steps:
        Relay steps used (one joiner exchange + one donor exchange each).
    ok, error:
        Whether the joiner holds the verified state, else why not.
    direct_bytes:
        Of :attr:`bytes_per_donor`, the bytes that came over a direct grpc link (donors that
        advertised a ``chaos-direct-addr``); the rest came through the relay.
    direct_failed:
        Donors whose direct link failed (their remaining shards went through the relay).
    rate_bps:
        The per-donor rate estimates (bytes/s) the joiner planned with: measured on direct
        links, the assumed rate for relay-only donors.
    """

    party: str
    node: int
    server_round: int = -1
    digest: bytes = b""
    donors: list[str] = field(default_factory=list)
    planned_shards: dict[str, int] = field(default_factory=dict)
    planned_bytes: dict[str, int] = field(default_factory=dict)
    bytes_per_donor: dict[str, int] = field(default_factory=dict)
    shard_bytes: int = 0
    num_shards: int = 0
    total_bytes: int = 0
    lost: list[str] = field(default_factory=list)
    pull_s: float = 0.0
    lower_bound_s: float = 0.0
    steps: int = 0
    ok: bool = False
    error: str = ""
    direct_bytes: dict[str, int] = field(default_factory=dict)
    direct_failed: list[str] = field(default_factory=list)
    rate_bps: dict[str, float] = field(default_factory=dict)

    @property
    def delay_ratio(self) -> float:
        """Measured pull time over the planner's lower bound (``inf`` when the bound is 0)."""
        return self.pull_s / self.lower_bound_s if self.lower_bound_s > 0 else float("inf")


@dataclass
class MembershipEvent:
    """One membership record (join, leave, fail, link_up, link_down) as the ServerApp relayed it.

    Attributes
    ----------
    kind, subject, record_id:
        The record's kind, its subject party (``a|b`` for a link) and id.
    server_round:
        Round in which the ServerApp first relayed it.
    first_seen:
        ServerApp clock at its first relay.
    settle_s:
        Time from the first relay until every live member (the server-side view's active
        parties, the subject of a leave/fail excluded) had applied it: had sent it, or had
        answered a message that delivered it. ``None`` while not settled; it is filled in
        place when it settles in a later round.
    """

    kind: str
    subject: str
    record_id: str
    server_round: int
    first_seen: float
    settle_s: float | None = None


@dataclass
class RoundLog:
    """What happened in one round (kept in :attr:`ChaosStrategy.rounds`).

    Attributes
    ----------
    server_round:
        The round (0: certifying the initial state; -1: a restarted ServerApp's hello).
    eligible, trained:
        Node ids that could be sampled (active in the server-side view, not suspected, holding
        the current certified state) and those the inner strategy sampled.
    missing, errors:
        Nodes that missed a deadline / answered with an error code.
    holders:
        Party ids whose verified receipt names this round's certified state.
    unsigned_receipts:
        Parties whose receipts were taken unverified (no verifier).
    digest:
        The certified digest of this round's state.
    train_s, certify_s, join_s:
        Wall time of the train exchange, the certify exchange and the joiners' pulls.
    skipped:
        Why training was skipped, if it was.
    members:
        Status (``active``, ``left``, ``failed``) -> sorted party ids, from the server-side view
        (built from the signed records the ServerApp relayed) at the end of the round.
    joins:
        The pulls of the parties that joined (or caught up) in this round (:class:`JoinLog`).
    leaves, failures:
        Parties whose leave / fail record was first relayed in this round.
    events:
        Every membership record first relayed in this round (:class:`MembershipEvent`, with
        the time it took to settle).
    equivocations:
        Evidence parties reported in this round (encoded
        :class:`chaos_flwr.receipts.Equivocation`: two signed receipts of one round with
        different digests). Parties holding evidence refuse to train.
    """

    server_round: int
    eligible: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    errors: dict[int, int] = field(default_factory=dict)
    holders: list[str] = field(default_factory=list)
    unsigned_receipts: list[str] = field(default_factory=list)
    digest: bytes = b""
    train_s: float = 0.0
    certify_s: float = 0.0
    join_s: float = 0.0
    skipped: str = ""
    members: dict[str, list[str]] = field(default_factory=dict)
    joins: list[JoinLog] = field(default_factory=list)
    leaves: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    events: list[MembershipEvent] = field(default_factory=list)
    equivocations: list[bytes] = field(default_factory=list)


class _EligibleGrid(Grid):
    """A view of a Grid that lists only the eligible nodes (what the inner strategy samples)."""

    def __init__(self, grid: Grid, nodes: list[int]) -> None:
        self._grid = grid
        self._nodes = list(nodes)

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._nodes)

    def get_nodes(self) -> Iterable[NodeInfo]:
        return (NodeInfo(node_id=n) for n in self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self._grid.send_and_receive(messages, timeout=timeout)


def _min_nodes(inner: Strategy, kind: str) -> int:
    """Nodes the inner strategy's sampler waits for (it would sleep forever with fewer)."""
    need = int(getattr(inner, "min_available_nodes", 0) or 0)
    return max(need, int(getattr(inner, f"min_{kind}_nodes", 0) or 0))


class ChaosStrategy(Strategy):
    """Wrap a ``flwr.serverapp.strategy`` strategy with the Chaos phases (module docstring).

    Parameters
    ----------
    inner:
        Any new-style Flower strategy (FedAvg, FedProx, FedAdam, Krum, ...); it does all
        sampling sizes and aggregation.
    phase_timeout_s:
        Deadline of each exchange (capped by ``start(timeout=...)``).
    poll_interval_s:
        Pause between pulls while a phase waits.
    receipt_verifier:
        Checks parties' signed receipts (e.g. :func:`keyring_verifier` of the charter's
        keyring). Without one, receipts are taken as *unsigned* claims: they still steer whom
        to sample (a liveness decision), and every round lists them in ``unsigned_receipts``.
    view_source:
        Returns the party ids the signed view lists as active; ``None`` means no view is known
        to the server (sampling is then by receipts only).
    relay:
        The envelope router (a fresh one by default).
    resume, resume_min_receipts, resume_min_shard_bytes:
        On start, rebuild the newest state that at least ``resume_min_receipts`` parties
        certified (verified receipts only; default 1, the newest state any verified party
        holds), pulled in shards from all its holders at once (:mod:`chaos_flwr.flower.pull`),
        and go on above the newest round any party signed (:attr:`round_floor`; a restarted
        ServerApp keeps no checkpoint, and never certifies a round number twice).
    charter:
        The federation's verified charter. With it the ServerApp keeps a server-side view
        from the signed records it relays (:class:`~chaos_flwr.flower.serverview.ServerView`:
        validated, never forged), samples only parties it lists as active, verifies receipts
        with the charter's keyring, and logs membership events and their settle times.
    join_min_shard_bytes, join_max_donors, join_max_steps:
        A joiner's pull (:mod:`chaos_flwr.flower.joinpull`): smallest shard, most donors,
        most relay steps.
    """

    def __init__(
        self,
        inner: Strategy,
        *,
        phase_timeout_s: float = FLOWER_PHASE_TIMEOUT_S,
        poll_interval_s: float = FLOWER_POLL_INTERVAL_S,
        receipt_verifier: ReceiptVerifier | None = None,
        view_source: Callable[[], set[str]] | None = None,
        relay: Relay | None = None,
        resume: bool = True,
        resume_min_receipts: int = FLOWER_RESUME_MIN_RECEIPTS,
        resume_min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES,
        charter: Any | None = None,
        join_min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES,
        join_max_donors: int = FLOWER_JOIN_MAX_DONORS,
        join_max_steps: int = FLOWER_JOIN_MAX_STEPS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(inner, Strategy):
            raise TypeError(
                f"inner must be a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}"
            )
        if phase_timeout_s <= 0:
            raise ValueError(f"phase_timeout_s must be > 0, got {phase_timeout_s}")
        self.inner = inner
        self.phase_timeout_s = phase_timeout_s
        self.poll_interval_s = poll_interval_s
        self.receipt_verifier = receipt_verifier
        self.view_source = view_source
        self.relay = relay or Relay()
        self.resume = resume
        self.resume_min_receipts = resume_min_receipts
        self.resume_min_shard_bytes = resume_min_shard_bytes
        self.last_pull: PullReport | None = None
        self.clock = clock
        self.sleep = sleep
        self.suspects: set[int] = set()
        self.holders: dict[int, tuple[str, int, bytes]] = {}
        self.receipts: dict[int, bytes] = {}
        self.rounds: list[RoundLog] = []
        self.join_min_shard_bytes = join_min_shard_bytes
        self.join_max_donors = join_max_donors
        self.join_max_steps = join_max_steps
        self.view: ServerView | None = None
        self._synced: set[int] = set()
        self._round_receipts: dict[int, dict[tuple[str, bytes], bytes]] = {}
        self._forward_round = -1
        self._hello = RoundLog(-1)
        self._late: dict[str, int] = {}
        self.round_floor = -1
        if charter is not None:
            from chaos_flwr.flower.serverview import ServerView

            self.view = ServerView(charter, clock)
            if self.receipt_verifier is None:
                self.receipt_verifier = keyring_verifier(dict(charter.keyring()))
            if self.view_source is None:
                self.view_source = self.view.active

    # -- delegation ---------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Delegate to the inner strategy."""
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Delegate to the inner strategy."""
        return self.inner.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Delegate to the inner strategy."""
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Delegate to the inner strategy."""
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Log the inner strategy's summary and the Chaos settings."""
        log(INFO, "\t├──> Chaos: relay + receipts around %s", type(self.inner).__name__)
        log(INFO, "\t│\t├── phase timeout: %.1f s", self.phase_timeout_s)
        log(INFO, "\t│\t└── receipts: %s", "verified" if self.receipt_verifier else "UNSIGNED")
        self.inner.summary()

    # -- profiles -----------------------------------------------------------------------------
    @classmethod
    def from_profile(cls, name_or_path: str | Path, **overrides: Any) -> ChaosStrategy:
        """Build a ChaosStrategy from a strategy profile (``strategies/<name>.yaml`` or a path).

        ``overrides`` replace keyword arguments of :class:`ChaosStrategy` (e.g.
        ``receipt_verifier``); :class:`~chaos_flwr.errors.ProfileError` names a bad field.
        """
        from chaos_flwr.flower.profiles import load_profile

        profile = load_profile(name_or_path)
        kwargs: dict[str, Any] = dict(profile.chaos)
        kwargs.update(overrides)
        return cls(profile.build_inner(), **kwargs)

    # -- the rounds ---------------------------------------------------------------------------
    def _eligible(self, known: list[int], digest: bytes, server_round: int) -> list[int]:
        active = self.view_source() if self.view_source is not None else None
        out: list[int] = []
        for node in known:
            if node in self.suspects:
                continue
            held = self.holders.get(node)
            if held is None or held[1] != server_round or held[2] != digest:
                continue
            if active is not None and held[0] not in active:
                continue
            out.append(node)
        return out

    def _holding(self, nodes: Iterable[int], server_round: int, digest: bytes) -> list[int]:
        """Nodes (not suspected) whose verified receipt names ``(server_round, digest)``."""
        out = []
        for node in nodes:
            held = self.holders.get(node)
            if node in self.suspects or held is None:
                continue
            if held[1] == server_round and held[2] == digest:
                out.append(node)
        return sorted(out)

    def _msg(
        self,
        node: int,
        phase: str,
        rnd: int,
        digest: bytes,
        content: RecordDict | None = None,
        *,
        inner: Message | None = None,
        strategy_state: bytes | None = None,
    ) -> tuple[Message, list[bytes]]:
        """A message for ``node`` with its relay envelopes attached (and which were taken)."""
        envs = self.relay.take(node)
        record = server_record(
            envs, phase=phase, server_round=rnd, digest=digest, strategy_state=strategy_state
        )
        if self.view is not None:
            if node not in self._synced:
                record["sync"] = True  # first message to this node in this run: your records
                self._synced.add(node)
            party = self.relay.party_of.get(node)
            active = self.view.active()
            if party is None or party not in active:
                record["members"] = sorted(active)  # whom a non-member may ask to sponsor it
        fwd = self._round_receipts.get(self._forward_round)
        if phase == "relay" and fwd:
            # the previous round's receipts, so that parties can compare them with their own
            record["receipts"] = [fwd[p] for p in sorted(fwd)]
        if inner is not None:
            return with_chaos(inner, record), envs
        content = RecordDict() if content is None else content
        content[FLOWER_CHAOS_RECORD_KEY] = record
        # a Chaos message outlives its phase only briefly: a dead node must not come back to a
        # backlog of stale relay traffic queued at the SuperLink
        msg = Message(
            content,
            dst_node_id=node,
            message_type=FLOWER_CHAOS_MESSAGE_TYPE,
            ttl=self.phase_timeout_s * FLOWER_CHAOS_TTL_PHASES,
        )
        return msg, envs

    def _exchange(
        self,
        grid: Grid,
        msgs: list[Message],
        taken: dict[int, list[bytes]],
        *,
        timeout: float,
        log_: RoundLog,
    ) -> ExchangeResult:
        """Run one deadline-bounded exchange; absorb the parties' Chaos records."""
        addressed = {m.metadata.dst_node_id for m in msgs}
        # suspects are not waited for, unless every addressed node is one: then nothing would
        # ever be waited for again (each exchange would end at its first pull, before any reply
        # could come, and no late reply could clear a suspicion), so wait for them, bounded
        wait_for = {n for n in addressed if n not in self.suspects} or set(addressed)
        res = exchange(
            grid,
            msgs,
            timeout_s=min(timeout, self.phase_timeout_s),
            wait_for=wait_for,
            poll_interval_s=self.poll_interval_s,
            clock=self.clock,
            sleep=self.sleep,
            late=self._late,
        )
        # replies to earlier messages that missed their deadline: their envelopes and
        # receipts still count (a recipient refuses a duplicate envelope as a replay)
        for mid in list(self._late):
            if self._late[mid] in res.late or self._late[mid] in addressed:
                del self._late[mid]  # answered late, or superseded by this exchange's message
        for node, reply in res.late.items():
            # it is alive: no longer a suspect (the next phase may wait for it, up to its
            # deadline; otherwise a federation whose every node once missed a deadline, e.g.
            # a first exchange while Ray starts, would never be waited for again)
            self._absorb(node, reply, {}, log_)
        self._late.update(res.missing_ids)
        node_of_msg = dict(
            zip(res.message_ids, (m.metadata.dst_node_id for m in msgs), strict=True)
        )
        absorbed: set[int] = set()
        for mid in res.message_ids:
            answer = res.by_message.get(mid)
            if answer is None:
                continue
            node = node_of_msg[mid]
            # several messages to one node (joiners asking one donor): every reply's records
            # count; the envelopes it was given are delivered once
            self._absorb(node, answer, {} if node in absorbed else taken, log_)
            absorbed.add(node)
        for node, code in res.errors.items():
            self.suspects.add(node)
            log_.errors[node] = code
            self.relay.give_back(node, taken.get(node, []))
            self.holders.pop(node, None)
        for node in res.missing:
            self.suspects.add(node)
            self.relay.give_back(node, taken.get(node, []))
        log_.missing = sorted(set(log_.missing) | res.missing)
        if self.view is not None:
            live = {p for n, p in self.relay.party_of.items() if n not in self.suspects}
            self.view.settle(live)
        return res

    def _absorb(
        self,
        node: int,
        reply: Message,
        taken: Mapping[int, list[bytes]],
        log_: RoundLog,
        *,
        in_time: bool = True,
    ) -> None:
        """Take a party's Chaos record off its reply: route, fold, note its receipt."""
        if in_time:
            self.suspects.discard(node)
        record = split_chaos(reply)
        if record is None:
            return
        try:
            pr = self.relay.absorb(node, record)
        except DecodeError as exc:
            log(WARNING, "Chaos: malformed record from node %d: %s", node, exc)
            return
        evidence = record.get("evidence")
        if isinstance(evidence, list) and evidence:
            who = pr.party or str(node)
            log(WARNING, "Chaos: %s reports equivocation evidence (%d)", who, len(evidence))
            log_.equivocations.extend(e for e in evidence if isinstance(e, bytes))
        held = record.get("records")
        if self.view is not None and isinstance(held, list):
            self.view.sync(r for r in held if isinstance(r, bytes))
        if self.view is not None:
            for _, data in pr.outgoing:
                self.view.sent(data, log_.server_round)
            party = pr.party or self.relay.party_of.get(node)
            if party:
                self.view.delivered(party, taken.get(node, []))
        self._note_receipt(node, pr.party, pr.receipt_round, pr.receipt_digest, pr.receipt, log_)

    def _phase(
        self,
        grid: Grid,
        inner_msgs: list[Message],
        known: list[int],
        *,
        phase: str,
        server_round: int,
        digest: bytes,
        arrays_for_others: ArrayRecord | None,
        timeout: float,
        log_: RoundLog,
        receivers: set[int] | None = None,
        strategy_state: bytes = b"",
    ) -> tuple[list[Message], float]:
        """Run one exchange; return the inner strategy's replies (Chaos records removed).

        Known nodes the inner strategy did not address get a ``query.chaos`` message; it
        carries ``arrays_for_others`` (and the strategy state) only to ``receivers`` (default:
        all of them). A joiner is never a receiver: its state comes from parties.
        """
        msgs: list[Message] = []
        taken: dict[int, list[bytes]] = {}
        sstate = strategy_state if phase == "certify" else None
        for m in inner_msgs:
            node = m.metadata.dst_node_id
            msg, taken[node] = self._msg(
                node, phase, server_round, digest, inner=m, strategy_state=sstate
            )
            msgs.append(msg)
        for node in known:
            if node in taken:
                continue
            gets = arrays_for_others is not None and (receivers is None or node in receivers)
            content = RecordDict()
            if gets:
                assert arrays_for_others is not None
                content["arrays"] = arrays_for_others
            msg, taken[node] = self._msg(
                node,
                phase,
                server_round,
                digest,
                content,
                strategy_state=sstate if gets else None,
            )
            msgs.append(msg)
        res = self._exchange(grid, msgs, taken, timeout=timeout, log_=log_)
        # the inner strategy sees its replies in the order of its own messages, as Flower's
        # send_and_receive gives them when all replies are in
        inner_order = [m.metadata.dst_node_id for m in inner_msgs]
        inner_replies = [res.replies[n] for n in inner_order if n in res.replies]
        return inner_replies, res.elapsed_s

    def _note_receipt(
        self, node: int, party: str, rnd: int, digest: bytes, receipt: bytes, log_: RoundLog
    ) -> None:
        if rnd < 0 or not party:
            if party and rnd < 0:
                self.holders.pop(node, None)  # it holds nothing (any more)
            return
        if self.receipt_verifier is not None:
            if not self.receipt_verifier(party, rnd, digest, receipt):
                log(WARNING, "Chaos: receipt of %s for round %d does not verify", party, rnd)
                return
        elif party not in log_.unsigned_receipts:
            log_.unsigned_receipts.append(party)
        self.holders[node] = (party, rnd, digest)
        self.receipts[node] = receipt
        if self.receipt_verifier is not None and receipt:
            from chaos_flwr.receipts import Receipt

            try:
                blob = Receipt.from_flower(party, rnd, digest, receipt).encode()
            except ChaosError:
                return
            self._round_receipts.setdefault(rnd, {}).setdefault((party, digest), blob)

    def _finish(self, rlog: RoundLog) -> None:
        """Fill the round's membership fields from the server-side view and keep the log."""
        if self.view is not None:
            rlog.members = self.view.members()
            rlog.events = [e for e in self.view.events if e.server_round == rlog.server_round]
            rlog.leaves = [e.subject for e in rlog.events if e.kind == "leave"]
            rlog.failures = [e.subject for e in rlog.events if e.kind == "fail"]
        self.rounds.append(rlog)

    # -- joiners ------------------------------------------------------------------------------
    def _join_pulls(
        self, grid: Grid, rnd: int, digest: bytes, rlog: RoundLog, timeout: float
    ) -> float:
        """Have every live party that lacks the certified state pull it from its holders.

        The joiners pull concurrently: each relay step is one exchange with every joiner still
        pulling, then one exchange carrying every joiner's shard requests to the donors (a
        donor asked by several joiners gets one message per joiner in that same exchange), so
        two joiners take as many exchanges as one.
        """
        t0 = self.clock()
        nodes = [n for n in grid.get_node_ids() if n not in self.suspects]
        active = self.view_source() if self.view_source is not None else None
        donors = [
            n
            for n in self._holding(nodes, rnd, digest)
            if active is None or self.holders[n][0] in active
        ][: self.join_max_donors]
        if not donors:
            return 0.0
        holding = set(self._holding(nodes, rnd, digest))
        joiners: list[tuple[int, str]] = []
        for node in nodes:
            party = self.relay.party_of.get(node)
            if party is None or node in holding:
                continue
            if active is not None and party not in active:
                continue
            joiners.append((node, party))
        if not joiners:
            return 0.0
        for jl in self._pull_for(grid, joiners, donors, rnd, digest, timeout, rlog):
            rlog.joins.append(jl)
            if jl.ok:
                log(
                    INFO,
                    "Chaos: %s pulled round %d from %d donors in %.3fs (bound %.3fs): %s",
                    jl.party, rnd, len(jl.bytes_per_donor), jl.pull_s, jl.lower_bound_s,
                    jl.bytes_per_donor,
                )  # fmt: skip
            else:
                log(WARNING, "Chaos: %s could not pull round %d: %s", jl.party, rnd, jl.error)
        return self.clock() - t0

    def _pull_for(
        self,
        grid: Grid,
        joiners: list[tuple[int, str]],
        donors: list[int],
        rnd: int,
        digest: bytes,
        timeout: float,
        rlog: RoundLog,
    ) -> list[JoinLog]:
        """Relay the joiners' pulls (:mod:`chaos_flwr.flower.joinpull`); they plan, we carry.

        Every joiner's relay steps share the same exchanges (see :meth:`_join_pulls`).
        """
        node_of = {self.holders[d][0]: d for d in donors}
        start = start_record(
            [self.holders[d][0] for d in donors],
            [self.receipts.get(d, b"") for d in donors],
            self.join_min_shard_bytes,
        )
        logs = {n: JoinLog(party=p, node=n, server_round=rnd, digest=digest) for n, p in joiners}
        ctl: dict[int, ConfigRecord] = {n: start for n, _ in joiners}
        replies: dict[int, dict[str, ConfigRecord]] = {n: {} for n, _ in joiners}
        step_times: list[float] = []
        pulling = [n for n, _ in joiners]
        t0 = self.clock()
        for _ in range(self.join_max_steps):
            if not pulling:
                break
            t_step = self.clock()
            msgs: list[Message] = []
            taken: dict[int, list[bytes]] = {}
            for node in pulling:
                content = RecordDict({FLOWER_PULL_DATA_KEY: ctl[node]})
                for dparty, rec in replies[node].items():
                    content[donor_key(dparty)] = rec
                msg, taken[node] = self._msg(node, "join", rnd, digest, content)
                msgs.append(msg)
            res = self._exchange(grid, msgs, taken, timeout=timeout, log_=rlog)
            donor_msgs: list[Message] = []
            asked: list[tuple[int, str]] = []  # (joiner, donor party) of each donor message
            lost: dict[int, set[str]] = {}
            still: list[int] = []
            taken = {}
            for node in pulling:
                jl = logs[node]
                jl.steps += 1
                reply = res.replies.get(node)
                got = reply.content.get(FLOWER_PULL_DATA_KEY) if reply is not None else None
                if not isinstance(got, ConfigRecord):
                    jl.error = "the joiner did not answer"
                    jl.pull_s = self.clock() - t0
                    continue
                status = got.get("status")
                if status != "want":
                    _read_join_stats(jl, got)
                    jl.ok = status == "done"
                    if not jl.ok and not jl.error:
                        jl.error = str(got.get("error", "failed"))
                    jl.pull_s = self.clock() - t0
                    continue
                still.append(node)
                lost[node] = set()
                requests = read_donor_records(reply.content) if reply is not None else {}
                for dparty, req in requests.items():
                    dn = node_of.get(dparty)
                    if dn is None or dn in self.suspects:
                        lost[node].add(dparty)
                        continue
                    m, envs = self._msg(
                        dn, "pull", rnd, digest, RecordDict({FLOWER_PULL_DATA_KEY: req})
                    )
                    taken.setdefault(dn, []).extend(envs)
                    donor_msgs.append(m)
                    asked.append((node, dparty))
            if not still:
                pulling = []
                break
            res2 = self._exchange(grid, donor_msgs, taken, timeout=timeout, log_=rlog)
            for node in still:
                replies[node] = {}
            for (node, dparty), mid in zip(asked, res2.message_ids, strict=True):
                r = res2.by_message.get(mid)
                data = r.content.get(FLOWER_PULL_DATA_KEY) if r is not None else None
                if isinstance(data, ConfigRecord):
                    replies[node][dparty] = data
                else:
                    lost[node].add(dparty)
            for node in still:
                ctl[node] = ConfigRecord({"op": "step", "lost": sorted(lost[node])})
            pulling = still
            step_times.append(self.clock() - t_step)
        for node in pulling:
            logs[node].error = f"no verified state after {self.join_max_steps} relay steps"
            logs[node].pull_s = self.clock() - t0
        latency = min(step_times) if step_times else 0.0
        for jl in logs.values():
            if jl.total_bytes and jl.planned_bytes:
                plan_donors = [
                    PlanDonor(id=d, bandwidth=FLOWER_PULL_ASSUMED_BANDWIDTH_BPS, latency=latency)
                    for d in jl.planned_bytes
                ]
                jl.lower_bound_s = lower_bound(jl.total_bytes, plan_donors)
        return [logs[n] for n, _ in joiners]

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds of the inner strategy with the Chaos phases.

        Same parameters and result as :meth:`flwr.serverapp.strategy.Strategy.start`;
        ``timeout`` bounds every exchange (together with ``phase_timeout_s``).
        """
        log(INFO, "Starting ChaosStrategy(%s)", type(self.inner).__name__)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        t_start = time.time()
        if evaluate_fn:
            res0 = evaluate_fn(0, initial_arrays)
            if res0 is not None:
                result.evaluate_metrics_serverapp[0] = res0
        arrays = initial_arrays
        sstate = b""
        digest = certified_digest(arrays, 0)

        known = self._wait_for_nodes(grid, timeout)
        resumed = self._resume(grid, known, timeout) if self.resume else None
        if resumed is not None:
            certified_round, arrays, digest, sstate = resumed
            restore_strategy_state(self.inner, sstate)
            self._forward_round = certified_round
            result.arrays = arrays
            hello = self._hello
            hello.join_s = self._join_pulls(grid, certified_round, digest, hello, timeout)
            self._finish(hello)
        else:
            # round 0: certify the initial state on every node that answers (numbered above
            # every round a party already signed, if a resume found receipts but no state)
            round0 = self.round_floor + 1 if self.round_floor >= 0 else 0
            digest = certified_digest(arrays, round0)
            log0 = RoundLog(round0, digest=digest)
            _, log0.certify_s = self._phase(
                grid, [], known, phase="certify", server_round=round0, digest=digest,
                arrays_for_others=arrays, timeout=timeout, log_=log0,
            )  # fmt: skip
            log0.holders = sorted(
                p for p, r, d in self.holders.values() if r == round0 and d == digest
            )
            self._finish(log0)
            certified_round = round0
            self._forward_round = round0

        first_round = max(certified_round, self.round_floor) + 1
        for rnd in range(first_round, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s] (Chaos)", rnd, num_rounds)
            rlog = RoundLog(rnd)
            known = list(grid.get_node_ids())
            prev_holders = set(self._holding(known, certified_round, digest))
            eligible = self._eligible(known, digest, certified_round)
            rlog.eligible = eligible
            need = _min_nodes(self.inner, "train")
            train_replies: list[Message] = []
            if len(eligible) < need:
                rlog.skipped = f"train: {len(eligible)} eligible nodes < {need} required"
                log(WARNING, "Chaos: skipping training of round %d (%s)", rnd, rlog.skipped)
                train_msgs: list[Message] = []
            else:
                train_msgs = list(
                    self.inner.configure_train(
                        rnd, arrays, train_config, _EligibleGrid(grid, eligible)
                    )
                )
            rlog.trained = [m.metadata.dst_node_id for m in train_msgs]
            train_replies, rlog.train_s = self._phase(
                grid, train_msgs, known, phase="relay", server_round=certified_round,
                digest=digest, arrays_for_others=None, timeout=timeout, log_=rlog,
            )  # fmt: skip
            if train_msgs:
                agg_arrays, agg_metrics = self.inner.aggregate_train(rnd, train_replies)
                if agg_arrays is not None:
                    arrays = agg_arrays
                    result.arrays = agg_arrays
                if agg_metrics is not None:
                    result.train_metrics_clientapp[rnd] = agg_metrics
            sstate = strategy_state_of(self.inner)
            digest = certified_digest(arrays, rnd, sstate)
            rlog.digest = digest

            # certify + evaluate: the new state goes to the live nodes that held the previous
            # one or trained on it; receipts come back. Others (joiners) pull it from parties.
            nodes_now = set(grid.get_node_ids())
            receivers = {
                n for n in (prev_holders | set(rlog.trained)) & nodes_now
                if n not in self.suspects
            }  # fmt: skip
            if not receivers:
                # nobody holds the previous state (e.g. every node missed the last deadline):
                # there is no party to pull from, so the state goes to every live node
                receivers = {n for n in nodes_now if n not in self.suspects} or set(nodes_now)
            eval_need = _min_nodes(self.inner, "evaluate")
            eval_msgs: list[Message] = []
            if len(receivers) >= eval_need:
                eval_msgs = list(
                    self.inner.configure_evaluate(
                        rnd, arrays, evaluate_config, _EligibleGrid(grid, sorted(receivers))
                    )
                )
            eval_replies, rlog.certify_s = self._phase(
                grid, eval_msgs, known, phase="certify", server_round=rnd, digest=digest,
                arrays_for_others=arrays, timeout=timeout, log_=rlog, receivers=receivers,
                strategy_state=sstate,
            )  # fmt: skip
            certified_round = rnd
            self._forward_round = rnd
            for old in [r for r in self._round_receipts if r < rnd]:
                del self._round_receipts[old]
            rlog.holders = sorted(
                p for p, r, d in self.holders.values() if r == rnd and d == digest
            )
            rlog.join_s = self._join_pulls(grid, rnd, digest, rlog, timeout)
            if eval_msgs:
                agg_eval = self.inner.aggregate_evaluate(rnd, eval_replies)
                if agg_eval is not None:
                    result.evaluate_metrics_clientapp[rnd] = agg_eval
            if evaluate_fn:
                res = evaluate_fn(rnd, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
            self._finish(rlog)

        log(INFO, "ChaosStrategy finished in %.2fs", time.time() - t_start)
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        return result

    def _resume(
        self, grid: Grid, known: list[int], timeout: float
    ) -> tuple[int, ArrayRecord, bytes, bytes] | None:
        """Rebuild the latest certified state from the parties (a restarted ServerApp).

        Asks every party for its receipt. Candidates are the ``(round, digest)`` pairs named by
        *verified* receipts, newest first; a round whose verified receipts name two digests is
        conflicted (equivocation evidence) and never resumed from. The newest candidate with at
        least ``resume_min_receipts`` holders (default 1: the newest round *any* verified party
        holds, e.g. one certified by only some parties before a kill) is pulled in
        planner-sized shares from all its holders at once; the manifest and the assembled state
        must match the certified digest (else the next older candidate is tried). The inner
        strategy's state (e.g. FedAdam's moments) is part of the certified state and comes
        back with it.

        Whatever is resumed from, :attr:`round_floor` becomes the newest round any verified
        receipt names, and :meth:`start` numbers every new round above it: a round number some
        party already certified is never certified again (an older state resumed from, or a
        fresh start, goes on under new round numbers), so no honest party is ever shown two
        digests of one round by this ServerApp. Without a receipt verifier nothing is resumed:
        unsigned claims are not proof.
        """
        if self.receipt_verifier is None:
            log(WARNING, "Chaos: no receipt verifier, so no resume from party replicas")
            return None
        hello = RoundLog(-1)
        self._phase(
            grid, [], known, phase="hello", server_round=-1, digest=b"",
            arrays_for_others=None, timeout=timeout, log_=hello,
        )  # fmt: skip
        tally: dict[tuple[int, bytes], list[int]] = {}
        digests: dict[int, set[bytes]] = {}
        for node, (_, rnd, dig) in self.holders.items():
            # every verified receipt counts for the floor, a suspect's too (it was signed)
            self.round_floor = max(self.round_floor, rnd)
            digests.setdefault(rnd, set()).add(dig)
            if node not in self.suspects:
                tally.setdefault((rnd, dig), []).append(node)
        conflicted = {rnd for rnd, digs in digests.items() if len(digs) > 1}
        for rnd in sorted(conflicted):
            log(WARNING, "Chaos: round %d has receipts for two digests; not resumed from", rnd)
        for (rnd, dig), nodes in sorted(tally.items(), key=lambda kv: -kv[0][0]):
            if rnd in conflicted or len(nodes) < self.resume_min_receipts:
                continue
            holders = [(n, self.holders[n][0]) for n in sorted(nodes)]
            try:
                ask = RelayAsker(
                    grid, rnd, dig, min(timeout, self.phase_timeout_s), self.poll_interval_s,
                    self.clock, self.sleep, lambda n, m: self._absorb(n, m, {}, hello),
                )  # fmt: skip
                arrays, report = pull_state(
                    ask, holders, min_shard_bytes=self.resume_min_shard_bytes
                )
            except ChaosError as exc:
                log(WARNING, "Chaos: pulling round %d from its holders failed: %s", rnd, exc)
                continue
            hello.server_round = rnd
            hello.digest = dig
            hello.holders = sorted(p for _, p in holders)
            self.last_pull = report
            log(INFO, "Chaos: resumed at round %d, shares per holder: %s", rnd, report.shares)
            if self.round_floor > rnd:
                log(
                    INFO, "Chaos: rounds up to %d were signed by some party: going on at %d",
                    self.round_floor, self.round_floor + 1,
                )  # fmt: skip
            self._hello = hello  # filed by start() once its joiners have pulled
            return rnd, arrays, dig, report.strategy_state
        self._finish(hello)
        return None

    def _wait_for_nodes(self, grid: Grid, timeout: float) -> list[int]:
        """Wait (bounded) until the inner strategy's minimum of nodes is connected."""
        need = _min_nodes(self.inner, "train")
        deadline = self.clock() + min(timeout, self.phase_timeout_s)
        while len(nodes := list(grid.get_node_ids())) < need and self.clock() < deadline:
            self.sleep(self.poll_interval_s)
        return nodes


def _read_join_stats(jl: JoinLog, rec: ConfigRecord) -> None:
    """Copy the joiner's figures (plan, bytes per donor, lost donors) into its JoinLog."""

    def ints(key: str) -> list[int]:
        v = rec.get(key, [])
        return [x for x in v if isinstance(x, int)] if isinstance(v, list) else []

    def strs(key: str) -> list[str]:
        v = rec.get(key, [])
        return [x for x in v if isinstance(x, str)] if isinstance(v, list) else []

    for name, attr in (("total", "total_bytes"), ("shard-bytes", "shard_bytes")):
        v = rec.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(jl, attr, v)
    v = rec.get("num-shards")
    if isinstance(v, int) and not isinstance(v, bool):
        jl.num_shards = v
    jl.planned_shards = dict(zip(strs("plan-donors"), ints("plan-shards"), strict=False))
    jl.planned_bytes = dict(zip(strs("plan-donors"), ints("plan-bytes"), strict=False))
    jl.bytes_per_donor = dict(zip(strs("recv-donors"), ints("recv-bytes"), strict=False))
    jl.donors = sorted(set(jl.planned_bytes) | set(jl.bytes_per_donor))
    jl.lost = strs("lost")
    direct = dict(zip(strs("recv-donors"), ints("direct-bytes"), strict=False))
    jl.direct_bytes = {d: b for d, b in direct.items() if b > 0}
    jl.direct_failed = strs("direct-failed")
    rates = rec.get("rate-bps", [])
    if isinstance(rates, list):
        jl.rate_bps = {
            d: float(r)
            for d, r in zip(strs("rate-donors"), rates, strict=False)
            if isinstance(r, (int, float)) and not isinstance(r, bool)
        }
    err = rec.get("error", "")
    jl.error = err if isinstance(err, str) else ""


_M, _V = "m_t/", "v_t/"


def strategy_state_of(inner: Strategy) -> bytes:
    """The inner strategy's own state as opaque bytes (part of the certified state).

    A strategy with a ``chaos_state() -> bytes`` method gives its own; FedOpt strategies
    (FedAdam, FedYogi, FedAdagrad) give their moments ``m_t`` / ``v_t``; others none.
    """
    own = getattr(inner, "chaos_state", None)
    if callable(own):
        return bytes(own())
    m, v = getattr(inner, "m_t", None), getattr(inner, "v_t", None)
    if not isinstance(m, dict) and not isinstance(v, dict):
        return b""
    arrays = {f"{_M}{k}": np.asarray(a) for k, a in (m or {}).items()}
    arrays.update({f"{_V}{k}": np.asarray(a) for k, a in (v or {}).items()})
    if not arrays:
        return b""
    return TrainingState(arrays=arrays, round=0).to_bytes()


def restore_strategy_state(inner: Strategy, blob: bytes) -> None:
    """Give the inner strategy back the state :func:`strategy_state_of` took (a resume)."""
    own = getattr(inner, "chaos_restore", None)
    if callable(own):
        own(blob)
        return
    if not blob or not hasattr(inner, "m_t"):
        return
    state = TrainingState.from_bytes(blob)
    m = {k[len(_M) :]: np.array(a) for k, a in state.arrays.items() if k.startswith(_M)}
    v = {k[len(_V) :]: np.array(a) for k, a in state.arrays.items() if k.startswith(_V)}
    inner.m_t = m or None
    inner.v_t = v or None  # type: ignore[attr-defined]
