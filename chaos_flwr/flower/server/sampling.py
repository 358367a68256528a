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
of them to reach the minimum), in one exchange that waits for them as long as their train
replies may take; those that answer with a receipt of the base (they took the last certify
late) are eligible again. A node the base's certify did not reach (no reply: it expired
unread, or its SuperNode restarted) and that still lacks the base is sent that certify again
in the same exchange (:class:`LostCertify`): otherwise, when it reached nobody, no party
would ever hold the state the next round trains on, and every try left would be skipped. A
node that answered the certify and did not take it refused it: it is not sent it again.
Nothing is sent when enough nodes are eligible: rounds without the event are unchanged.
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


@dataclass(frozen=True)
class LostCertify:
    """A round's certify exchange (its spec) and the nodes it did not reach."""

    spec: PhaseSpec
    nodes: frozenset[int]

    @classmethod
    def of(cls, spec: PhaseSpec, unanswered: Iterable[int]) -> LostCertify | None:
        """The certify ``spec`` (without its audit job, whose updates are not kept) and the
        nodes that gave no reply to it (``None``: none)."""
        nodes = frozenset(unanswered)
        return cls(replace(spec, audit=None), nodes) if nodes else None


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
        node, or ``base`` was resumed or initial).

    Returns
    -------
    list of int
        The eligible nodes, in the order of ``known``.
    """
    eligible = courier.eligible(known, base[1], base[0])
    if len(eligible) >= need:
        return eligible
    resend = frozenset(
        n for n in (lost.nodes if lost is not None else ()) if _receipt(courier, n) != base
    )
    asked = [
        n
        for n in _active_parties(courier, known)
        if (n in courier.suspects or n in resend) and n not in courier.config_errors
    ]
    if not asked or len(eligible) + len(asked) < need:
        return eligible
    # the suspects among them are waited for only when all are (Courier.exchange), as long
    # as their train replies may take; ``everyone``: each gets a message even with nothing to
    # relay to it
    wait = min(timeout, max(courier.times.deadline("relay:train", n) for n in asked))
    spec = PhaseSpec("relay", base[0], base[1], everyone=True)
    if lost is not None and resend.intersection(asked):
        spec = replace(lost.spec, receivers=resend, everyone=True)
    _, rlog.ask_s = courier.phase(grid, [], asked, spec, timeout=wait, log_=rlog)
    return courier.eligible(known, base[1], base[0])
