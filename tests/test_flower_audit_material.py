"""Audit material as it travels to an auditor: the committed updates' arrays go as
:class:`~chaos_flwr.flower.updates.SharedArray`, whose bytes pickle out of band (what Flower's
simulation engine, through Ray, does with every message) and deflate as a plain Array's (what
the deployment engine sends)."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from test_flower_lib_join import _initial
from test_flower_verified_rounds import PARTIES, TYPED, _alarms, _certified, _world

from chaos_flwr.charter import AggregationRule
from chaos_flwr.flower.rule import recompute
from chaos_flwr.flower.server.proofs import AuditJob, RoundProofs
from chaos_flwr.flower.server.state import certified_state
from chaos_flwr.flower.updates import (
    SharedArray,
    copy_update,
    pack_updates,
    unpack_updates,
    update_digest,
    updates_size,
)
from chaos_flwr.rounds import Audit, auditors_of

ROUNDS_BASE = 0


def _update(seed: int, examples: int) -> RecordDict:
    rng = np.random.default_rng(seed)
    return RecordDict(
        {
            "arrays": ArrayRecord(
                [rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal(32)]
            ),
            "metrics": MetricRecord({"num-examples": examples, "loss": 0.25}),
            "config": ConfigRecord({"note": "x"}),
        }
    )


def _updates() -> list[tuple[str, RecordDict]]:
    return [(f"p{i}", _update(i, 10 + i)) for i in range(4)]


def _packed() -> tuple[list[tuple[str, RecordDict]], RecordDict]:
    updates = _updates()
    content = RecordDict()
    pack_updates(updates, content)
    return updates, content


def _data(record: ArrayRecord) -> list[object]:
    return [a.data for a in record.values()]


def test_packed_arrays_share_the_updates_bytes_and_deflate_as_plain_arrays() -> None:
    updates, content = _packed()
    for party, update in updates:
        packed = content[f"chaos-upd.{party}.arrays"]
        assert isinstance(packed, ArrayRecord)
        assert all(type(a) is SharedArray for a in packed.values())
        assert all(a is b for a, b in zip(_data(packed), _data(update["arrays"]), strict=True))
        # the deployment engine sends the deflated form: byte for byte an Array's
        assert packed.deflate() == update["arrays"].deflate()
        assert packed.object_id == update["arrays"].object_id
        for a, b in zip(packed.values(), update["arrays"].values(), strict=True):
            assert a.deflate() == b.deflate() and a.deflate().startswith(b"Array ")
    unpacked = unpack_updates(content)
    assert [p for p, _ in updates] == list(unpacked)
    for party, update in updates:
        assert update_digest(unpacked[party]) == update_digest(update)
    assert updates_size(list(unpacked.items())) == updates_size(updates) > 0


def test_out_of_band_pickling_moves_no_array_bytes_and_unpickles_views() -> None:
    updates, content = _packed()
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(content, protocol=5, buffer_callback=buffers.append)
    size = updates_size(updates)
    assert len(buffers) == 8  # two arrays of each of the four updates, out of band
    assert sum(b.raw().nbytes for b in buffers) == size
    assert len(blob) < size / 4  # the pickle itself carries no array bytes
    back = pickle.loads(blob, buffers=buffers)
    unpacked = unpack_updates(back)
    for party, update in updates:
        record = unpacked[party]["arrays"]
        assert isinstance(record, ArrayRecord)
        for got, sent in zip(record.values(), update["arrays"].values(), strict=True):
            assert type(got) is Array  # a plain Array again, its data a read-only view
            assert isinstance(got.data, memoryview) and got.data.readonly
            view, source = (np.frombuffer(a.data, np.uint8) for a in (got, sent))
            assert np.shares_memory(view, source)  # read in place: no copy
            np.testing.assert_array_equal(got.numpy(), sent.numpy())
        assert update_digest(unpacked[party]) == update_digest(update)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_in_band_pickling_gives_plain_arrays_with_bytes(protocol: int) -> None:
    updates, content = _packed()
    back = pickle.loads(pickle.dumps(content, protocol=protocol))
    unpacked = unpack_updates(back)
    for party, update in updates:
        record = unpacked[party]["arrays"]
        assert isinstance(record, ArrayRecord)
        assert all(type(a) is Array and type(a.data) is bytes for a in record.values())
        assert update_digest(unpacked[party]) == update_digest(update)


@pytest.mark.parametrize("strategy", ["FedAvg", "FedMedian", "FedTrimmedAvg"])
def test_an_auditor_recomputes_the_same_state_from_out_of_band_material(strategy: str) -> None:
    updates, content = _packed()
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(content, protocol=5, buffer_callback=buffers.append)
    unpacked = unpack_updates(pickle.loads(blob, buffers=buffers))
    base_arrays = ArrayRecord([np.zeros((64, 32), np.float32), np.zeros(32)])
    base = certified_state(base_arrays, ROUNDS_BASE, b"")
    rule = AggregationRule(strategy=strategy, args={})
    sent = recompute(rule, base, ROUNDS_BASE + 1, [u for _, u in updates])
    got = recompute(rule, base, ROUNDS_BASE + 1, [unpacked[p] for p, _ in updates])
    assert got.digest() == sent.digest()


def test_an_array_that_is_not_plain_bytes_is_packed_as_it_is() -> None:
    odd = Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=b"\x00" * 4)
    odd.data = memoryview(b"\x00" * 4)  # type: ignore[assignment]
    assert SharedArray.of(odd) is odd
    shared = SharedArray.of(Array(np.zeros(2)))
    assert SharedArray.of(shared) is shared


def _forged(update: RecordDict, how: str) -> RecordDict:
    """``update`` with its first array changed: one byte of it (``values``), or its shape (a
    FedAvg of it fails: ``shape``)."""
    out = copy_update(update)
    record = next(r for r in out.values() if isinstance(r, ArrayRecord))
    name, array = next(iter(record.items()))
    if how == "values":
        data = bytearray(array.data)
        data[-1] ^= 0xFF
        record[name] = Array(
            dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=bytes(data)
        )
    else:
        record[name] = Array(np.zeros(3, np.float32))
    return out


@pytest.mark.parametrize("how", ["values", "shape"])
def test_an_auditor_refuses_material_that_is_not_the_committed_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The relay sends the round-1 auditor one forged update: the auditor refuses it as not
    the committed one (whatever the recomputation, which runs beside the checks, made of
    it) and signs nothing; the audit asked again with the right material makes round 1
    final."""
    honest = RoundProofs.audit_job
    forged: list[str] = []

    def audit_job(self: RoundProofs, active: Sequence[str]) -> AuditJob | None:
        job = honest(self, active)
        if job is not None and not forged:
            (victim, update), *rest = job.updates
            forged.append(victim)
            job = dataclasses.replace(job, updates=((victim, _forged(update, how)), *rest))
        return job

    monkeypatch.setattr(RoundProofs, "audit_job", audit_job)
    w = _world(tmp_path)
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=3, timeout=10)
    assert _certified(strategy) == [1, 2, 3]
    r1 = next(r for r in strategy.rounds if r.server_round == 1)
    (auditor,) = auditors_of(1, r1.members["active"], 1)
    for p in range(PARTIES):
        party = w.party(p)
        want = (
            [f"ProofError: audit of round 1: the update of {forged[0]} is not the one it committed"]
            if party.party_id == auditor
            else []
        )
        assert _alarms(party, TYPED) == want
    audits = strategy.courier.proofs.audits_of(1, r1.digest)  # type: ignore[union-attr]
    # positive audits only: of the asking again with the right material (the forged one got
    # nothing signed, not even a negative audit)
    assert audits and all(Audit.decode(b).ok for b in audits)
    assert auditor in {Audit.decode(b).party for b in audits}
