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
from typing import Any

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
    FLOWER_PHASE_TIMEOUT_S,
    FLOWER_POLL_INTERVAL_S,
    FLOWER_PULL_MIN_SHARD_BYTES,
    FLOWER_RESUME_MIN_RECEIPTS,
)
from chaos_flwr.errors import ChaosError, DecodeError
from chaos_flwr.flower.client import certified_digest, receipt_bytes
from chaos_flwr.flower.pull import PullReport, pull_state
from chaos_flwr.flower.relay import Relay, exchange, server_record, split_chaos, with_chaos

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
        On start, rebuild the latest state that at least ``resume_min_receipts`` parties
        certified (verified receipts only), pulled in shards from all its holders at once
        (:mod:`chaos_flwr.flower.pull`), and go on at the next round (a restarted ServerApp
        keeps no checkpoint).
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
        resume_min_shard_bytes: int = FLOWER_PULL_MIN_SHARD_BYTES,
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
        self.rounds: list[RoundLog] = []

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

    def _chaos_msg(
        self, node: int, phase: str, rnd: int, digest: bytes, arrays: ArrayRecord | None
    ) -> Message:
        content = RecordDict()
        if arrays is not None:
            content["arrays"] = arrays
        content[FLOWER_CHAOS_RECORD_KEY] = server_record(
            self.relay.take(node), phase=phase, server_round=rnd, digest=digest
        )
        # a Chaos message outlives its phase only briefly: a dead node must not come back to a
        # backlog of stale relay traffic queued at the SuperLink
        return Message(
            content,
            dst_node_id=node,
            message_type=FLOWER_CHAOS_MESSAGE_TYPE,
            ttl=self.phase_timeout_s * FLOWER_CHAOS_TTL_PHASES,
        )

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
    ) -> tuple[list[Message], float]:
        """Run one exchange; return the inner strategy's replies (Chaos records removed)."""
        msgs: list[Message] = []
        taken: dict[int, list[bytes]] = {}
        addressed: set[int] = set()
        for m in inner_msgs:
            node = m.metadata.dst_node_id
            envs = self.relay.take(node)
            taken[node] = envs
            addressed.add(node)
            msgs.append(
                with_chaos(
                    m, server_record(envs, phase=phase, server_round=server_round, digest=digest)
                )
            )
        for node in known:
            if node not in addressed:
                msgs.append(self._chaos_msg(node, phase, server_round, digest, arrays_for_others))
                addressed.add(node)
        res = exchange(
            grid,
            msgs,
            timeout_s=min(timeout, self.phase_timeout_s),
            wait_for={n for n in addressed if n not in self.suspects},
            poll_interval_s=self.poll_interval_s,
            clock=self.clock,
            sleep=self.sleep,
        )
        inner_order = [m.metadata.dst_node_id for m in inner_msgs]
        for node, reply in res.replies.items():
            self.suspects.discard(node)
            record = split_chaos(reply)
            if record is not None:
                try:
                    pr = self.relay.absorb(node, record)
                except DecodeError as exc:
                    log(WARNING, "Chaos: malformed record from node %d: %s", node, exc)
                else:
                    self._note_receipt(
                        node, pr.party, pr.receipt_round, pr.receipt_digest, pr.receipt, log_
                    )
        # the inner strategy sees its replies in the order of its own messages, as Flower's
        # send_and_receive gives them when all replies are in
        inner_replies = [res.replies[n] for n in inner_order if n in res.replies]
        for node, code in res.errors.items():
            self.suspects.add(node)
            log_.errors[node] = code
            self.relay.give_back(node, taken.get(node, []))
            self.holders.pop(node, None)
        for node in res.missing:
            self.suspects.add(node)
            self.relay.give_back(node, taken.get(node, []))
        log_.missing = sorted(set(log_.missing) | res.missing)
        return inner_replies, res.elapsed_s

    def _note_receipt(
        self, node: int, party: str, rnd: int, digest: bytes, receipt: bytes, log_: RoundLog
    ) -> None:
        if rnd < 0 or not party:
            return
        if self.receipt_verifier is not None:
            if not self.receipt_verifier(party, rnd, digest, receipt):
                log(WARNING, "Chaos: receipt of %s for round %d does not verify", party, rnd)
                return
        elif party not in log_.unsigned_receipts:
            log_.unsigned_receipts.append(party)
        self.holders[node] = (party, rnd, digest)

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
        digest = certified_digest(arrays, 0)

        known = self._wait_for_nodes(grid, timeout)
        resumed = self._resume(grid, known, timeout) if self.resume else None
        if resumed is not None:
            certified_round, arrays, digest = resumed
            result.arrays = arrays
        else:
            # round 0: certify the initial state on every node that answers
            log0 = RoundLog(0, digest=digest)
            _, log0.certify_s = self._phase(
                grid, [], known, phase="certify", server_round=0, digest=digest,
                arrays_for_others=arrays, timeout=timeout, log_=log0,
            )  # fmt: skip
            log0.holders = sorted(p for p, r, d in self.holders.values() if r == 0 and d == digest)
            self.rounds.append(log0)
            certified_round = 0

        for rnd in range(certified_round + 1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s] (Chaos)", rnd, num_rounds)
            rlog = RoundLog(rnd)
            known = list(grid.get_node_ids())
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
            digest = certified_digest(arrays, rnd)
            rlog.digest = digest

            # certify + evaluate: the new state goes to every live node, receipts come back
            live = [n for n in grid.get_node_ids() if n not in self.suspects]
            eval_need = _min_nodes(self.inner, "evaluate")
            eval_msgs: list[Message] = []
            if len(live) >= eval_need:
                eval_msgs = list(
                    self.inner.configure_evaluate(
                        rnd, arrays, evaluate_config, _EligibleGrid(grid, live)
                    )
                )
            eval_replies, rlog.certify_s = self._phase(
                grid, eval_msgs, known, phase="certify", server_round=rnd, digest=digest,
                arrays_for_others=arrays, timeout=timeout, log_=rlog,
            )  # fmt: skip
            certified_round = rnd
            rlog.holders = sorted(
                p for p, r, d in self.holders.values() if r == rnd and d == digest
            )
            if eval_msgs:
                agg_eval = self.inner.aggregate_evaluate(rnd, eval_replies)
                if agg_eval is not None:
                    result.evaluate_metrics_clientapp[rnd] = agg_eval
            if evaluate_fn:
                res = evaluate_fn(rnd, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
            self.rounds.append(rlog)

        log(INFO, "ChaosStrategy finished in %.2fs", time.time() - t_start)
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        return result

    def _resume(
        self, grid: Grid, known: list[int], timeout: float
    ) -> tuple[int, ArrayRecord, bytes] | None:
        """Rebuild the latest certified state from the parties (a restarted ServerApp).

        Asks every party for its receipt; the newest (round, digest) that at least
        ``resume_min_receipts`` parties certified with *verified* signatures is pulled in
        planner-sized shares from all its holders at once; the manifest and the assembled state
        must match the certified digest (else the next older candidate is tried). Without a
        receipt verifier nothing is resumed: unsigned claims are not proof.
        """
        if self.receipt_verifier is None:
            log(WARNING, "Chaos: no receipt verifier, so no resume from party replicas")
            return None
        hello = RoundLog(-1)
        self.rounds.append(hello)
        self._phase(
            grid, [], known, phase="hello", server_round=-1, digest=b"",
            arrays_for_others=None, timeout=timeout, log_=hello,
        )  # fmt: skip
        tally: dict[tuple[int, bytes], list[int]] = {}
        for node, (_, rnd, dig) in self.holders.items():
            if rnd > 0 and node not in self.suspects:
                tally.setdefault((rnd, dig), []).append(node)
        for (rnd, dig), nodes in sorted(tally.items(), key=lambda kv: -kv[0][0]):
            if len(nodes) < self.resume_min_receipts:
                continue
            holders = [(n, self.holders[n][0]) for n in nodes]
            try:
                arrays, report = pull_state(
                    grid,
                    holders,
                    server_round=rnd,
                    digest=dig,
                    timeout_s=min(timeout, self.phase_timeout_s),
                    poll_interval_s=self.poll_interval_s,
                    min_shard_bytes=self.resume_min_shard_bytes,
                    clock=self.clock,
                    sleep=self.sleep,
                )
            except ChaosError as exc:
                log(WARNING, "Chaos: pulling round %d from its holders failed: %s", rnd, exc)
                continue
            hello.server_round = rnd
            hello.digest = dig
            hello.holders = sorted(p for _, p in holders)
            self.last_pull = report
            log(INFO, "Chaos: resumed at round %d, shares per holder: %s", rnd, report.shares)
            return rnd, arrays, dig
        return None

    def _wait_for_nodes(self, grid: Grid, timeout: float) -> list[int]:
        """Wait (bounded) until the inner strategy's minimum of nodes is connected."""
        need = _min_nodes(self.inner, "train")
        deadline = self.clock() + min(timeout, self.phase_timeout_s)
        while len(nodes := list(grid.get_node_ids())) < need and self.clock() < deadline:
            self.sleep(self.poll_interval_s)
        return nodes
