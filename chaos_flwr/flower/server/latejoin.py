"""Late joiners: a node that comes while a round trains is admitted, takes the state the round
trains from, and trains in that round.

Flower samples a round's trainers when the round starts: a SuperNode that connects during
training is first sampled in the next round, and a plain FedAvg joiner trains one round later
than it could have. While the train exchange waits for its replies, :class:`LateJoiners` looks
for nodes that came since it started (at most every :data:`FLOWER_LATE_JOIN_LOOK_S`) and has
those admitted now take the certified state the round trains from (:func:`during_round`).

- **The holders announced endpoints** (their party daemons serve while their SuperNodes train):
  the question to the newcomers carries the join's start (the holders' signed receipts, join
  and endpoint records). In the one ClientApp that answers it, a charter party that needs
  sponsors asks the holders' daemons to countersign its join (:mod:`chaos_flwr.countersign`),
  then fetches the state over their links, checked against the receipts. A first message
  costs a fresh SuperNode a ClientApp process (15 to 38 s on the testbed's loaded cores), so
  asking and pulling in one message saves one of them.
- **Otherwise** it is asked; one whose own signed records already admit it (a founder, or a
  charter whose ``admission.sponsors_required`` is 0) takes the ServerApp's copy, checked
  against the holders' receipts (so does an admitted one whose fetch failed). One that needs
  sponsors is admitted with the round's certify and trains in the next round.

It then gets the round's train instruction (the content of the inner strategy's first train
message of the round, with the model left out: it holds it) and the exchange waits for its
reply too, so the inner strategy aggregates its update with the others'.

Costs, and limits: nothing is sent in a round where no node comes (a look is a ``get_node_ids``
call); a round with a late joiner lasts until its update is in, bounded by its deadline (a node
with no history gets :attr:`PhaseSettings.first_deadline_s`, capped by the run's timeout), so a
joiner that comes near the end of training lengthens that round by about its own training;
asking a node that never answers holds the exchange's next pull up for
:data:`FLOWER_LATE_JOIN_ASK_S` once (more when the question carries the join's start: the
countersign and direct-link bounds, and the state's bytes at :data:`FLOWER_LATE_JOIN_HOLD_BPS`;
a node's first deadline, :attr:`PhaseSettings.first_deadline_s`, caps either wait, with the
direct-link bound added when the question carries the start).
Nothing is added once the run's timeout has passed since the exchange began, and each added
wait ends by then. A newcomer whose party
already has the round's train message (its SuperNode restarted) takes nothing (the start
names the parties that train) and is sent no train message. The start goes to every newcomer
before the ServerApp knows its party: a node at the SuperLink reads the holders' receipts and
signed endpoint records (their link servers still let only charter parties in). A strategy
that sends each node a different instruction gives the late joiner the first node's; one that
samples a subset of the eligible nodes (``fraction_train`` below 1) keeps its sample, and the
newcomer is sampled from the next round. Off with
``JoinSettings(during_round=False)``, with ``source="peers"`` (the state then only comes from
the holders, who are training), and for Flower's differential-privacy wrappers (their noise and
accounting are for the number of nodes sampled, and they refuse a different number of replies).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from logging import INFO

from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore import log

from chaos_flwr.flower.client.sponsors import FLOWER_COUNTERSIGN_S
from chaos_flwr.flower.fetch import FLOWER_LINK_WORKER_GRACE_S, direct_step_wait_s
from chaos_flwr.flower.held import elide_held
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY
from chaos_flwr.flower.server.courier import Courier, PhaseSpec, message_kind
from chaos_flwr.flower.server.joins import JoinRelay
from chaos_flwr.flower.server.logs import JoinLog, RoundLog
from chaos_flwr.flower.server.settings import JOIN_SOURCE_PEERS, JoinSettings
from chaos_flwr.state import TrainingState

__all__ = [
    "COUNTED_STRATEGIES",
    "FLOWER_LATE_JOIN_ASK_S",
    "FLOWER_LATE_JOIN_HOLD_BPS",
    "FLOWER_LATE_JOIN_LOOK_S",
    "LateJoiners",
    "during_round",
    "late_joins_allowed",
]

#: Seconds between two looks for nodes that came while a round trains (each look is one
#: ``Grid.get_node_ids`` call; asking a node that came is the work, done once per node).
FLOWER_LATE_JOIN_LOOK_S: float = 1.0
#: Longest wait (seconds) for the replies of the nodes asked while a round trains
#: (:func:`during_round`). A fresh SuperNode's first message starts its SuperExec and
#: a ClientApp process: 23 s on the testbed's 2 loaded cores while four institutions trained.
#: The wait holds up only the train exchange's next pull, so it delays the round only when
#: the trainers finish within it, by at most this much, once per node that never answers.
FLOWER_LATE_JOIN_ASK_S: float = 60.0
#: Bytes per second at which a late joiner verifies and writes the state it fetched: the question
#: that carries the join's start waits :data:`FLOWER_LATE_JOIN_ASK_S`, the countersign and
#: direct-link bounds (:data:`~chaos_flwr.flower.client.sponsors.FLOWER_COUNTERSIGN_S`,
#: :func:`~chaos_flwr.flower.fetch.direct_step_wait_s` of the state, with the link workers'
#: grace) and the state's bytes at this rate; a joiner whose reply comes later holds the
#: state and trains in the next round.
FLOWER_LATE_JOIN_HOLD_BPS: float = 50e6
#: Inner strategies whose aggregation is for exactly the nodes sampled (Flower's
#: differential-privacy wrappers: noise and accounting for that count; they refuse more
#: replies): no late joiner trains in their rounds.
COUNTED_STRATEGIES = (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)


def late_joins_allowed(inner: Strategy, settings: JoinSettings) -> bool:
    """Whether a node that comes during training may train in the round: ``during_round`` is
    on, the state may come from the ServerApp (not ``source="peers"``), and the inner strategy
    is not one of :data:`COUNTED_STRATEGIES`."""
    if not settings.during_round or settings.source == JOIN_SOURCE_PEERS:
        return False
    return not isinstance(inner, COUNTED_STRATEGIES)


class LateJoiners:
    """The train exchange's ``more`` hook (module docstring): train messages for the nodes
    that came during training and took the state it trains from.

    Parameters
    ----------
    joins, courier, grid:
        The join relay (asks and sends the state), the courier (wraps the messages) and the
        ServerApp's Grid.
    known, trainers:
        The nodes the train exchange addresses or asks (they are not looked at here), and
        those the inner strategy sent a train message.
    base:
        ``(round, digest, arrays)`` of the certified state the round trains from.
    state_of:
        Builds that state (it must hash to the digest); called only when a node is admitted.
    template:
        The inner strategy's first train message of the round, before any Chaos change.
    spec:
        The train exchange's phase spec (the relay record its messages carry).
    rlog, timeout:
        The round's log and the run's bound of every exchange.
    elide:
        Leave the model out of the late train messages (the receiver holds it, by its receipt).
    clock:
        The ServerApp's clock.

    Attributes
    ----------
    nodes:
        The nodes sent a train message by this hook, in order.
    """

    def __init__(
        self,
        joins: JoinRelay,
        courier: Courier,
        grid: Grid,
        known: list[int],
        trainers: list[int],
        *,
        base: tuple[int, bytes, ArrayRecord],
        state_of: Callable[[], TrainingState],
        template: Message,
        spec: PhaseSpec,
        rlog: RoundLog,
        timeout: float,
        elide: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._joins, self._courier, self._grid = joins, courier, grid
        self._base, self._state_of, self._template = base, state_of, template
        self._spec, self._rlog, self._timeout, self._elide = spec, rlog, timeout, elide
        self._clock = clock
        self._known = set(known)  # addressed or asked already: never asked here
        # parties the round's train messages went to (a restarted SuperNode's new node is not
        # sent a second instruction for its party)
        self._trainers = {courier.relay.party_of.get(n) for n in trainers}
        self._looked = clock()  # the exchange has just been set up: look in a while
        # the run's bound of an exchange holds for this one too: nothing is added after it
        self._until = self._looked + timeout
        self.nodes: list[int] = []

    def __call__(self, taken: dict[int, list[bytes]], ending: bool) -> tuple[list[Message], float]:
        """Look for nodes that came (every :data:`FLOWER_LATE_JOIN_LOOK_S`, and once more
        when the exchange would end); return train messages for those that took the state,
        and the wait their replies need (``([], 0.0)`` when none did)."""
        now = self._clock()
        if (now - self._looked < FLOWER_LATE_JOIN_LOOK_S and not ending) or now >= self._until:
            return [], 0.0
        self._looked = now
        courier, joins = self._courier, self._joins
        skip = self._known | set(courier.config_errors) | joins.silent
        came = [n for n in self._grid.get_node_ids() if n not in skip]
        if not came:
            return [], 0.0
        self._known.update(came)
        rnd, digest, arrays = self._base
        # its exchanges (the question, the state) end by the bound too
        bound = min(self._timeout, self._until - now)
        ready = during_round(
            joins, self._grid, came, rnd, digest, self._rlog, bound, self._state_of,
            training=self._trainers,
        )  # fmt: skip
        left = self._until - self._clock()
        if ready and left <= 0:  # they hold the state: they train in the next round
            log(INFO, "Chaos: nodes %s came too late to train in round %d", ready,
                self._rlog.server_round)  # fmt: skip
            return [], 0.0
        msgs: list[Message] = []
        for node in ready:
            party = courier.relay.party_of.get(node)
            if party in self._trainers:
                continue
            self._trainers.add(party)
            inner = _retarget(self._template, node)
            if self._elide:
                inner = elide_held(inner, arrays, rnd, digest)
            msg, taken[node] = courier.message(node, self._spec, inner=inner)
            msgs.append(msg)
            self.nodes.append(node)
            log(
                INFO, "Chaos: node %d (%s) trains in round %d, which it came during",
                node, party, self._rlog.server_round,
            )  # fmt: skip
        if not msgs:
            return [], 0.0
        wait = max(courier.times.deadline(message_kind(m), m.metadata.dst_node_id) for m in msgs)
        return msgs, min(wait, left)


def during_round(
    joins: JoinRelay,
    grid: Grid,
    newcomers: list[int],
    rnd: int,
    digest: bytes,
    rlog: RoundLog,
    timeout: float,
    state_of: Callable[[], TrainingState],
    training: Collection[str | None] = (),
) -> list[int]:
    """While a round trains: ask ``newcomers`` (nodes that came during training) and have
    those admitted now take the certified state ``(rnd, digest)`` the round trains from.
    Returns the active ones that hold it now (that took it up, or already held it: a
    founder's SuperNode restarted with its state directory). A newcomer whose party is in
    ``training`` (its train message went to the node it was on before a restart) takes
    nothing: it does not train again in this round, and the round's join gives it the state
    the round certifies.

    Nothing here waits on a member: they are training (a SuperNode runs one ClientApp at a
    time). When the holders announced endpoints (their daemons serve while their SuperNodes
    train), the question carries the join's start (:meth:`~.joins.JoinRelay.ask_pulling`): a
    charter party answers after it asked the holders' daemons to countersign its join (when
    it needs sponsors; :mod:`chaos_flwr.countersign`) and fetched the state over their links,
    so it costs one ClientApp, not two. Otherwise it is asked, and one whose own records admit
    it (a founder, or a charter whose ``admission.sponsors_required`` is 0) takes the
    ServerApp's copy, checked against the holders' receipts; so does an admitted one whose
    fetch failed. The others are admitted with the round's certify and take its state in its
    join, as before.
    """
    courier = joins.courier
    view = courier.view
    if view is None:
        return []
    t0 = joins.clock()
    spec = PhaseSpec("join", rnd, digest)
    donors = joins.donors(courier.holding(grid.get_node_ids(), rnd, digest), view.active())
    state: TrainingState | None = None
    taken: list[JoinLog] = []
    if donors and not joins.server_path(donors):
        state = state_of()
        size = state.serialized_size()
        wait = _pulling_wait(size)
        taken = joins.ask_pulling(grid, newcomers, donors, spec, min(timeout, wait), rlog,
                                  total=size, skip={p for p in training if p})  # fmt: skip
    else:
        joins.ask(grid, newcomers, rnd, digest, rlog, min(timeout, FLOWER_LATE_JOIN_ASK_S))
    rlog.ask_s += joins.clock() - t0
    active = view.active()  # a joiner its sponsors' daemons admitted is listed now
    holders = courier.holding(grid.get_node_ids(), rnd, digest)  # with those that just took it
    joiners = _charter_parties(courier, newcomers, training)
    held = [n for n, p in joiners if n in holders and p in active]
    # only an admitted joiner that does not hold the state gets the ServerApp's copy now
    joiners = [(n, p) for n, p in joiners if n not in holders and p in active]
    left = t0 + timeout - joins.clock()
    if joiners and donors and left > 0:
        state = state_of() if state is None else state
        then = "it takes the round's state in the round's join"
        sent, _ = joins.send_state(grid, joiners, donors, spec, state, left, rlog, then)
        taken += sent
        held += courier.holding([jl.node for jl in sent], rnd, digest)
    rlog.joins.extend(taken)
    for jl in taken:
        log(
            INFO, "Chaos: %s came during round %d's training and took round %d (%d bytes) "
            "%s in %.3fs", jl.party, rlog.server_round, rnd, jl.total_bytes,
            "from the ServerApp" if jl.source == "server" else "over direct links", jl.pull_s,
        )  # fmt: skip
    return held


def _pulling_wait(size: int) -> float:
    """How long the question that carries the join's start waits (module docstring)."""
    # the countersign calls, then the manifest and the fetch within one direct-link budget:
    # each of the three runs in a worker waited for up to its grace past its bound
    links = FLOWER_COUNTERSIGN_S + FLOWER_LINK_WORKER_GRACE_S + direct_step_wait_s(size)
    return FLOWER_LATE_JOIN_ASK_S + links + size / FLOWER_LATE_JOIN_HOLD_BPS


def _charter_parties(
    courier: Courier, newcomers: list[int], training: Collection[str | None]
) -> list[tuple[int, str]]:
    """``(node, party)`` of the charter parties among ``newcomers``: members, and those whose
    join waits for sponsors; not a suspect, nor a party that already trains in the round."""
    keyring, party_of = courier.view.keyring if courier.view else {}, courier.relay.party_of
    return [
        (n, p)
        for n in newcomers
        if (p := party_of.get(n)) is not None
        and p in keyring
        and p not in training
        and n not in courier.suspects
    ]


def _retarget(message: Message, node: int) -> Message:
    """``message``'s instruction (type, group, lifetime, content without a Chaos record) to
    ``node``."""
    md = message.metadata
    content = RecordDict({k: v for k, v in message.content.items() if k != CHAOS_RECORD_KEY})
    return Message(
        content,
        dst_node_id=node,
        message_type=md.message_type,
        group_id=md.group_id or None,
        ttl=md.ttl,
    )
