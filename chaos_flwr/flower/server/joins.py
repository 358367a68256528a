"""The join relay: live parties that lack the certified state get it, from the ServerApp or
pulled from its holders.

**From the ServerApp** (:attr:`JoinSettings.source` ``auto`` when the relay is the only path,
or ``server``): the ServerApp holds the newest certified state (it aggregated it), so, like
plain Flower sending the model in a train message, it sends the state's bytes in the join
exchange, one message per joiner (:func:`~chaos_flwr.flower.schema.take_record`, with the
holders' signed receipts and the round's audits). The joiner checks them (receipts, final,
digest; :func:`~chaos_flwr.flower.client.joiner.take_state`) and takes the state up, or
refuses it with a typed error: then it falls back to the pull below, in the same join.

**Pulled from the holders** (direct links known, ``peers``, or a refused copy): the joiner
plans and verifies (:mod:`chaos_flwr.flower.client.joiner`); the ServerApp only carries its
requests to the donors and the donors' shard replies back (it never assembles the state).
Every joiner still pulling shares the same two exchanges per relay step (one with the
joiners, one with the donors), so two joiners take as many exchanges as one.

**Before a round** (:meth:`JoinRelay.newcomers_first`): a node connected when a round starts
whose party the relay has never heard from (a SuperNode that came between rounds) is asked,
admitted and given the state the round trains on before the round's train messages go out,
so it trains in that round, as a plain FedAvg node connected then is sampled in it.

**During training** (:func:`~.latejoin.during_round`, called by
:class:`~.latejoin.LateJoiners`): a node that comes while the round trains is asked at once
(:meth:`JoinRelay.ask`), or, when the holders announced endpoints (their party daemons serve
while their SuperNodes train), asked with the join's start in the same message
(:meth:`JoinRelay.ask_pulling`): it fetches the state over their direct links, after their
daemons countersigned its join if it needs sponsors. No relay step follows, since the holders'
SuperNodes are training: an admitted joiner that did not finish takes the ServerApp's copy
(:meth:`JoinRelay.send_state`), as one does when no holder announced an endpoint. A joiner
that is not admitted by then has its join request reach its sponsors with the round's certify
messages and takes the state in that round's join, as above, so it trains in the next round:
the first round a plain FedAvg node that came during training is sampled in.

Either way nothing is sent in a round without a joiner: a churn-free round's messages are
unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from chaos_flwr import codec
from chaos_flwr.flower.fetch import direct_step_wait_s
from chaos_flwr.flower.schema import (
    PULL_DATA_KEY,
    donor_key,
    read_donor_records,
    start_record,
    take_record,
)
from chaos_flwr.flower.server.courier import Courier, PhaseSpec
from chaos_flwr.flower.server.grids import EligibleGrid
from chaos_flwr.flower.server.logs import JoinLog, RoundLog, read_join_stats
from chaos_flwr.flower.server.settings import JOIN_SOURCE_AUTO, JOIN_SOURCE_PEERS, JoinSettings
from chaos_flwr.planner import Donor as PlanDonor
from chaos_flwr.planner import lower_bound
from chaos_flwr.pull.negotiation import PULL_ASSUMED_BANDWIDTH_BPS
from chaos_flwr.state import TrainingState

__all__ = [
    "FLOWER_NEWCOMER_RETRY_S",
    "FLOWER_NEWCOMER_WAIT_S",
    "JoinRelay",
]

#: Longest wait (seconds) for the replies of the newcomers asked before a round's training
#: (:meth:`JoinRelay.newcomers_first`): a newcomer that answers later is admitted with the
#: round's certify and trains in the next round, so a node that never answers delays a round
#: by this much at most (and only while it is connected and unknown).
FLOWER_NEWCOMER_WAIT_S: float = 15.0
#: An unknown node whose error reply to that query came within this many seconds is asked
#: again before the next round (asking it is cheap); a slower one is not waited for again.
FLOWER_NEWCOMER_RETRY_S: float = 1.0


@dataclass
class _Run:
    """One round's concurrent pulls: per joiner node its log, its next control record and the
    donors' replies to its previous requests."""

    spec: PhaseSpec
    node_of: dict[str, int]
    logs: dict[int, JoinLog]
    ctl: dict[int, ConfigRecord]
    replies: dict[int, dict[str, ConfigRecord]]
    t0: float
    #: Whether the start carried the donors' signed endpoint records (a joiner may dial them).
    announced: bool = False


@dataclass
class _Step:
    """What the joiners asked for in one relay step."""

    still: list[int] = field(default_factory=list)
    donor_msgs: list[Message] = field(default_factory=list)
    asked: list[tuple[int, str]] = field(default_factory=list)  # (joiner, donor) per message
    lost: dict[int, set[str]] = field(default_factory=dict)
    taken: dict[int, list[bytes]] = field(default_factory=dict)


class _Arrivals(EligibleGrid):
    """The Grid as the newcomers' query uses it, noting when each node's first reply (or
    error) was pulled (node id -> clock)."""

    def __init__(self, grid: Grid, nodes: list[int], clock: Callable[[], float]) -> None:
        super().__init__(grid, nodes)
        self._clock = clock
        self.at: dict[int, float] = {}

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self._grid.pull_messages(message_ids))
        now = self._clock()
        for reply in replies:
            self.at.setdefault(reply.metadata.src_node_id, now)
        return replies


class JoinRelay:
    """Relays the joiners' pulls of each round's certified state (module docstring).

    Parameters
    ----------
    courier:
        Carries the exchanges and knows who holds what.
    settings:
        Smallest shard, most donors, most relay steps.
    clock:
        The ServerApp's clock (pull times).

    Attributes
    ----------
    direct_parties:
        Holders known to serve direct links (they named a direct address in a size or
        manifest reply this relay carried); with ``source="auto"`` a join whose donors
        include one is pulled, not sent by the ServerApp.
    silent:
        Unknown nodes that are not asked before a round again (:meth:`newcomers_first`): they
        missed the deadline of its query or of the ServerApp's hello (the strategy adds
        those) while it waited for them, answered without a party, or were slow to err.
    """

    def __init__(
        self,
        courier: Courier,
        settings: JoinSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.courier = courier
        self.settings = settings
        self.clock = clock
        self._total: int | None = None
        self.direct_parties: set[str] = set()
        self.silent: set[int] = set()

    def pull(
        self,
        grid: Grid,
        rnd: int,
        digest: bytes,
        rlog: RoundLog,
        timeout: float,
        total: int | None = None,
        state: TrainingState | None = None,
    ) -> float:
        """Have every live party that lacks the certified state take it up (module docstring).

        ``total`` is the certified state's size, named to the joiners as a hint (it saves
        them a step; the donors' manifest decides). ``state`` is the certified state itself
        when the ServerApp holds it (it must hash to ``digest``): by
        :attr:`JoinSettings.source` it is sent to the joiners in one message each; without
        it they pull. The joins are filed in ``rlog.joins``; returns the wall time they took.
        """
        courier = self.courier
        t0 = self.clock()
        self._admit(grid, rnd, digest, rlog, timeout)
        nodes = [n for n in grid.get_node_ids() if n not in courier.suspects]
        active = courier.active()
        holding = courier.holding(nodes, rnd, digest)
        donors = self.donors(holding, active)
        if not donors:
            return 0.0
        joiners: list[tuple[int, str]] = []
        for node in nodes:
            party = courier.relay.party_of.get(node)
            if party is None or node in holding:
                continue
            if active is not None and party not in active:
                continue
            joiners.append((node, party))
        if not joiners:
            return 0.0
        spec = PhaseSpec("join", rnd, digest)
        self._total = total
        taken: list[JoinLog] = []
        refused: dict[int, str] = {}
        if state is not None and self.server_path(donors):
            taken, refused = self.send_state(grid, joiners, donors, spec, state, timeout, rlog)
            joiners = [(n, p) for n, p in joiners if n in refused]
        pulled = self._pull_for(grid, joiners, donors, spec, timeout, rlog) if joiners else []
        for jl in pulled:
            jl.server_refused = refused.get(jl.node, "")
        for jl in [*taken, *pulled]:
            rlog.joins.append(jl)
            if jl.ok and jl.source == "server":
                log(
                    INFO, "Chaos: %s took round %d (%d bytes) from the ServerApp in %.3fs",
                    jl.party, rnd, jl.total_bytes, jl.pull_s,
                )  # fmt: skip
            elif jl.ok:
                log(
                    INFO,
                    "Chaos: %s pulled round %d from %d donors in %.3fs (bound %.3fs): %s",
                    jl.party, rnd, len(jl.bytes_per_donor), jl.pull_s, jl.lower_bound_s,
                    jl.bytes_per_donor,
                )  # fmt: skip
            else:
                log(WARNING, "Chaos: %s could not pull round %d: %s", jl.party, rnd, jl.error)
        return self.clock() - t0

    def donors(self, holding: list[int], active: set[str] | None) -> list[int]:
        """The donors of a join among the nodes ``holding`` the state: those whose party is
        in ``active`` (every one when it is ``None``: an unsigned run), at most
        :attr:`JoinSettings.max_donors`."""
        holders = self.courier.holders
        ok = [n for n in holding if active is None or holders[n][0] in active]
        return ok[: self.settings.max_donors]

    def newcomers_first(
        self,
        grid: Grid,
        rnd: int,
        digest: bytes,
        rlog: RoundLog,
        timeout: float,
        state_of: Callable[[], TrainingState],
    ) -> float:
        """Before a round's training: ask the newcomers, admit them and give them the certified
        state ``(rnd, digest)`` the round trains on, so they are eligible in this round.

        Parameters
        ----------
        grid, rlog, timeout:
            The ServerApp's Grid, the round's log, the bound of every exchange.
        rnd, digest:
            The certified state the round trains on.
        state_of:
            Builds that state (it must hash to ``digest``); called only when a newcomer is
            admitted.

        Returns
        -------
        float
            The wall time it took (0.0 when nothing was sent).

        Notes
        -----
        Newcomers are connected nodes whose party the relay has never heard from, except nodes
        whose last error said their settings are wrong and :attr:`silent` ones. Without a
        charter, or with none, nothing is sent. One exchange asks only them, waited for at
        most :data:`FLOWER_NEWCOMER_WAIT_S`: their replies carry their join requests; then
        :meth:`pull` carries the requests to sponsors and has the admitted newcomers take the
        state. A node that lets the exchange pass unanswered while it was waited for (a
        suspect is not, next to a node that is not), answers without a party, or whose error
        came later than :data:`FLOWER_NEWCOMER_RETRY_S` after the push becomes
        :attr:`silent`: it still gets its query with the round's messages, as before, but is
        never waited for here again. One that errs at once (in simulation, a node the churn
        emulation does not let in yet) is asked again before the next round.
        """
        courier = self.courier
        if courier.view is None:
            return 0.0
        party_of, skip = courier.relay.party_of, set(courier.config_errors) | self.silent
        newcomers = [n for n in grid.get_node_ids() if n not in party_of and n not in skip]
        if not newcomers:
            return 0.0
        t0 = self.clock()
        self.ask(grid, newcomers, rnd, digest, rlog, min(timeout, FLOWER_NEWCOMER_WAIT_S))
        if any(n in party_of for n in newcomers):
            state = state_of()
            self.pull(grid, rnd, digest, rlog, timeout, state.serialized_size(), state)
        return self.clock() - t0

    def ask(
        self, grid: Grid, newcomers: list[int], rnd: int, digest: bytes, rlog: RoundLog,
        wait: float,
    ) -> None:  # fmt: skip
        """One exchange with ``newcomers`` only (their replies carry their parties' records
        and join requests), waited for at most ``wait`` seconds; marks the slow ones
        :attr:`silent` (:meth:`newcomers_first`)."""
        t0 = self.clock()
        waited = self._waited(newcomers)
        timed = _Arrivals(grid, newcomers, self.clock)
        spec = PhaseSpec("relay", rnd, digest)
        self.courier.phase(timed, [], newcomers, spec, timeout=wait, log_=rlog,
                           stop_on_config=False)  # fmt: skip
        self._silence(newcomers, waited, timed, t0, rlog)

    def ask_pulling(
        self, grid: Grid, newcomers: list[int], donors: list[int], spec: PhaseSpec,
        wait: float, rlog: RoundLog, *, total: int, skip: Collection[str] = (),
    ) -> list[JoinLog]:  # fmt: skip
        """:meth:`ask` with the join's start in the question (while a round trains, when the
        donors announced endpoints): a charter party answers and, in the same ClientApp,
        asks its sponsors' daemons to countersign and fetches the state ``spec`` names over
        the donors' links; nothing goes to the training donors. A party in ``skip`` (it trains
        in the round already) takes nothing. Returns the logs of the finished pulls; the
        envelopes that the others' relay requests took go back to the relay."""
        t0 = self.clock()
        waited = self._waited(newcomers)
        timed = _Arrivals(grid, newcomers, self.clock)
        self._total = total
        run = self._run_for([(n, "") for n in newcomers], donors, spec, skip=skip)
        step = self._ask_joiners(timed, run, newcomers, wait, rlog, newcomers=True)
        for node, envelopes in step.taken.items():
            self.courier.relay.give_back(node, envelopes)
        self._silence(newcomers, waited, timed, t0, rlog)
        # a node that held the state already (a member's SuperNode restarted with its disk)
        # took nothing: it is no join
        done = [jl for n in newcomers if (jl := run.logs[n]).ok and jl.total_bytes > 0]
        for jl in done:
            jl.party = self.courier.relay.party_of.get(jl.node, "")
        return done

    def _waited(self, newcomers: list[int]) -> set[int]:
        """The newcomers an exchange with them waits for (a suspect only when all are)."""
        suspects = self.courier.suspects
        return {n for n in newcomers if n not in suspects} or set(newcomers)

    def _silence(
        self, newcomers: list[int], waited: set[int], timed: _Arrivals, t0: float, rlog: RoundLog
    ) -> None:
        """Mark the newcomers that were slow to answer (or answered without a party)
        :attr:`silent`."""
        party_of = self.courier.relay.party_of
        for n in newcomers:
            if n in party_of:
                continue
            if n in rlog.errors:  # asked again only when its error came at once
                slow = timed.at.get(n, float("inf")) - t0 > FLOWER_NEWCOMER_RETRY_S
            else:  # missed a deadline it was waited for, or answered without a party
                slow = n in waited or n not in rlog.missing
            if slow:
                self.silent.add(n)

    def _admit(self, grid: Grid, rnd: int, digest: bytes, rlog: RoundLog, timeout: float) -> None:
        """Carry a newcomer's join request to its sponsors now, not with the next round.

        A live party the charter's keyring names but the view has never listed (a newcomer)
        whose request reached the relay too late for this round's certify messages (e.g. its
        node was a suspect, so the train exchange did not wait for it) would be admitted one
        round later, and only then take the state. When such a newcomer is live and active
        members have envelopes waiting, one relay exchange with those members delivers them
        (a sponsor countersigns and broadcasts the join record), so the newcomer joins in this
        round's join. Nothing is sent otherwise: churn-free rounds are unchanged.
        """
        courier, view = self.courier, self.courier.view
        if view is None:
            return
        relay = courier.relay
        live = [n for n in grid.get_node_ids() if n not in courier.suspects]
        newcomers = [
            p
            for n in live
            if (p := relay.party_of.get(n)) is not None
            and p in view.keyring
            and view.status(p) is None
        ]
        if not newcomers:
            return
        active = view.active()
        carry = [
            n
            for n in live
            if (p := relay.party_of.get(n)) is not None and p in active and relay.pending(p) > 0
        ]
        if not carry:
            return
        spec = PhaseSpec("relay", rnd, digest, everyone=True)
        courier.phase(grid, [], carry, spec, timeout=timeout, log_=rlog)
        log(
            INFO, "Chaos: carried %d member(s)' envelopes at once for newcomer(s) %s",
            len(carry), ", ".join(sorted(newcomers)),
        )  # fmt: skip

    def server_path(self, donors: list[int]) -> bool:
        """Whether the ServerApp sends the state (:attr:`JoinSettings.source`): always for
        ``server``, never for ``peers``; for ``auto`` when the relay is the only path (no
        donor offered announced a verified endpoint, or is known to serve a direct link)."""
        source = self.settings.source
        if source == JOIN_SOURCE_PEERS:
            return False
        if source != JOIN_SOURCE_AUTO:
            return True
        holders, view = self.courier.holders, self.courier.view
        parties = [holders[d][0] for d in donors if d in holders]
        if view is not None and any(view.records.endpoint(p) is not None for p in parties):
            return False
        return not any(p in self.direct_parties for p in parties)

    def _start(self, donors: list[int], spec: PhaseSpec) -> ConfigRecord:
        """The join's start record: the donors, their signed receipts, the round's audits."""
        holders, receipts = self.courier.holders, self.courier.receipts
        parties = [holders[d][0] for d in donors]
        start = start_record(
            parties,
            [receipts.get(d, b"") for d in donors],
            self.settings.min_shard_bytes,
            self._total,
            _endpoint_records(self.courier, parties),
        )
        proofs = self.courier.proofs
        if proofs is not None:  # the joiner takes only a final state: here are its audits
            start["audits"] = proofs.audits_of(spec.server_round, spec.digest)
        return start

    def send_state(
        self,
        grid: Grid,
        joiners: list[tuple[int, str]],
        donors: list[int],
        spec: PhaseSpec,
        state: TrainingState,
        timeout: float,
        rlog: RoundLog,
        then: str = "it pulls it from the holders",
    ) -> tuple[list[JoinLog], dict[int, str]]:
        """One exchange: every joiner gets the certified state in its join message and takes
        it up (its receipt comes back with the reply) or refuses it. Returns the logs of
        those that took it, and why each other joiner did not (they fall back to the pull)."""
        t0 = self.clock()
        data = state.to_bytes()  # one copy, shared by every joiner's message
        ctl = take_record(self._start(donors, spec), data)
        msgs: list[Message] = []
        taken: dict[int, list[bytes]] = {}
        for node, _ in joiners:
            msg, taken[node] = self.courier.message(node, spec, RecordDict({PULL_DATA_KEY: ctl}))
            msgs.append(msg)
        res = self.courier.exchange(
            grid, msgs, taken, timeout=timeout, log_=rlog, stop_on_config=False
        )
        done: list[JoinLog] = []
        refused: dict[int, str] = {}
        for node, party in joiners:
            reply = res.replies.get(node)
            got = reply.content.get(PULL_DATA_KEY) if reply is not None else None
            if not isinstance(got, ConfigRecord):
                refused[node] = "the joiner did not answer"
            elif got.get("status") != "done":
                refused[node] = str(got.get("error", "failed"))
            else:
                jl = JoinLog(party=party, node=node, server_round=spec.server_round)
                jl.digest, jl.source, jl.steps, jl.ok = spec.digest, "server", 1, True
                jl.total_bytes, jl.pull_s = len(data), self.clock() - t0
                done.append(jl)
                continue
            log(
                WARNING, "Chaos: %s refused the state the ServerApp sent for round %d (%s); %s",
                party, spec.server_round, refused[node], then,
            )  # fmt: skip
        return done, refused

    def _pull_for(
        self,
        grid: Grid,
        joiners: list[tuple[int, str]],
        donors: list[int],
        spec: PhaseSpec,
        timeout: float,
        rlog: RoundLog,
    ) -> list[JoinLog]:
        """Relay the joiners' pulls; they plan, we carry."""
        run = self._run_for(joiners, donors, spec)
        step_times: list[float] = []
        pulling = [n for n, _ in joiners]
        for _ in range(self.settings.max_steps):
            if not pulling:
                break
            t_step = self.clock()
            step = self._ask_joiners(grid, run, pulling, timeout, rlog)
            if not step.still:
                pulling = []
                break
            self._ask_donors(grid, run, step, timeout, rlog)
            pulling = step.still
            step_times.append(self.clock() - t_step)
        for node in pulling:
            run.logs[node].error = f"no verified state after {self.settings.max_steps} relay steps"
            run.logs[node].pull_s = self.clock() - run.t0
        _lower_bounds(run.logs.values(), min(step_times) if step_times else 0.0)
        return [run.logs[n] for n, _ in joiners]

    def _run_for(
        self, joiners: list[tuple[int, str]], donors: list[int], spec: PhaseSpec,
        skip: Collection[str] = (),
    ) -> _Run:  # fmt: skip
        """The pulls of ``joiners`` from ``donors``, before their first step (the parties in
        ``skip`` are named in the start: they take nothing)."""
        start = self._start(donors, spec)
        if skip:
            start["skip"] = sorted(skip)
        return _Run(
            spec=spec,
            node_of={self.courier.holders[d][0]: d for d in donors},
            logs={
                n: JoinLog(party=p, node=n, server_round=spec.server_round, digest=spec.digest)
                for n, p in joiners
            },
            ctl={n: start for n, _ in joiners},
            replies={n: {} for n, _ in joiners},
            t0=self.clock(),
            announced="records" in start,
        )

    def _ask_joiners(
        self, grid: Grid, run: _Run, pulling: list[int], timeout: float, rlog: RoundLog,
        *, newcomers: bool = False,
    ) -> _Step:  # fmt: skip
        """One exchange with every joiner still pulling; their requests become donor messages.
        ``newcomers``: they are nodes not yet heard from (a misconfigured one stops nothing)."""
        courier = self.courier
        # a joiner that may fetch over direct links in this step is waited for (and its message
        # lives) that much longer than its reply history says: the donors announced endpoints,
        # or one named a direct address in a reply
        direct = run.announced or any(p in self.direct_parties for p in run.node_of)
        extra = direct_step_wait_s(self._total) if direct else 0.0
        msgs: list[Message] = []
        taken: dict[int, list[bytes]] = {}
        for node in pulling:
            content = RecordDict({PULL_DATA_KEY: run.ctl[node]})
            for dparty, rec in run.replies[node].items():
                content[donor_key(dparty)] = rec
            msg, taken[node] = courier.message(node, run.spec, content, extra_s=extra)
            msgs.append(msg)
        res = courier.exchange(
            grid, msgs, taken, timeout=timeout, log_=rlog, stop_on_config=not newcomers,
            extra_s=extra,
        )  # fmt: skip
        step = _Step()
        for node in pulling:
            jl = run.logs[node]
            jl.steps += 1
            reply = res.replies.get(node)
            got = reply.content.get(PULL_DATA_KEY) if reply is not None else None
            if not isinstance(got, ConfigRecord):
                jl.error = "the joiner did not answer"
                jl.pull_s = self.clock() - run.t0
                continue
            status = got.get("status")
            if status != "want":
                read_join_stats(jl, got)
                jl.ok = status == "done"
                if not jl.ok and not jl.error:
                    jl.error = str(got.get("error", "failed"))
                jl.pull_s = self.clock() - run.t0
                continue
            step.still.append(node)
            step.lost[node] = set()
            requests = read_donor_records(reply.content) if reply is not None else {}
            pull_spec = PhaseSpec("pull", run.spec.server_round, run.spec.digest)
            for dparty, req in requests.items():
                dn = run.node_of.get(dparty)
                if dn is None or dn in courier.suspects:
                    step.lost[node].add(dparty)
                    continue
                m, envs = courier.message(dn, pull_spec, RecordDict({PULL_DATA_KEY: req}))
                step.taken.setdefault(dn, []).extend(envs)
                step.donor_msgs.append(m)
                step.asked.append((node, dparty))
        return step

    def _ask_donors(
        self, grid: Grid, run: _Run, step: _Step, timeout: float, rlog: RoundLog
    ) -> None:
        """One exchange carrying every joiner's requests to the donors; keep their answers."""
        res = self.courier.exchange(grid, step.donor_msgs, step.taken, timeout=timeout, log_=rlog)
        for node in step.still:
            run.replies[node] = {}
        for (node, dparty), mid in zip(step.asked, res.message_ids, strict=True):
            r = res.by_message.get(mid)
            data = r.content.get(PULL_DATA_KEY) if r is not None else None
            if isinstance(data, ConfigRecord):
                run.replies[node][dparty] = data
                if isinstance(data.get("direct"), str) and data.get("direct"):
                    self.direct_parties.add(dparty)  # it serves direct links: pull next time
            else:
                step.lost[node].add(dparty)
        for node in step.still:
            run.ctl[node] = ConfigRecord({"op": "step", "lost": sorted(step.lost[node])})


def _endpoint_records(courier: Courier, parties: list[str]) -> list[bytes]:
    """The signed join and endpoint records of ``parties`` that announced an endpoint (a
    joiner needs both to dial it: an endpoint counts only for an active member), encoded."""
    view = courier.view
    if view is None:
        return []
    named = {p for p in parties if view.records.endpoint(p) is not None}
    return [
        codec.encode(r.to_wire())
        for r in view.records
        if r.body.get("subject") in named and r.body.get("kind") in ("join", "endpoint")
    ]


def _lower_bounds(logs: Iterable[JoinLog], latency: float) -> None:
    """The planner's lower bound for each pull (assumed link rates, measured relay latency)."""
    for jl in logs:
        if jl.total_bytes and jl.planned_bytes:
            plan_donors = [
                PlanDonor(id=d, bandwidth=PULL_ASSUMED_BANDWIDTH_BPS, latency=latency)
                for d in jl.planned_bytes
            ]
            jl.lower_bound_s = lower_bound(jl.total_bytes, plan_donors)
