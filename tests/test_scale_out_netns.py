"""The scale-out benchmark over real kernel links: donors in namespaces, tbf-shaped veths."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos_flwr.bench.scale_out import latency_only, netns_rates_bit_s, run_scale_out
from chaos_flwr.defaults import NETNS_STAR_MTU
from chaos_flwr.errors import ConfigError
from chaos_flwr.transfer import Progress
from chaos_flwr.transport import parse_profile

pytestmark = pytest.mark.timeout(120)

_CAN = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not _CAN, reason="netns mode needs root and iproute2 (ip, tc)")

PROFILE = {
    "name": "tiny3",
    "parties": {
        "joiner": {"up_mb_s": 50, "down_mb_s": 100, "latency_ms": 1},
        "fast": {"up_mb_s": 8, "latency_ms": 5},
        "mid": {"up_mb_s": 4, "latency_ms": 10},
        "slow": {"up_mb_s": 2, "latency_ms": 20},
    },
    "links": [{"src": "mid", "dst": "joiner", "mb_s": 3}],
    "storage": {"up_mb_s": 20, "down_mb_s": 20, "latency_ms": 2},
}


def _namespaces() -> set[str]:
    """Namespaces, but a testbed's (``t<pid><k>hub``, ``t<pid><k>h<i>``: a bench may run beside
    the suite; this benchmark makes none)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    return {n for n in names if not re.fullmatch(r"t\d+h(ub|\d+)", n)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prof") / "tiny3.yaml"
    path.write_text(yaml.safe_dump(PROFILE), encoding="utf-8")
    return path


def test_rates_follow_the_profile_and_latency_only_drops_rates() -> None:
    profile = parse_profile(PROFILE)
    rates, down, up = netns_rates_bit_s(profile)
    # tbf counts whole frames: MTU + 14 bytes of Ethernet carry MTU - 52 bytes of TCP payload
    wire = (NETNS_STAR_MTU + 14) / (NETNS_STAR_MTU - 52)
    # the pair cap (3 MB/s) is below mid's uplink (4 MB/s), so it sets mid's link
    assert rates["mid"] == pytest.approx(3e6 * 8 * wire, abs=1)
    assert rates["fast"] == pytest.approx(8e6 * 8 * wire, abs=1)
    assert rates["fast"] > rates["mid"] > rates["slow"]
    assert down == pytest.approx(100e6 * 8 * wire, abs=1)
    assert up is not None and up > 0
    lat = latency_only(profile)
    for name, link in lat.parties.items():
        assert link.up_mb_s is None and link.down_mb_s is None
        assert link.latency_ms == profile.parties[name].latency_ms
    assert lat.links == []


@needs_root
def test_netns_benchmark_moves_the_state_and_cleans_up(profile_path: Path) -> None:
    before = _namespaces()
    seen: dict[str, Any] = {}

    def on_transfer(label: str, snapshot: Progress) -> None:
        if "ns" not in seen:  # once, mid-run: the star exists and the donors are shaped
            seen["ns"] = _namespaces() - before
            seen["qdisc"] = {
                ns: subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "show"],
                    capture_output=True,
                    text=True,
                ).stdout
                for ns in seen["ns"]
            }

    result = run_scale_out(
        profile_path=profile_path,
        wan="netns",
        state_mib=8,
        runs=1,
        extras=False,
        on_transfer=on_transfer,
    )
    total = result["state_bytes"]
    methods = result["methods"]
    assert set(methods) == {"chaos", "uniform", "single", "checkpoint"}
    for name, row in methods.items():
        assert row["digest_ok"] is True, name
        assert sum(row["bytes_by_donor"].values()) == total, name
    for name in ("chaos", "uniform", "single"):
        # the kernel links cannot beat the bound over the profile's rates (unshaped veths would)
        assert methods[name]["ratio_to_bound"] >= 1.0, name
    assert methods["single"]["bytes_by_donor"]["fast"] == total
    # single pours everything through fast's 8 MB/s tbf
    assert methods["single"]["delay_s"] >= 0.9 * total / 8e6
    assert methods["chaos"]["delay_s"] < methods["single"]["delay_s"]
    assert methods["chaos"]["delay_s"] < methods["uniform"]["delay_s"]
    chaos = methods["chaos"]["bytes_by_donor"]
    assert chaos["fast"] > chaos["mid"] > chaos["slow"]

    info = result["netns"]
    made = set(info["namespaces"]) | {info["hub"]}
    assert seen["ns"] == made  # every namespace created was there during the run ...
    donor_ns = set(info["namespaces"])
    assert all("tbf" in seen["qdisc"][ns] for ns in donor_ns)
    assert "tbf" in seen["qdisc"][info["hub"]]  # the joiner's downlink port
    assert len(info["donor_pids"]) == 3
    assert _namespaces() == before  # ... and none is left
    assert not [pid for pid in info["donor_pids"] if _alive(pid)]


@needs_root
def test_interrupt_mid_transfer_leaves_nothing_behind(profile_path: Path) -> None:
    before = _namespaces()
    seen: dict[str, Any] = {}

    def on_transfer(label: str, snapshot: Progress) -> None:
        made = _namespaces() - before
        pids: list[int] = []
        for ns in made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids.extend(int(p) for p in out.stdout.split())
        seen["ns"], seen["pids"] = made, pids
        raise KeyboardInterrupt  # as a Ctrl-C during the first transfer

    with pytest.raises(KeyboardInterrupt):
        run_scale_out(
            profile_path=profile_path,
            wan="netns",
            state_mib=2,
            runs=1,
            methods=("chaos",),
            extras=False,
            on_transfer=on_transfer,
        )
    assert len(seen["ns"]) == 4 and len(seen["pids"]) == 3
    assert _namespaces() == before
    assert not [pid for pid in seen["pids"] if _alive(pid)]


def test_netns_refuses_the_extras_and_unknown_modes() -> None:
    with pytest.raises(ConfigError, match="extras"):
        run_scale_out(wan="netns", state_mib=1, extras=True)
    with pytest.raises(ConfigError, match="wan"):
        run_scale_out(wan="teleport", state_mib=1, extras=False)
