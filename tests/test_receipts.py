"""Signed receipts, the receipt ledger and relay-equivocation evidence."""

from __future__ import annotations

import hashlib

import pytest

from chaos_flwr import codec
from chaos_flwr.charter import Charter
from chaos_flwr.errors import (
    DecodeError,
    EquivocationError,
    OversizeError,
    PolicyError,
    SignatureError,
    UnknownPartyError,
)
from chaos_flwr.identity import Identity
from chaos_flwr.receipts import Equivocation, Receipt, ReceiptLedger, receipt_signing_bytes
from chaos_flwr.receipts import receipt_signing_bytes as receipt_bytes

IDS = [Identity.from_seed(f"receipt-party-{i}") for i in range(4)]
OUTSIDER = Identity.from_seed("receipt-outsider")
CHARTER = Charter.create("receipts", IDS[:2], IDS[2:])
D1 = hashlib.sha256(b"aggregate-1").digest()
D2 = hashlib.sha256(b"aggregate-2").digest()


def ledger() -> ReceiptLedger:
    return ReceiptLedger.from_charter(CHARTER)


def test_signing_bytes_are_the_flower_party_receipt_bytes() -> None:
    for ident in IDS:
        assert receipt_signing_bytes(ident.party_id, 7, D1) == receipt_bytes(ident.party_id, 7, D1)
    # a blob a Flower party produced verifies as a Receipt
    blob = IDS[0].sign(receipt_bytes(IDS[0].party_id, 3, D2))
    r = Receipt.from_flower(IDS[0].party_id, 3, D2, blob)
    r.verify(CHARTER.keyring())


def test_certified_needs_quorum_of_distinct_signers() -> None:
    led = ledger()
    assert led.add(Receipt.sign(IDS[0], 1, D1)) is None
    assert led.add(Receipt.sign(IDS[0], 1, D1)) is None  # duplicate: no-op
    assert led.certified(1, 2) is None
    assert led.add(Receipt.sign(IDS[1], 1, D1)) is None
    assert led.certified(1, 2) == D1
    assert led.require_certified(1, 2) == D1
    assert led.holders(1, D1) == sorted([IDS[0].party_id, IDS[1].party_id])
    assert led.latest_certified(2) == (1, D1)
    with pytest.raises(PolicyError):
        led.require_certified(1, 3)
    with pytest.raises(PolicyError):
        led.certified(1, 0)


def test_two_parties_shown_two_digests_is_relay_equivocation() -> None:
    led = ledger()
    led.add(Receipt.sign(IDS[0], 4, D1))
    led.add(Receipt.sign(IDS[1], 4, D1))
    ev = led.add(Receipt.sign(IDS[2], 4, D2))
    assert ev is not None
    assert ev.culprit == "relay" and ev.round == 4
    assert {ev.first.digest, ev.second.digest} == {D1, D2}
    assert led.conflicted(4)
    assert led.certified(4, 1) is None  # no party accepts the round
    with pytest.raises(EquivocationError, match="round 4"):
        led.require_certified(4, 1)
    # transferable: another ledger checks and adopts the evidence
    other = ledger()
    decoded = Equivocation.decode(ev.encode())
    assert decoded == ev
    other.add_evidence(decoded)
    assert other.certified(4, 1) is None and other.conflicted(4)


def test_one_party_signing_two_digests_is_named() -> None:
    led = ledger()
    led.add(Receipt.sign(IDS[3], 2, D1))
    ev = led.add(Receipt.sign(IDS[3], 2, D2))
    assert ev is not None and ev.culprit == IDS[3].party_id


@pytest.mark.parametrize("attack", ["forged", "wrong-key", "outsider", "tampered-digest"])
def test_bad_receipts_raise_typed_change_nothing_and_are_logged(attack: str) -> None:
    led = ledger()
    led.add(Receipt.sign(IDS[0], 5, D1))
    before = led.receipts(5)
    if attack == "forged":
        bad = Receipt(IDS[1].party_id, 5, D2, bytes(64))
        err: type[Exception] = SignatureError
    elif attack == "wrong-key":
        sig = IDS[2].sign(receipt_signing_bytes(IDS[1].party_id, 5, D2))
        bad = Receipt(IDS[1].party_id, 5, D2, sig)
        err = SignatureError
    elif attack == "outsider":
        bad = Receipt.sign(OUTSIDER, 5, D2)
        err = UnknownPartyError
    else:
        good = Receipt.sign(IDS[1], 5, D1)
        bad = Receipt(good.party, 5, D2, good.signature)
        err = SignatureError
    with pytest.raises(err):
        led.add(bad)
    assert led.receipts(5) == before
    assert not led.conflicted(5)
    assert len(led.rejections) == 1 and isinstance(led.rejections[0].error, err)
    # forged evidence is refused too
    with pytest.raises(SignatureError):
        led.add_evidence(Equivocation(before[0], bad))
    assert not led.conflicted(5) and led.certified(5, 1) == D1


def test_receipt_codec_round_trip_and_strict_decode() -> None:
    r = Receipt.sign(IDS[1], 9, D2)
    assert Receipt.decode(r.encode()) == r
    with pytest.raises(DecodeError):
        Receipt.decode(r.encode()[:-1])
    with pytest.raises(DecodeError):
        Receipt.decode(codec.encode({"party": r.party, "round": 9, "digest": D2}))
    with pytest.raises(DecodeError):
        Receipt.decode(codec.encode({**r.to_value(), "round": -1}))
    with pytest.raises(OversizeError):
        Receipt.decode(codec.encode({**r.to_value(), "digest": bytes(5000)}))
    with pytest.raises(DecodeError):
        Equivocation(r, r)
    with pytest.raises(DecodeError):
        Receipt(r.party, 9, D2, b"")  # an unsigned Flower receipt is no receipt


def test_forget_before_keeps_evidence() -> None:
    led = ledger()
    led.add(Receipt.sign(IDS[0], 1, D1))
    led.add(Receipt.sign(IDS[1], 1, D2))
    led.add(Receipt.sign(IDS[0], 2, D1))
    led.forget_before(2)
    assert led.rounds() == [2]
    assert led.conflicted(1)
