"""The multi-site testbed: hosts in namespaces on a bridge, tbf both ways, TLS, SuperNode auth.

Fast tests check the pieces without root (names, addresses, rates, certificates, command
lines); the root tests build real links (a transfer at the shaped rate each way, cleanup after
an error and after SIGTERM), and the slow one runs the example signed with Chaos on a 3-host
testbed with a model of a few MB and checks that its bytes crossed every shaped interface.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509

from chaos_flwr.errors import ConfigError, NetnsError
from chaos_flwr.lab.launch import deployment_home, in_netns, superlink_cmd, supernode_cmd
from chaos_flwr.lab.processes import alive, descendants
from chaos_flwr.lab.testbed import host_rates_bit_s, load_testbed_profile, wan_testbed
from chaos_flwr.lab.testbed_run import WanRunSpec, run_on_testbed
from chaos_flwr.lab.tls import make_auth_key, make_tls
from chaos_flwr.lab.wan_bench import WanBenchSpec, _joiner_trained, join_bounds, overhead_ratio
from chaos_flwr.transport.netns import (
    _lan_topology,
    lan,
    lan_prefix,
    measure_tcp_rate,
    wire_rate_bit_s,
)
from chaos_flwr.transport.shaping import WanProfile, parse_profile

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "multi_institution"
_CAN = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(
    not _CAN, reason="the testbed needs root and iproute2 (ip, tc) for namespaces and tbf"
)


def _four_hosts() -> WanProfile:
    """A well-connected SuperLink host and three institutions (inst3 joins)."""
    return parse_profile({"parties": {
        "superlink": {"up_mb_s": 20.0, "down_mb_s": 20.0},
        "inst1": {"up_mb_s": 10.0, "down_mb_s": 20.0},
        "inst2": {"up_mb_s": 5.0, "down_mb_s": 10.0},
        "inst3": {"up_mb_s": 5.0, "down_mb_s": 20.0},
    }})  # fmt: skip


def _namespaces() -> set[str]:
    """Namespaces this test process may have made (a bench may run beside the suite)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    return {n for n in names if not re.fullmatch(r"t\d+h(ub|\d+)", n) or _own_lan(n)}


def _own_lan(name: str) -> bool:
    return name.startswith(lan_prefix())


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    return {line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines()}


# --- without root ------------------------------------------------------------------------------


def test_a_second_signal_does_not_abort_the_testbeds_cleanup() -> None:
    from chaos_flwr.lab.testbed import _stop_on_signals

    before = signal.getsignal(signal.SIGINT)
    cleaned = []
    with pytest.raises(KeyboardInterrupt, match="signal 15"), _stop_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # the handler raises here
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the cleanup: ignored
            time.sleep(0.05)
            cleaned.append(True)
    assert cleaned == [True]
    assert signal.getsignal(signal.SIGINT) is before


def test_lan_names_addresses_and_rates() -> None:
    topo = _lan_topology({"srv": (8_000_000, None), "a": (None, 4_000_000)}, "10.77.0.0/24",
                         "tbx", 1500)  # fmt: skip
    assert topo.hub == "tbxhub"
    assert topo.namespaces == {"srv": "tbxh0", "a": "tbxh1"}
    assert topo.addresses == {"srv": "10.77.0.1", "a": "10.77.0.2"}
    assert topo.up_bit_s == {"srv": 8_000_000, "a": None}
    assert topo.down_bit_s == {"srv": None, "a": 4_000_000}
    assert all(len(d) <= 15 for d in [*topo.devices.values(), *topo.ports.values()])
    # unnamed: this process's fixed-width prefix (t + 3 digits), never a prefix of another's
    mine = _lan_topology({"a": (None, None)}, "10.77.0.0/24", None, 1500)
    assert re.fullmatch(r"t\d{3}\d{2}hub", mine.hub) and mine.hub.startswith(lan_prefix())


@pytest.mark.parametrize(
    ("hosts", "subnet", "name", "match"),
    [
        ({"a": (1, 1)}, "8.8.8.0/24", "x", "private"),  # a public range would leak
        ({"a": (1, 1), "b": (1, 1), "c": (1, 1)}, "10.77.0.0/30", "x", "room for 3"),
        ({"a": (0, None)}, "10.77.0.0/24", "x", "uplink rate must be > 0"),
        ({"a": (None, -5)}, "10.77.0.0/24", "x", "downlink rate must be > 0"),
        ({"a": (1, 1)}, "10.77.0.0/24", "muchtoolong", "at most 8"),
        ({"a": (1, 1)}, "not-a-net", "x", "not an IPv4 network"),
        ({}, "10.77.0.0/24", "x", "1 to 200 hosts"),
    ],
)
def test_lan_refuses_bad_arguments(
    hosts: dict[str, tuple[int | None, int | None]], subnet: str, name: str, match: str
) -> None:
    with pytest.raises(NetnsError, match=match):
        _lan_topology(hosts, subnet, name, 1500)


def test_profile_rates_become_tbf_rates_for_the_tcp_payload() -> None:
    profile = load_testbed_profile()  # the shipped testbed5.yaml
    assert profile.name == "testbed5" and len(profile.parties) == 6
    rates = host_rates_bit_s(profile, list(profile.parties))
    assert rates["inst1"] == (wire_rate_bit_s(20e6), wire_rate_bit_s(40e6))
    ups = [rates[h][0] or 0 for h in profile.parties if h != "superlink"]
    assert max(ups) / min(ups) >= 8  # the spread of link speeds
    loose = parse_profile({"parties": {"s": {"up_mb_s": 1.0}}})
    assert host_rates_bit_s(loose, ["s"]) == {"s": (wire_rate_bit_s(1e6), None)}


def test_tls_files_chain_to_the_ca_and_name_the_superlink_address(tmp_path: Path) -> None:
    files = make_tls(tmp_path, ["10.77.0.1"])
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert = x509.load_pem_x509_certificate(files.certificate.read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if the signature does not check
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.77.0.1") in san.get_values_for_type(x509.IPAddress)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert files.key.stat().st_mode & 0o777 == 0o600
    private, public = make_auth_key(tmp_path, "inst1")
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert private.stat().st_mode & 0o777 == 0o600


def test_command_lines_bind_the_address_with_tls_and_auth(tmp_path: Path) -> None:
    files = make_tls(tmp_path, ["10.77.0.1"])
    link = superlink_cmd(9000, tmp_path / "db", host="10.77.0.1", tls=files, supernode_auth=True)
    assert "--insecure" not in link and "--enable-supernode-auth" in link
    assert link[link.index("--host") + 1] == "10.77.0.1"
    assert link[link.index("--ssl-certfile") + 1] == str(files.certificate)
    node = supernode_cmd(9000, {"partition-id": 0}, superlink_host="10.77.0.1",
                         root_certificates=files.ca, auth_key=tmp_path / "k")  # fmt: skip
    assert "--insecure" not in node and node[node.index("--superlink") + 1] == "10.77.0.1:9000"
    assert node[node.index("--auth-supernode-private-key") + 1] == str(tmp_path / "k")
    assert "--insecure" in superlink_cmd(9000, tmp_path / "db")  # loopback default unchanged
    assert in_netns("ns1", ["flwr"]) == ["ip", "netns", "exec", "ns1", "flwr"]
    assert in_netns(None, ["flwr"]) == ["flwr"]
    deployment_home(tmp_path, 9000, host="10.77.0.1", root_certificates=files.ca)
    config = (tmp_path / "config.toml").read_text()
    assert 'address = "10.77.0.1:9000"' in config and "insecure" not in config
    assert f'root-certificates = "{files.ca}"' in config


def test_testbed_refuses_an_unknown_server_before_making_anything(tmp_path: Path) -> None:
    profile = parse_profile({"parties": {"s": {"up_mb_s": 1.0}, "a": {"up_mb_s": 1.0}}})
    bad = pytest.raises(ConfigError, match="'nowhere' is not a party")
    with bad, wan_testbed(profile, tmp_path, app_dir=EXAMPLE, server="nowhere"):
        pass
    bad = pytest.raises(ConfigError, match="institutions")
    with bad, wan_testbed(profile, tmp_path, app_dir=EXAMPLE, server="s", institutions=["zz"]):
        pass
    assert not (tmp_path / "certs").exists()


def test_join_bounds_follow_the_relay_path_and_the_donors_uplinks() -> None:
    profile = parse_profile({"parties": {
        "hub": {"up_mb_s": 50.0, "down_mb_s": 50.0},
        "d1": {"up_mb_s": 1.0}, "d2": {"up_mb_s": 2.0},
        "new": {"down_mb_s": 100.0},
    }})  # fmt: skip
    w = 6_000_000
    b = join_bounds(profile, "hub", "new", ["d1", "d2", "new"], w)
    assert b["plain"] == pytest.approx(w / 50e6)  # the server's uplink is the bottleneck
    assert b["relay"] == pytest.approx(w / 3e6)  # both donors at once: 1 + 2 MB/s
    # the server at a donor's host: that donor reaches the relay without a link
    at_d2 = join_bounds(profile, "d2", "new", ["d1", "d2", "new"], w)
    assert at_d2["plain"] == pytest.approx(w / 2e6)  # d2's uplink now carries everything
    assert at_d2["relay"] == pytest.approx(w / 2e6)  # and caps the relay too


def test_a_plain_joiner_has_trained_once_every_node_trained_in_a_round() -> None:
    line = {"round": 3, "trainers_per_round": [2, 2, 3]}
    assert _joiner_trained(line, "fedavg", 3, None)
    assert not _joiner_trained({**line, "round": 2}, "fedavg", 3, None)
    assert not _joiner_trained(line, "chaos", 3, None)  # chaos needs the joiner's party id
    with pytest.raises(ConfigError, match="rounds"):
        WanBenchSpec(rounds=3)  # the join after round 2 needs rounds after it


def test_round_overhead_compares_rounds_churn_free_in_both_runs_of_a_pair() -> None:
    fedavg = [{"round_wall_s": [9.0, 10.0, 30.0, 40.0, 20.0], "churn_free_rounds": [2, 5]}]
    chaos = [{"round_wall_s": [9.0, 12.0, 30.0, 40.0, 99.0], "churn_free_rounds": [2]}]
    out = overhead_ratio(fedavg, chaos)
    assert out["pairs"][0]["rounds"] == [2]  # round 5 was a join round for Chaos
    assert out["ratio"] == pytest.approx(1.2)
    none = overhead_ratio(fedavg, [{"round_wall_s": [1.0], "churn_free_rounds": []}])
    assert none["ratio"] is None


def test_keys_no_join_mode_gives_are_named_not_measured() -> None:
    from chaos_flwr.lab.wan_bench import _unmeasured_join_keys

    # with daemons and no relay runs, the round ratio is measured against the direct runs
    assert set(_unmeasured_join_keys(["fedavg", "direct"])) == {
        "relay_join_s",
        "relay_train_sent_s",
    }
    alone = _unmeasured_join_keys(["direct"])  # no FedAvg: no ratio, no plain join
    assert {"plain_join_s", "plain_round_s", "round_overhead_ratio", "chaos_round_s"} <= set(alone)
    assert "direct_join_s" not in alone
    assert _unmeasured_join_keys(["fedavg", "chaos", "direct"]) == {}


# --- with root: real links ---------------------------------------------------------------------


@needs_root
@pytest.mark.timeout(60)
def test_lan_shapes_each_host_uplink_and_downlink() -> None:
    up_a, down_c = 8_000_000, 4_000_000
    hosts = {"a": (up_a, None), "b": (None, None), "c": (None, down_c)}
    with lan(hosts, name="tbq") as net:
        assert {"tbqhub", "tbqh0", "tbqh1", "tbqh2"} <= _namespaces()
        assert "tbqh0v" not in _root_links()  # nothing of the LAN in the root namespace
        q = net.qdiscs("a")
        assert "tbf" in q["up"] and "8Mbit" in q["up"] and "tbf" not in q["down"]
        assert "tbf" in net.qdiscs("c")["down"] and "4Mbit" in net.qdiscs("c")["down"]
        before = net.counters("a")
        total, rate = measure_tcp_rate(net.pair("a", "b"), 1_000_000, port=45021)
        assert total == 1_000_000
        assert 0.85 * up_a / 8 <= rate <= 1.05 * up_a / 8  # a's uplink is the bottleneck
        _, rate_c = measure_tcp_rate(net.pair("b", "c"), 600_000, port=45022)
        assert 0.85 * down_c / 8 <= rate_c <= 1.05 * down_c / 8  # c's downlink is
        _, rate_free = measure_tcp_rate(net.pair("b", "a"), 2_000_000, port=45023)
        assert rate_free > 3 * up_a / 8  # nothing shapes b -> a
        sent = net.counters("a")["tx_bytes"] - before["tx_bytes"]
        assert sent >= 1_000_000  # the payload, plus headers
        assert re.search(r"Sent (\d+) bytes", q["up"]) is not None
    assert not {"tbqhub", "tbqh0", "tbqh1", "tbqh2"} & _namespaces()
    assert not {d for d in _root_links() if d.startswith("tbq")}


@needs_root
@pytest.mark.timeout(60)
def test_lan_is_removed_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), lan({"a": (None, None)}, name="tbr") as net:
        assert net.hub in _namespaces()
        raise RuntimeError("boom")
    assert not {"tbrhub", "tbrh0"} & _namespaces()


_SIGTERM_CHILD = r"""
import sys, time
from pathlib import Path
from chaos_flwr.lab.testbed import wan_testbed
from chaos_flwr.transport.shaping import parse_profile
profile = parse_profile({"parties": {"s": {"up_mb_s": 5.0}, "a": {"down_mb_s": 5.0}}})
bed_cm = wan_testbed(profile, Path(sys.argv[1]), app_dir=Path(sys.argv[2]), server="s", name="tbs")
with bed_cm as bed:
    print("ready", bed.cluster.link.pid, flush=True)
    time.sleep(120)
"""


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_removes_the_superlink_and_every_namespace(tmp_path: Path) -> None:
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home")}
    child = subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_CHILD, str(tmp_path / "bed"), str(EXAMPLE)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line and line[0] == "ready", line
        link_pid = int(line[1])
        assert alive(link_pid) and {"tbshub", "tbsh0", "tbsh1"} <= _namespaces()
        below = descendants(child.pid)
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode != 0  # it was interrupted, and cleaned up on the way out
    assert not alive(link_pid) and not [p for p in below if alive(p)]
    assert not {"tbshub", "tbsh0", "tbsh1"} & _namespaces()
    assert not {d for d in _root_links() if d.startswith("tbs")}


# --- with root: the example on a 3-host testbed ------------------------------------------------


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_chaos_run_crosses_every_shaped_link_and_leaves_nothing(
    tmp_path: Path, flower_env: Path
) -> None:
    profile = parse_profile({"parties": {
        "superlink": {"up_mb_s": 20.0, "down_mb_s": 20.0, "latency_ms": 5},
        "inst1": {"up_mb_s": 5.0, "down_mb_s": 10.0, "latency_ms": 20},
        "inst2": {"up_mb_s": 2.5, "down_mb_s": 5.0, "latency_ms": 40},
    }})  # fmt: skip
    before_pids = set(descendants(os.getpid()))
    links_before = _root_links()
    t0 = time.monotonic()
    fig = run_on_testbed(profile, WanRunSpec(mode="chaos", rounds=2, model_mib=3.0), tmp_path)
    print(f"testbed run: {time.monotonic() - t0:.0f} s, rounds {fig['round_wall_s']}")
    model = int(fig["model_bytes"])
    assert model > 3_000_000 and fig["returncode"] == 0
    assert fig["trainers_per_round"] == [2, 2]  # both rounds finished with both institutions
    b = fig["bytes"]
    # each SuperNode pulls the model in round 1's train message (the initial state's certify)
    # and in each round's evaluate message (the new aggregate, certified); round 2's train
    # message leaves out the model it holds. It sends its trained model back each round. All
    # of it crosses its own shaped link and the SuperLink's
    for inst in ("inst1", "inst2"):
        assert 3 * model < b[inst]["rx_bytes"] < 4 * model and b[inst]["tx_bytes"] > 2 * model
    assert 2 * 3 * model < b["superlink"]["tx_bytes"] < 2 * 4 * model
    assert b["superlink"]["rx_bytes"] > 2 * 2 * model
    for host, rates in host_rates_bit_s(profile, list(profile.parties)).items():
        q = fig["qdiscs"][host]
        for side, rate in zip(("up", "down"), rates, strict=True):
            match = re.search(r"tbf .*? rate (\d+)Kbit.*?Sent (\d+) bytes", q[side], re.S)
            assert match, q[side]
            assert abs(int(match.group(1)) * 1000 - int(rate or 0)) < 1000  # the profile's rate
            assert int(match.group(2)) > model  # and the run's bytes went through it
    hosts = fig["testbed"]["hosts"]
    assert {h["address"] for h in hosts.values()} == {"10.77.0.1", "10.77.0.2", "10.77.0.3"}
    assert hosts["inst2"]["latency_ms"] == 40 and "netem is missing" in fig["testbed"]["latency"]
    # nothing left: processes, namespaces, links in the root namespace
    assert fig["pids_alive"] == [] and fig["namespaces_left"] == []
    assert _root_links() <= links_before
    assert [p for p in descendants(os.getpid()) if p not in before_pids and alive(p)] == []


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_joiner_pulls_over_direct_links_between_the_hosts(
    tmp_path: Path, flower_env: Path
) -> None:
    # every institution runs its party daemon on its own host; the joiner (inst3) takes the
    # state over authenticated links straight from the donors' hosts, not through the SuperLink
    from chaos_flwr.lab.wan_bench import _one_run

    profile = _four_hosts()
    before_pids, ns_before = set(descendants(os.getpid())), _namespaces()
    spec = WanBenchSpec(model_mib=2.0, rounds=4, joiner="inst3", app_dir=EXAMPLE, timeout_s=240)
    t0 = time.monotonic()
    fig = _one_run(profile, spec, "superlink", "direct", tmp_path)
    print(f"direct join run: {time.monotonic() - t0:.0f} s, joined after {fig['join_s']} s")
    join = fig["join"]
    assert join is not None and join["ok"] and join["source"] == "pull", join
    assert fig["joiner_trained_in_round"] is not None
    # every byte came over the two donors' direct links, in one relay step
    assert set(join["direct_bytes"]) == set(join["bytes_per_donor"])
    assert len(join["direct_bytes"]) == 2
    assert sum(join["direct_bytes"].values()) == join["total_bytes"] > 2_000_000
    assert join["direct_failed"] == []
    logs = tmp_path / "bed" / "home" / "logs"
    served = 0
    for host in ("inst1", "inst2"):
        text = (logs / f"party-{host}.log").read_text()
        assert "serving 10.77.0." in text and "refused: none" in text
        served += int(text.split("requests, ")[1].split(" bytes")[0])
    assert served >= join["total_bytes"]
    # each daemon held its party and answered its protocol messages (the donors' hellos; the
    # joiner's first message, which carried the join's start: its pull included) over its
    # local socket
    for host, least in (("inst1", 1), ("inst2", 1), ("inst3", 1)):
        text = (logs / f"party-{host}.log").read_text()
        answered = int(text.split("local socket: ")[1].split(" ")[0])
        assert answered >= least and " answered, 0 refused" in text, (host, answered)
    assert fig["pids_alive"] == []
    assert _namespaces() <= ns_before
    assert [p for p in descendants(os.getpid()) if p not in before_pids and alive(p)] == []


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_joiner_its_own_join_admits_trains_in_the_round_it_comes_during(
    tmp_path: Path, flower_env: Path
) -> None:
    # a charter with admission.sponsors_required 0: the joiner's SuperNode starts once round
    # JOIN_AFTER_ROUND is logged, while the next round trains; the ServerApp asks it, sends it
    # the state that round trains from, then that round's train message, and waits for it
    from chaos_flwr.lab.wan_bench import JOIN_AFTER_ROUND, _one_run

    profile = _four_hosts()
    before_pids, ns_before = set(descendants(os.getpid())), _namespaces()
    spec = WanBenchSpec(model_mib=2.0, rounds=4, joiner="inst3", app_dir=EXAMPLE, timeout_s=240,
                        sponsors_required=0)  # fmt: skip
    fig = _one_run(profile, spec, "superlink", "chaos", tmp_path)
    came_during = JOIN_AFTER_ROUND + 1
    log_text = (tmp_path / "bed" / "home" / "logs" / "run.log").read_text()
    assert fig["joiner_trained_in_round"] == came_during, log_text[-3000:]
    join = fig["join"]
    assert join is not None and join["ok"] and join["source"] == "server", join
    assert join["round"] == came_during and join["total_bytes"] > 2_000_000
    assert f"trains in round {came_during}, which it came during" in log_text
    # its first train message went out before that round ended (the join_s mark)
    assert fig["train_sent_s"] is not None and 0 < fig["train_sent_s"] < fig["join_s"]
    assert fig["pids_alive"] == []
    assert _namespaces() <= ns_before
    assert [p for p in descendants(os.getpid()) if p not in before_pids and alive(p)] == []
