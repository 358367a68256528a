"""Simulator building blocks: engine ordering, exact network timing, faults, scenario validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos_flwr.errors import ConfigError
from chaos_flwr.sim.engine import Engine, SimBoundError
from chaos_flwr.sim.network import Faults, Network
from chaos_flwr.sim.scenario import load_scenario, parse_scenario, scenario_names

# --- engine ------------------------------------------------------------------------------------


def test_engine_orders_by_time_then_by_scheduling_order() -> None:
    eng = Engine(0)
    seen: list[str] = []
    eng.at(2.0, lambda: seen.append("c"))
    eng.at(1.0, lambda: seen.append("a"))
    eng.at(1.0, lambda: seen.append("b"))  # same time: after "a", scheduled first
    eng.at(1.0, lambda: eng.after(0.0, lambda: seen.append("a2")))
    eng.run(5.0)
    assert seen == ["a", "b", "a2", "c"]
    assert eng.events == 5
    assert eng.now == 5.0


def test_engine_past_schedule_clamps_to_now_and_run_stops_at_until() -> None:
    eng = Engine(0)
    times: list[float] = []
    eng.at(3.0, lambda: eng.at(1.0, lambda: times.append(eng.now)))
    eng.at(4.0, lambda: times.append(eng.now))
    eng.run(3.5)
    assert times == [3.0]
    assert eng.pending() == 1
    eng.run(10.0)
    assert times == [3.0, 4.0]


def test_engine_rng_is_seeded() -> None:
    a = [Engine(7).rng.random() for _ in range(3)]
    b = [Engine(7).rng.random() for _ in range(3)]
    assert a == b
    assert Engine(7).rng.random() != Engine(8).rng.random()


def test_engine_event_bound_ends_a_storm() -> None:
    eng = Engine(0, max_events=50)

    def storm() -> None:
        eng.after(0.0, storm)

    eng.at(0.0, storm)
    with pytest.raises(SimBoundError, match="max_events=50"):
        eng.run(1.0)
    assert eng.events == 51


def test_engine_virtual_time_bound() -> None:
    eng = Engine(0, max_virtual_s=10.0)
    with pytest.raises(SimBoundError, match="max_virtual_s"):
        eng.run(11.0)


# --- network -----------------------------------------------------------------------------------


def _net(**kw: float) -> tuple[Engine, Network, list[tuple[float, str, str, bytes]]]:
    eng = Engine(1)
    got: list[tuple[float, str, str, bytes]] = []
    net = Network(
        eng,
        lambda s, d, data: got.append((eng.now, s, d, data)),
        latency_s=kw.get("latency", 0.25),
        bandwidth_bps=kw.get("bw", 1024.0),
        link_latency_s={("b", "a"): 0.5},
        uplink_bps={"c": 256.0},
    )
    return eng, net, got


def test_latency_plus_serialisation_exact() -> None:
    eng, net, got = _net()
    net.send("x", "y", b"\0" * 512)  # 512 B over 1024 B/s = 0.5 s, + 0.25 s latency
    net.send("x", "y", b"\1" * 256)  # queued behind: uplink busy until 0.5, done 0.75
    net.send("z", "y", b"\2" * 1024)  # another uplink: 1.0 + 0.25
    eng.run(10.0)
    assert [(t, s) for t, s, _, _ in got] == [(0.75, "x"), (1.0, "x"), (1.25, "z")]
    assert net.delivered == 3 and net.dropped == 0


def test_per_link_latency_and_per_party_uplink_overrides() -> None:
    eng, net, got = _net()
    net.send("a", "b", b"\0" * 128)  # 0.125 s + link override 0.5 s
    net.send("c", "d", b"\0" * 128)  # uplink override 256 B/s: 0.5 s + 0.25 s
    eng.run(10.0)
    assert sorted((t, s) for t, s, _, _ in got) == [(0.625, "a"), (0.75, "c")]


def test_uplink_idle_gap_does_not_bank_credit() -> None:
    eng, net, got = _net()
    net.send("x", "y", b"\0" * 256)  # done 0.25, arrives 0.5
    eng.run(2.0)
    net.send("x", "y", b"\0" * 256)  # sent at 2.0: done 2.25, arrives 2.5
    eng.run(10.0)
    assert [t for t, *_ in got] == [0.5, 2.5]


def test_partition_drops_across_sides_and_heal_restores() -> None:
    eng, net, got = _net()
    net.partition(["a"])
    net.send("a", "b", b"1")
    net.send("b", "c", b"2")
    eng.run(5.0)
    assert [d for *_, d in got] == [b"2"]
    net.heal()
    net.send("a", "b", b"3")
    eng.run(10.0)
    assert [d for *_, d in got] == [b"2", b"3"]
    assert net.dropped == 1


def test_partition_during_flight_loses_the_message() -> None:
    eng, net, got = _net()
    net.send("x", "y", b"\0" * 512)  # arrives 0.75
    eng.run(0.5)
    net.partition(["x"])
    eng.run(5.0)
    assert got == [] and net.dropped == 1


def test_crash_drops_at_send_and_in_flight() -> None:
    eng, net, got = _net()
    net.send("x", "y", b"\0" * 512)
    eng.run(0.1)
    net.crashed.add("y")
    net.send("z", "y", b"late")
    eng.run(5.0)
    assert got == [] and net.dropped == 2
    net.crashed.discard("y")
    net.send("z", "y", b"back")
    eng.run(10.0)
    assert [d for *_, d in got] == [b"back"]


def test_drop_all_and_duplicate_all() -> None:
    eng, net, got = _net()
    net.faults = Faults(drop=1.0)
    for _ in range(5):
        net.send("x", "y", b"m")
    eng.run(5.0)
    assert got == [] and net.dropped == 5
    net.faults = Faults(duplicate=1.0)
    net.send("x", "y", b"d" * 512)  # both copies serialised: 1024 B -> 1.0 s, + 0.25 s
    eng.run(10.0)
    assert [(t, d) for t, _, _, d in got] == [(6.25, b"d" * 512), (6.25, b"d" * 512)]


def test_fixed_delay_adds_exactly() -> None:
    eng, net, got = _net()
    net.faults = Faults(delay_s=0.5)
    net.send("x", "y", b"\0" * 256)
    eng.run(10.0)
    assert got[0][0] == 0.25 + 0.25 + 0.5


def test_reorder_delays_within_bound_and_changes_order() -> None:
    eng, net, got = _net(bw=1e9, latency=0.0)
    net.faults = Faults(reorder=1.0, reorder_max_s=1.0)
    payloads = [bytes([i]) for i in range(40)]
    for p in payloads:
        net.send("x", "y", p)
    eng.run(10.0)
    assert sorted(d for *_, d in got) == payloads
    assert [d for *_, d in got] != payloads
    assert all(0.0 <= t <= 1.0 + 1e-6 for t, *_ in got)


def test_no_faults_keeps_fifo_order() -> None:
    eng, net, got = _net(bw=1e9, latency=0.1)
    payloads = [bytes([i]) for i in range(40)]
    for p in payloads:
        net.send("x", "y", p)
    eng.run(10.0)
    assert [d for *_, d in got] == payloads


def test_trace_digest_follows_deliveries() -> None:
    def run(data: bytes) -> str:
        eng, net, _ = _net()
        net.send("x", "y", data)
        eng.run(5.0)
        return net.trace_digest()

    assert run(b"a") == run(b"a")
    assert run(b"a") != run(b"b")


# --- scenarios ---------------------------------------------------------------------------------

BASE = {"name": "t", "parties": 5}


def test_shipped_scenarios_load() -> None:
    names = scenario_names()
    assert {"churn-5", "partition-heal", "scale-200"} <= set(names)
    for name in names:
        sc = load_scenario(name)
        assert sc.parties >= 5
    assert load_scenario("scale-200").parties == 200


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({"colour": "red"}, "colour"),
        ({"parties": 1}, "parties"),
        ({"initial": 9}, "initial"),
        ({"events": [{"at": 1, "action": "explode", "party": 1}]}, "events.0.action"),
        ({"events": [{"at": 1, "action": "crash"}]}, "events.0"),
        ({"events": [{"at": -1, "action": "heal"}]}, "events.0.at"),
        ({"events": [{"at": 1, "action": "faults", "drop": 1.5}]}, "events.0.drop"),
        ({"events": [{"at": 1, "action": "heal", "when": 3}]}, "events.0.when"),
        ({"events": [{"at": 1, "action": "crash", "party": 7}]}, "events.0.party"),
        ({"events": [{"at": 1, "action": "link_up", "a": 1, "b": 1}]}, "events.0"),
        ({"events": [{"at": 1, "action": "partition", "group": [0, 9]}]}, "events.0.group"),
        ({"events": [{"at": 1, "action": "partition"}]}, "events.0"),
    ],
)
def test_bad_scenarios_name_the_field(extra: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        parse_scenario({**BASE, **extra})


def test_scenario_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a file nor a shipped scenario"):
        load_scenario(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot be read as YAML"):
        load_scenario(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_scenario(str(lst))
    good = tmp_path / "good.yaml"
    good.write_text("name: g\nparties: 6\nevents:\n  - {at: 2, action: heal}\n")
    sc = load_scenario(str(good))
    assert sc.parties == 6 and sc.last_event_at == 2.0 and sc.members_at_start == 6
