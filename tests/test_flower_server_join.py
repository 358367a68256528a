"""A joiner takes the certified state from the ServerApp in one message when the relay is the
only path (issue #16 item 4), checked against the holders' receipts and the round's audits;
a state that fails a check is refused with a typed error, changes nothing, and the joiner
falls back to the multi-source pull (fake Grid, signed parties, audited rounds)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message
from test_flower_lib_join import _initial
from verified_world import VerifiedWorld

from chaos_flwr.errors import ConfigError
from chaos_flwr.flower.relay import Relay
from chaos_flwr.flower.schema import JOIN_TAKE_OP, PULL_DATA_KEY, start_record, take_record
from chaos_flwr.flower.server import ChaosStrategy, JoinLog, JoinSettings, PhaseSettings, RoundLog
from chaos_flwr.flower.server.courier import Courier
from chaos_flwr.flower.server.joins import JoinRelay
from chaos_flwr.state import TrainingState

#: Every test runs Flower offline with a private FLWR_HOME (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("flower_env")

#: Founders that train from round 1; the joiner is partition FOUNDERS.
FOUNDERS = 3
#: The round during whose training the joiner's SuperNode appears.
JOIN_AT = 3
ROUNDS = 6


def _world(tmp: Path) -> VerifiedWorld:
    w = VerifiedWorld(tmp, FOUNDERS + 1)
    for p in range(FOUNDERS):
        w.add(p)
    w.hooks[JOIN_AT] = lambda: w.add(FOUNDERS) and None
    return w


def _run(w: VerifiedWorld, **kw: Any) -> tuple[ChaosStrategy, dict[int, int]]:
    """Run ROUNDS rounds; return the strategy and the exchanges each round's join used."""
    strategy = w.strategy(**kw)
    exchanges: dict[int, int] = {}
    count = {"n": 0}
    real_exchange, real_pull = strategy.courier.exchange, strategy.join_relay.pull

    def counting_exchange(*a: Any, **k: Any) -> Any:
        count["n"] += 1
        return real_exchange(*a, **k)

    def counted_pull(grid: Any, rnd: int, digest: bytes, rlog: RoundLog, *rest: Any) -> float:
        before = count["n"]
        out = real_pull(grid, rnd, digest, rlog, *rest)
        exchanges[rlog.server_round] = count["n"] - before
        return out

    strategy.courier.exchange = counting_exchange  # type: ignore[method-assign]
    strategy.join_relay.pull = counted_pull  # type: ignore[method-assign]
    strategy.start(w.grid, _initial(), num_rounds=ROUNDS, timeout=10)
    return strategy, exchanges


def _join(strategy: ChaosStrategy, party: str) -> tuple[RoundLog, JoinLog]:
    ((rlog, jl),) = [(r, j) for r in strategy.rounds for j in r.joins if j.party == party]
    return rlog, jl


def _first_trained(strategy: ChaosStrategy, node: int) -> int:
    return min(r.server_round for r in strategy.rounds if node in r.trained)


def _take_ctl(msg: Message) -> ConfigRecord | None:
    """The control record of a join message that carries the state, else ``None``."""
    ctl = msg.content.get(PULL_DATA_KEY) if msg.has_content() else None
    ok = isinstance(ctl, ConfigRecord) and ctl.get("op") == JOIN_TAKE_OP
    return ctl if ok else None  # type: ignore[return-value]


def test_a_joiner_takes_the_state_from_the_server_in_one_message_and_trains_next_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")  # it reads the joined round back later
    w = _world(tmp_path)
    held: list[tuple[int, bytes]] = []

    def after(msg: Message, reply: Message) -> None:
        if _take_ctl(msg) is not None:
            held.append((w.party(FOUNDERS).held_round, w.party(FOUNDERS).held_digest))

    w.grid.after.append(after)
    strategy, exchanges = _run(w)
    jp, node = w.pid(FOUNDERS), w.nodes[FOUNDERS].node_id
    rlog, jl = _join(strategy, jp)
    # one message from the ServerApp: no donor was asked for a byte
    assert jl.ok and jl.error == "" and jl.source == "server" and jl.server_refused == ""
    assert jl.steps == 1 and jl.donors == [] and jl.bytes_per_donor == {}
    assert jl.digest == rlog.digest and jl.server_round == rlog.server_round == JOIN_AT
    # it was asked while round JOIN_AT trained (its reply carried its join request, which
    # reached its sponsors with the round's certify messages): one exchange, the state to it
    assert exchanges[rlog.server_round] == 1
    # rounds without a joiner add no exchange for joins (churn-free rounds unchanged)
    assert all(n == 0 for r, n in exchanges.items() if r != rlog.server_round)
    party = w.party(FOUNDERS)
    assert held == [(rlog.server_round, rlog.digest)]  # held right after that one message
    stored = party.store.get(rlog.server_round)  # type: ignore[union-attr]
    assert stored.digest() == rlog.digest and jl.total_bytes == len(stored.to_bytes())
    assert party.joins_done[-1]["source"] == "server"
    # its signed receipt came back with the reply: it trains in the very next round
    assert jp in strategy.rounds[-1].holders
    # a plain FedAvg joiner whose SuperNode comes during round JOIN_AT's training is first
    # sampled in round JOIN_AT + 1: so is this one
    assert _first_trained(strategy, node) == rlog.server_round + 1 == JOIN_AT + 1
    assert all(node in r.trained for r in strategy.rounds if r.server_round > rlog.server_round)
    assert not [e for e in party.errors if "refused" in e]


def test_the_pull_setting_keeps_the_multi_source_pull(tmp_path: Path) -> None:
    w = _world(tmp_path)
    strategy, exchanges = _run(w, joins=JoinSettings(source="peers"))
    rlog, jl = _join(strategy, w.pid(FOUNDERS))
    assert jl.ok and jl.source == "pull" and len(jl.bytes_per_donor) >= 2
    assert exchanges[rlog.server_round] == 1 + 2 * jl.steps - 1 > 2  # admission, relay steps
    assert _first_trained(strategy, w.nodes[FOUNDERS].node_id) == rlog.server_round + 1


def _refused_then_pulled(
    tmp_path: Path, tamper: Callable[[ConfigRecord], ConfigRecord]
) -> tuple[VerifiedWorld, ChaosStrategy, RoundLog, JoinLog, list[tuple[int, bytes, list[int]]]]:
    """Run with a relay that hands the joiner ``tamper(take record)``; note what the joiner
    held right after it answered that message (round, digest, replica rounds)."""
    w = _world(tmp_path)
    seen: list[tuple[int, bytes, list[int]]] = []

    def before(msg: Message) -> None:
        ctl = _take_ctl(msg)
        if ctl is not None:
            msg.content[PULL_DATA_KEY] = tamper(ctl)

    def after(msg: Message, reply: Message) -> None:
        if _take_ctl(msg) is not None:
            p = w.party(FOUNDERS)
            seen.append((p.held_round, p.held_digest, p.store.rounds()))  # type: ignore[union-attr]

    w.grid.before.append(before)
    w.grid.after.append(after)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")  # the joined round is read back later
    try:
        strategy, _ = _run(w)
    finally:
        monkeypatch.undo()
    rlog, jl = _join(strategy, w.pid(FOUNDERS))
    return w, strategy, rlog, jl, seen


def _assert_fell_back(
    w: VerifiedWorld, strategy: ChaosStrategy, rlog: RoundLog, jl: JoinLog, seen: list[Any]
) -> None:
    assert seen == [(-1, b"", [])]  # the refused state changed nothing it holds
    # the joiner then pulled the certified state from the holders, in the same join
    assert jl.ok and jl.source == "pull" and len(jl.bytes_per_donor) >= 2
    assert jl.digest == rlog.digest
    assert w.party(FOUNDERS).store.get(rlog.server_round).digest() == rlog.digest  # type: ignore[union-attr]
    assert _first_trained(strategy, w.nodes[FOUNDERS].node_id) == rlog.server_round + 1


def test_a_state_that_does_not_match_the_receipts_is_refused_and_the_joiner_pulls(
    tmp_path: Path,
) -> None:
    def other_state(ctl: ConfigRecord) -> ConfigRecord:
        data = ctl["state"]
        assert isinstance(data, bytes)
        real = TrainingState.from_bytes(data, copy=True)
        fake = {k: a + 1 for k, a in real.arrays.items()}  # the same round, other arrays
        forged = TrainingState(arrays=fake, round=real.round, strategy_state=real.strategy_state)
        return take_record(ctl, forged.to_bytes())

    w, strategy, rlog, jl, seen = _refused_then_pulled(tmp_path, other_state)
    assert jl.server_refused.startswith("ShardIntegrityError: the state the ServerApp sent")
    assert any(e.startswith("join take of round") and "ShardIntegrityError" in e
               for e in w.party(FOUNDERS).errors)  # fmt: skip
    _assert_fell_back(w, strategy, rlog, jl, seen)


def test_a_non_final_state_is_refused_and_the_joiner_pulls(tmp_path: Path) -> None:
    def without_audits(ctl: ConfigRecord) -> ConfigRecord:
        return ConfigRecord({k: v for k, v in ctl.items() if k != "audits"})

    w, strategy, rlog, jl, seen = _refused_then_pulled(tmp_path, without_audits)
    assert jl.server_refused.startswith(f"ProofError: round {rlog.server_round} is not final")
    _assert_fell_back(w, strategy, rlog, jl, seen)


def test_take_state_refuses_bad_records_with_typed_errors(tmp_path: Path) -> None:
    w = VerifiedWorld(tmp_path, 3)
    for p in range(3):
        w.add(p)
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=2, timeout=10)
    last = strategy.rounds[-1]
    donors = [w.pid(p) for p in (1, 2)]
    receipts = [w.party(p)._receipt() for p in (1, 2)]
    start = start_record(donors, receipts)
    start["audits"] = strategy.courier.proofs.audits_of(2, last.digest)  # type: ignore[union-attr]
    state = w.party(1).held_state
    assert state is not None
    joiner = w.party(0)
    joiner.held_round, joiner.held_digest = 1, joiner.store.get(1).digest()  # type: ignore[union-attr]
    record = ConfigRecord({"round": 2, "digest": last.digest})
    cases = {
        "DecodeError": ConfigRecord({**dict(start.items()), "op": JOIN_TAKE_OP}),  # no state
        "ShardIntegrityError": take_record(start, state.to_bytes()[:-1]),  # truncated
    }
    for name, ctl in cases.items():
        reply, asks = joiner.join_step(record, ctl, {})
        assert reply["status"] == "failed" and str(reply["error"]).startswith(name)
        assert asks == {} and (joiner.held_round, joiner.held_digest)[0] == 1
    # receipts that name another digest: refused before the bytes are even hashed
    forged = take_record(start_record(donors, [b"x" * 64, b"y" * 64]), state.to_bytes())
    reply, _ = joiner.join_step(record, forged, {})
    assert reply["status"] == "failed" and reply["error"] == "no donor receipt verifies"
    assert joiner.held_round == 1
    # the real one is taken up under the digest it was checked against
    reply, _ = joiner.join_step(record, take_record(start, state.to_bytes()), {})
    assert reply["status"] == "done" and reply["source"] == "server"
    assert (joiner.held_round, joiner.held_digest) == (2, last.digest)


def test_join_source_is_validated_and_auto_pulls_when_a_donor_serves_direct_links() -> None:
    with pytest.raises(ConfigError, match=r"JoinSettings\.source must be one of auto, server"):
        JoinSettings(source="fastest")
    assert JoinSettings().source == "auto"
    courier = Courier(Relay(), PhaseSettings())
    courier.holders = {1: ("a", 2, b"d"), 2: ("b", 2, b"d")}
    paths = {}
    for source in ("auto", "server", "peers"):
        relay = JoinRelay(courier, JoinSettings(source=source))
        before = relay.server_path([1, 2])
        relay.direct_parties.add("b")  # b named a direct address in a pull it served
        paths[source] = (before, relay.server_path([1, 2]), relay.server_path([1]))
    assert paths == {
        "auto": (True, False, True),  # relay only: the server's copy; a direct donor: pull
        "server": (True, True, True),
        "peers": (False, False, False),
    }


def test_a_late_newcomer_is_admitted_and_takes_the_state_in_the_round_it_first_answers(
    tmp_path: Path,
) -> None:
    import time

    # the joiner's node is there from the start but fails every message (as a node that is
    # not there yet: the churn emulation), so it is a suspect; from round JOIN_AT on it
    # answers, a little later than the trainers: the train exchange does not wait for it
    w = VerifiedWorld(tmp_path, FOUNDERS + 1)
    w.grid._clock = time.monotonic  # type: ignore[attr-defined]  # real time: delays count
    for p in range(FOUNDERS + 1):
        w.add(p).delay_s = 0.2  # every reply takes 0.2 s ...
    late = w.nodes[FOUNDERS]
    late.mode = "error"

    def comes() -> None:
        late.mode, late.delay_s = "ok", 0.3  # ... the newcomer's a little longer

    w.hooks[JOIN_AT] = comes
    strategy, exchanges = _run(w)
    rlog, jl = _join(strategy, w.pid(FOUNDERS))
    # its request reached the relay after this round's certify messages had gone out; the
    # members' envelopes were carried at once (one exchange), a sponsor countersigned, and it
    # took the state in the same round's join
    assert rlog.server_round == JOIN_AT and jl.ok and jl.source == "server"
    assert [e.kind for e in rlog.events if e.subject == w.pid(FOUNDERS)] == ["join"]
    assert exchanges[JOIN_AT] == 2  # the envelopes' exchange, then the state's
    assert all(n == 0 for r, n in exchanges.items() if r != JOIN_AT)
    assert _first_trained(strategy, late.node_id) == JOIN_AT + 1


@pytest.mark.parametrize("how", ["connects", "answers"])
def test_a_node_there_when_a_round_starts_is_admitted_first_and_trains_in_that_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    w = VerifiedWorld(tmp_path, FOUNDERS + 1)
    for p in range(FOUNDERS):
        w.add(p)
    if how == "answers":  # there from the start, failing every message (the churn emulation)
        w.add(FOUNDERS).mode = "error"
    strategy = w.strategy()
    real_round, probes = strategy._round, strategy.join_relay.newcomers_first
    spent: dict[int, float] = {}

    def round_(run: Any, rnd: int, held: Any) -> Any:
        if rnd == JOIN_AT:  # between rounds JOIN_AT - 1 and JOIN_AT: its SuperNode is there
            if how == "connects":
                w.add(FOUNDERS)
            else:
                w.nodes[FOUNDERS].mode = "ok"
        return real_round(run, rnd, held)

    def newcomers_first(grid: Any, rnd: int, *rest: Any) -> float:
        sent = w.grid.pushed
        out = probes(grid, rnd, *rest)
        spent[rnd + 1] = w.grid.pushed - sent  # messages sent before round rnd + 1 trains
        return out

    strategy._round = round_  # type: ignore[method-assign]
    strategy.join_relay.newcomers_first = newcomers_first  # type: ignore[method-assign]
    strategy.start(w.grid, _initial(), num_rounds=JOIN_AT + 1, timeout=10)
    jp, node = w.pid(FOUNDERS), w.nodes[FOUNDERS].node_id
    rlog, jl = _join(strategy, jp)
    base = next(r for r in strategy.rounds if r.server_round == JOIN_AT - 1 and r.digest)
    # before round JOIN_AT trained: asked, admitted (a sponsor countersigned), and given the
    # state that round trains on, by the ServerApp in one message, checked by its receipts
    assert rlog.server_round == JOIN_AT and jl.ok and jl.source == "server" and jl.steps == 1
    assert jl.server_round == JOIN_AT - 1 and jl.digest == base.digest
    assert [e.kind for e in rlog.events if e.subject == jp] == ["join"]
    # so it trains in round JOIN_AT, as a plain FedAvg node there at that round's start
    assert _first_trained(strategy, node) == JOIN_AT
    assert node in rlog.eligible and node in strategy.rounds[-1].trained
    assert w.party(FOUNDERS).held_digest == strategy.rounds[-1].digest
    # the query, the sponsors' exchange and the state: only in that round; a round with no
    # unknown node sends nothing before its training (a failing one: one query each round)
    assert spent[JOIN_AT] >= 3
    quiet = 1 if how == "answers" else 0
    assert all(n == quiet for r, n in spent.items() if 1 < r < JOIN_AT), spent
    assert spent[JOIN_AT + 1] == 0


@pytest.mark.parametrize("since", [0, 2])
def test_an_unknown_node_that_never_answers_is_waited_for_before_one_round_at_most(
    tmp_path: Path, since: int
) -> None:
    w = VerifiedWorld(tmp_path, FOUNDERS + 1)
    for p in range(FOUNDERS):
        w.add(p)
    strategy = w.strategy()
    real_round, probes = strategy._round, strategy.join_relay.newcomers_first
    spent: dict[int, int] = {}

    def connect_dead() -> None:  # connected as far as the Grid knows, never answers
        w.add(FOUNDERS).mode = "dead"

    def round_(run: Any, rnd: int, held: Any) -> Any:
        if rnd == since:
            connect_dead()
        return real_round(run, rnd, held)

    def newcomers_first(grid: Any, rnd: int, *rest: Any) -> float:
        sent = w.grid.pushed
        out = probes(grid, rnd, *rest)
        spent[rnd + 1] = w.grid.pushed - sent
        return out

    if since == 0:
        connect_dead()
    strategy._round = round_  # type: ignore[method-assign]
    strategy.join_relay.newcomers_first = newcomers_first  # type: ignore[method-assign]
    strategy.start(w.grid, _initial(), num_rounds=4, timeout=10)
    dead = w.nodes[FOUNDERS].node_id
    # there from the start: it missed the hello and round 1's query, so no round waits for
    # it; connected between rounds 1 and 2: asked (and waited for) before round 2 only
    assert spent == ({2: 0, 3: 0, 4: 0} if since == 0 else {2: 1, 3: 0, 4: 0})
    assert strategy.join_relay.silent == {dead}
    trained = {r.server_round: r.trained for r in strategy.rounds if r.server_round >= 1}
    assert all(len(t) == FOUNDERS and dead not in t for t in trained.values()), trained


def test_an_unknown_node_slow_to_err_is_not_waited_for_before_a_round_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # in a deployment an error reply costs a poll and a ClientApp start: a node that keeps
    # failing (not a settings error) is asked once, then only with the rounds' own messages
    from chaos_flwr.flower.server import joins

    monkeypatch.setattr(joins, "FLOWER_NEWCOMER_RETRY_S", -1.0)  # every error counts as slow
    w = VerifiedWorld(tmp_path, FOUNDERS + 1)
    for p in range(FOUNDERS):
        w.add(p)
    failing = w.add(FOUNDERS)
    failing.mode = "error"
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=4, timeout=10)
    assert strategy.join_relay.silent == {failing.node_id}
    # it was still asked with every round's messages (it could come back that way)
    assert failing.received.count("query.chaos") >= 4


def test_a_newcomer_that_already_holds_the_base_is_not_logged_as_a_join() -> None:
    # a member's SuperNode that restarted with its disk answers the question that carries the
    # join's start with "already held": it took nothing, so no join is filed for it
    from types import SimpleNamespace

    from flwr.app import RecordDict

    from chaos_flwr.flower.server.courier import PhaseSpec

    digest = b"d" * 32
    relay = SimpleNamespace(party_of={}, give_back=lambda _n, _e: None)

    def exchange(_grid: Any, _msgs: Any, _taken: Any, **_k: Any) -> Any:
        relay.party_of.update({7: "pb", 8: "pc"})  # the replies' Chaos records name them
        done = {"status": "done", "total": 10, "recv-donors": ["pa"], "recv-bytes": [10]}
        replies = {
            7: ConfigRecord({"status": "done", "error": "already held"}),
            8: ConfigRecord(done),  # type: ignore[arg-type]
        }
        out = {
            n: SimpleNamespace(content=RecordDict({PULL_DATA_KEY: r})) for n, r in replies.items()
        }
        return SimpleNamespace(replies=out)

    courier = SimpleNamespace(
        suspects=set(), relay=relay, holders={1: ("pa", 3, digest)}, receipts={1: b"r"},
        view=None, proofs=None, exchange=exchange,
        message=lambda node, spec, content=None, **_k: (SimpleNamespace(node=node), []),
    )  # fmt: skip
    joins = JoinRelay(courier, JoinSettings())  # type: ignore[arg-type]
    done = joins.ask_pulling(
        SimpleNamespace(), [7, 8], [1], PhaseSpec("join", 3, digest), 5.0, RoundLog(4), total=10
    )  # type: ignore[arg-type]
    assert [(jl.node, jl.party, jl.total_bytes) for jl in done] == [(8, "pc", 10)]


@pytest.mark.parametrize("direct", [False, True])
def test_a_joiners_step_is_waited_for_its_direct_link_bound_when_a_donor_serves_links(
    direct: bool,
) -> None:
    # the joiner's history says 1 s: a 40 s step is past its 15 s deadline. When a donor is
    # known to serve direct links the joiner may fetch a 64 MiB state over them in the step,
    # bounded by direct_budget_s: the ServerApp waits that much longer, and its message lives
    # that much longer
    from fake_grid import FakeGrid
    from flwr.app import RecordDict
    from test_flower_strategy import VClock

    from chaos_flwr.defaults import FLOWER_CHAOS_TTL_PHASES
    from chaos_flwr.flower.fetch import direct_step_wait_s

    clock = VClock()
    grid = FakeGrid(clock=clock)
    ttls: list[float] = []

    def joiner(msg: Message, _ctx: Any) -> Message:
        reply = ConfigRecord({"status": "failed", "error": "the links broke"})
        return Message(RecordDict({PULL_DATA_KEY: reply}), reply_to=msg)

    push = grid.push_messages

    def pushed(msgs: Any) -> Any:  # the lifetime as sent (the handler sees a copy)
        msgs = list(msgs)
        ttls.extend(m.metadata.ttl for m in msgs)
        return push(msgs)

    grid.push_messages = pushed  # type: ignore[method-assign]
    donor_node = grid.add_node(joiner).node_id
    node = grid.add_node(joiner).node_id
    courier = Courier(Relay(), PhaseSettings(), clock=clock, sleep=clock.sleep)
    courier.holders = {donor_node: ("a", 2, b"d")}
    courier.relay.bind("b", node)
    courier.times.observe("join:query.chaos", node, 1.0)
    relay = JoinRelay(courier, JoinSettings(source="peers"), clock=clock)
    if direct:
        relay.direct_parties.add("a")  # a named a direct address in a pull it served
    grid.node(node).delay_s = 40.0
    rlog = RoundLog(3)
    relay.pull(grid, 2, b"d", rlog, timeout=3600, total=64 << 20)
    (jl,) = rlog.joins
    assert jl.party == "b" and not jl.ok
    extra = direct_step_wait_s(64 << 20) if direct else 0.0
    assert ttls == [pytest.approx((15.0 + extra) * FLOWER_CHAOS_TTL_PHASES)]
    if direct:
        assert jl.error == "the links broke" and node not in courier.suspects
    else:
        assert jl.error == "the joiner did not answer" and node in courier.suspects
