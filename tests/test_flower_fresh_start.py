"""A churn-free start costs what plain Flower's does (issue #15): the initial state's certify
rides on the first round's train messages in a verified federation, a certified state is
hashed once per message (the digest the certify was checked against is reused for the held
state and the replica), and a Flower ``Array`` is viewed in place, not copied."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from test_flower_lib_join import _initial
from verified_world import VerifiedWorld

from chaos_flwr.errors import DecodeError, StoreError
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY
from chaos_flwr.flower.server.courier import message_kind
from chaos_flwr.state import TrainingState, from_array_record
from chaos_flwr.store import ReplicaStore

PARTIES = 4


def _state(round_: int = 3) -> TrainingState:
    w = np.arange(1000, dtype=np.float32).reshape(10, 100)
    return TrainingState(arrays={"w": w, "b": np.ones(7, np.int64)}, round=round_)


# -- the store takes a digest its caller just checked -------------------------------------------
def test_a_replica_written_with_its_known_digest_is_the_same_file(tmp_path: Path) -> None:
    state = _state()
    hashed = ReplicaStore(tmp_path / "a").put(state, certificate=b"c")
    given = ReplicaStore(tmp_path / "b").put(state, certificate=b"c", digest=state.digest())
    assert hashed.read_bytes() == given.read_bytes()
    again = ReplicaStore(tmp_path / "b").get(3)
    assert again.digest() == state.digest()


def test_a_wrong_known_digest_makes_a_replica_that_is_refused_on_read(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path)
    store.put(_state(), digest=hashlib.sha256(b"another state").digest())
    with pytest.raises(StoreError, match="digest mismatch"):
        store.get(3)


@pytest.mark.parametrize("bad", [b"short", "0" * 32, bytes(33)])
def test_a_malformed_known_digest_is_refused_before_writing(tmp_path: Path, bad: object) -> None:
    store = ReplicaStore(tmp_path)
    with pytest.raises(StoreError, match="32-byte"):
        store.put(_state(), digest=bad)  # type: ignore[arg-type]
    assert store.rounds() == []


# -- a Flower Array is viewed in place ----------------------------------------------------------
def test_numpy_arrays_are_viewed_without_a_copy() -> None:
    w = np.linspace(0, 1, 4096, dtype=np.float32).reshape(64, 64)
    record = ArrayRecord({"w": Array(w)})
    state = from_array_record(record, round=1)
    got = state.arrays["w"]
    np.testing.assert_array_equal(got, w)
    assert not got.flags.writeable  # a view of the message's own bytes
    assert np.shares_memory(got, np.frombuffer(record["w"].data, np.uint8))
    assert state.digest() == TrainingState(arrays={"w": w}, round=1).digest()


def test_fortran_order_and_scalars_decode_to_the_same_state() -> None:
    f = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    s = np.array(5, dtype=np.int32)
    state = from_array_record(ArrayRecord({"f": Array(f), "s": Array(s)}), round=0)
    np.testing.assert_array_equal(state.arrays["f"], f)
    assert state.arrays["s"].shape == () and int(state.arrays["s"]) == 5
    want = TrainingState(arrays={"f": f, "s": s}, round=0)
    assert state.digest() == want.digest()


def test_an_array_whose_bytes_do_not_match_its_header_is_refused() -> None:
    good = Array(np.zeros(16, np.float32))
    cut = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-8])
    with pytest.raises((DecodeError, ValueError)):
        from_array_record(ArrayRecord({"w": cut}), round=0)


def test_an_object_array_is_still_refused() -> None:
    obj = Array(np.zeros(2, np.float32))
    data = obj.data.replace(b"'<f4'", b"'|O' ")  # an object dtype in the same header
    bad = Array(dtype="object", shape=(2,), stype=obj.stype, data=data)
    with pytest.raises(DecodeError, match="object arrays are refused"):
        from_array_record(ArrayRecord({"w": bad}), round=0)


# -- the initial state rides on the first train messages ----------------------------------------
def test_a_fresh_verified_start_certifies_round_0_on_the_first_train_messages(
    tmp_path: Path,
) -> None:
    w = VerifiedWorld(tmp_path, PARTIES, founders=PARTIES)
    for p in range(PARTIES):
        w.add(p)
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=3, timeout=10)
    for p in range(PARTIES):
        got = w.nodes[p].received
        # the hello, then nothing but the inner strategy's messages: no certify exchange
        assert got[0] == "query.chaos", got
        assert got[1:] == ["train", "evaluate"] * 3, got
    logs = {r.server_round: r for r in strategy.rounds if not r.skipped}
    assert sorted(logs) == [-1, 0, 1, 2, 3]
    assert logs[0].holders == sorted(w.pid(p) for p in range(PARTIES))
    assert sorted(logs[1].trained) == sorted(n.node_id for n in w.nodes.values())
    for p in range(PARTIES):
        party = w.party(p)
        assert (party.held_round, party.held_digest) == (3, logs[3].digest)
        assert not [e for e in party.errors if "Error" in e], party.errors


def test_a_train_message_is_timed_as_training_whatever_rides_on_it() -> None:
    # round 1's train messages carry the genesis certify; their reply times must feed the
    # same history as every later train message (else round 2 has none to set its deadline)
    def msg(kind: str, phase: str) -> Message:
        content = RecordDict({CHAOS_RECORD_KEY: ConfigRecord({"phase": phase})})
        return Message(content, dst_node_id=7, message_type=kind, group_id="g")

    assert message_kind(msg("train", "certify")) == "relay:train"
    assert message_kind(msg("train", "relay")) == "relay:train"
    assert message_kind(msg("evaluate", "certify")) == "certify:evaluate"
    assert message_kind(msg("query.chaos", "certify")) == "certify:query.chaos"
