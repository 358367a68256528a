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
of them to reach the minimum), in one relay exchange that waits for them as long as their
train replies may take; those that answer (with a receipt of the base, if they took the last
certify late) are eligible again. Nothing is sent when enough nodes are eligible: rounds
without the event are unchanged.
"""

from __future__ import annotations

from flwr.serverapp import Grid

from chaos_flwr.flower.server.courier import Courier, PhaseSpec
from chaos_flwr.flower.server.logs import RoundLog

__all__ = ["eligible_nodes", "genesis_takers"]


def genesis_takers(courier: Courier, known: list[int]) -> list[int]:
    """Who may train on an initial state that rides on the train messages: every live node
    whose party answered the hello and is active in the signed view, since none holds the
    state before the message comes."""
    return [n for n in _active_parties(courier, known) if n not in courier.suspects]


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
) -> list[int]:
    """The known nodes that may train on ``base`` (its round and digest), asking the
    suspects once more when fewer than ``need`` are eligible (module docstring).

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

    Returns
    -------
    list of int
        The eligible nodes, in the order of ``known``.
    """
    eligible = courier.eligible(known, base[1], base[0])
    if len(eligible) >= need:
        return eligible
    asked = [
        n
        for n in _active_parties(courier, known)
        if n in courier.suspects and n not in courier.config_errors
    ]
    if not asked or len(eligible) + len(asked) < need:
        return eligible
    # every addressed node is a suspect, so the exchange waits for them (Courier.exchange),
    # as long as their train replies may take; ``everyone``: each gets a message even with
    # nothing to relay to it
    wait = min(timeout, max(courier.times.deadline("relay:train", n) for n in asked))
    spec = PhaseSpec("relay", base[0], base[1], everyone=True)
    _, rlog.ask_s = courier.phase(grid, [], asked, spec, timeout=wait, log_=rlog)
    return courier.eligible(known, base[1], base[0])
