"""Train messages without the model their receivers hold (chaos_flwr/flower/held.py).

The end-to-end case (same model, same trainers, no arrays on the wire from round 2 on) is in
``test_flower_lib_join.py::test_train_messages_leave_out_the_model_each_party_holds``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from fake_grid import set_task_identity
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from chaos_flwr.errors import DecodeError, ProofError
from chaos_flwr.flower.held import HELD_KEY, elide_held, restore_held

DIGEST = b"d" * 32


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    set_task_identity()  # Message(...) needs it outside a running app


def _arrays(value: float = 1.0) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.full((4, 3), value, np.float32))})


def _train(arrays: ArrayRecord) -> Message:
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"lr": 0.1})})
    return Message(content, dst_node_id=7, message_type="train")


@dataclass
class _Party:
    held_round: int = 3
    held_digest: bytes = DIGEST
    held_arrays: ArrayRecord | None = None


def test_the_held_model_is_left_out_and_put_back_unchanged() -> None:
    arrays = _arrays()
    sent = elide_held(_train(arrays), arrays, 3, DIGEST)
    assert set(sent.content.keys()) == {"config", HELD_KEY}
    assert sent.metadata.dst_node_id == 7 and sent.metadata.message_type == "train"
    assert sent.content.config_records[HELD_KEY]["keys"] == ["arrays"]
    mine = _arrays()  # the party's own copy (equal values, another object)
    restore_held(sent, _Party(held_arrays=mine))
    assert set(sent.content.keys()) == {"config", "arrays"}
    got = sent.content.array_records["arrays"]
    assert got is not mine and list(got) == ["w"] and got["w"].data is mine["w"].data  # no copy
    del got["w"]  # an application that edits the record leaves the party's copy alone
    assert list(mine) == ["w"]
    assert sent.content.config_records["config"]["lr"] == 0.1


def test_a_message_whose_arrays_are_a_copy_is_sent_as_it_is() -> None:
    msg = _train(_arrays())
    assert elide_held(msg, _arrays(), 3, DIGEST) is msg  # not the very state: not left out
    restore_held(msg, _Party())  # nothing named: nothing to do
    assert "arrays" in msg.content


def test_a_party_that_does_not_hold_the_named_state_refuses() -> None:
    arrays = _arrays()
    for party in (
        _Party(held_arrays=None),
        _Party(held_round=2, held_arrays=_arrays()),
        _Party(held_digest=b"x" * 32, held_arrays=_arrays()),
    ):
        with pytest.raises(ProofError, match="does not hold"):
            restore_held(elide_held(_train(arrays), arrays, 3, DIGEST), party)


@pytest.mark.parametrize(
    "record",
    [
        {"keys": [], "round": 3, "digest": DIGEST},
        {"keys": ["config"], "round": 3, "digest": DIGEST},  # would overwrite a record
        {"keys": ["arrays"], "round": True, "digest": DIGEST},
        {"keys": ["arrays"], "round": 3, "digest": "d"},
        {"keys": [f"k{i}" for i in range(9)], "round": 3, "digest": DIGEST},
    ],
)
def test_a_malformed_held_record_is_refused(record: dict[str, object]) -> None:
    content = RecordDict({"config": ConfigRecord({"lr": 0.1})})
    content[HELD_KEY] = ConfigRecord(record)  # type: ignore[arg-type]
    msg = Message(content, dst_node_id=7, message_type="train")
    with pytest.raises(DecodeError, match=HELD_KEY):
        restore_held(msg, _Party(held_arrays=_arrays()))
    assert HELD_KEY not in msg.content  # never reaches the application
