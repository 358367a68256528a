"""Real kernel links: namespaces + veth + tbf, an 8 Mbit/s transfer, and cleanup."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from chaos_flwr.errors import NetnsError
from chaos_flwr.transport import netns
from chaos_flwr.transport.netns import check_netns_available, measure_tcp_rate, veth_pair

pytestmark = pytest.mark.timeout(60)

_CAN = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not _CAN, reason="netns mode needs root and iproute2 (ip, tc)")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _links() -> str:
    return subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout


@needs_root
def test_tbf_shaped_veth_carries_tcp_at_the_set_rate() -> None:
    rate_bit_s = 8_000_000
    with veth_pair(name="cftest1", rate_a_bit_s=rate_bit_s) as pair:
        assert {pair.ns_a, pair.ns_b} <= _namespaces()
        assert "tbf" in pair.qdiscs("a") and "8Mbit" in pair.qdiscs("a")
        total, rate = measure_tcp_rate(pair, 1_500_000, port=45011)
        assert total == 1_500_000
        # tbf counts Ethernet/IP/TCP headers too, so TCP payload runs ~4-5 % below the rate
        assert 0.88 * rate_bit_s / 8 <= rate <= 1.05 * rate_bit_s / 8
        # the unshaped direction (b -> a) is not capped: the reverse test is not needed to
        # know a's egress is the only tbf; b has the default qdisc
        assert "tbf" not in pair.qdiscs("b")
    assert pair.ns_a not in _namespaces() and pair.ns_b not in _namespaces()
    assert pair.dev_a not in _links()


@needs_root
def test_everything_is_deleted_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), veth_pair(name="cftest2") as pair:
        assert pair.ns_a in _namespaces()
        raise RuntimeError("boom")
    assert pair.ns_a not in _namespaces() and pair.ns_b not in _namespaces()
    assert pair.dev_a not in _links()


@needs_root
def test_a_failing_setup_step_still_cleans_up() -> None:
    with pytest.raises(NetnsError, match="rate_bit_s"), veth_pair(name="cftest3", rate_b_bit_s=-1):
        pass
    assert not {"cftest3a", "cftest3b"} & _namespaces()
    assert "cftest3va" not in _links()
    with pytest.raises(NetnsError, match="name"), veth_pair(name="much-too-long-name"):
        pass


def test_clear_errors_when_not_root_or_tools_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="root"):
        check_netns_available()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    with pytest.raises(NetnsError, match="'tc'"):
        check_netns_available()
