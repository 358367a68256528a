"""Train messages without the model their receivers already hold.

In a Chaos round every node that gets a train message holds the state the round trains from:
the ServerApp picks exactly the nodes whose signed receipts name that certified ``(round,
digest)``. So the model the inner strategy puts in each train message (as plain Flower does)
is a copy of what the receiver holds. The ServerApp leaves it out (:func:`elide_held`) and
names instead, in a small record (:data:`HELD_KEY`), the keys it left out and the state they
held; the party puts its own copy back before the application's train function sees the
message (:func:`restore_held`). The application reads the same arrays either way; the
ServerApp's uplink carries the model once per round (the new aggregate, in the certify)
instead of twice.

A party that does not hold exactly that state refuses the message with a typed error (it is
then not counted as a trainer, as a node that missed the round); it never trains on another
state.
"""

from __future__ import annotations

from typing import Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from chaos_flwr.errors import DecodeError, ProofError
from chaos_flwr.flower.schema import with_content

__all__ = ["HELD_KEY", "elide_held", "restore_held"]

#: Content key of the record that names the arrays a train message leaves out.
HELD_KEY = "chaos-held"


class HoldingParty(Protocol):
    """What :func:`restore_held` reads of a party."""

    held_round: int
    held_digest: bytes
    held_arrays: ArrayRecord | None


def elide_held(message: Message, arrays: ArrayRecord, server_round: int, digest: bytes) -> Message:
    """``message`` without the records that are ``arrays`` itself (the certified state of
    ``(server_round, digest)``), and with :data:`HELD_KEY` naming them; ``message`` itself if
    it carries none (a strategy that copied the arrays sends them as they are)."""
    keys = [k for k, v in message.content.items() if v is arrays]
    if not keys:
        return message
    content = RecordDict({k: v for k, v in message.content.items() if k not in keys})
    content[HELD_KEY] = ConfigRecord({"keys": keys, "round": server_round, "digest": digest})
    return with_content(message, content)


def restore_held(message: Message, party: HoldingParty) -> None:
    """Put the party's copy of the certified state back where the ServerApp left it out.

    Nothing happens for a message without :data:`HELD_KEY`.

    Raises
    ------
    DecodeError
        The record is malformed (bad keys, round or digest).
    ProofError
        The party does not hold exactly the state the record names.
    """
    if not message.has_content() or HELD_KEY not in message.content:
        return
    record = message.content.config_records.get(HELD_KEY)
    del message.content[HELD_KEY]
    keys = record.get("keys") if record is not None else None
    rnd = record.get("round") if record is not None else None
    digest = record.get("digest") if record is not None else None
    if (
        not isinstance(keys, list)
        or not 0 < len(keys) <= 8
        or not all(isinstance(k, str) and k and k not in message.content for k in keys)
        or not isinstance(rnd, int)
        or isinstance(rnd, bool)
        or not isinstance(digest, bytes)
    ):
        raise DecodeError(f"the {HELD_KEY} record must name 1..8 new keys, a round and a digest")
    held = party.held_arrays
    if held is None or (party.held_round, party.held_digest) != (rnd, digest):
        raise ProofError(
            f"the train message leaves out the state of round {rnd}, which this party does not "
            f"hold (it holds round {party.held_round}): it does not train on another state"
        )
    for key in keys:  # a record of its own: an app that edits it leaves the party's copy
        message.content[str(key)] = ArrayRecord(dict(held.items()))
