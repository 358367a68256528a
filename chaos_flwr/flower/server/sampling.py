"""Who a round's training may sample, and the one exchange that brings slow nodes back.

A node is *eligible* for a round's training when it is not a suspect, its verified receipt
names the round's base state, and its party is active in the signed view
(:meth:`Courier.eligible`). On an initial state that rides on the train messages, every live
node whose party answered the hello and is active is (:func:`genesis_takers`).

A node that misses a deadline becomes a suspect, and a suspect gets no train message until
it answers again. So when every node was slow once (a loaded host, a long pause), the round
is not certified, the next try finds no eligible node, and no message would ever reach the
suspects to clear them: the run would skip every round left. :func:`eligible_nodes` therefore
asks, when too few nodes are eligible, the live suspects active in the view once more (enough
of them to reach the minimum), in a relay exchange that waits for them as long as their train
replies may take; those that answer with a receipt of the base (they took the last certify
late) are eligible again. A node that was to take the base's state from its certify and gave
no reply (the message expired unread, or its SuperNode restarted), and still lacks the base,
is sent that certify again instead, in an exchange of its own (:class:`LostCertify`):
otherwise, when the certify reached nobody, no party would ever hold the state the next round
trains on, and every try left would be skipped. A node that answers the certify and does not
take it refused it: it is not sent it again. Nothing is sent when enough nodes are eligible:
rounds without the event are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from flwr.serverapp import Grid

from chaos_flwr.flower.server.courier import Courier, PhaseSpec
from chaos_flwr.flower.server.logs import RoundLog

__all__ = ["LostCertify", "eligible_nodes", "genesis_takers"]


def genesis_takers(courier: Courier, known: list[int]) -> list[int]:
    """Who may train on an initial state that rides on the train messages: every live node
    whose party answered the hello and is active in the signed view, since none holds the
    state before the message comes."""
    return [n for n in _active_parties(courier, known) if n not in courier.suspects]


@dataclass
class LostCertify:
    """A certify exchange (its spec, without the audit job, whose updates are not kept) and
    the nodes that were to take its state and gave no reply (its message lost); the nodes
    that answer it when it is sent again leave the set, whether they took it or refused it."""

    spec: PhaseSpec
    nodes: set[int]

    @classmethod
    def after(
        cls, spec: PhaseSpec, suspects: Iterable[int], *, sent_to: Iterable[int] = ()
    ) -> LostCertify | None:
        """The certify ``spec`` just sent, with its receivers of the state (``sent_to`` when
        it names none: all got it) that are ``suspects`` after it (``None``: none)."""
        takers = set(sent_to) if spec.receivers is None else spec.receivers
        nodes = set(takers.intersection(suspects))
        return cls(replace(spec, audit=None), nodes) if nodes else None

    def lacking(self, courier: Courier, base: tuple[int, bytes]) -> set[int]:
        """The lost nodes whose newest receipt still does not name ``base``."""
        return {n for n in self.nodes if _receipt(courier, n) != base}


def _receipt(courier: Courier, node: int) -> tuple[int, bytes] | None:
    """The (round, digest) of ``node``'s newest accepted receipt, if any."""
    held = courier.holders.get(node)
    return None if held is None else (held[1], held[2])


def _active_parties(courier: Courier, nodes: list[int]) -> list[int]:
    """The ``nodes`` whose party the relay knows and the signed view lists as active."""
    active, party_of = courier.active(), courier.relay.party_of
    return [n for n in nodes if n in party_of and (active is None or party_of[n] in active)]


def eligible_nodes(
    courier: Courier,
    grid: Grid,
    known: list[int],
    base: tuple[int, bytes],
    need: int,
    *,
    timeout: float,
    rlog: RoundLog,
    lost: LostCertify | None = None,
) -> list[int]:
    """The known nodes that may train on ``base`` (its round and digest), asking the
    suspects once more, and sending ``base``'s certify again to the nodes it did not reach,
    when fewer than ``need`` are eligible (module docstring).

    Parameters
    ----------
    courier, grid:
        The ServerApp's courier and Grid.
    known:
        The nodes connected at the round's start.
    base:
        The certified state the round trains on.
    need:
        The inner strategy's minimum of training nodes.
    timeout, rlog:
        The bound of the exchange; the round's log (its replies and misses are noted there).
    lost:
        The certify of ``base`` and the nodes it did not reach (``None``: it reached every
        node, or ``base`` was resumed or rode on a first round's train messages); pruned of
        those that answer it here.

    Returns
    -------
    list of int
        The eligible nodes, in the order of ``known``.
    """
    eligible = courier.eligible(known, base[1], base[0])
    if len(eligible) >= need:
        return eligible
    resend = lost.lacking(courier, base) if lost is not None else set()
    asked = [
        n
        for n in _active_parties(courier, known)
        if (n in courier.suspects or n in resend) and n not in courier.config_errors
    ]
    if not asked or len(eligible) + len(asked) < need:
        return eligible
    # suspects are waited for when every node an exchange addresses is one (Courier.exchange),
    # here as long as their train replies may take
    wait = min(timeout, max(courier.times.deadline("relay:train", n) for n in asked))
    again = [n for n in asked if n in resend]
    others = [n for n in asked if n not in resend]
    if lost is not None and again:  # the certify again, with the state, to those it missed
        spec = replace(lost.spec, receivers=frozenset(again))
        rlog.ask_s += courier.phase(grid, [], again, spec, timeout=wait, log_=rlog)[1]
        lost.nodes &= courier.suspects  # those that answered took it or refused it
    if others:  # a relay (it carries refutations too); ``everyone``: even with nothing to relay
        spec = PhaseSpec("relay", base[0], base[1], everyone=True)
        rlog.ask_s += courier.phase(grid, [], others, spec, timeout=wait, log_=rlog)[1]
    return courier.eligible(known, base[1], base[0])
