"""A trainer's update as the verifiable rounds see it: its digest, its weight, and how the
committed updates of a round travel to its auditors.

:func:`update_digest` is the one definition of what a commitment
(:class:`chaos_flwr.rounds.Commitment`) binds: every record of the train reply that the
aggregation can read (all of them but Chaos's own), in the reply's order, each array's dtype,
shape, storage type and bytes, each metric and config value. The trainer signs it; the ServerApp
checks it before it aggregates the update; an auditor checks it before it recomputes.

Audit material (:func:`pack_updates` / :func:`unpack_updates`) rides on the certify message of
the round to its auditors: the records of update ``i`` under ``chaos-upd.<party>.<key>``. Its
arrays are :class:`SharedArray`: the same bytes, which Flower's simulation engine hands to the
auditor's ClientApp worker without copying them (see the class).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping, Sequence
from typing import Any, SupportsIndex

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from chaos_flwr import codec
from chaos_flwr.errors import DecodeError
from chaos_flwr.flower.schema import AUDIT_RECORD_PREFIX, CHAOS_RECORD_KEY

__all__ = [
    "UPDATE_RECORD_PREFIX",
    "WEIGHT_KEY",
    "SharedArray",
    "copy_update",
    "pack_updates",
    "unpack_updates",
    "update_digest",
    "update_records",
    "updates_size",
    "weight_of",
]

#: Prefix of the keys of audit material in a message's RecordDict (the schema's).
UPDATE_RECORD_PREFIX = AUDIT_RECORD_PREFIX
#: The metric a FedAvg-family aggregation weighs an update by (Flower's default
#: ``weighted_by_key``); a commitment's weight is its value.
WEIGHT_KEY = "num-examples"
_DOMAIN = b"chaos-flwr/update/v1\x00"


def _is_chaos(key: str) -> bool:
    return key == CHAOS_RECORD_KEY or key.startswith("chaos-")


def update_records(content: RecordDict) -> dict[str, ArrayRecord | MetricRecord | ConfigRecord]:
    """The records of a train reply that make up the update (all but Chaos's own), in order."""
    return {k: v for k, v in content.items() if not _is_chaos(k)}


def _value_bytes(value: object) -> bytes:
    try:
        return codec.encode(value)
    except (TypeError, ValueError):
        return repr(value).encode()


def update_digest(content: RecordDict | Mapping[str, object]) -> bytes:
    """SHA-256 of an update (module docstring): 32 bytes."""
    h = hashlib.sha256(_DOMAIN)
    items = content.items()
    for key, record in items:
        if _is_chaos(key):
            continue
        h.update(codec.encode([key, type(record).__name__]))
        if isinstance(record, ArrayRecord):
            for name, arr in record.items():
                h.update(codec.encode([name, str(arr.dtype), list(arr.shape), arr.stype]))
                h.update(len(arr.data).to_bytes(8, "big"))
                h.update(arr.data)
        elif isinstance(record, MetricRecord | ConfigRecord):
            for name, value in record.items():
                h.update(codec.encode(name))
                h.update(_value_bytes(value))
        else:
            h.update(_value_bytes(record))
    return h.digest()


def weight_of(content: RecordDict, key: str = WEIGHT_KEY) -> int:
    """The update's weight: the integer ``key`` metric of its (first) MetricRecord, else 0."""
    for record in content.values():
        if isinstance(record, MetricRecord) and key in record:
            value = record[key]
            if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
                return int(value)
    return 0


def copy_update(content: RecordDict) -> RecordDict:
    """The update records of a reply in a new RecordDict, each record container copied (the
    arrays' bytes are shared, not copied): what the reply's owner does to its own records
    afterwards (an inner strategy popping arrays) does not reach the copy."""
    out = RecordDict()
    for key, record in update_records(content).items():
        if isinstance(record, ArrayRecord):
            out[key] = ArrayRecord(dict(record.items()))
        elif isinstance(record, MetricRecord):
            out[key] = MetricRecord(dict(record.items()))
        else:
            out[key] = ConfigRecord(dict(record.items()))
    return out


def updates_size(updates: Sequence[tuple[str, RecordDict]]) -> int:
    """Array bytes of the updates ``(party, content)`` (what an auditor is sent)."""
    total = 0
    for _, content in updates:
        for record in update_records(content).values():
            if isinstance(record, ArrayRecord):
                total += sum(len(a.data) for a in record.values())
    return total


def _array(dtype: str, shape: tuple[int, ...], stype: str, data: Any) -> Array:
    """An Array unpickled from :meth:`SharedArray.__reduce_ex__`: its bytes as they came, or a
    read-only view of the buffer they came out of band in (no copy)."""
    if isinstance(data, bytes):
        return Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data)
    out = Array.__new__(Array)
    out.dtype, out.shape, out.stype = dtype, tuple(shape), stype
    out.data = memoryview(data).cast("B").toreadonly()  # type: ignore[assignment]
    return out


class SharedArray(Array):
    """An :class:`~flwr.app.Array` of audit material whose bytes pickle out of band.

    Flower's simulation engine hands every message to its ClientApp worker process by pickling
    it (Ray, pickle protocol 5). A plain Array's bytes are pickled in band: copied into the
    pickle, again into Ray's object store, and again out of it in the worker, which for the
    n committed updates an auditor is sent is most of what the audit costs (see
    docs/internals.md, "Verifiable rounds"). This Array hands its bytes over as a
    :class:`pickle.PickleBuffer`: with a buffer callback (Ray's) they go out of band, written
    once into the object store and read in place by the worker (a read-only ``memoryview``
    as :attr:`data`); without one they pickle as bytes and unpickle as a plain Array.

    Anything else is an Array's: the same fields, digest (:func:`update_digest`) and
    deflated form (its header names ``Array``: the deployment engine's receivers inflate a
    plain Array from it).
    """

    __qualname__ = "Array"  # what Flower's deflated header names (and its receivers inflate)

    @classmethod
    def of(cls, array: Array) -> Array:
        """``array``'s fields as a SharedArray (its bytes shared, not copied); an Array whose
        data is not ``bytes`` is returned as it is."""
        if type(array) is not Array or not isinstance(array.data, bytes):
            return array
        return cls(dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=array.data)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """Rebuilt as a plain Array; the bytes out of band with protocol 5 (class docstring)."""
        data = pickle.PickleBuffer(self.data) if int(protocol) >= 5 else self.data
        return (_array, (self.dtype, tuple(self.shape), self.stype, data))


def _shared(record: ArrayRecord) -> ArrayRecord:
    out = ArrayRecord()
    for name, array in record.items():
        out[name] = SharedArray.of(array)  # item by item: the constructor would copy them
    return out


def pack_updates(updates: Sequence[tuple[str, RecordDict]], into: RecordDict) -> None:
    """Put the updates ``(party, content)`` into a message's RecordDict as audit material
    (their arrays as :class:`SharedArray`, sharing the updates' bytes)."""
    for party, content in updates:
        for key, record in update_records(content).items():
            if isinstance(record, ArrayRecord):
                record = _shared(record)
            into[f"{UPDATE_RECORD_PREFIX}{party}.{key}"] = record


def unpack_updates(content: RecordDict) -> dict[str, RecordDict]:
    """The audit material of a message: party -> its update's RecordDict (in arrival order).

    Raises
    ------
    DecodeError
        A key that names no party.
    """
    out: dict[str, RecordDict] = {}
    for key, record in content.items():
        if not key.startswith(UPDATE_RECORD_PREFIX):
            continue
        party, dot, name = key[len(UPDATE_RECORD_PREFIX) :].partition(".")
        if not dot or not party or not name:
            raise DecodeError(f"audit material key {key!r} is not 'chaos-upd.<party>.<key>'")
        out.setdefault(party, RecordDict())[name] = record
    return out
