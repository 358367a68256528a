"""What Chaos adds to Flower's messages: its message type, record keys and record layouts.

One module owns this wire vocabulary, so the server and client wings read and write the same
records. Every Chaos message and reply carries a ConfigRecord under :data:`CHAOS_RECORD_KEY`:

- **server -> party** (:func:`server_record`): the phase (:class:`Phase`), the certified round
  and digest, the envelopes relayed to the party, and on certify the inner strategy's state;
- **party -> server** (:func:`party_record` / :func:`read_party_record`): the party's id, its
  outgoing envelopes with their destinations, and its signed receipt.

A pull adds records of its own (:data:`PULL_DATA_KEY` for the joiner's control record, and
``chaos-pull.<party id>`` per donor, :func:`donor_key`); their contents are the messages of
:mod:`chaos_flwr.pull.messages`. Messages Chaos sends besides the inner strategy's are of type
:data:`CHAOS_MESSAGE_TYPE`. When the ServerApp sends a joiner the certified state itself
(:func:`take_record`), the join's control record carries the state's canonical bytes; the
joiner checks them against the holders' receipts before taking them up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from flwr.app import ConfigRecord, Message, RecordDict

from chaos_flwr.defaults import FLOWER_JOIN_MIN_SHARD_BYTES
from chaos_flwr.errors import DecodeError
from chaos_flwr.pull.negotiation import PULL_MAX_STATE_BYTES

__all__ = [
    "AUDIT_RECORD_PREFIX",
    "CHAOS_MESSAGE_TYPE",
    "CHAOS_RECORD_KEY",
    "JOIN_TAKE_OP",
    "PULL_DATA_KEY",
    "RECORD_VERSION",
    "RELAY_SPKI_KEY",
    "OutgoingLike",
    "PartyReply",
    "Phase",
    "donor_key",
    "party_record",
    "read_donor_records",
    "read_party_record",
    "server_record",
    "split_chaos",
    "split_chaos_content",
    "start_record",
    "take_record",
    "with_chaos",
    "with_content",
]

#: Flower message type of the messages Chaos sends besides the inner strategy's.
CHAOS_MESSAGE_TYPE: str = "query.chaos"
#: Key of the Chaos ConfigRecord in a message's or reply's RecordDict.
CHAOS_RECORD_KEY: str = "chaos"
#: Prefix of the records of audit material (a round's committed updates, for its auditors).
AUDIT_RECORD_PREFIX: str = "chaos-upd."
#: Key of the ConfigRecord that carries pull requests and shard replies in a RecordDict.
PULL_DATA_KEY: str = "chaos-pull"
#: Chaos record field of a hello: the SHA-256 of the ServerApp's link key (SubjectPublicKeyInfo),
#: which parties grant reads of their certified states (:mod:`chaos_flwr.flower.grant`).
RELAY_SPKI_KEY: str = "relay-spki"
#: ``op`` of a join control record that carries the certified state (:func:`take_record`).
JOIN_TAKE_OP: str = "take"
#: Version of the record layouts below.
RECORD_VERSION = 1


class Phase(StrEnum):
    """What a server message is for (its record's ``phase``)."""

    RELAY = "relay"  # train (and relay traffic): envelopes only
    CERTIFY = "certify"  # the new state: sign a receipt for it
    JOIN = "join"  # a joiner's pull step (control record + donor replies)
    PULL = "pull"  # a donor: answer the pull request from your replica


class OutgoingLike(Protocol):
    """An envelope to route on: ``to`` (party id) and ``data`` (sealed bytes)."""

    @property
    def to(self) -> str: ...

    @property
    def data(self) -> bytes: ...


@dataclass(frozen=True)
class PartyReply:
    """The Chaos part of one party's reply, as the relay reads it.

    Attributes
    ----------
    party:
        Party id the sender claims (binding only; envelopes are verified by recipients).
    outgoing:
        ``(destination party id, envelope bytes)`` pairs to route on.
    receipt_round, receipt_digest, receipt:
        The party's receipt for the state it holds: round, digest, and the signed receipt
        blob (empty when the party has no identity: such a receipt is *unsigned*).
    held_bytes:
        Size of the held state's bytes, sent on a run's first message to the party (a hint
        that spares a resume's pull its size step; -1: not sent).
    """

    party: str
    outgoing: tuple[tuple[str, bytes], ...]
    receipt_round: int
    receipt_digest: bytes
    receipt: bytes
    held_bytes: int = -1


def read_party_record(record: ConfigRecord) -> PartyReply:
    """Parse the Chaos ConfigRecord of a party's reply; :class:`DecodeError` names the field."""
    party = record.get("party", "")
    to = record.get("to", [])
    env = record.get("env", [])
    rnd = record.get("receipt-round", -1)
    dig = record.get("receipt-digest", b"")
    rec = record.get("receipt", b"")
    if not isinstance(party, str):
        raise DecodeError("chaos record field 'party' must be a str")
    if not isinstance(to, list) or not all(isinstance(t, str) for t in to):
        raise DecodeError("chaos record field 'to' must be a list of str")
    if not isinstance(env, list) or not all(isinstance(e, bytes) for e in env):
        raise DecodeError("chaos record field 'env' must be a list of bytes")
    if len(to) != len(env):
        raise DecodeError(f"chaos record fields 'to' ({len(to)}) and 'env' ({len(env)}) differ")
    if isinstance(rnd, bool) or not isinstance(rnd, int):
        raise DecodeError("chaos record field 'receipt-round' must be an int")
    if not isinstance(dig, bytes) or not isinstance(rec, bytes):
        raise DecodeError("chaos record fields 'receipt-digest' and 'receipt' must be bytes")
    size = record.get("held-bytes", -1)
    if (
        isinstance(size, bool)
        or not isinstance(size, int)
        or not -1 <= size <= PULL_MAX_STATE_BYTES
    ):
        raise DecodeError(
            f"chaos record field 'held-bytes' must be an int in [0, {PULL_MAX_STATE_BYTES}]"
        )
    pairs = tuple(
        (t, e) for t, e in zip(to, env, strict=True) if isinstance(t, str) and isinstance(e, bytes)
    )
    return PartyReply(party, pairs, rnd, dig, rec, size)


def party_record(
    party: str,
    outgoing: Iterable[OutgoingLike],
    *,
    receipt_round: int = -1,
    receipt_digest: bytes = b"",
    receipt: bytes = b"",
) -> ConfigRecord:
    """Build the Chaos ConfigRecord a party attaches to its reply."""
    outs = list(outgoing)
    return ConfigRecord(
        {
            "v": RECORD_VERSION,
            "party": party,
            "to": [o.to for o in outs],
            "env": [bytes(o.data) for o in outs],
            "receipt-round": receipt_round,
            "receipt-digest": receipt_digest,
            "receipt": receipt,
        }
    )


def server_record(
    envelopes: Sequence[bytes],
    *,
    phase: str,
    server_round: int,
    digest: bytes = b"",
    strategy_state: bytes | None = None,
) -> ConfigRecord:
    """Build the Chaos ConfigRecord the relay attaches to a message for one party.

    ``strategy_state`` (certify messages that carry the state) is the inner strategy's opaque
    state, part of the certified state whose digest is ``digest``.
    """
    record = ConfigRecord(
        {
            "v": RECORD_VERSION,
            "phase": phase,
            "round": server_round,
            "digest": digest,
            "env": list(envelopes),
        }
    )
    if strategy_state:
        record["strategy-state"] = strategy_state
    return record


def with_chaos(message: Message, record: ConfigRecord) -> Message:
    """Copy ``message`` with ``record`` added to its content (the original is left as it is).

    Strategies often share one RecordDict between all the messages of a round, so the Chaos
    record (different per party) goes into a fresh RecordDict holding the same records.
    """
    content = RecordDict(dict(message.content.items()))
    content[CHAOS_RECORD_KEY] = record
    return with_content(message, content)


def with_content(message: Message, content: RecordDict) -> Message:
    """A new message to ``message``'s destination, of its type, group and lifetime, carrying
    ``content``."""
    md = message.metadata
    return Message(
        content,
        dst_node_id=md.dst_node_id,
        message_type=md.message_type,
        group_id=md.group_id or None,
        ttl=md.ttl,
    )


def split_chaos(message: Message) -> ConfigRecord | None:
    """Remove and return the Chaos record of a message with content (``None`` if it has none).

    Audit material (``chaos-upd.*`` records) goes too: what remains is exactly what the
    application (or the inner strategy) expects to see.
    """
    if not message.has_content() or CHAOS_RECORD_KEY not in message.content:
        return None
    record, message.content = split_chaos_content(message.content)
    return record


def split_chaos_content(content: RecordDict) -> tuple[ConfigRecord | None, RecordDict]:
    """The Chaos record of ``content`` (``None`` if it has none) and the rest of it, without
    the Chaos record and audit material (:func:`split_chaos`, on a message's content)."""
    record = content.get(CHAOS_RECORD_KEY)
    rest = RecordDict(
        {
            k: v
            for k, v in content.items()
            if k != CHAOS_RECORD_KEY and not k.startswith(AUDIT_RECORD_PREFIX)
        }
    )
    return (record if isinstance(record, ConfigRecord) else None), rest


def donor_key(party: str) -> str:
    """RecordDict key of the request to / reply from donor ``party``."""
    return f"{PULL_DATA_KEY}.{party}"


def read_donor_records(content: RecordDict) -> dict[str, ConfigRecord]:
    """The per-donor records (``chaos-pull.<party>``) of a RecordDict, by party id."""
    prefix = f"{PULL_DATA_KEY}."
    out: dict[str, ConfigRecord] = {}
    for key, value in content.items():
        if key.startswith(prefix) and isinstance(value, ConfigRecord):
            out[key[len(prefix) :]] = value
    return out


def start_record(
    donors: list[str],
    receipts: list[bytes],
    min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES,
    total: int | None = None,
    records: Sequence[bytes] = (),
) -> ConfigRecord:
    """The first step's control record: the donors and their signed receipts (same order),
    the state's size when the ServerApp knows it (a hint: the donors' manifest decides), and
    ``records``: the donors' signed join and endpoint records, encoded (a joiner that came
    just now may not hold them yet; it verifies each before it dials an address one names)."""
    record = ConfigRecord(
        {
            "op": "start",
            "donors": list(donors),
            "receipts": list(receipts),
            "min-shard": min_shard_bytes,
        }
    )
    if total is not None:
        record["total"] = total
    if records:
        record["records"] = list(records)
    return record


def take_record(start: ConfigRecord, state: bytes) -> ConfigRecord:
    """A join control record that hands the joiner the certified state itself.

    It is ``start`` (the holders and their signed receipts, the round's audits) with ``op``
    :data:`JOIN_TAKE_OP` and ``state``: the state's canonical bytes
    (:meth:`chaos_flwr.state.TrainingState.to_bytes`, arrays and strategy state), which must
    hash to the digest the receipts name. The bytes are shared, not copied.
    """
    record = ConfigRecord(dict(start.items()))
    record["op"] = JOIN_TAKE_OP
    record["state"] = state
    return record
