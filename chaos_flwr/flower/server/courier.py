"""The courier: the ServerApp's side of every exchange with the parties.

It builds each party's message with the relay envelopes addressed to it, runs deadline-bounded
exchanges, takes the parties' Chaos records off their replies (routing their envelopes,
feeding the server-side view, noting their receipts), and keeps who is *suspect* (missed a
deadline or answered with an error: not waited for, not sampled, until it answers again) and
who holds which certified state (by its receipt). :meth:`Courier.phase` is one exchange of a
round: the inner strategy's messages plus a ``query.chaos`` message to the other known nodes
that need one: in the train phase only those unknown, not yet synced or not members (envelopes
waiting for the others go with their certify message of the same round; with every node
sampled, a churn-free round sends only the inner strategy's messages); in the certify phase
those not sampled for evaluation (they get the new state). It also says which nodes are
eligible for sampling (:meth:`Courier.eligible`) and gives the inner strategy a Grid that lists
only those (:class:`EligibleGrid`).

Deadlines follow the federation: every reply's time (push to the pull that brought it) feeds
the node's history per kind of message (:class:`~.deadlines.ReplyTimes`); an exchange waits
until the latest deadline of its non-suspect nodes, and on (``stall_s``) if none answered. A
node dropped for lateness is logged with the deadline it missed; when its reply comes after all
(pulled with a later exchange), its time is logged and joins its history.

Misconfigured parties stop the run: a node whose error reply says its ClientApp raised a
:class:`~chaos_flwr.errors.ConfigError` is kept in :attr:`Courier.config_errors`; when every node
an exchange addressed answered so, or too few nodes are left to ever reach the inner
strategy's minimum, a :class:`~chaos_flwr.errors.PartyConfigError` names them and the setting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from chaos_flwr.defaults import FLOWER_CHAOS_TTL_PHASES
from chaos_flwr.errors import ChaosError, DecodeError
from chaos_flwr.flower.relay import ExchangeResult, Relay
from chaos_flwr.flower.relay import exchange as relay_exchange
from chaos_flwr.flower.schema import (
    CHAOS_MESSAGE_TYPE,
    CHAOS_RECORD_KEY,
    server_record,
    split_chaos,
    with_chaos,
)
from chaos_flwr.flower.server.deadlines import ReplyTimes
from chaos_flwr.flower.server.grids import TimedGrid
from chaos_flwr.flower.server.logs import RoundLog
from chaos_flwr.flower.server.misconfig import config_reason, misconfigured
from chaos_flwr.flower.server.proofs import AuditJob, RoundProofs
from chaos_flwr.flower.server.settings import PhaseSettings
from chaos_flwr.flower.server.view import ServerView
from chaos_flwr.flower.updates import pack_updates, updates_size
from chaos_flwr.receipts import Receipt, receipt_verifies

__all__ = [
    "Courier",
    "LateReply",
    "MoreMessages",
    "PhaseSpec",
    "ReceiptVerifier",
    "keyring_verifier",
    "min_nodes",
]

#: Equivocation evidence blobs a round's log keeps (unverified: the server holds no key).
FLOWER_MAX_EVIDENCE_PER_ROUND: int = 64

#: ``(party, round, digest, receipt blob) -> True`` if the receipt is that party's signature.
ReceiptVerifier = Callable[[str, int, bytes, bytes], bool]

#: Called while an exchange waits, with the exchange's envelopes-taken table (node -> the
#: envelopes its messages carry) and whether it would end now: messages to add and how long
#: to wait for them.
MoreMessages = Callable[[dict[int, list[bytes]], bool], tuple[list[Message], float]]


def keyring_verifier(keyring: Mapping[str, bytes]) -> ReceiptVerifier:
    """A receipt verifier from a ``party id -> raw Ed25519 public key`` keyring (the charter's).

    A receipt counts only if its party is in the keyring and the blob is that key's signature
    over :func:`~chaos_flwr.receipts.receipt_signing_bytes` (checked by
    :func:`~chaos_flwr.receipts.receipt_verifies`).
    """
    keys = dict(keyring)

    def verify(party: str, server_round: int, digest: bytes, receipt: bytes) -> bool:
        return receipt_verifies(keys, party, server_round, digest, receipt)

    return verify


class _Added:
    """A ``more`` hook of one exchange (:meth:`Courier.exchange`): the messages it added and
    each node's push time and wait. When it holds the exchange's pulls up for longer than a
    poll (its own exchanges), the replies the next pull brings to messages pushed before are
    not timed (:attr:`TimedGrid.held_until`): they may have come while it ran."""

    def __init__(
        self,
        more: MoreMessages,
        taken: dict[int, list[bytes]],
        kinds: dict[int, str],
        timed: TimedGrid,
        clock: Callable[[], float],
        poll_s: float,
    ) -> None:
        self._more, self._taken, self._kinds, self._timed = more, taken, kinds, timed
        self._clock, self._poll_s = clock, poll_s
        self.messages: list[Message] = []
        self.sent: dict[int, tuple[float, float]] = {}

    def __call__(self, ending: bool) -> tuple[list[Message], float]:
        t0 = self._clock()
        extra, wait_s = self._more(self._taken, ending)
        now = self._clock()
        if now - t0 > self._poll_s:
            self._timed.held_until = now
        self.messages.extend(extra)
        for m in extra:
            node = m.metadata.dst_node_id
            self._kinds.setdefault(node, message_kind(m))
            self.sent[node] = (now, wait_s)
        return extra, wait_s


@dataclass(frozen=True)
class LateReply:
    """A node dropped from an exchange for lateness whose reply came after all.

    Attributes
    ----------
    node, kind:
        The node and its kind of message (``"<phase>:<message type>"``).
    deadline_s:
        The deadline it missed.
    measured_s:
        When its reply was pulled, counted from the push (at a later exchange's poll).
    """

    node: int
    kind: str
    deadline_s: float
    measured_s: float


def message_kind(msg: Message) -> str:
    """``"<Chaos phase>:<message type>"`` of an outgoing message (the key of its node's reply
    times: a trainer's replies and a relayed-to node's are timed apart). A train message is
    ``relay:train`` whatever rides on it (round 1's carries the initial state's certify)."""
    record = msg.content.get(CHAOS_RECORD_KEY) if msg.has_content() else None
    phase = record.get("phase", "") if isinstance(record, ConfigRecord) else ""
    phase = "relay" if msg.metadata.message_type.startswith("train") else phase
    kind = f"{phase if isinstance(phase, str) else ''}:{msg.metadata.message_type}"
    if isinstance(record, ConfigRecord) and "audit-round" in record:
        # an auditor's message carries every committed update and its reply waits for the
        # recomputation: timed apart, so its deadline does not come from lighter messages
        kind += ":audit"
    return kind


def min_nodes(inner: Strategy, kind: str) -> int:
    """Nodes the inner strategy's sampler waits for (it would sleep forever with fewer)."""
    need = int(getattr(inner, "min_available_nodes", 0) or 0)
    return max(need, int(getattr(inner, f"min_{kind}_nodes", 0) or 0))


@dataclass(frozen=True)
class PhaseSpec:
    """What one exchange of a round carries (see :meth:`Courier.phase`).

    Attributes
    ----------
    phase:
        ``hello``, ``relay`` (train), ``certify``, ``join`` or ``pull``.
    server_round, digest:
        The round and the certified digest the messages name.
    arrays:
        The state sent to known nodes the inner strategy did not address (certify), if any.
    receivers:
        Which of those nodes get ``arrays`` (default: all). A joiner is never a receiver: its
        state comes from parties.
    strategy_state:
        The inner strategy's state, sent with the certified state.
    fields:
        More fields of every message's Chaos record (a certify's proof).
    audit:
        The audit due with this exchange: its fields and committed updates go to the
        auditors' messages (a train phase; :mod:`.proofs`).
    everyone:
        A relay exchange that every known node gets a message in (a rollback's refutation).
    """

    phase: str
    server_round: int
    digest: bytes
    arrays: ArrayRecord | None = None
    receivers: frozenset[int] | None = None
    strategy_state: bytes = b""
    fields: tuple[tuple[str, Any], ...] = ()
    audit: AuditJob | None = None
    everyone: bool = False


@dataclass
class Courier:
    """Carries the round's messages and keeps what the replies say (module docstring).

    Parameters
    ----------
    relay:
        The envelope router.
    phases:
        Deadline and poll interval of each exchange.
    receipt_verifier:
        Checks parties' signed receipts; ``None`` takes them as *unsigned* claims.
    view:
        The server-side view fed from the relayed records (``None`` without a charter).
    view_source:
        Party ids the signed view lists as active (``None``: sampling by receipts only).
    clock, sleep:
        The ServerApp's clock and pause.

    Attributes
    ----------
    suspects:
        Nodes that missed a deadline or answered with an error (until they answer again).
    holders:
        Node -> ``(party, round, digest)`` of its newest accepted receipt.
    receipts:
        Node -> that receipt's blob.
    config_errors:
        Node -> the reason of its last error reply, while that says its settings are wrong.
    forward_round:
        The round whose receipts go out with the next train messages.
    times:
        The nodes' reply times and the deadlines they give.
    late_replies:
        Nodes dropped for lateness whose reply came after all (newest last).
    proofs:
        The verifiable rounds' commitments and audits (with a charter), else ``None``.
    """

    relay: Relay
    phases: PhaseSettings
    receipt_verifier: ReceiptVerifier | None = None
    view: ServerView | None = None
    view_source: Callable[[], set[str]] | None = None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    suspects: set[int] = field(default_factory=set)
    holders: dict[int, tuple[str, int, bytes]] = field(default_factory=dict)
    receipts: dict[int, bytes] = field(default_factory=dict)
    config_errors: dict[int, str] = field(default_factory=dict)
    forward_round: int = -1
    _synced: set[int] = field(default_factory=set)
    _round_receipts: dict[int, dict[tuple[str, bytes], bytes]] = field(default_factory=dict)
    _late: dict[str, int] = field(default_factory=dict)
    proofs: RoundProofs | None = None
    times: ReplyTimes = field(init=False)
    late_replies: list[LateReply] = field(default_factory=list)
    _sent: dict[str, tuple[float, str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.times = ReplyTimes(self.phases)

    # -- who holds what -----------------------------------------------------------------------
    def active(self) -> set[str] | None:
        """The active party ids of the signed view, or ``None`` when no view is known."""
        return self.view_source() if self.view_source is not None else None

    def eligible(self, known: list[int], digest: bytes, server_round: int) -> list[int]:
        """Known nodes that may be sampled: not suspect, holding the certified state, active."""
        active = self.active()
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

    def holding(self, nodes: Iterable[int], server_round: int, digest: bytes) -> list[int]:
        """Nodes (not suspected) whose verified receipt names ``(server_round, digest)``."""
        out = []
        for node in nodes:
            held = self.holders.get(node)
            if node in self.suspects or held is None:
                continue
            if held[1] == server_round and held[2] == digest:
                out.append(node)
        return sorted(out)

    def holder_parties(self, server_round: int, digest: bytes) -> list[str]:
        """Sorted party ids whose accepted receipt names ``(server_round, digest)``."""
        return sorted(p for p, r, d in self.holders.values() if r == server_round and d == digest)

    def certified(self, server_round: int) -> None:
        """``server_round`` is certified: its receipts go out next; older ones are dropped."""
        self.forward_round = server_round
        for old in [r for r in self._round_receipts if r < server_round]:
            del self._round_receipts[old]

    # -- messages -----------------------------------------------------------------------------
    def message(
        self,
        node: int,
        spec: PhaseSpec,
        content: RecordDict | None = None,
        *,
        inner: Message | None = None,
        strategy_state: bytes | None = None,
        extra_s: float = 0.0,
    ) -> tuple[Message, list[bytes]]:
        """A message for ``node`` with its relay envelopes attached (and which were taken);
        ``extra_s``: as :meth:`exchange`'s (the message lives that much longer)."""
        envs = self.relay.take(node)
        record = server_record(
            envs,
            phase=spec.phase,
            server_round=spec.server_round,
            digest=spec.digest,
            strategy_state=strategy_state,
        )
        if self.view is not None:
            if node not in self._synced:
                record["sync"] = True  # first message to this node in this run: your records
                self._synced.add(node)
            party = self.relay.party_of.get(node)
            active = self.view.active()
            if party is None or party not in active:
                record["members"] = sorted(active)  # whom a non-member may ask to sponsor it
        fwd = self._round_receipts.get(self.forward_round)
        if spec.phase == "relay" and fwd:
            # the previous round's receipts, so that parties can compare them with their own
            record["receipts"] = [fwd[p] for p in sorted(fwd)]
        for key, value in spec.fields:
            record[key] = value
        first = bool(record.get("sync"))  # a newcomer's first message may be a join
        if (
            self.proofs is not None
            and (spec.phase in ("relay", "hello") or first)
            and (self.proofs.refuted)
        ):
            record["refuted"] = self.proofs.refutations()
        audit = spec.audit if self._audits(node, spec) else None
        if audit is not None:
            for key, value in audit.fields:
                record[key] = value
        if inner is not None:
            msg = with_chaos(inner, record)
            if audit is not None:
                pack_updates(audit.updates, msg.content)
            return msg, envs
        content = RecordDict() if content is None else content
        content[CHAOS_RECORD_KEY] = record
        if audit is not None:
            pack_updates(audit.updates, content)
        # it outlives its phase only briefly (the node's deadline): no stale backlog for a dead node
        wait = self.times.deadline(f"{spec.phase}:{CHAOS_MESSAGE_TYPE}", node) + extra_s
        msg = Message(
            content,
            dst_node_id=node,
            message_type=CHAOS_MESSAGE_TYPE,
            ttl=wait * FLOWER_CHAOS_TTL_PHASES,
        )
        return msg, envs

    def _audits(self, node: int, spec: PhaseSpec) -> bool:
        """Whether ``node``'s party is one of the auditors ``spec`` asks."""
        party = self.relay.party_of.get(node)
        return spec.audit is not None and party is not None and party in spec.audit.parties

    # -- exchanges ----------------------------------------------------------------------------
    def exchange(
        self,
        grid: Grid,
        msgs: list[Message],
        taken: dict[int, list[bytes]],
        *,
        timeout: float,
        log_: RoundLog,
        more: MoreMessages | None = None,
        stop_on_config: bool = True,
        extra_s: float = 0.0,
    ) -> ExchangeResult:
        """Run one deadline-bounded exchange; absorb the parties' Chaos records. ``more``
        adds messages while it waits (``relay.exchange``): it is given ``taken`` to file the
        envelopes they carry. ``stop_on_config``: raise :class:`PartyConfigError` when every
        node addressed answered that its settings are wrong (not for an exchange with
        newcomers only: a stray misconfigured node must not stop the run). ``extra_s``: added
        to the nodes' deadlines (a step's own bound, beyond what their reply times show)."""
        dst = [m.metadata.dst_node_id for m in msgs]
        addressed = set(dst)
        # suspects are not waited for, unless every addressed node is one: then nothing would
        # ever be waited for again (each exchange would end at its first pull, before any reply
        # could come, and no late reply could clear a suspicion), so wait for them, bounded
        wait_for = {n for n in addressed if n not in self.suspects} or set(addressed)
        kinds: dict[int, str] = {}
        for m in msgs:
            kinds.setdefault(m.metadata.dst_node_id, message_kind(m))
        deadline = min(timeout, self.times.exchange_deadline(kinds, wait_for) + extra_s)
        timed = TimedGrid(grid, self.clock)
        pushed_at = self.clock()
        poll_s = self.phases.poll_interval_s
        add = _Added(more, taken, kinds, timed, self.clock, poll_s) if more else None
        res = relay_exchange(
            timed,
            msgs,
            timeout_s=deadline,
            wait_for=wait_for,
            poll_interval_s=self.phases.poll_interval_s,
            clock=self.clock,
            sleep=self.sleep,
            late=self._late,
            stall_s=self.times.stall_bound(timeout) if wait_for - self.suspects else None,
            more=add,
        )
        sent_at = dict.fromkeys(res.message_ids, pushed_at)
        if add is not None:
            dst += [m.metadata.dst_node_id for m in add.messages]
            addressed |= {m.metadata.dst_node_id for m in add.messages}
        node_of_msg = dict(zip(res.message_ids, dst, strict=True))
        # timed: replies that no work of ``more`` held up, each from its own message's push
        for mid in res.message_ids[len(msgs) :]:
            sent_at[mid] = add.sent[node_of_msg[mid]][0] if add is not None else pushed_at
        timed_ids = {
            m: n for m, n in node_of_msg.items() if timed.held.get(m, -math.inf) <= sent_at[m]
        }
        self._time_replies(res, timed.seen, sent_at, timed_ids, kinds, deadline)
        if add is not None:  # an added message that goes unanswered: its own wait
            for mid in res.message_ids[len(msgs) :]:
                if mid in self._sent:
                    node = node_of_msg[mid]
                    self._sent[mid] = (sent_at[mid], kinds.get(node, ""), add.sent[node][1])
        self._take_late(res, addressed, log_)
        self._settle(res, node_of_msg, taken, log_)
        if stop_on_config and addressed and addressed <= set(self.config_errors) & set(res.errors):
            raise misconfigured(
                {n: self.config_errors[n] for n in addressed},
                len(addressed),
                "no node could answer",
            )
        return res

    def _settle(
        self,
        res: ExchangeResult,
        node_of_msg: dict[str, int],
        taken: dict[int, list[bytes]],
        log_: RoundLog,
    ) -> None:
        """Absorb an exchange's replies; mark nodes that failed or stayed silent as suspects
        and give back the envelopes they were handed; settle the view on who is live."""
        absorbed: set[int] = set()
        for mid in res.message_ids:
            answer = res.by_message.get(mid)
            if answer is None:
                continue
            node = node_of_msg[mid]
            # several messages to one node (joiners asking one donor): every reply's records
            # count; the envelopes it was given are delivered once
            self.absorb(node, answer, {} if node in absorbed else taken, log_)
            absorbed.add(node)
        for node, code in res.errors.items():
            reason = config_reason(node, res.reasons.get(node, ""))
            if reason is not None:
                self.config_errors[node] = reason
            self.suspects.add(node)
            log_.errors[node] = code
            self.relay.give_back(node, taken.get(node, []))
            self.holders.pop(node, None)
        for node in res.missing:
            if node not in res.late:  # a late reply just showed it alive: wait for it next
                self.suspects.add(node)
            self.relay.give_back(node, taken.get(node, []))
        log_.missing = sorted(set(log_.missing) | res.missing)
        if self.view is not None:
            live = {p for n, p in self.relay.party_of.items() if n not in self.suspects}
            self.view.settle(live)

    def check_enough(self, known: list[int], need: int) -> None:
        """Stop the run when misconfigured nodes leave fewer than ``need`` nodes that could
        ever train (the inner strategy's minimum): every round would be skipped.

        Raises
        ------
        PartyConfigError
            Names the misconfigured nodes and their reasons.
        """
        bad = {n: self.config_errors[n] for n in known if n in self.config_errors}
        if bad and len(known) - len(bad) < need:
            raise misconfigured(bad, len(known), f"the inner strategy needs {need} nodes to train")

    def _time_replies(
        self,
        res: ExchangeResult,
        seen: Mapping[str, float],
        sent_at: Mapping[str, float],
        node_of_msg: Mapping[str, int],
        kinds: Mapping[int, str],
        deadline: float,
    ) -> None:
        """Feed the reply times of this exchange (and of late replies to earlier ones) to the
        history; log the nodes dropped for lateness and, when it comes, their measured time."""
        for mid, node in node_of_msg.items():
            if mid in res.by_message and mid in seen:
                self.times.observe(kinds[node], node, seen[mid] - sent_at[mid])
        for node, reply in res.late.items():
            mid = reply.metadata.reply_to_message_id
            sent = self._sent.pop(mid, None)
            if sent is None or mid not in seen:
                continue
            at, kind, missed = sent
            late = LateReply(node, kind, missed, seen[mid] - at)
            self.times.observe(kind, node, late.measured_s)
            self.late_replies.append(late)
            log(
                INFO, "Chaos: node %d answered its %s message after %.1f s (the deadline it "
                "missed was %.1f s); its next deadline covers that",
                node, kind, late.measured_s, missed,
            )  # fmt: skip
        for mid in [m for m in self._sent if m not in self._late]:
            del self._sent[mid]  # superseded or forgotten: no longer pulled
        for mid, node in res.missing_ids.items():
            self._sent[mid] = (sent_at[mid], kinds.get(node, ""), deadline)
            if node in self.suspects:
                continue  # a suspect is not waited for: its silence is no news
            log(
                WARNING, "Chaos: node %d dropped from this %s exchange: no reply in %.1f s "
                "(the deadline %.1f s; reply times so far: %s)",
                node, kinds.get(node, "?"), max(deadline, res.elapsed_s), deadline,
                ", ".join(f"{t:.1f}" for t in self.times.samples(kinds.get(node, ""), node))
                or "none",
            )  # fmt: skip

    def _take_late(self, res: ExchangeResult, addressed: set[int], log_: RoundLog) -> None:
        """Absorb replies to earlier messages that missed their deadline; remember this
        exchange's missing messages (their envelopes and receipts still count when they come:
        a recipient refuses a duplicate envelope as a replay)."""
        for mid in list(self._late):
            if self._late[mid] in res.late or self._late[mid] in addressed:
                del self._late[mid]  # answered late, or superseded by this exchange's message
        for node, reply in res.late.items():
            # it is alive: no longer a suspect (the next phase may wait for it, up to its
            # deadline; otherwise a federation whose every node once missed a deadline, e.g.
            # a first exchange while Ray starts, would never be waited for again)
            self.absorb(node, reply, {}, log_)
        self._late.update(res.missing_ids)

    def absorb(
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
            self.config_errors.pop(node, None)
        record = split_chaos(reply)
        if record is None:
            return
        try:
            pr = self.relay.absorb(node, record)
        except DecodeError as exc:
            log(WARNING, "Chaos: malformed record from node %d: %s", node, exc)
            return
        if self.proofs is not None:
            self.proofs.absorb(node, record)
        evidence = record.get("evidence")
        if isinstance(evidence, list) and evidence:
            who = pr.party or str(node)
            log(WARNING, "Chaos: %s reports equivocation evidence (%d)", who, len(evidence))
            room = FLOWER_MAX_EVIDENCE_PER_ROUND - len(log_.equivocations)
            blobs = [e for e in evidence if isinstance(e, bytes)]
            log_.equivocations.extend(blobs[: max(room, 0)])  # bounded: a party may flood it
        held = record.get("records")
        if self.view is not None and isinstance(held, list):
            self.view.sync(r for r in held if isinstance(r, bytes))
        if self.view is not None:
            for _, data in pr.outgoing:
                self.view.sent(data, log_.server_round)
            party = pr.party or self.relay.party_of.get(node)
            if party:
                self.view.delivered(party, taken.get(node, []))
        self.note_receipt(node, pr.party, pr.receipt_round, pr.receipt_digest, pr.receipt, log_)

    def phase(
        self,
        grid: Grid,
        inner_msgs: list[Message],
        known: list[int],
        spec: PhaseSpec,
        *,
        timeout: float,
        log_: RoundLog,
        more: MoreMessages | None = None,
        stop_on_config: bool = True,
    ) -> tuple[list[Message], float]:
        """Run one exchange; return the inner strategy's replies (Chaos records removed),
        those to the messages ``more`` added while it waited last (:meth:`exchange`).

        Known nodes the inner strategy did not address get a ``query.chaos`` message (in the
        train phase only those that need one: :meth:`_has_news`); it carries ``spec.arrays``
        (and the strategy state) only to ``spec.receivers`` (default: all of them).
        """
        msgs: list[Message] = []
        taken: dict[int, list[bytes]] = {}
        sstate = spec.strategy_state if spec.phase == "certify" else None
        for m in inner_msgs:
            node = m.metadata.dst_node_id
            msg, taken[node] = self.message(node, spec, inner=m, strategy_state=sstate)
            msgs.append(msg)
        for node in known:
            if node in taken:
                continue
            quiet = not spec.everyone and not self._has_news(node) and not self._audits(node, spec)
            if spec.phase == "relay" and quiet:
                continue  # churn-free: the round sends only the inner strategy's messages
            gets = spec.arrays is not None and (spec.receivers is None or node in spec.receivers)
            content = RecordDict()
            if gets:
                assert spec.arrays is not None
                content["arrays"] = spec.arrays
            msg, taken[node] = self.message(
                node, spec, content, strategy_state=sstate if gets else None
            )
            msgs.append(msg)
        if spec.audit is not None:
            sent_to = sorted(
                p for n in taken if (p := self.relay.party_of.get(n)) in spec.audit.parties
            )
            log_.audited = sent_to
            log_.audit_bytes = len(sent_to) * updates_size(spec.audit.updates)
        res = self.exchange(
            grid, msgs, taken, timeout=timeout, log_=log_, more=more, stop_on_config=stop_on_config
        )
        # the inner strategy sees its replies in the order of its own messages, as Flower's
        # send_and_receive gives them when all replies are in
        inner_order = [m.metadata.dst_node_id for m in inner_msgs]
        inner_replies = [res.replies[n] for n in inner_order if n in res.replies]
        added = [res.by_message.get(mid) for mid in res.message_ids[len(msgs) :]]
        return inner_replies + [r for r in added if r is not None], res.elapsed_s

    def _has_news(self, node: int) -> bool:
        """Whether a node the inner strategy did not sample needs a relay query in the train
        phase: it is unknown, not yet synced, or not an active member (a joiner). Envelopes
        that merely wait for it (e.g. heartbeats) go with its certify message of the same
        round, which every node gets."""
        party = self.relay.party_of.get(node)
        if party is None:
            return True
        if self.view is None:
            return False
        return node not in self._synced or party not in self.view.active()

    # -- receipts -----------------------------------------------------------------------------
    def note_receipt(
        self, node: int, party: str, rnd: int, digest: bytes, receipt: bytes, log_: RoundLog
    ) -> None:
        """Keep a party's receipt: verified (or listed as unsigned), then forwarded next round."""
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
            try:
                blob = Receipt.from_flower(party, rnd, digest, receipt).encode()
            except ChaosError:
                return
            self._round_receipts.setdefault(rnd, {}).setdefault((party, digest), blob)
