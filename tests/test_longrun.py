"""Bounded growth (issue #18): the windows hold after many rounds; the long-run bench's JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest
from flwr.app import ConfigRecord
from typer.testing import CliRunner

from chaos_flwr.bench.longrun import LongRunSettings, least_squares_slope, run_long_run
from chaos_flwr.cli import app
from chaos_flwr.errors import PolicyError
from chaos_flwr.flower.client.party import Party
from chaos_flwr.flower.client.witness import PARTY_LEDGER_ROUNDS, PARTY_MAX_EVIDENCE
from chaos_flwr.flower.server import logs as server_logs
from chaos_flwr.flower.server.logs import (
    SERVER_MAX_ROUND_LOGS,
    MembershipEvent,
    RoundLog,
    RoundLogs,
)
from chaos_flwr.identity import Identity
from chaos_flwr.receipts import RECEIPT_LEDGER_MAX_ROUNDS, Receipt, ReceiptLedger


@pytest.fixture(scope="module")
def signers() -> list[Identity]:
    return [Identity.from_seed(f"test-longrun-{i}", name=f"t{i}") for i in range(3)]


def _keyring(ids: list[Identity]) -> dict[str, bytes]:
    return {str(i.party_id): bytes(i.public_key) for i in ids}


def _digest(rnd: int, variant: int = 0) -> bytes:
    return bytes([variant]) + rnd.to_bytes(31, "big")


def test_ledger_window_keeps_the_held_rounds_only(signers: list[Identity]) -> None:
    ledger = ReceiptLedger(_keyring(signers))
    for rnd in range(300):
        ledger.window(rnd - 15, rnd + 1)
        ledger.add_all(Receipt.sign(s, rnd, _digest(rnd)) for s in signers[:2])
    assert ledger.rounds() == list(range(284, 300))
    assert ledger.holders(299, _digest(299)) == sorted(str(s.party_id) for s in signers[:2])
    # a far-future receipt of an admitted party is ignored unverified: it evicts nothing
    assert ledger.add(Receipt.sign(signers[2], 10**9, _digest(7))) is None
    assert ledger.ignored == 1 and ledger.rounds() == list(range(284, 300))
    # evidence below the window goes with its round; evidence inside stays
    ev = ledger.add(Receipt.sign(signers[2], 290, _digest(290, 1)))
    assert ev is not None and ledger.conflicted(290)
    ledger.window(291, 301)
    assert not ledger.conflicted(290) and ledger.rounds()[0] == 291
    with pytest.raises(PolicyError):
        ledger.window(5, 4)


def test_ledger_without_window_is_capped(signers: list[Identity]) -> None:
    ledger = ReceiptLedger(_keyring(signers))
    n = RECEIPT_LEDGER_MAX_ROUNDS + 40
    for rnd in range(n):
        ledger.add(Receipt.sign(signers[0], rnd, _digest(rnd)))
    assert ledger.rounds() == list(range(40, n))
    # a round older than every held one is not kept (it cannot evict newer rounds)
    ledger.add(Receipt.sign(signers[1], 3, _digest(3)))
    assert ledger.rounds()[0] == 40 and len(ledger.rounds()) == RECEIPT_LEDGER_MAX_ROUNDS


def test_party_evidence_is_bounded_and_still_refuses(signers: list[Identity]) -> None:
    me, a, b = signers
    party = Party(party_id=str(me.party_id), keyring=_keyring(signers))
    for rnd in range(40):
        party.held_round, party.held_digest = rnd, _digest(rnd)
        blobs = [
            Receipt.sign(a, rnd, _digest(rnd, 1)).encode(),
            Receipt.sign(b, rnd, _digest(rnd, 2)).encode(),
        ]
        assert party.check_receipts(_record({"receipts": blobs}))
    assert len(party.evidence) == PARTY_MAX_EVIDENCE
    assert [ev.round for ev in party.evidence] == list(range(40 - PARTY_MAX_EVIDENCE, 40))
    ledger = party._ledger
    assert ledger is not None
    assert ledger.rounds() == list(range(40 - PARTY_LEDGER_ROUNDS, 40))


def test_party_reports_new_evidence_after_the_window_is_full(signers: list[Identity]) -> None:
    me, a, b = signers
    party = Party(party_id=str(me.party_id), keyring=_keyring(signers))
    sent = 0
    for rnd in range(PARTY_MAX_EVIDENCE + 5):
        party.held_round, party.held_digest = rnd, _digest(rnd)
        blobs = [
            Receipt.sign(a, rnd, _digest(rnd, 1)).encode(),
            Receipt.sign(b, rnd, _digest(rnd, 2)).encode(),
        ]
        out = party.process(_record({"receipts": blobs}), None)
        sent += "evidence" in out
    assert sent == PARTY_MAX_EVIDENCE + 5  # every round's new evidence went out


def _record(values: dict[str, Any]) -> ConfigRecord:
    return ConfigRecord(values)


def test_round_logs_keep_the_newest() -> None:
    logs = RoundLogs()
    for rnd in range(SERVER_MAX_ROUND_LOGS + 76):
        logs.append(RoundLog(rnd))
    assert len(logs) == SERVER_MAX_ROUND_LOGS and logs.dropped == 76
    assert logs[0].server_round == 76 and logs[-1].server_round == SERVER_MAX_ROUND_LOGS + 75
    small = RoundLogs([RoundLog(i) for i in range(5)], keep=3)
    assert [r.server_round for r in small[1:]] == [3, 4]
    with pytest.raises(ValueError):
        RoundLogs(keep=0)


def test_server_view_events_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from chaos_flwr.flower.server import view as view_mod

    monkeypatch.setattr(view_mod, "SERVER_MAX_EVENTS", 3)
    view = view_mod.ServerView.__new__(view_mod.ServerView)
    view.events, view._by_id, view._has, view._env, view._body = [], {}, {}, {}, {}
    for i in range(7):
        ev = MembershipEvent("leave", f"p{i}", f"r{i}", i, float(i))
        view.events.append(ev)
        view._by_id[ev.record_id], view._has[ev.record_id] = ev, set()
        view._env[bytes([i])] = (ev.record_id,)
        view._trim()
    assert [e.record_id for e in view.events] == ["r4", "r5", "r6"]
    assert sorted(view._by_id) == sorted(view._has) == ["r4", "r5", "r6"]
    assert list(view._env) == [bytes([4]), bytes([5]), bytes([6])]
    assert server_logs.SERVER_MAX_EVENTS >= 1


def test_least_squares_slope() -> None:
    assert least_squares_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert least_squares_slope([1, 1], [0, 5]) is None
    assert least_squares_slope([1], [0]) is None


def test_long_run_soak_json_shape() -> None:
    result = run_long_run(LongRunSettings(rounds=24, events=12, samples=3))
    soak = result["soak"]
    assert result["bench"] == "long-run" and result["settings"]["rounds"] == 24
    assert [s["round"] for s in soak["samples"]] == [8, 16, 24]
    assert soak["events"] == sum(soak["events_by_kind"].values()) and soak["events"] >= 6
    keys = {"state_bytes", "rss_kib", "message_ms", "rebuild_ms", "records"}
    assert set(soak["slopes_per_1000_rounds"]) == keys == set(soak["slopes_per_1000_events"])
    first = soak["samples"][0]
    assert first["state_bytes"] > 0 and first["rebuild_ms"] > 0 and first["active"] >= 3
    assert all(s["ledger_rounds"] <= PARTY_LEDGER_ROUNDS for s in soak["samples"])
    assert "flood" not in result


def test_long_run_cli_flood_json() -> None:
    out = CliRunner().invoke(app, ["bench", "long-run", "--json", "--flood", "40"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert result["soak"] is None
    flood = result["flood"]
    assert flood["quiet"]["minted"] == 0 and flood["flooded"]["minted"] == 40
    honest = len(flood["flooded"]["records_held"])
    assert honest == LongRunSettings().parties - 1
    held = max(flood["flooded"]["records_held"]) - min(flood["quiet"]["records_held"])
    assert flood["refused"] == sum(
        40 - (n - min(flood["quiet"]["records_held"])) for n in flood["flooded"]["records_held"]
    )
    assert 0 <= held <= 40
    assert flood["flooder"] == flood["flooded"]["flooder"]
    assert len(flood["flooded"]["signature_cache_entries"]) == honest
    assert len(flood["quiet"]["rejections_logged"]) == honest
    assert set(flood) >= {"message_ratio", "rss_growth_ratio", "named_by_peers"}


def test_long_run_soak_stops_at_its_time_budget() -> None:
    soak = run_long_run(LongRunSettings(rounds=50, events=0, samples=5, max_seconds=1e-6))["soak"]
    assert soak["stopped_early"] and soak["rounds"] == 1 and soak["rounds_asked"] == 50
    assert [s["round"] for s in soak["samples"]] == [1]
    with pytest.raises(ValueError):
        LongRunSettings(max_seconds=0)


def test_refused_by_is_read_whatever_the_peer_offers() -> None:
    from types import SimpleNamespace

    from chaos_flwr.bench.longrun import _refused_by

    assert _refused_by(SimpleNamespace()) == {}  # a peer without the flood budget
    assert _refused_by(SimpleNamespace(refused_by={"p1": 3, "p2": "x"})) == {"p1": 3}
    assert _refused_by(SimpleNamespace(refused_by=lambda: {"p1": 2})) == {"p1": 2}
