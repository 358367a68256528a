"""``ChaosStrategy``: Chaos phases around any new-style Flower strategy (the round loop).

Each round has the same two exchanges as the inner strategy (train, evaluate), and Chaos rides
on them, so a churn-free round costs about what the inner strategy's round costs:

1. **train**: the inner strategy's ``configure_train`` samples from a Grid that lists only the
   *eligible* nodes (those whose party holds the current state, by its receipt, and, when a view
   source is given, that the signed view lists as active). Every message carries the relay
   envelopes for its party; other known nodes get a ``query.chaos`` message with theirs in the
   same push, only for an event (an unknown node, a first sync, a joiner); their other
   envelopes go with the certify phase: with every node sampled, a churn-free round sends
   exactly the inner strategy's messages. The phase waits for the non-suspect nodes only, and
   never past its deadline.
2. **certify + evaluate**: the inner strategy's ``configure_evaluate`` messages carry the new
   state; nodes not sampled for evaluation get it in a ``query.chaos`` certify message. Every
   reply carries the party's receipt (round, digest), signed by the party's key.
3. **joins**: live parties that lack the certified state get it: in one message from the
   ServerApp when the relay is the only path (they check it against the holders' receipts),
   else pulled from its holders (:mod:`.joins`, :attr:`JoinSettings.source`). A node that
   came between rounds is admitted and takes the state before the round's training, so it
   trains in that round (:meth:`~.joins.JoinRelay.newcomers_first`); one that comes during
   training and whose own records admit it does too (:mod:`.latejoin`).

Replies are stripped of their Chaos record before the inner strategy aggregates them, so the
inner strategy sees exactly what it would have seen without Chaos.

The work is done by collaborators: the :class:`~.courier.Courier` (messages, exchanges,
receipts, suspects), the :class:`~.joins.JoinRelay` and the :class:`~.resume.Resumer`. This
class only delegates to the inner strategy and runs the rounds.

What this strategy does **not** do by itself: decide membership. Nodes that miss a deadline or
answer with an error are *suspects* (not waited for, not sampled) until they answer again
(when too few nodes are eligible, the live suspects are asked once before the round is
skipped: :mod:`.sampling`); the membership of the federation is what the parties'
signed records say (``view_source``).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from chaos_flwr.defaults import FLOWER_ELIDE_HELD_ARRAYS
from chaos_flwr.errors import ResumeError
from chaos_flwr.flower.held import elide_held
from chaos_flwr.flower.relay import Relay
from chaos_flwr.flower.server.audits import audit_again, not_certifiable
from chaos_flwr.flower.server.courier import (
    Courier,
    PhaseSpec,
    ReceiptVerifier,
    keyring_verifier,
    min_nodes,
)
from chaos_flwr.flower.server.grids import EligibleGrid
from chaos_flwr.flower.server.joins import JoinRelay
from chaos_flwr.flower.server.latejoin import LateJoiners, late_joins_allowed
from chaos_flwr.flower.server.logs import RoundLog, RoundLogs
from chaos_flwr.flower.server.proofs import Chosen, RoundProofs
from chaos_flwr.flower.server.pull import PullReport
from chaos_flwr.flower.server.resume import Resumed, Resumer
from chaos_flwr.flower.server.sampling import LostCertify, eligible_nodes, genesis_takers
from chaos_flwr.flower.server.settings import (
    FLAT_KEYS,
    RESUME_FRESH,
    RESUME_REQUIRE,
    JoinSettings,
    PhaseSettings,
    ResumeSettings,
)
from chaos_flwr.flower.server.state import (
    certified_digest,
    certified_state,
    restore_strategy_state,
    strategy_state_of,
)
from chaos_flwr.flower.server.view import ServerView
from chaos_flwr.state import TrainingState

__all__ = ["ChaosStrategy"]


@dataclass(frozen=True)
class _Held:
    """The newest certified state: its round, arrays and digest. ``genesis`` is the proof of
    an initial state that no party holds yet: its certify rides on the first round's train
    messages (which carry those arrays anyway), so a fresh start adds no exchange. ``lost``:
    the exchange that certified the state and the nodes it did not reach, sent to them again
    when too few nodes can train on it (:func:`~.sampling.eligible_nodes`)."""

    server_round: int
    arrays: ArrayRecord
    digest: bytes
    strategy_state: bytes = b""
    genesis: tuple[tuple[str, Any], ...] | None = None
    lost: LostCertify | None = None


@dataclass
class _Run:
    """What one :meth:`ChaosStrategy.start` call was given."""

    grid: Grid
    timeout: float
    train_config: ConfigRecord
    evaluate_config: ConfigRecord
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None
    result: Result


class ChaosStrategy(Strategy):
    """Wrap a ``flwr.serverapp.strategy`` strategy with the Chaos phases (module docstring).

    Parameters
    ----------
    inner:
        Any new-style Flower strategy (FedAvg, FedProx, FedAdam, Krum, ...); it does all
        sampling sizes and aggregation.
    charter:
        The federation's verified charter. With it the ServerApp keeps a server-side view
        from the signed records it relays (:class:`~chaos_flwr.flower.server.view.ServerView`:
        validated, never forged), samples only parties it lists as active, verifies receipts
        with the charter's keyring, and logs membership events and their settle times.
    phases:
        Adaptive deadlines of the exchanges (each node's from its own reply times, between a
        floor and a ceiling; capped by ``start(timeout=...)``) and the pause between pulls
        while a phase waits; default :class:`PhaseSettings()`.
    joins:
        How a joiner gets the certified state (``source``: from the ServerApp, or pulled),
        smallest shard, most donors, most relay steps; default :class:`JoinSettings()`.
    resume:
        On start, rebuild the newest state that at least ``resume.min_receipts`` parties
        certified (verified receipts only), pulled in shards from all its holders at once, and
        go on above the newest round any party signed (:attr:`round_floor`; a restarted
        ServerApp keeps no checkpoint, and never certifies a round number twice); default
        :class:`ResumeSettings()` (``mode="auto"``; ``fresh`` and ``require``: see
        :meth:`start`).
    receipt_verifier:
        Checks parties' signed receipts (e.g. :func:`keyring_verifier` of the charter's
        keyring). Without one, receipts are taken as *unsigned* claims: they still steer whom
        to sample (a liveness decision), and every round lists them in ``unsigned_receipts``.
    view_source:
        Returns the party ids the signed view lists as active; ``None`` means no view is known
        to the server (sampling is then by receipts only).
    relay:
        The envelope router (a fresh one by default).
    clock, sleep:
        The ServerApp's clock and pause (a virtual clock in tests).
    elide_held:
        Leave the model out of train messages to parties that hold it (with a charter: each
        receiver's verified receipt names the state the round trains from; the party puts its
        own copy back, :mod:`chaos_flwr.flower.held`), so the model leaves the ServerApp once
        per round instead of twice; default
        :data:`~chaos_flwr.defaults.FLOWER_ELIDE_HELD_ARRAYS`.

    Attributes
    ----------
    rounds:
        One :class:`~chaos_flwr.flower.server.logs.RoundLog` per round (and the hello), the
        newest ``SERVER_MAX_ROUND_LOGS`` (:class:`~chaos_flwr.flower.server.logs.RoundLogs`).
    view:
        The server-side view (with a charter), else ``None``.
    last_pull:
        The resume's pull of the certified state, if there was one.
    round_floor:
        The newest round any verified receipt named at the resume (-1: none).
    """

    def __init__(
        self,
        inner: Strategy,
        *,
        charter: Any | None = None,
        phases: PhaseSettings | None = None,
        joins: JoinSettings | None = None,
        resume: ResumeSettings | None = None,
        receipt_verifier: ReceiptVerifier | None = None,
        view_source: Callable[[], set[str]] | None = None,
        relay: Relay | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        elide_held: bool = FLOWER_ELIDE_HELD_ARRAYS,
    ) -> None:
        if not isinstance(inner, Strategy):
            raise TypeError(
                f"inner must be a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}"
            )
        self.inner = inner
        self.elide_held = elide_held
        self.phases = phases or PhaseSettings()
        self.joins = joins or JoinSettings()
        self.resume = resume or ResumeSettings()
        self.view: ServerView | None = None
        if charter is not None:
            self.view = ServerView(charter, clock)
            if receipt_verifier is None:
                receipt_verifier = keyring_verifier(dict(charter.keyring()))
            if view_source is None:
                view_source = self.view.active
        self.receipt_verifier = receipt_verifier
        self.view_source = view_source
        self.relay = relay or Relay()
        self.courier = Courier(
            self.relay, self.phases, receipt_verifier, self.view, view_source, clock, sleep
        )
        if charter is None and receipt_verifier is not None:
            log(
                WARNING, "Chaos: receipts are verified but no charter is given: certifies carry "
                "no proof, and parties that sign take none up (give charter=...)",
            )  # fmt: skip
        if charter is not None and receipt_verifier is not None:
            self.courier.proofs = RoundProofs.from_charter(charter)
            policy = getattr(charter, "round_policy", None)
            rule = policy().rule if callable(policy) else None
            if rule is not None:  # the federation's rule, not the server's (ConfigError)
                from chaos_flwr.flower.rule import check_inner

                check_inner(rule, inner)
        self.join_relay = JoinRelay(self.courier, self.joins, clock)
        self.resumer = Resumer(self.courier, self.resume, clock, sleep)
        self.rounds: list[RoundLog] = RoundLogs()  # the newest SERVER_MAX_ROUND_LOGS
        self.last_pull: PullReport | None = None
        self.round_floor = -1
        self._prev: _Held | None = None  # the base of the held state (a rollback goes there)

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
        ph = self.phases
        log(
            INFO, "\t│\t├── deadlines: %.0f%% quantile of each node's reply times x %.2f, in "
            "[%.1f, %.1f] s; %.1f s before a node has any",
            100 * ph.deadline_quantile, 1 + ph.deadline_margin, ph.deadline_floor_s,
            ph.deadline_ceiling_s, ph.first_deadline_s,
        )  # fmt: skip
        log(INFO, "\t│\t├── resume: chaos-resume=%s", self.resume.mode)
        log(INFO, "\t│\t└── receipts: %s", "verified" if self.receipt_verifier else "UNSIGNED")
        self.inner.summary()

    # -- profiles -----------------------------------------------------------------------------
    @classmethod
    def from_profile(cls, name_or_path: str | Path, **overrides: Any) -> ChaosStrategy:
        """Build a ChaosStrategy from a strategy profile (``strategies/<name>.yaml`` or a path).

        ``overrides`` named like a profile's ``chaos:`` keys (``phase_timeout_s``,
        ``join_max_donors``, ...) replace the profile's values; the others are keyword
        arguments of :class:`ChaosStrategy` (e.g. ``receipt_verifier``).
        :class:`~chaos_flwr.errors.ProfileError` names a bad field.
        """
        from chaos_flwr.flower.profiles import load_profile

        profile = load_profile(name_or_path)
        flat = {k: overrides.pop(k) for k in list(overrides) if k in FLAT_KEYS}
        kwargs = profile.settings(**flat)
        kwargs.update(overrides)
        return cls(profile.build_inner(), **kwargs)

    # -- the rounds ---------------------------------------------------------------------------
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
        """Run the inner strategy's rounds with the Chaos phases, up to round ``num_rounds``.

        Same parameters and result as :meth:`flwr.serverapp.strategy.Strategy.start`;
        ``timeout`` bounds every exchange (together with the adaptive deadlines of
        ``phases``).

        ``num_rounds`` is the **last round number**, absolute, not a count of rounds to run: a
        run that resumes at round 40 (``resume.mode`` ``auto`` or ``require``) with
        ``num_rounds=40`` trains nothing (a warning says so); give ``num_rounds=50`` for ten
        more. A ``fresh`` run starts above every round any party signed (round 41 after a run
        that reached 40), so it too needs ``num_rounds`` above that. The log names the resume
        mode, the round it starts from and why.

        Raises
        ------
        PartyConfigError
            Parties cannot take part because of their settings (every node an exchange
            addressed answered with a ConfigError, or too few are left to train).
        ResumeError
            ``resume.mode`` is ``require`` and no certified state could be resumed.
        """
        log(INFO, "Starting ChaosStrategy(%s)", type(self.inner).__name__)
        self.summary()
        run = _Run(
            grid,
            timeout,
            ConfigRecord() if train_config is None else train_config,
            ConfigRecord() if evaluate_config is None else evaluate_config,
            evaluate_fn,
            Result(),
        )
        t_start = time.time()
        if evaluate_fn:
            res0 = evaluate_fn(0, initial_arrays)
            if res0 is not None:
                run.result.evaluate_metrics_serverapp[0] = res0
        held = self._begin(run, initial_arrays)
        verified = self.courier.proofs is not None
        first = _first_round(self.courier, held, self.round_floor, num_rounds)
        for attempt in range(first, num_rounds + 1):
            # verified rounds: a round is its base + 1, so a round that was not certified
            # (nobody trained, too few signed updates, its base's audit missing) is tried again
            rnd = _next_round(self.courier, held) if verified else attempt
            if rnd > num_rounds:
                break
            log(INFO, "")
            log(INFO, "[ROUND %s/%s] (Chaos)", rnd, num_rounds)
            held = self._round(run, rnd, held)
        if verified and held.server_round < num_rounds:
            log(
                WARNING, "Chaos: the run ends at round %d, below num_rounds=%d: some rounds "
                "were not certified and tried again (see the warnings above)",
                held.server_round, num_rounds,
            )  # fmt: skip
        log(INFO, "ChaosStrategy finished in %.2fs", time.time() - t_start)
        for line in io.StringIO(str(run.result)):
            log(INFO, "\t%s", line.strip("\n"))
        return run.result

    def _refuted(self, rnd: int, digest: bytes) -> bool:
        """Whether a rota auditor signed round ``rnd``'s state false."""
        proofs = self.courier.proofs
        if proofs is None or self.view is None:
            return False
        return proofs.verdict(rnd, digest, sorted(self.view.active())) is False

    def _rolled_back(self, run: _Run, held: _Held) -> _Held:
        """``held`` itself, or, when its rota auditor signed it false, the state it was built
        on: every node is sent the refutation (the one extra exchange of a rollback) and the
        parties roll back to it, so their receipts make them eligible again."""
        prev = self._prev
        if prev is None:
            return held
        if self._refuted(held.server_round, held.digest):
            log(
                WARNING, "Chaos: round %d was audited false; every party rolls back to round "
                "%d and the next round trains on it", held.server_round, prev.server_round,
            )  # fmt: skip
            spec = PhaseSpec("relay", prev.server_round, prev.digest, everyone=True)
            known = list(run.grid.get_node_ids())
            rlog = RoundLog(prev.server_round)
            self.courier.phase(run.grid, [], known, spec, timeout=run.timeout, log_=rlog)
            return prev
        return held

    def _begin(self, run: _Run, initial_arrays: ArrayRecord) -> _Held:
        """Resume from the parties' replicas (by ``resume.mode``), else certify the initial
        state (round 0, or above every round a party signed)."""
        grid, mode = run.grid, self.resume.mode
        known = self.resumer.wait_for_nodes(grid, min_nodes(self.inner, "train"), run.timeout)
        found = Resumed()
        if self.resume.enabled:
            pull = mode != RESUME_FRESH
            found = self.resumer.resume(grid, known, run.timeout, pull=pull)
        self.round_floor = found.round_floor
        if found.hello is not None:  # waited for and silent: not waited for before a round
            self.join_relay.silent.update(found.hello.missing)
        if found.report is not None:
            self.last_pull = found.report
        if found.state is not None and found.hello is not None:
            rnd, arrays, digest, sstate = found.state
            log(INFO, "Chaos: chaos-resume=%s: resumed at round %d (%s)", mode, rnd, found.why)
            restore_strategy_state(self.inner, sstate)
            self.courier.forward_round = rnd
            run.result.arrays = arrays
            state = certified_state(arrays, rnd, sstate)  # the joiners may take it from here
            found.hello.join_s = self.join_relay.pull(
                grid, rnd, digest, found.hello, run.timeout, state.serialized_size(), state
            )
            self._finish(found.hello)
            return _Held(rnd, arrays, digest, sstate)
        if mode == RESUME_REQUIRE:
            raise ResumeError(
                f"chaos-resume=require: no certified state could be resumed ({found.why}); "
                f"{len(known)} node(s) connected"
            )
        if found.hello is not None:
            self._finish(found.hello)
        return self._certify_initial(run, initial_arrays, known, found.why)

    def _certify_initial(
        self, run: _Run, initial_arrays: ArrayRecord, known: list[int], why: str
    ) -> _Held:
        """The initial state, numbered 0 or above every round a party already signed (a fresh
        start never reuses a round number). In a verified federation whose parties answered
        the hello and none of which signed a round, its certify rides on the first round's
        train messages (:func:`_round0_log`; nodes no train message reaches get it in a
        certify message of that exchange); otherwise it is certified in an exchange of its
        own."""
        round0 = self.round_floor + 1 if self.round_floor >= 0 else 0
        proofs = self.courier.proofs
        if proofs is not None and round0 > 0:
            log(
                WARNING, "Chaos: parties signed rounds up to %d, but a verified federation starts "
                "only at round 0 (a party that signed a round takes no new initial state): "
                "only parties that hold nothing take it up",
                self.round_floor,
            )  # fmt: skip
            round0 = 0
        log(INFO, "Chaos: chaos-resume=%s: starting from the initial state as round %d (%s)",
            self.resume.mode, round0, why)  # fmt: skip
        digest = certified_digest(initial_arrays, round0)
        self.courier.forward_round = round0
        genesis = proofs.certify_fields((-1, b""), []) if proofs is not None else ()
        fresh = self.round_floor < 0  # no party signed a round: every party takes it up
        if (
            proofs is not None
            and fresh
            and len(genesis_takers(self.courier, known)) >= min_nodes(self.inner, "train")
        ):
            # signed commitments name their base, so an update trained on a state its party
            # refused never counts: the certify may ride on the first train messages
            return _Held(round0, initial_arrays, digest, genesis=genesis)
        log0 = RoundLog(round0, digest=digest)
        spec = PhaseSpec("certify", round0, digest, arrays=initial_arrays, fields=genesis)
        _, log0.certify_s = self.courier.phase(
            run.grid, [], known, spec, timeout=run.timeout, log_=log0
        )
        log0.holders = self.courier.holder_parties(round0, digest)
        self._finish(log0)
        lost = LostCertify.after(spec, self.courier.suspects, sent_to=known)
        return _Held(round0, initial_arrays, digest, lost=lost)

    def _round(self, run: _Run, rnd: int, held: _Held) -> _Held:
        """One round: train on the eligible nodes, certify the new state, relay the joins."""
        grid, courier = run.grid, self.courier
        held = self._rolled_back(run, held)
        rlog = RoundLog(rnd)
        rlog.join_s = _newcomers_first(self.join_relay, grid, held, rlog, run.timeout)
        known = list(grid.get_node_ids())
        prev_holders = set(courier.holding(known, held.server_round, held.digest))
        trained = self._train(run, rnd, rlog, known, held)
        if held.genesis is not None:  # those that took the initial state with this exchange
            prev_holders |= set(courier.holding(known, held.server_round, held.digest))
        if held.genesis is not None:  # round 0 is logged with this exchange's receipts
            log0 = _round0_log(courier, held, rlog)
            self._finish(log0)
            held = replace(held, genesis=None) if log0.holders else held
        if trained is None:  # nothing to certify: the round is tried again
            restore_strategy_state(self.inner, held.strategy_state)
            self._finish(rlog)
            return held
        arrays, fields, chosen = trained
        sstate = strategy_state_of(self.inner)
        state = certified_state(arrays, rnd, sstate)
        digest = state.digest()
        rlog.digest = digest

        # certify + evaluate: the new state to the previous holders and trainers (joiners: below)
        receivers = _receivers(self.courier, grid, prev_holders | set(rlog.trained))
        eval_msgs: list[Message] = []
        if len(receivers) >= min_nodes(self.inner, "evaluate"):
            eval_msgs = list(
                self.inner.configure_evaluate(
                    rnd, arrays, run.evaluate_config, EligibleGrid(grid, sorted(receivers))
                )
            )
        audit = None
        if courier.proofs is not None:  # the audit rides on the rota auditors' certify messages
            active = sorted(self.view.active()) if self.view is not None else []
            courier.proofs.certified(rnd, digest, (held.server_round, held.digest), chosen, active)
            audit = courier.proofs.audit_job(active)
        spec = PhaseSpec(
            "certify", rnd, digest, arrays, frozenset(receivers), sstate, fields, audit
        )
        # every node connected now: one that came during training can join in this round
        eval_replies, rlog.certify_s = courier.phase(
            grid, eval_msgs, list(grid.get_node_ids()), spec, timeout=run.timeout, log_=rlog
        )
        courier.certified(rnd)
        rlog.holders = courier.holder_parties(rnd, digest)
        audit_again(courier, self.view, grid, run.timeout, rnd, digest)
        size = state.serialized_size()
        if self._refuted(rnd, digest):  # nobody is to pull a false aggregate
            log(WARNING, "Chaos: round %d was audited false by its auditor", rnd)
        else:
            rlog.join_s += self.join_relay.pull(grid, rnd, digest, rlog, run.timeout, size, state)
        if eval_msgs:
            agg_eval = self.inner.aggregate_evaluate(rnd, eval_replies)
            if agg_eval is not None:
                run.result.evaluate_metrics_clientapp[rnd] = agg_eval
        if run.evaluate_fn:
            res = run.evaluate_fn(rnd, arrays)
            if res is not None:
                run.result.evaluate_metrics_serverapp[rnd] = res
        self._finish(rlog)
        self._prev = held
        return _Held(rnd, arrays, digest, sstate, lost=LostCertify.after(spec, courier.suspects))

    def _train(
        self, run: _Run, rnd: int, rlog: RoundLog, known: list[int], held: _Held
    ) -> tuple[ArrayRecord, tuple[tuple[str, Any], ...], list[Chosen]] | None:
        """The train exchange on the eligible nodes: the aggregated arrays, the certify's proof
        fields and the updates used; ``None`` when there is nothing to certify."""
        need = min_nodes(self.inner, "train")
        base = (held.server_round, held.digest)
        rlog.eligible = eligible = (
            genesis_takers(self.courier, known) if held.genesis is not None
            else eligible_nodes(self.courier, run.grid, known, base, need,
                                timeout=run.timeout, rlog=rlog, lost=held.lost)
        )  # fmt: skip
        train_msgs: list[Message] = []
        late: LateJoiners | None = None
        if len(eligible) < need:
            self.courier.check_enough(known, need)
            rlog.skipped = f"train: {len(eligible)} eligible nodes < {need} required"
            log(WARNING, "Chaos: skipping training of round %d (%s)", rnd, rlog.skipped)
        else:
            train_msgs = list(
                self.inner.configure_train(
                    rnd, held.arrays, run.train_config, EligibleGrid(run.grid, eligible)
                )
            )
            late = _late_joiners(self, run, rlog, known, held, train_msgs, len(eligible))
            if self.elide_held and held.genesis is None and self.view is not None:
                # each receiver holds exactly this state (its verified receipt names it)
                train_msgs = [
                    elide_held(m, held.arrays, held.server_round, held.digest) for m in train_msgs
                ]
        rlog.trained = [m.metadata.dst_node_id for m in train_msgs]
        proofs = self.courier.proofs
        active = sorted(self.view.active()) if self.view is not None else []
        audit = proofs.audit_job(active) if proofs is not None else None
        spec = PhaseSpec("relay", held.server_round, held.digest, audit=audit)
        if held.genesis is not None:  # the initial state's certify rides on these messages
            spec = PhaseSpec(
                "certify", held.server_round, held.digest, held.arrays, fields=held.genesis
            )
        train_replies, rlog.train_s = self.courier.phase(
            run.grid, train_msgs, known, spec, timeout=run.timeout, log_=rlog, more=late
        )
        rlog.trained += late.nodes if late is not None else []
        chosen: list[Chosen] = []
        if proofs is not None and train_msgs:
            members = self.view.members() if self.view is not None else {}
            gone = {p for status, ids in members.items() if status != "active" for p in ids}
            chosen = proofs.select(rnd, base, self.relay.party_of, train_replies, gone)
            train_replies = [c.reply for c in chosen]
            why = not_certifiable(proofs, base, active, len(chosen))
            if why:
                rlog.skipped = why
                log(WARNING, "Chaos: round %d is not certified (%s); it is tried again", rnd, why)
                return None
        if not train_msgs:
            return None if proofs is not None else (held.arrays, (), [])
        agg_arrays, agg_metrics = self.inner.aggregate_train(rnd, train_replies)
        if agg_metrics is not None:
            run.result.train_metrics_clientapp[rnd] = agg_metrics
        if agg_arrays is None:
            return None if proofs is not None else (held.arrays, (), [])
        run.result.arrays = agg_arrays
        fields = proofs.certify_fields(base, chosen) if proofs is not None else ()
        return agg_arrays, fields, chosen

    def _finish(self, rlog: RoundLog) -> None:
        """Fill the round's membership fields from the server-side view and keep the log."""
        if self.view is not None:
            rlog.members = self.view.members()
            rlog.events = [e for e in self.view.events if e.server_round == rlog.server_round]
            rlog.leaves = [e.subject for e in rlog.events if e.kind == "leave"]
            rlog.failures = [e.subject for e in rlog.events if e.kind == "fail"]
        self.rounds.append(rlog)


def _next_round(courier: Courier, held: _Held) -> int:
    """A verified round's number: its base + 1, or, after a rollback, above the round the
    parties rolled back from (they never sign that number again)."""
    proofs = courier.proofs
    top = proofs.top_refuted() if proofs is not None else -1
    return max(held.server_round, top) + 1


def _first_round(courier: Courier, held: _Held, round_floor: int, num_rounds: int) -> int:
    """The run's first round number: with verified rounds a round is its base + 1 (parties
    that signed the numbers between refuse them and catch up above); unverified, above every
    round any party signed. Warns when that is above ``num_rounds`` (nothing to train)."""
    if courier.proofs is not None:
        first = _next_round(courier, held)
    else:
        first = max(held.server_round, round_floor) + 1
    if first > num_rounds:
        log(
            WARNING,
            "Chaos: no rounds left: the run starts above round %d and num_rounds=%d is the "
            "last round number (absolute, not a count); give num_rounds=%d or more to train",
            first - 1, num_rounds, first,
        )  # fmt: skip
    return first


def _newcomers_first(
    relay: JoinRelay, grid: Grid, held: _Held, rlog: RoundLog, timeout: float
) -> float:
    """Before a round's training: nodes that came between rounds are admitted and take the
    state ``held`` names, so they train in this round (:meth:`JoinRelay.newcomers_first`);
    not before round 1 of a fresh start, whose state no party holds yet. Returns the time."""
    if held.genesis is not None:
        return 0.0

    def state() -> TrainingState:  # hashes to held.digest, as the parties hold it
        return certified_state(held.arrays, held.server_round, held.strategy_state)

    return relay.newcomers_first(grid, held.server_round, held.digest, rlog, timeout, state)


def _late_joiners(
    strategy: ChaosStrategy, run: _Run, rlog: RoundLog, known: list[int], held: _Held,
    train_msgs: list[Message], eligible: int,
) -> LateJoiners | None:  # fmt: skip
    """The train exchange's hook that lets a node that comes during training train in the
    round (:mod:`.latejoin`), when :attr:`JoinSettings.during_round` allows it, the ServerApp
    holds a certified state the parties hold (not before round 1 of a fresh start) and the
    inner strategy sent every eligible node a train message (one that samples a subset, e.g.
    ``fraction_train`` below 1, keeps its sample: the newcomer is sampled from next round)."""
    if not train_msgs or strategy.view is None or held.genesis is not None:
        return None
    if len(train_msgs) < eligible:
        return None
    if not late_joins_allowed(strategy.inner, strategy.joins):
        return None

    def state() -> TrainingState:  # hashes to held.digest, as the parties hold it
        return certified_state(held.arrays, held.server_round, held.strategy_state)

    spec = PhaseSpec("relay", held.server_round, held.digest)
    return LateJoiners(
        strategy.join_relay, strategy.courier, run.grid, known,
        [m.metadata.dst_node_id for m in train_msgs],
        base=(held.server_round, held.digest, held.arrays), state_of=state,
        template=train_msgs[0], spec=spec, rlog=rlog, timeout=run.timeout,
        elide=strategy.elide_held, clock=strategy.courier.clock,
    )  # fmt: skip


def _receivers(courier: Courier, grid: Grid, candidates: set[int]) -> set[int]:
    """Who gets the new state: live, non-suspect ``candidates``; if none, every live node
    (nobody holds the previous state, e.g. every node missed the last deadline: there is no
    party to pull from)."""
    suspects = courier.suspects
    nodes_now = set(grid.get_node_ids())
    receivers = {n for n in candidates & nodes_now if n not in suspects}
    return receivers or {n for n in nodes_now if n not in suspects} or set(nodes_now)


def _round0_log(courier: Courier, held: _Held, rlog: RoundLog) -> RoundLog:
    """Round 0's log after the train exchange that carried the initial state's certify: its
    holders are the parties whose receipts in the train replies name it (once one holds it,
    it is certified like any other state and certified no more)."""
    log0 = RoundLog(held.server_round, digest=held.digest)
    log0.certify_s = rlog.train_s
    log0.unsigned_receipts = list(rlog.unsigned_receipts)
    log0.holders = courier.holder_parties(held.server_round, held.digest)
    return log0
