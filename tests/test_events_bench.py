"""``chaos-flwr bench events`` over the real carrier: worker processes, grpc push streams."""

from __future__ import annotations

import os

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
    # The wake-up probe timed both kinds of seal (their ratio is the machine's, not asserted).
    assert result["seal_warm_us"] > 0 and result["seal_after_idle_us"] > 0
    # Pinned by default: each worker runs on one CPU of its own (round robin over ours).
    ours = sorted(os.sched_getaffinity(0))
    assert result["pinned"] is True
    assert result["host_cpus"] == [[ours[0]], [ours[1 % len(ours)]]]
    ev = result["events"]
    for row in ev.values():
        assert row["count"] == 2
        assert 0.0 < row["p50_ms"] <= row["p99_ms"]
        assert 0.0 < row["hop_p50_ms"] <= row["p99_ms"]
        assert row["floor_p50_ms"] > 0
    # verifies_p50 counts every Ed25519 check the peers made in the window (each peer has its
    # own cache). A leave of one of 12 is one "own" envelope whose signature is also the
    # leaver's record signature: the 11 others verify it once each.
    assert ev["leave"]["verifies_p50"] == 11 * 1
    # link_down is signed by one end, sent the same way: the other 11 verify once each.
    assert ev["link_down"]["verifies_p50"] == 11 * 1
    # link_up: the acceptor checks the request envelope and the initiator's signature (2), the
    # initiator checks the acceptor's envelope (its own signature is its own: 1), the 10 others
    # check the acceptor's envelope and the initiator's signature (2 each).
    assert ev["link_up"]["verifies_p50"] == 2 + 1 + 10 * 2
    assert ev["link_up"]["ends_p50_ms"] <= ev["link_up"]["p50_ms"]


def test_memory_hosts_and_bad_options() -> None:
    result = run_events(8, repeats=1, carrier="memory", workers=2, progress=lambda s: None)
    assert result["workers"] == 2 and result["views_agree"] and result["rejections"] == 0
    with pytest.raises(ConfigError, match="workers"):
        run_events(8, repeats=1, carrier="memory", workers=0)
    with pytest.raises(ConfigError, match="repeats"):
        run_events(8, repeats=0, carrier="memory")


def test_a_worker_that_dies_fails_the_next_call_at_once() -> None:
    import asyncio
    import time

    from chaos_flwr.bench.events import _ProcessHosts

    async def scenario() -> tuple[str, float]:
        hosts = _ProcessHosts(8, 1, lambda msg: None, pin=False)
        await hosts.start()
        try:
            # Unpinned, the worker may run wherever this process may.
            assert await hosts.call(0, "cpus") == sorted(os.sched_getaffinity(0))
            proc = hosts._procs[0]
            proc.kill()
            proc.join(10)
            await asyncio.sleep(0.3)
            # The dead pipe was noticed once (one error queued), not read in a loop.
            assert hosts._replies[0].qsize() == 1
            t = time.perf_counter()
            with pytest.raises(ConfigError) as info:
                await hosts.call(0, "counts")
            return str(info.value), time.perf_counter() - t
        finally:
            await hosts.close()

    message, waited = asyncio.run(scenario())
    assert "bench worker 0" in message and "exited" in message
    assert waited < 5.0  # not the 10 s reply timeout: the dead pipe was noticed
