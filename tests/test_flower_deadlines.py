"""Adaptive exchange deadlines: slow nodes are waited for, crashed ones only as their history
allows, and a node dropped for lateness is logged with its measured time."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fake_grid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.serverapp.strategy import FedAvg
from test_flower_strategy import VClock, _app, _initial

from chaos_flwr.errors import ConfigError
from chaos_flwr.flower.relay import Relay
from chaos_flwr.flower.server import ChaosStrategy, PhaseSettings, run_options
from chaos_flwr.flower.server.courier import Courier, LateReply, PhaseSpec
from chaos_flwr.flower.server.deadlines import ReplyTimes, quantile
from chaos_flwr.flower.server.logs import RoundLog
from chaos_flwr.flower.server.settings import settings_from_flat


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _slow_grid(clock: VClock, delays: list[float]) -> FakeGrid:
    grid = FakeGrid(clock=clock)
    app = _app(True)
    for k, delay in enumerate(delays, start=1):
        grid.add_node(app, node_config={"k": k}).delay_s = delay
    return grid


def _fedavg(n: int) -> FedAvg:
    return FedAvg(min_available_nodes=n, min_train_nodes=n, min_evaluate_nodes=n)


def test_a_deployment_slower_than_the_old_fixed_timeout_trains_everyone_every_round() -> None:
    # every reply takes 34 s (the deployment engine's train phase that a fixed 30 s dropped)
    clock = VClock()
    grid = _slow_grid(clock, [34.0] * 4)
    chaos = ChaosStrategy(_fedavg(4), clock=clock, sleep=clock.sleep)
    chaos.start(grid, _initial(), num_rounds=4, timeout=3600)
    rounds = chaos.rounds[1:]
    assert [len(r.trained) for r in rounds] == [4, 4, 4, 4]
    assert all(not r.missing and not r.skipped for r in rounds)
    assert chaos.courier.late_replies == []
    # from round 2 on every node's train deadline comes from its history: 1.5 x 34 s
    node = next(iter(grid.get_node_ids()))
    assert chaos.courier.times.deadline("relay:train", node) == pytest.approx(51.0, abs=0.2)


def test_a_crashed_node_is_waited_for_only_as_long_as_its_history_allows() -> None:
    clock = VClock()
    grid = _slow_grid(clock, [20.0] * 4)
    victim = list(grid.get_node_ids())[1]

    def kill_after_round_2(rnd: int, arrays: ArrayRecord) -> None:
        if rnd == 2:
            grid.node(victim).mode = "dead"

    chaos = ChaosStrategy(_fedavg(3), clock=clock, sleep=clock.sleep)
    chaos.start(grid, _initial(), num_rounds=4, timeout=3600, evaluate_fn=kill_after_round_2)
    r3, r4 = chaos.rounds[3:]
    assert victim in r3.trained and victim in r3.missing
    # its replies took 20 s: its deadline was 1.5 x 20 s, not the 600 s ceiling
    assert r3.train_s == pytest.approx(30.0, abs=0.2)
    assert victim not in r4.trained and len(r4.trained) == 3
    assert r4.train_s == pytest.approx(20.0, abs=0.2)  # the live ones, not the dead one


def test_a_trainer_dropped_for_lateness_is_logged_with_its_time_and_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VClock()
    grid = _slow_grid(clock, [1.0, 1.0, 1.0])
    node = next(iter(grid.get_node_ids()))
    courier = Courier(Relay(), PhaseSettings(), clock=clock, sleep=clock.sleep)
    known = list(grid.get_node_ids())

    def train_exchange(rnd: int) -> None:
        content = RecordDict({"arrays": _initial(), "config": ConfigRecord({"server-round": rnd})})
        msgs = [grid.create_message(content, "train", n, "") for n in known]
        courier.phase(grid, msgs, known, PhaseSpec("relay", rnd, b""), timeout=3600,
                      log_=RoundLog(rnd))  # fmt: skip

    train_exchange(1)  # history: 1 s each
    assert courier.times.deadline("relay:train", node) == courier.phases.deadline_floor_s
    grid.node(node).delay_s = 40.0
    caplog.set_level(logging.INFO)
    train_exchange(2)
    assert node in courier.suspects
    assert "dropped from this relay:train exchange" in caplog.text
    assert "(the deadline 15.0 s;" in caplog.text
    grid.node(node).delay_s = 1.0
    clock.sleep(30.0)  # its reply is in by now; the next exchange pulls it
    train_exchange(3)
    (late,) = courier.late_replies
    assert late == LateReply(node, "relay:train", 15.0, late.measured_s)
    assert 40.0 <= late.measured_s <= 46.0
    assert "answered its relay:train message after" in caplog.text
    # its next deadline covers what it took
    assert courier.times.deadline("relay:train", node) >= 1.5 * late.measured_s


def test_reply_times_give_quantile_plus_margin_between_floor_and_ceiling() -> None:
    times = ReplyTimes(PhaseSettings(deadline_floor_s=2.0, deadline_ceiling_s=100.0))
    assert times.deadline("relay:train", 1) == 100.0  # no history: the ceiling
    for t in [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 10.0]:
        times.observe("relay:train", 1, t)
    assert quantile(times.samples("relay:train", 1), 0.95) == 10.0
    assert times.deadline("relay:train", 1) == pytest.approx(15.0)
    times.observe("relay:query.chaos", 1, 0.1)
    assert times.deadline("relay:query.chaos", 1) == 2.0  # the floor
    for _ in range(30):
        times.observe("relay:train", 2, 500.0)
    assert times.deadline("relay:train", 2) == 100.0  # the ceiling
    assert times.exchange_deadline({1: "relay:train", 2: "relay:train"}, [1]) == 15.0
    fixed = ReplyTimes(PhaseSettings(phase_timeout_s=3.0))
    assert fixed.deadline("certify:evaluate", 1) == 3.0  # a configured first deadline
    fixed.observe("certify:evaluate", 1, 0.1)
    assert fixed.deadline("certify:evaluate", 1) == 3.0  # the floor lowered to it


def test_deadline_settings_from_a_profile_and_their_checks() -> None:
    kw = settings_from_flat({"deadline_floor_s": 3.0, "deadline_ceiling_s": 90.0})
    assert kw["phases"].deadline_floor_s == 3.0 and kw["phases"].deadline_ceiling_s == 90.0
    with pytest.raises(ConfigError, match="deadline_ceiling_s"):
        PhaseSettings(deadline_floor_s=10.0, deadline_ceiling_s=5.0)
    with pytest.raises(ConfigError, match="deadline_quantile"):
        PhaseSettings(deadline_quantile=0.0)
    with pytest.raises(ConfigError, match="deadline_margin"):
        PhaseSettings(deadline_margin=-0.1)


def _context(run_config: dict[str, str | float | bool]) -> Context:
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)


def test_run_config_sets_the_deadline_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHAOS_DEADLINE_FLOOR_S", raising=False)
    monkeypatch.delenv("CHAOS_PHASE_TIMEOUT_S", raising=False)
    monkeypatch.delenv("CHAOS_DEADLINE_CEILING_S", raising=False)
    assert "phases" not in run_options(_context({"chaos-unsigned": True}))
    opts = run_options(
        _context(
            {
                "chaos-unsigned": True,
                "chaos-deadline-floor-s": 4.0,
                "chaos-deadline-ceiling-s": "120",
            }
        )
    )
    assert opts["phases"] == PhaseSettings(deadline_floor_s=4.0, deadline_ceiling_s=120.0)
    monkeypatch.setenv("CHAOS_PHASE_TIMEOUT_S", "45")  # the environment fallback
    assert run_options(_context({"chaos-unsigned": True}))["phases"].phase_timeout_s == 45.0
    with pytest.raises(ConfigError, match="chaos-deadline-ceiling-s"):
        run_options(_context({"chaos-unsigned": True, "chaos-deadline-ceiling-s": "soon"}))
    with pytest.raises(ConfigError, match="chaos-deadline-floor-s, chaos-deadline-ceiling-s"):
        run_options(
            _context(
                {"chaos-unsigned": True, "chaos-deadline-floor-s": 9, "chaos-deadline-ceiling-s": 3}
            )
        )


def test_a_chaos_query_lives_twice_its_nodes_deadline() -> None:
    courier = Courier(Relay(), PhaseSettings(deadline_floor_s=4.0))
    spec = PhaseSpec("relay", 1, b"")
    first, _ = courier.message(1001, spec)
    assert first.metadata.ttl == pytest.approx(2 * 600.0)  # no history: the ceiling
    courier.times.observe("relay:query.chaos", 1001, 0.5)
    msg, _ = courier.message(1001, spec)
    assert msg.metadata.ttl == pytest.approx(2 * 4.0)  # 1.5 x 0.5 s is under the floor


@pytest.mark.parametrize(("delay", "extra", "answered"), [
    (25.0, False, False),  # 25 s against its 15 s deadline: dropped, a suspect
    (40.0, True, True),  # waited for its deadline and the step's bound (15 + 33.4 s)
    (55.0, True, False),  # no longer than that
])  # fmt: skip
def test_an_exchange_adds_a_steps_own_bound_to_the_deadline(
    delay: float, extra: bool, answered: bool
) -> None:
    # a node's history says 1 s (a deadline at the 15 s floor); a step that may fetch a large
    # state over direct links is waited for that bound longer (a joiner's join step), and its
    # message lives as much longer (Flower refuses a reply to an expired message)
    from chaos_flwr.defaults import FLOWER_CHAOS_TTL_PHASES
    from chaos_flwr.flower.fetch import direct_step_wait_s

    clock = VClock()
    grid = _slow_grid(clock, [1.0])
    (node,) = grid.get_node_ids()
    courier = Courier(Relay(), PhaseSettings(), clock=clock, sleep=clock.sleep)
    spec = PhaseSpec("join", 1, b"")
    bound = direct_step_wait_s(64 << 20) if extra else 0.0  # 33.4 s

    def exchange(extra_s: float) -> bool:
        msg, taken = courier.message(node, spec, extra_s=extra_s)
        res = courier.exchange(grid, [msg], {node: taken}, timeout=3600, log_=RoundLog(1),
                               extra_s=extra_s)  # fmt: skip
        return node in res.replies

    assert exchange(0.0)  # history: 1 s
    floor = courier.phases.deadline_floor_s
    assert courier.times.deadline("join:query.chaos", node) == floor
    msg, _ = courier.message(node, spec, extra_s=bound)
    assert msg.metadata.ttl == pytest.approx((floor + bound) * FLOWER_CHAOS_TTL_PHASES)
    grid.node(node).delay_s = delay
    assert exchange(bound) is answered
    assert (node in courier.suspects) is not answered
