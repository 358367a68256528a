"""The ServerApp as an untrusted relay of opaque Chaos envelopes between parties.

Flower allows no node-to-node traffic: SuperNodes only talk to the SuperLink. So each exchange
of a round, the ServerApp sends every party one Message whose RecordDict carries, in a
ConfigRecord under :data:`~chaos_flwr.flower.schema.CHAOS_RECORD_KEY` (its layout:
:mod:`chaos_flwr.flower.schema`), the envelopes addressed
to it (``bytes`` values, which ConfigRecord carries as they are), and reads from the party's reply
the envelopes it sends on (each with a destination party id). They are delivered on the next
exchange. The relay never opens an envelope: parties verify every one end to end, so the relay
can delay or drop, never forge.

The relay learns which Flower node a party sits on from the party's own replies. A party that
lies about its id can only misroute envelopes addressed to that id, which the relay could drop
anyway; envelopes it receives are still verified by their recipients.

This module also holds :func:`exchange`, a send-and-receive with a hard deadline that treats
missing replies and error replies (e.g. ``NODE_UNAVAILABLE``) as ordinary input.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid

from chaos_flwr.defaults import (
    FLOWER_MAX_ENVELOPES_PER_MESSAGE,
    FLOWER_MAX_ENVELOPES_PER_SENDER_PER_MESSAGE,
    FLOWER_MAX_QUEUED_ENVELOPES,
    FLOWER_MAX_QUEUED_PER_SENDER,
    FLOWER_POLL_INTERVAL_S,
)
from chaos_flwr.flower.schema import OutgoingLike, PartyReply, read_party_record

__all__ = [
    "BROADCAST",
    "ExchangeResult",
    "PeerProtocol",
    "Relay",
    "exchange",
]

#: Destination that means "every other party the relay knows".
BROADCAST = "*"


class PeerProtocol(Protocol):
    """The sans-I/O peer contract of ``docs/internals.md`` (``chaos_flwr.peer.Peer``)."""

    @property
    def party_id(self) -> str: ...

    def handle(self, data: bytes, now: float) -> Sequence[OutgoingLike]: ...

    def tick(self, now: float) -> Sequence[OutgoingLike]: ...


#: Node ids a party was bound to before its current one that the relay still knows
#: (:meth:`Relay.give_back` to a node a restart replaced reaches its party); oldest go first.
FLOWER_RELAY_FORMER_NODES: int = 1024


@dataclass
class Relay:
    """Routes opaque envelopes between party ids over Flower node ids, fairly per sender.

    Each receiver has one queue per sender, and a message takes from them in turn: a party
    that floods another fills and overflows only its own share (its oldest envelopes go first),
    never the share of the other senders, and each message carries at most
    ``max_per_sender`` of its envelopes.

    Parameters
    ----------
    max_queue:
        Most envelopes queued for one party; past it the oldest of the longest sender queue are
        dropped (and counted).
    max_per_message:
        Most envelopes delivered to a party in one message; the rest wait.
    max_queue_per_sender:
        Most envelopes of one sender queued for one party; past it that sender's oldest go.
    max_per_sender:
        Most envelopes of one sender in one message to a party.
    """

    max_queue: int = FLOWER_MAX_QUEUED_ENVELOPES
    max_per_message: int = FLOWER_MAX_ENVELOPES_PER_MESSAGE
    max_queue_per_sender: int = FLOWER_MAX_QUEUED_PER_SENDER
    max_per_sender: int = FLOWER_MAX_ENVELOPES_PER_SENDER_PER_MESSAGE
    node_of: dict[str, int] = field(default_factory=dict)
    party_of: dict[int, str] = field(default_factory=dict)
    dropped: int = 0
    routed: int = 0
    #: node id -> the size of the state its party holds, as it last told (a pull's hint)
    held_bytes: dict[int, int] = field(default_factory=dict)
    # receiver -> sender -> its envelopes; and receiver -> envelopes given back (served first)
    _queues: dict[str, dict[str, deque[bytes]]] = field(default_factory=dict)
    _returned: dict[str, deque[bytes]] = field(default_factory=dict)
    # node id a party left for another -> that party (bounded: FLOWER_RELAY_FORMER_NODES)
    _former: dict[int, str] = field(default_factory=dict)

    def bind(self, party: str, node_id: int) -> None:
        """Record that ``party`` is reachable on ``node_id`` (a later claim replaces it)."""
        old = self.node_of.get(party)
        if old is not None and old != node_id:
            self.party_of.pop(old, None)
            self._former[old] = party
            while len(self._former) > FLOWER_RELAY_FORMER_NODES:
                del self._former[next(iter(self._former))]
        self._former.pop(node_id, None)
        prev = self.party_of.get(node_id)
        if prev is not None and prev != party:
            self.node_of.pop(prev, None)
        self.node_of[party] = node_id
        self.party_of[node_id] = party

    def enqueue(self, to: str, data: bytes, *, sender: str | None = None) -> None:
        """Queue ``data`` for party ``to`` (or for every known party but ``sender``)."""
        targets = [p for p in self.node_of if p != sender] if to == BROADCAST else [to]
        for target in targets:
            queues = self._queues.setdefault(target, {})
            q = queues.setdefault(sender or "", deque())
            if len(q) >= self.max_queue_per_sender:
                q.popleft()
                self.dropped += 1
            elif self.pending(target) >= self.max_queue:
                longest = max(queues.values(), key=len)
                (longest if longest else self._returned[target]).popleft()
                self.dropped += 1
            q.append(data)
            self.routed += 1

    def pending(self, party: str) -> int:
        """Number of envelopes waiting for ``party``."""
        queued = sum(len(q) for q in self._queues.get(party, {}).values())
        return queued + len(self._returned.get(party, ()))

    def take(self, node_id: int) -> list[bytes]:
        """Envelopes to deliver to the party on ``node_id`` now (removed from its queues).

        Envelopes given back come first; then the senders' queues in turn, one envelope each
        per turn, at most ``max_per_sender`` of a sender.
        """
        party = self.party_of.get(node_id)
        if party is None:
            return []
        returned = self._returned.get(party)
        out = (
            [returned.popleft() for _ in range(min(len(returned), self.max_per_message))]
            if returned
            else []
        )
        queues = self._queues.get(party, {})
        share = dict.fromkeys(queues, 0)
        live = [k for k, q in queues.items() if q]
        while live and len(out) < self.max_per_message:
            for sender in live:
                if len(out) >= self.max_per_message:
                    break
                out.append(queues[sender].popleft())
                share[sender] += 1
            live = [k for k in live if queues[k] and share[k] < self.max_per_sender]
        for sender in [k for k, q in queues.items() if not q]:
            del queues[sender]
        return out

    def give_back(self, node_id: int, envelopes: Sequence[bytes]) -> None:
        """Put undelivered envelopes back at the head of the queue of the party they were
        taken for (in order): the party on ``node_id``, or the one that was on it before a
        restart moved that party to another node while they were out."""
        party = self.party_of.get(node_id) or self._former.get(node_id)
        if party is None or not envelopes:
            return
        q = self._returned.setdefault(party, deque())
        q.extendleft(reversed(list(envelopes)))
        while self.pending(party) > self.max_queue and q:
            q.pop()
            self.dropped += 1

    def absorb(self, node_id: int, record: ConfigRecord) -> PartyReply:
        """Read a party's Chaos record: bind its id to ``node_id`` and queue what it sends."""
        reply = read_party_record(record)
        if reply.party:
            self.bind(reply.party, node_id)
        if reply.held_bytes >= 0:
            self.held_bytes[node_id] = reply.held_bytes
        for to, data in reply.outgoing:
            self.enqueue(to, data, sender=reply.party or None)
        return reply


@dataclass
class ExchangeResult:
    """What one deadline-bounded exchange brought back.

    Attributes
    ----------
    replies:
        Node id -> reply with content (Chaos record still inside).
    errors:
        Node id -> error code of an error reply (e.g. ``ErrorCode.NODE_UNAVAILABLE``).
    reasons:
        Node id -> the reason string of that error reply.
    missing:
        Nodes that were sent a message and had not replied by the deadline.
    elapsed_s:
        Wall time of the exchange.
    missing_ids:
        Message id -> node of the messages still unanswered (pass them as ``late`` to a later
        exchange to collect replies that come after the deadline).
    late:
        Node -> a reply to a message of an *earlier* exchange (see ``late``) that came in
        during this one.
    message_ids, by_message:
        The pushed messages' ids (in the order given) and message id -> its reply with
        content: with several messages to one node, ``replies`` keeps that node's first reply
        and ``by_message`` has every one.
    """

    replies: dict[int, Message]
    errors: dict[int, int]
    missing: set[int]
    elapsed_s: float
    missing_ids: dict[str, int] = field(default_factory=dict)
    late: dict[int, Message] = field(default_factory=dict)
    message_ids: list[str] = field(default_factory=list)
    by_message: dict[str, Message] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)


#: After a stalled exchange's first answer, the others' further wait, as a fraction of the
#: exchange's deadline (see :class:`_Deadline`).
STALL_GRACE: float = 0.5
#: The fewest waited nodes whose silence past the deadline is taken for a stall: one node's is
#: indistinguishable from its crash, which must not hold an exchange up to the ceiling.
STALL_MIN_NODES: int = 2
#: A stall waits on at most this share of its messages' shortest time to live (the ttl runs
#: from the message's creation, a little before the push).
STALL_TTL_SHARE: float = 0.9


@dataclass
class _Deadline:
    """When an exchange stops waiting (``stall_s`` of :func:`exchange`).

    At ``at``, unless no waited node has replied: then they all stalled at once (a loaded
    host or link, not as many crashes), and ending would only throw their work away. The
    wait then goes on, up to ``end``, until the first of them answers, and from then for
    :data:`STALL_GRACE` of the deadline's ``length`` more for the others.
    """

    at: float
    end: float
    length: float
    waiting: frozenset[int]
    stalled: bool = False

    @classmethod
    def starting(
        cls,
        start: float,
        length: float,
        stall_s: float | None,
        messages: Sequence[Message],
        waiting: set[int],
    ) -> _Deadline:
        """The deadline of an exchange started at ``start`` that waits for ``waiting``. A
        stall never waits past :data:`STALL_TTL_SHARE` of the shortest time to live of their
        messages: an expired message is answered with an error, not a reply."""
        if stall_s is None or len(waiting) < STALL_MIN_NODES:
            stall_s = length
        ttls = [m.metadata.ttl for m in messages if m.metadata.dst_node_id in waiting]
        stall_s = min([stall_s, *(t * STALL_TTL_SHARE for t in ttls if t)])
        return cls(start + length, start + max(length, stall_s), length, frozenset(waiting))

    def passed(self, now: float, replied: set[int]) -> bool:
        """Whether to stop at ``now``; ``replied``: the nodes that replied so far (an error
        reply, e.g. a crashed node's, says nothing about a stall of the others)."""
        answered = replied & self.waiting
        if self.stalled and answered:  # the first answer after a stall: a grace for the rest
            self.at, self.stalled = min(self.end, now + self.length * STALL_GRACE), False
        if now < self.at:
            return False
        if self.stalled or answered or now >= self.end:
            return True
        self.at, self.stalled = self.end, True
        return False


def exchange(
    grid: Grid,
    messages: Sequence[Message],
    *,
    timeout_s: float,
    wait_for: set[int] | None = None,
    poll_interval_s: float = FLOWER_POLL_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    late: Mapping[str, int] | None = None,
    stall_s: float | None = None,
    more: Callable[[bool], tuple[Sequence[Message], float]] | None = None,
) -> ExchangeResult:
    """Push ``messages``, then pull replies until all of ``wait_for`` answered or the deadline.

    Parameters
    ----------
    grid:
        The Flower Grid.
    messages:
        Usually one message per destination node; several to one node are allowed (their
        replies are in ``by_message``; the node counts as answered once all of them are).
    timeout_s:
        The exchange's deadline (see ``stall_s``).
    wait_for:
        Nodes whose replies end the wait (default: every destination); replies of others
        that arrive in time are returned too (suspected-dead nodes never hold a phase up).
    poll_interval_s, clock, sleep:
        Pause between pulls; the time source and the pause.
    late:
        Message id -> node of earlier messages whose replies missed their deadline: they are
        pulled too (never waited for) and returned in ``late``.
    stall_s:
        Past the deadline with no reply from ``wait_for``, wait on up to ``stall_s`` from the
        start (:class:`_Deadline`); ``None``: the deadline is final.
    more:
        Called after every pull, with whether the exchange would end now (it may run
        exchanges of its own): messages to add to this exchange and how long to wait for
        their replies from now. They are pushed and their destinations waited for until then
        (or until they answer), besides the exchange's own: its deadline and stall still go by
        ``wait_for`` alone, and never end the wait for them sooner. A round uses it to send a
        train message to a node that came and took the state during training
        (:mod:`chaos_flwr.flower.server.latejoin`).
    """
    start = clock()
    waiting = {m.metadata.dst_node_id for m in messages} if wait_for is None else set(wait_for)
    ex = _Pulls(grid, late)
    ex.push(messages)
    deadline = _Deadline.starting(start, timeout_s, stall_s, messages, waiting)
    added_until = start  # the messages ``more`` added are waited for until then
    while ex.outstanding:
        ex.pull()
        answered = ex.answered()
        now = clock()
        done = waiting <= answered or deadline.passed(now, set(ex.replies))
        done = not ex.outstanding or (done and (ex.added <= answered or now >= added_until))
        added, wait_s = more(done) if more is not None else ((), 0.0)
        if added:  # pushed, then pulled before the end is decided again
            ex.push(added, extra=True)
            added_until = max(added_until, clock() + wait_s)
            continue
        if done:
            break
        until = max(deadline.at, added_until if ex.added - answered else deadline.at)
        sleep(min(poll_interval_s, max(0.0, until - clock())))
    return ex.result(clock() - start)


class _Pulls:
    """What one :func:`exchange` pushed and what came back (its loop's state)."""

    def __init__(self, grid: Grid, late: Mapping[str, int] | None) -> None:
        self.grid = grid
        self.ids: list[str] = []
        self.node_of_msg: dict[str, int] = {}
        self.outstanding: set[str] = set()
        self.added: set[int] = set()  # destinations of the messages ``more`` added
        self.replies, self.by_message = dict[int, Message](), dict[str, Message]()
        self.errors, self.reasons = dict[int, int](), dict[int, str]()
        self.late_out, self.late_replies = dict(late or {}), dict[int, Message]()

    def push(self, messages: Sequence[Message], *, extra: bool = False) -> None:
        new_ids = list(self.grid.push_messages(messages))
        self.ids.extend(new_ids)
        for mid, m in zip(new_ids, messages, strict=True):
            self.node_of_msg[mid] = m.metadata.dst_node_id
            self.outstanding.add(mid)
            if extra:
                self.added.add(m.metadata.dst_node_id)

    def pull(self) -> None:
        asked = [m for m in self.ids if m in self.outstanding] + list(self.late_out)
        for reply in self.grid.pull_messages(asked):
            mid = reply.metadata.reply_to_message_id
            if mid in self.late_out:
                lnode = self.late_out.pop(mid)
                if not reply.has_error():
                    self.late_replies[lnode] = reply
                continue
            node = self.node_of_msg.get(mid)
            if node is None or mid not in self.outstanding:
                continue
            self.outstanding.discard(mid)
            if reply.has_error():
                self.errors[node] = int(reply.error.code)
                self.reasons[node] = str(reply.error.reason or "")
            else:
                self.replies.setdefault(node, reply)
                self.by_message[mid] = reply

    def answered(self) -> set[int]:
        """Nodes all of whose messages were answered (a reply or an error)."""
        pending = {self.node_of_msg[m] for m in self.outstanding}
        return (set(self.replies) | set(self.errors)) - pending

    def result(self, elapsed_s: float) -> ExchangeResult:
        outstanding = self.outstanding
        return ExchangeResult(
            self.replies,
            self.errors,
            {self.node_of_msg[mid] for mid in outstanding},
            elapsed_s,
            missing_ids={mid: self.node_of_msg[mid] for mid in outstanding},
            late=self.late_replies,
            message_ids=self.ids,
            by_message=self.by_message,
            reasons=self.reasons,
        )
