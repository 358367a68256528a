"""The relay carrier: routing, record parsing, deadline-bounded exchanges, peers end to end."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fake_grid import FakeGrid
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from chaos_flwr.errors import ConfigError, DecodeError
from chaos_flwr.flower.client import Party, enable, party_settings
from chaos_flwr.flower.relay import BROADCAST, ExchangeResult, Relay, exchange
from chaos_flwr.flower.schema import (
    CHAOS_MESSAGE_TYPE,
    CHAOS_RECORD_KEY,
    read_party_record,
    server_record,
    split_chaos,
    with_chaos,
)


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


class VClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps = 0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps += 1
        self.t += max(s, 1e-3)


@dataclass(frozen=True)
class Out:
    to: str
    data: bytes


@dataclass
class EchoPeer:
    """Sends each envelope it gets back to its sender (sender id = bytes before ':')."""

    party_id: str
    got: list[bytes] = field(default_factory=list)
    to_send: list[Out] = field(default_factory=list)

    def handle(self, data: bytes, now: float) -> list[Out]:
        self.got.append(data)
        sender, _, body = data.partition(b":")
        if body.startswith(b"ping"):
            return [Out(sender.decode(), self.party_id.encode() + b":pong")]
        return []

    def tick(self, now: float) -> list[Out]:
        out, self.to_send = self.to_send, []
        return out


# -- the router -----------------------------------------------------------------------------
def test_relay_routes_by_party_and_keeps_order_and_bounds() -> None:
    r = Relay(max_queue=3, max_per_message=2)
    r.bind("a", 1)
    r.bind("b", 2)
    for i in range(4):
        r.enqueue("b", bytes([i]))
    assert r.dropped == 1  # the oldest went
    assert r.take(2) == [b"\x01", b"\x02"]
    r.give_back(2, [b"\x02"])
    assert r.take(2) == [b"\x02", b"\x03"]
    assert r.take(2) == []
    r.enqueue(BROADCAST, b"all", sender="a")
    assert r.take(1) == [] and r.take(2) == [b"all"]
    # a party that moves to another node takes its id with it
    r.bind("b", 7)
    assert r.node_of["b"] == 7 and 2 not in r.party_of


def test_envelopes_for_unbound_party_wait_until_it_shows_up() -> None:
    r = Relay()
    r.enqueue("c", b"early")
    assert r.pending("c") == 1
    r.bind("c", 9)
    assert r.take(9) == [b"early"]


@pytest.mark.parametrize(
    ("record", "field_name"),
    [
        ({"party": 3}, "party"),
        ({"party": "a", "to": ["b"], "env": []}, "'to'"),
        ({"party": "a", "to": [1], "env": [b"x"]}, "to"),
        ({"party": "a", "receipt-round": "1"}, "receipt-round"),
        ({"party": "a", "receipt-digest": "x"}, "receipt-digest"),
        ({"party": "a", "held-bytes": True}, "held-bytes"),
        ({"party": "a", "held-bytes": "10"}, "held-bytes"),
        ({"party": "a", "held-bytes": -2}, "held-bytes"),
        ({"party": "a", "held-bytes": 1 << 40}, "held-bytes"),
    ],
)
def test_malformed_party_records_are_refused_naming_the_field(
    record: dict[str, object], field_name: str
) -> None:
    with pytest.raises(DecodeError, match=field_name):
        read_party_record(ConfigRecord(record))  # type: ignore[arg-type]


def test_with_chaos_copies_and_split_chaos_restores_the_content() -> None:
    FakeGrid()  # sets Flower's task identity
    shared = RecordDict({"config": ConfigRecord({"lr": 0.1})})
    m1 = Message(shared, dst_node_id=1, message_type="train")
    m2 = with_chaos(m1, server_record([b"e"], phase="relay", server_round=1))
    assert CHAOS_RECORD_KEY not in shared  # the shared RecordDict is untouched
    rec = split_chaos(m2)
    assert rec is not None and rec["env"] == [b"e"]
    assert list(m2.content.keys()) == ["config"]
    assert m2.metadata.message_type == "train" and m2.metadata.dst_node_id == 1


# -- deadline-bounded exchanges ---------------------------------------------------------------
def _query_app() -> ClientApp:
    app = ClientApp()

    @app.query("chaos")
    def q(msg: Message, ctx: Context) -> Message:
        return Message(RecordDict({"ok": ConfigRecord({"n": ctx.node_id})}), reply_to=msg)

    return app


def test_dead_and_failing_nodes_never_hold_an_exchange_past_its_deadline() -> None:
    clock = VClock()
    grid = FakeGrid(clock=clock)
    app = _query_app()
    alive, dead, failing, slow = (grid.add_node(app) for _ in range(4))
    dead.mode = "dead"
    failing.mode = "error"
    slow.delay_s = 0.5
    msgs = [
        Message(RecordDict(), dst_node_id=n.node_id, message_type=CHAOS_MESSAGE_TYPE)
        for n in (alive, dead, failing, slow)
    ]
    res = exchange(grid, msgs, timeout_s=2.0, poll_interval_s=0.1, clock=clock, sleep=clock.sleep)
    assert set(res.replies) == {alive.node_id, slow.node_id}
    assert res.errors == {failing.node_id: ErrorCode.NODE_UNAVAILABLE}
    assert res.missing == {dead.node_id}
    assert 2.0 <= res.elapsed_s < 2.2


def test_exchange_returns_as_soon_as_the_awaited_nodes_answered() -> None:
    clock = VClock()
    grid = FakeGrid(clock=clock)
    app = _query_app()
    alive, dead = grid.add_node(app), grid.add_node(app)
    dead.mode = "dead"
    msgs = [
        Message(RecordDict(), dst_node_id=n.node_id, message_type=CHAOS_MESSAGE_TYPE)
        for n in (alive, dead)
    ]
    res = exchange(
        grid, msgs, timeout_s=30.0, wait_for={alive.node_id}, clock=clock, sleep=clock.sleep
    )
    assert set(res.replies) == {alive.node_id} and res.missing == {dead.node_id}
    assert res.elapsed_s < 0.1


def _stalled(
    delays: list[float | str | None], stall_s: float | None, ttl: float | None = None
) -> tuple[ExchangeResult, list[int]]:
    """One exchange (deadline 1 s) with nodes answering after ``delays`` (None: dead;
    "error": an error reply at once), its messages living ``ttl``."""
    clock = VClock()
    grid = FakeGrid(clock=clock)
    app = _query_app()
    nodes = [grid.add_node(app) for _ in delays]
    for node, delay in zip(nodes, delays, strict=True):
        if isinstance(delay, float):
            node.delay_s = delay
        else:
            node.mode = "dead" if delay is None else "error"
    msgs = [
        Message(RecordDict(), dst_node_id=n.node_id, message_type=CHAOS_MESSAGE_TYPE, ttl=ttl)
        for n in nodes
    ]
    res = exchange(
        grid, msgs, timeout_s=1.0, poll_interval_s=0.1, clock=clock, sleep=clock.sleep,
        stall_s=stall_s,
    )  # fmt: skip
    return res, [n.node_id for n in nodes]


def test_a_stalled_exchange_waits_on_for_the_first_answer_then_a_grace() -> None:
    # every node past the deadline: the first answer at 4 s, the second within the grace
    res, (a, b) = _stalled([4.0, 4.3], stall_s=10.0)
    assert set(res.replies) == {a, b} and res.missing == set()
    assert 4.3 <= res.elapsed_s < 4.5
    # the second one after the grace (half the 1 s deadline past the first answer) is missing
    res, (a, b) = _stalled([4.0, 6.0], stall_s=10.0)
    assert set(res.replies) == {a} and res.missing == {b}
    assert 4.5 <= res.elapsed_s < 4.7
    # nobody answers at all: it ends at the stall bound
    res, (a, b) = _stalled([None, 20.0], stall_s=10.0)
    assert res.missing == {a, b} and 10.0 <= res.elapsed_s < 10.2
    # an error reply (a crashed node's) is no answer of the others: they are still waited on
    res, (a, b, c) = _stalled(["error", 4.0, 4.2], stall_s=10.0)
    assert set(res.replies) == {b, c} and set(res.errors) == {a} and res.missing == set()
    # never past the messages' time to live (an expired message gets an error, not a reply)
    res, (a, b) = _stalled([None, 20.0], stall_s=10.0, ttl=3.0)
    assert res.missing == {a, b} and 2.7 <= res.elapsed_s < 2.9


def test_an_exchange_with_an_answer_by_its_deadline_or_no_stall_bound_ends_at_it() -> None:
    # one node answered in time: the others are late, not a stall
    res, (a, b) = _stalled([0.2, 4.0], stall_s=10.0)
    assert set(res.replies) == {a} and res.missing == {b}
    assert 1.0 <= res.elapsed_s < 1.2
    # a single waited node's silence may be its crash: not a stall, the deadline holds
    res, (a,) = _stalled([4.0], stall_s=10.0)
    assert res.missing == {a} and 1.0 <= res.elapsed_s < 1.2
    res, (a, b) = _stalled([None, 0.2], stall_s=10.0)  # one of two answered: no stall either
    assert res.missing == {a} and 1.0 <= res.elapsed_s < 1.2
    # without stall_s the deadline is final, as before
    res, (a, b) = _stalled([4.0, 4.3], stall_s=None)
    assert res.missing == {a, b} and 1.0 <= res.elapsed_s < 1.2


def test_messages_added_while_an_exchange_waits_are_waited_for_past_its_deadline() -> None:
    clock = VClock()
    grid = FakeGrid(clock=clock)
    app = _query_app()
    first, late = grid.add_node(app), grid.add_node(app)
    first.delay_s, late.delay_s = 0.5, 2.5  # the added node answers after the first deadline
    calls: list[tuple[float, bool]] = []

    def more(ending: bool) -> tuple[list[Message], float]:
        calls.append((clock(), ending))
        if len(calls) == 3:  # while waiting: add one message, to be waited for 5 s from now
            msg = Message(RecordDict(), dst_node_id=late.node_id, message_type=CHAOS_MESSAGE_TYPE)
            return [msg], 5.0
        return [], 0.0

    msg = Message(RecordDict(), dst_node_id=first.node_id, message_type=CHAOS_MESSAGE_TYPE)
    start = clock()
    res = exchange(
        grid, [msg], timeout_s=1.0, poll_interval_s=0.1, clock=clock, sleep=clock.sleep, more=more
    )
    assert set(res.replies) == {first.node_id, late.node_id} and res.missing == set()
    assert len(res.message_ids) == 2 and set(res.by_message) == set(res.message_ids)
    added_at = calls[2][0]
    assert 2.5 <= start + res.elapsed_s - added_at < 2.7  # past the 1 s deadline, until its reply
    # called after every pull, told when the exchange would end; and once more after adding
    assert calls[-1][1] and not any(ending for _, ending in calls[:2])
    # nothing added: the exchange ends at its deadline, as without the hook
    nobody = exchange(
        grid, [Message(RecordDict(), dst_node_id=late.node_id, message_type=CHAOS_MESSAGE_TYPE)],
        timeout_s=1.0, poll_interval_s=0.1, clock=clock, sleep=clock.sleep,
        more=lambda ending: ([], 0.0),
    )  # fmt: skip
    assert nobody.missing == {late.node_id} and 1.0 <= nobody.elapsed_s < 1.2


def test_an_added_message_neither_ends_a_stall_nor_is_cut_by_its_grace() -> None:
    clock = VClock()
    grid = FakeGrid(clock=clock)
    app = _query_app()
    a, b, joiner = grid.add_node(app), grid.add_node(app), grid.add_node(app)
    a.delay_s, b.delay_s = 4.0, 4.2  # both past the 1 s deadline: a stall (bound 10 s)
    joiner.delay_s = 0.2  # its added message is answered at once...
    sent: list[float] = []

    def more(ending: bool) -> tuple[list[Message], float]:
        if sent:
            return [], 0.0
        sent.append(clock())
        msg = Message(RecordDict(), dst_node_id=joiner.node_id, message_type=CHAOS_MESSAGE_TYPE)
        return [msg], 0.5

    msgs = [Message(RecordDict(), dst_node_id=n.node_id, message_type=CHAOS_MESSAGE_TYPE)
            for n in (a, b)]  # fmt: skip
    res = exchange(grid, msgs, timeout_s=1.0, poll_interval_s=0.1, clock=clock,
                   sleep=clock.sleep, stall_s=10.0, more=more)  # fmt: skip
    # ...and that does not end the trainers' stall: both are waited for and answer
    assert set(res.replies) == {a.node_id, b.node_id, joiner.node_id} and res.missing == set()
    # an added message waited for longer than the grace after the stall's first answer
    clock2 = VClock()
    grid2 = FakeGrid(clock=clock2)
    a2, b2, late = grid2.add_node(app), grid2.add_node(app), grid2.add_node(app)
    a2.delay_s, b2.delay_s, late.delay_s = 4.0, 4.1, 6.0

    def more2(ending: bool) -> tuple[list[Message], float]:
        if clock2() < 2.0 or len(grid2_added) == 1:
            return [], 0.0
        grid2_added.append(1)
        msg = Message(RecordDict(), dst_node_id=late.node_id, message_type=CHAOS_MESSAGE_TYPE)
        return [msg], 20.0

    grid2_added: list[int] = []
    msgs2 = [Message(RecordDict(), dst_node_id=n.node_id, message_type=CHAOS_MESSAGE_TYPE)
             for n in (a2, b2)]  # fmt: skip
    res2 = exchange(grid2, msgs2, timeout_s=1.0, poll_interval_s=0.1, clock=clock2,
                    sleep=clock2.sleep, stall_s=10.0, more=more2)  # fmt: skip
    assert set(res2.replies) == {a2.node_id, b2.node_id, late.node_id} and res2.missing == set()
    assert res2.elapsed_s > 8.0  # the added node answered 6 s after its push, past the grace


def test_a_reply_that_misses_its_deadline_is_collected_by_a_later_exchange() -> None:
    clock = VClock()
    grid = FakeGrid(clock=clock)
    app = _query_app()
    fast, slow = grid.add_node(app), grid.add_node(app)
    slow.delay_s = 3.0

    def msg(node: int) -> Message:
        return Message(RecordDict(), dst_node_id=node, message_type=CHAOS_MESSAGE_TYPE)

    first = exchange(
        grid, [msg(fast.node_id), msg(slow.node_id)], timeout_s=1.0, clock=clock,
        sleep=clock.sleep,
    )  # fmt: skip
    assert first.missing == {slow.node_id} and set(first.missing_ids.values()) == {slow.node_id}
    late_id = next(iter(first.missing_ids))
    second = exchange(
        grid, [msg(fast.node_id)], timeout_s=5.0, clock=clock, sleep=clock.sleep,
        late=first.missing_ids,
    )  # fmt: skip
    assert set(second.replies) == {fast.node_id}  # it did not wait for the late one ...
    assert second.late == {}
    third = exchange(
        grid, [msg(fast.node_id)], timeout_s=5.0, wait_for=set(), clock=clock,
        sleep=clock.sleep, late=first.missing_ids,
    )  # fmt: skip
    clock.t += 3.0  # the slow node's reply is ready now
    fourth = exchange(
        grid, [msg(fast.node_id)], timeout_s=5.0, clock=clock, sleep=clock.sleep,
        late=first.missing_ids,
    )  # fmt: skip
    assert third.late == {} and set(fourth.late) == {slow.node_id}
    assert fourth.late[slow.node_id].metadata.reply_to_message_id == late_id


# -- peers talking through the relay ----------------------------------------------------------
def test_envelopes_travel_between_peers_through_the_relay() -> None:
    grid = FakeGrid()
    peers: dict[int, EchoPeer] = {}

    def factory(ctx: Context) -> Party:
        peer = EchoPeer(f"party{ctx.node_id}")
        peers[ctx.node_id] = peer
        return Party(party_id=peer.party_id, peer=peer)

    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        return Message(RecordDict(), reply_to=msg)

    enable(app, party_factory=factory)
    a, b = grid.add_node(app), grid.add_node(app)
    relay = Relay()

    def round_trip() -> None:
        msgs = [
            Message(
                RecordDict(
                    {CHAOS_RECORD_KEY: server_record(relay.take(n), phase="relay", server_round=0)}
                ),
                dst_node_id=n,
                message_type=CHAOS_MESSAGE_TYPE,
            )
            for n in (a.node_id, b.node_id)
        ]
        res = exchange(grid, msgs, timeout_s=1.0)
        for node, reply in res.replies.items():
            rec = split_chaos(reply)
            assert rec is not None
            relay.absorb(node, rec)

    round_trip()  # hello: parties tell the relay who they are
    assert relay.node_of == {f"party{a.node_id}": a.node_id, f"party{b.node_id}": b.node_id}
    pa, pb = peers[a.node_id], peers[b.node_id]
    pa.to_send.append(Out(pb.party_id, pa.party_id.encode() + b":ping"))
    round_trip()  # a's ping leaves a
    assert pb.got == []
    round_trip()  # delivered to b, b answers
    assert pb.got == [pa.party_id.encode() + b":ping"]
    round_trip()  # b's pong delivered to a
    assert pa.got == [pb.party_id.encode() + b":pong"]


def test_enable_leaves_train_replies_as_the_app_made_them() -> None:
    grid = FakeGrid()
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        seen = sorted(msg.content.keys())
        return Message(RecordDict({"seen": ConfigRecord({"keys": seen})}), reply_to=msg)

    enable(app, party_factory=lambda ctx: Party(party_id="p"))
    node = grid.add_node(app)
    base = Message(
        RecordDict({"config": ConfigRecord({"x": 1})}),
        dst_node_id=node.node_id,
        message_type="train",
    )
    msg = with_chaos(base, server_record([], phase="relay", server_round=0))
    (reply,) = grid.send_and_receive([msg])
    assert reply.content["seen"]["keys"] == ["config"]  # the handler never saw the Chaos record
    rec = split_chaos(reply)
    assert rec is not None and rec["party"] == "p"
    with pytest.raises(ConfigError, match="already enabled"):
        enable(app)


# -- party settings ---------------------------------------------------------------------------
def _ctx(node_config: dict[str, object], run_config: dict[str, object] | None = None) -> Context:
    return Context(1, 5, node_config, RecordDict(), run_config or {})  # type: ignore[arg-type]


def test_party_settings_name_the_missing_or_wrong_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'chaos-key' is missing"):
        party_settings(_ctx({}))
    key = tmp_path / "a.key"
    charter = tmp_path / "charter.yaml"
    with pytest.raises(ConfigError, match="'chaos-charter' is missing"):
        party_settings(_ctx({"chaos-key": str(key)}))
    cfg = {"chaos-key": str(key), "chaos-charter": str(charter), "chaos-state-dir": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"chaos-key.*no key file"):
        party_settings(_ctx(cfg))
    key.write_bytes(b"k")
    with pytest.raises(ConfigError, match=r"chaos-charter.*no charter"):
        party_settings(_ctx(cfg))
    charter.write_text("x")
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"chaos-state-dir.*not a directory"):
        party_settings(_ctx({**cfg, "chaos-state-dir": str(tmp_path / "f")}))
    with pytest.raises(ConfigError, match="non-empty path"):
        party_settings(_ctx({**cfg, "chaos-key": 3}))
    ok = party_settings(_ctx(cfg))
    assert ok.key_path == key and not ok.unsigned
    # an explicitly unsigned run needs no identity, and says so
    assert party_settings(_ctx({}, {"chaos-unsigned": True})).unsigned


def test_a_flooding_sender_fills_only_its_own_share_of_a_receivers_queue_and_messages() -> None:
    r = Relay(max_queue=100, max_per_message=20, max_queue_per_sender=50, max_per_sender=8)
    r.bind("victim", 1)
    for i in range(1000):
        r.enqueue("victim", b"F%d" % i, sender="flooder")
    for i in range(5):
        r.enqueue("victim", b"H%d" % i, sender="honest")
    assert r.pending("victim") == 55  # the flooder's newest 50, every honest envelope
    first = r.take(1)
    assert [e for e in first if e.startswith(b"H")] == [b"H%d" % i for i in range(5)]
    assert len([e for e in first if e.startswith(b"F")]) == 8  # its per-message share
    assert first[1] == b"H0"  # turns alternate between the senders
    assert first[0] == b"F950"  # the flooder's oldest 950 were dropped
    assert r.dropped == 950
    r.give_back(1, first[:2])
    assert r.take(1)[:2] == first[:2]  # given back first, in order


def test_a_queue_full_of_given_back_envelopes_still_takes_new_ones() -> None:
    r = Relay(max_queue=3, max_per_message=3)
    r.bind("b", 2)
    for i in range(3):
        r.enqueue("b", bytes([i]), sender="a")
    r.give_back(2, r.take(2))  # the whole queue is given back
    r.enqueue("b", b"new", sender="c")  # the oldest given-back envelope makes room
    assert r.dropped == 1 and r.pending("b") == 3
    assert r.take(2) == [b"\x01", b"\x02", b"new"]


def test_a_told_state_size_is_kept_per_node_and_the_most_told_is_the_hint() -> None:
    from chaos_flwr.flower.server.resume import size_hint

    r = Relay()
    r.absorb(4, ConfigRecord({"party": "a", "held-bytes": 900}))
    r.absorb(5, ConfigRecord({"party": "b"}))  # told none: no entry
    assert r.held_bytes == {4: 900} and read_party_record(ConfigRecord({})).held_bytes == -1
    assert size_hint({1: 10, 2: 20, 3: 20}, [1, 2, 3]) == 20  # the most told
    assert size_hint({1: 10, 2: 20}, [1, 2]) == 10  # a tie: the smallest
    assert size_hint({1: 10, 2: 20}, [2, 9]) == 20  # only the given nodes count
    assert size_hint({1: 10}, [2]) is None
