"""What a remote side or a planted file can make a party or the ServerApp keep is bounded."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from fake_grid import set_task_identity
from flwr.app import ConfigRecord, Message, RecordDict

from chaos_flwr.errors import ConfigError, DecodeError
from chaos_flwr.flower.client.factory import FLOWER_INCARNATION_MAX, _incarnation
from chaos_flwr.flower.client.party import PARTY_MAX_ERRORS, Party
from chaos_flwr.flower.client.settings import PartySettings
from chaos_flwr.flower.relay import Relay
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY, party_record
from chaos_flwr.flower.server.courier import FLOWER_MAX_EVIDENCE_PER_ROUND, Courier
from chaos_flwr.flower.server.logs import RoundLog
from chaos_flwr.flower.server.settings import PhaseSettings


class _Refusing:
    """A peer that refuses every envelope (as garbage from the relay would be)."""

    party_id = "p0"

    def handle(self, data: bytes, now: float) -> Sequence[object]:
        raise DecodeError(f"garbage envelope of {len(data)} bytes")

    def tick(self, now: float) -> Sequence[object]:
        return []


def test_garbage_from_the_relay_cannot_grow_a_partys_error_list() -> None:
    party = Party("p0", peer=_Refusing())  # type: ignore[arg-type]
    record = ConfigRecord({"env": [b"x%d" % i for i in range(5000)], "phase": "relay"})
    for _ in range(3):
        party.process(record, None)
    assert len(party.errors) == PARTY_MAX_ERRORS
    assert party.errors[-1] == "DecodeError: garbage envelope of 5 bytes"  # the newest kept


def test_one_party_cannot_flood_the_servers_evidence() -> None:
    set_task_identity()
    courier = Courier(Relay(), PhaseSettings())
    log = RoundLog(3)
    record = party_record("p1", [])
    record["evidence"] = [b"e%d" % i for i in range(10_000)]
    reply = Message(RecordDict({CHAOS_RECORD_KEY: record}), dst_node_id=0, message_type="query")
    courier.absorb(7, reply, {}, log)
    assert len(log.equivocations) == FLOWER_MAX_EVIDENCE_PER_ROUND
    courier.absorb(7, reply, {}, log)  # a second reply adds nothing past the bound
    assert len(log.equivocations) == FLOWER_MAX_EVIDENCE_PER_ROUND


def _settings(state_dir: Path) -> PartySettings:
    return PartySettings(key_path=None, charter_path=None, state_dir=state_dir, unsigned=True)


def test_an_incarnation_file_near_the_counters_limit_is_refused_not_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "incarnation"
    path.write_text(f"{2**63 - 1}\n")
    with pytest.raises(ConfigError, match="past the limit"):
        _incarnation(_settings(tmp_path))
    assert path.read_text() == f"{2**63 - 1}\n"  # nothing written
    path.write_text(f"{FLOWER_INCARNATION_MAX - 5}\n")  # high, but a start can go on from it
    assert _incarnation(_settings(tmp_path)) == FLOWER_INCARNATION_MAX - 4


def test_an_incarnation_fifo_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "incarnation")
    with pytest.raises(ConfigError, match="not a regular file"):
        _incarnation(_settings(tmp_path))
