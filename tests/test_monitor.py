"""The cluster monitor: suspicion, probes, estimates, resources and planner donors."""

from __future__ import annotations

import math

import pytest

from chaos_flwr.defaults import MONITOR_DEFAULT_BANDWIDTH_BPS, MONITOR_PROBE_TIMEOUT_S
from chaos_flwr.errors import ConfigError
from chaos_flwr.monitor import Monitor, Resources
from chaos_flwr.planner import Donor


def make(**kw: float) -> Monitor:
    args = {"suspicion_timeout_s": 3.0, "heartbeat_interval_s": 1.0, "ewma_alpha": 0.5}
    args.update(kw)
    return Monitor("me", **args)  # type: ignore[arg-type]


def test_silence_past_the_timeout_is_suspected_once() -> None:
    m = make(min_missed_checks=1)  # the floor alone (the missed-checks gate: test_monitor_accrual)
    m.watch(["a", "b", "me"], now=0.0)
    assert m.watched() == ["a", "b"]
    m.heard_from("a", 2.0)
    assert m.check(2.9) == []
    assert m.check(3.0) == ["b"]
    assert m.check(3.5) == []  # reported once per silence
    assert m.suspected() == ["b"]
    assert m.check(5.0) == ["a"]
    m.heard_from("b", 5.5)
    assert m.suspected() == ["a"]
    assert m.check(8.4) == []
    assert m.check(8.5) == ["b"]


def test_newly_watched_party_gets_a_full_timeout_and_unwatch_drops_suspicion() -> None:
    m = make(min_missed_checks=1)
    m.watch(["a"], 0.0)
    assert m.check(10.0) == ["a"]
    m.watch(["b"], 10.0)
    assert m.suspected() == []
    assert m.check(12.9) == []
    assert m.check(13.0) == ["b"]


def test_heartbeat_schedule() -> None:
    m = make()
    assert m.heartbeat_due(0.0)
    assert not m.heartbeat_due(0.5)
    assert m.heartbeat_due(1.0)
    assert not m.heartbeat_due(1.99)


def test_probe_rtt_gives_ewma_latency() -> None:
    m = make(probe_interval_s=2.0)
    m.watch(["a"], 0.0)
    (probe,) = m.probes_due(0.0)
    assert probe[0] == "a"
    assert m.probes_due(1.0) == []
    assert m.probe_answered("a", probe[1], 0.2) == pytest.approx(0.2)
    assert m.link("a").latency_s == pytest.approx(0.1)
    assert m.probe_answered("a", probe[1], 0.3) is None  # answered already
    (probe2,) = m.probes_due(2.0)
    m.probe_answered("a", probe2[1], 2.6)
    assert m.link("a").latency_s == pytest.approx(0.5 * 0.1 + 0.5 * 0.3)
    assert m.link("a").latency_samples == 2
    assert m.probe_answered("b", 999, 3.0) is None


def test_expired_probes_are_forgotten() -> None:
    m = make(probe_interval_s=1000.0)
    m.watch(["a"], 0.0)
    ((_, nonce),) = m.probes_due(0.0)
    m.probes_due(MONITOR_PROBE_TIMEOUT_S + 1.0)
    assert m.probe_answered("a", nonce, MONITOR_PROBE_TIMEOUT_S + 1.5) is None


def test_bandwidth_from_transfers() -> None:
    m = make()
    m.observe_transfer("a", 1000, 1.0)
    assert m.link("a").bandwidth_bps == pytest.approx(1000.0)
    m.observe_transfer("a", 3000, 1.0)
    assert m.link("a").bandwidth_bps == pytest.approx(2000.0)
    m.observe_transfer("a", 0, 1.0)
    m.observe_transfer("a", 10, 0.0)
    assert m.link("a").bandwidth_samples == 2


def test_resource_table_keeps_newest_declaration() -> None:
    m = make()
    m.declare("a", Resources(2.0, 100, at=5.0))
    m.declare("a", Resources(1.0, 50, at=4.0))
    assert m.resources()["a"] == Resources(2.0, 100, 5.0)
    m.declare("a", Resources(3.0, 10, at=6.0))
    assert m.resources()["a"].compute_speed == 3.0
    with pytest.raises(ConfigError, match="compute_speed"):
        m.declare("b", Resources(-1.0, 1))
    with pytest.raises(ConfigError, match="free_memory_bytes"):
        m.declare("b", Resources(1.0, -1))


def test_donors_use_estimates_defaults_and_skip_suspects() -> None:
    m = make(min_missed_checks=1)
    m.watch(["a", "b", "c"], 0.0)
    m.observe_transfer("a", 5000, 1.0)
    m.observe_rtt("a", 0.04)
    m.heard_from("a", 2.5)
    m.heard_from("b", 2.5)
    m.check(3.0)  # c is suspected
    donors = m.donors(["me", "a", "b", "c"], ready={"b": 0.7}, overhead=0.01)
    assert donors == [
        Donor("a", 5000.0, 0.02, 0.0, 0.01),
        Donor("b", MONITOR_DEFAULT_BANDWIDTH_BPS, 0.0, 0.7, 0.01),
    ]
    assert [d.id for d in m.donors(["c"], exclude_suspected=False)] == ["c"]


@pytest.mark.parametrize(
    "kw",
    [
        {"suspicion_timeout_s": 0.0},
        {"heartbeat_interval_s": -1.0},
        {"suspicion_timeout_s": math.inf},
        {"ewma_alpha": 0.0},
        {"ewma_alpha": 1.5},
    ],
)
def test_bad_settings_raise_config_error(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        make(**kw)
