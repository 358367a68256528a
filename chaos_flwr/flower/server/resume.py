"""Resume: a restarted ServerApp rebuilds the newest certified state from the parties' replicas.

It keeps no checkpoint of its own. It says hello to every party (their replies carry their
signed receipts and the size of the state each holds; in a signed federation the hello also
names a link key made for this run, which the parties grant reads of their certified states),
picks the newest ``(round, digest)`` enough *verified* receipts name, and pulls that state in
planner-sized shares from all its holders at once
(:func:`chaos_flwr.flower.server.pull.pull_state`; the told size spares the pull its size
step; holders with party daemons are dialled directly). Whatever it resumes from, it goes on
above the newest round any party signed, so no round number is ever certified twice.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import ArrayRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from chaos_flwr.errors import ChaosError
from chaos_flwr.flower.schema import RELAY_SPKI_KEY
from chaos_flwr.flower.server.courier import Courier, PhaseSpec
from chaos_flwr.flower.server.logs import RoundLog
from chaos_flwr.flower.server.pull import PullReport, RelayAsker, pull_state, relay_link
from chaos_flwr.flower.server.settings import ResumeSettings
from chaos_flwr.transport.links import LinkAccess

__all__ = ["Resumed", "Resumer", "size_hint"]


def size_hint(told: Mapping[int, int], nodes: Sequence[int]) -> int | None:
    """The state size most of ``nodes`` told (the smallest of the most told sizes; ``None``
    when none told one): the resume pull's hint, so it asks no sizes first."""
    counts = Counter(told[n] for n in nodes if n in told)
    if not counts:
        return None
    top = max(counts.values())
    return min(size for size, c in counts.items() if c == top)


@dataclass
class Resumed:
    """What a resume found.

    Attributes
    ----------
    hello:
        The hello round's log (round -1, or the resumed round once a state was pulled);
        ``None`` when there was no hello (no receipt verifier).
    round_floor:
        The newest round any verified receipt names (-1: none).
    state:
        ``(round, arrays, digest, strategy state)`` of the resumed state, or ``None``.
    report:
        The pull of that state.
    why:
        Why that state was resumed, or why none was (for the log).
    """

    hello: RoundLog | None = None
    round_floor: int = -1
    state: tuple[int, ArrayRecord, bytes, bytes] | None = None
    report: PullReport | None = None
    why: str = "resume disabled"


class Resumer:
    """Rebuilds the latest certified state from the parties (module docstring).

    Parameters
    ----------
    courier:
        Carries the hello and keeps the receipts it brings back.
    settings:
        Receipts a state needs and the pull's smallest shard.
    clock, sleep:
        The ServerApp's clock and pause.
    """

    def __init__(
        self,
        courier: Courier,
        settings: ResumeSettings,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.courier = courier
        self.settings = settings
        self.clock = clock
        self.sleep = sleep

    def wait_for_nodes(self, grid: Grid, need: int, timeout: float) -> list[int]:
        """Wait (bounded by one phase deadline) until ``need`` nodes are connected."""
        phases = self.courier.phases
        deadline = self.clock() + phases.deadline(timeout)
        while len(nodes := list(grid.get_node_ids())) < need and self.clock() < deadline:
            self.sleep(phases.poll_interval_s)
        return nodes

    def resume(self, grid: Grid, known: list[int], timeout: float, *, pull: bool = True) -> Resumed:
        """Ask every party for its receipt; pull the newest state enough of them certified.

        Candidates are the ``(round, digest)`` pairs named by *verified* receipts, newest
        first; a round whose verified receipts name two digests is conflicted (equivocation
        evidence) and never resumed from. The newest candidate with at least
        ``settings.min_receipts`` holders (default 1: the newest round *any* verified party
        holds, e.g. one certified by only some parties before a kill) is pulled from all its
        holders at once; the manifest and the assembled state must match the certified digest
        (else the next older candidate is tried). The inner strategy's state (e.g. FedAdam's
        moments) is part of the certified state and comes back with it.

        :attr:`Resumed.round_floor` is the newest round any verified receipt names. Without a
        receipt verifier nothing is resumed: unsigned claims are not proof. With ``pull``
        false (``chaos-resume = fresh``) only the floor is learnt.
        """
        courier = self.courier
        if courier.receipt_verifier is None:
            log(WARNING, "Chaos: no receipt verifier, so no resume from party replicas")
            return Resumed(why="no receipt verifier (no charter): unsigned receipts are no proof")
        hello = RoundLog(-1)
        link = self._link() if pull else None
        fields = ((RELAY_SPKI_KEY, link.creds.spki),) if link is not None else ()
        spec = PhaseSpec("hello", -1, b"", fields=fields)
        courier.phase(grid, [], known, spec, timeout=timeout, log_=hello)
        out = Resumed(hello=hello)
        tally: dict[tuple[int, bytes], list[int]] = {}
        digests: dict[int, set[bytes]] = {}
        for node, (_, rnd, dig) in courier.holders.items():
            # every verified receipt counts for the floor, a suspect's too (it was signed)
            out.round_floor = max(out.round_floor, rnd)
            digests.setdefault(rnd, set()).add(dig)
            if node not in courier.suspects:
                tally.setdefault((rnd, dig), []).append(node)
        if not tally:
            out.why = "no party answered with a verified receipt (nothing certified yet)"
            return out
        if not pull:
            out.why = "the parties' replicas are ignored"
            return out
        out.why = (
            f"no certified state with at least {self.settings.min_receipts} verified holder(s) "
            "could be pulled"
        )
        conflicted = {rnd for rnd, digs in digests.items() if len(digs) > 1}
        for rnd in sorted(conflicted):
            log(WARNING, "Chaos: round %d has receipts for two digests; not resumed from", rnd)
        for (rnd, dig), nodes in sorted(tally.items(), key=lambda kv: -kv[0][0]):
            if rnd in conflicted or len(nodes) < self.settings.min_receipts:
                continue
            if self._pull(grid, (rnd, dig), sorted(nodes), timeout, out, link):
                break
        return out

    def _link(self) -> LinkAccess | None:
        """This run's link access for the resume pull (a fresh key the hello asks the parties
        to grant reads), or ``None``: no view (unsigned), or the key could not be made (the
        pull then goes through the relay)."""
        view = self.courier.view
        if view is None:
            return None
        try:
            return relay_link(view.policy, view.records.view)
        except (ChaosError, ValueError) as exc:
            log(WARNING, "Chaos: no link key for the resume (%s): pulling through the relay", exc)
            return None

    def _pull(
        self,
        grid: Grid,
        cert: tuple[int, bytes],
        nodes: list[int],
        timeout: float,
        out: Resumed,
        link: LinkAccess | None,
    ) -> bool:
        """Pull the certified state ``cert`` from the ``nodes`` holding it (over ``link`` from
        those with a signed endpoint); fill ``out``."""
        rnd, dig = cert
        courier = self.courier
        hello = out.hello
        assert hello is not None
        holders = [(n, courier.holders[n][0]) for n in nodes]
        try:
            ask = RelayAsker(
                grid, rnd, dig, courier.phases.deadline(timeout), courier.phases.poll_interval_s,
                self.clock, self.sleep, lambda n, m: courier.absorb(n, m, {}, hello),
            )  # fmt: skip
            arrays, report = pull_state(
                ask, holders, min_shard_bytes=self.settings.min_shard_bytes,
                total_hint=size_hint(courier.relay.held_bytes, nodes), link=link,
            )  # fmt: skip
        except ChaosError as exc:
            log(WARNING, "Chaos: pulling round %d from its holders failed: %s", rnd, exc)
            return False
        hello.server_round = rnd
        hello.digest = dig
        hello.holders = sorted(p for _, p in holders)
        out.report = report
        out.state = (rnd, arrays, dig, report.strategy_state)
        out.why = f"{len(holders)} verified holder(s) of round {rnd}"
        log(
            INFO, "Chaos: resumed at round %d, shares per holder: %s (over direct links: %s)",
            rnd, report.shares, report.direct or "none",
        )  # fmt: skip
        if out.round_floor > rnd:
            log(
                INFO, "Chaos: rounds up to %d were signed by some party: going on at %d",
                out.round_floor, out.round_floor + 1,
            )  # fmt: skip
        return True
