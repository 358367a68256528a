"""``chaos-flwr bench events`` over the real carrier: worker processes, grpc push streams."""

from __future__ import annotations

import pytest

from chaos_flwr.bench.events import run_events
from chaos_flwr.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def test_grpc_workers_settle_every_event_type_with_per_peer_verification() -> None:
    lines: list[str] = []
    result = run_events(12, repeats=2, carrier="grpc", workers=2, progress=lines.append)
    assert result["peers"] == 12 and result["carrier"] == "grpc" and result["workers"] == 2
    assert set(result["events"]) == {"leave", "link_up", "link_down", "fail"}
    assert result["views_agree"] and result["rejections"] == 0
    assert result["verify_us"] > 0 and lines  # progress was reported
    ev = result["events"]
    for row in ev.values():
        assert row["count"] == 2
        assert 0.0 < row["p50_ms"] <= row["p99_ms"]
        assert 0.0 < row["hop_p50_ms"] <= row["p99_ms"]
        assert row["floor_p50_ms"] > 0
    # Every affected peer verified the envelope and each record signature itself: a leave of
    # one of 12 reaches the 11 others, each verifying 2 signatures (envelope + leaver's).
    assert ev["leave"]["verifies_p50"] == 11 * 2
    # link_down is signed by one end: the 10 peers outside the link verify 2 each (the ends'
    # own work is not counted, so the floor is a lower bound).
    assert ev["link_down"]["verifies_p50"] == 10 * 2
    # link_up carries both ends' signatures: 3 per peer outside the two ends.
    assert ev["link_up"]["verifies_p50"] == 10 * 3
    assert ev["link_up"]["ends_p50_ms"] <= ev["link_up"]["p50_ms"]


def test_memory_hosts_and_bad_options() -> None:
    result = run_events(8, repeats=1, carrier="memory", workers=2, progress=lambda s: None)
    assert result["workers"] == 2 and result["views_agree"] and result["rejections"] == 0
    with pytest.raises(ConfigError, match="workers"):
        run_events(8, repeats=1, carrier="memory", workers=0)
    with pytest.raises(ConfigError, match="repeats"):
        run_events(8, repeats=0, carrier="memory")
