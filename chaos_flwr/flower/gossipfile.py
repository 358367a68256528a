"""The records a party's daemon heard by gossip, on disk: ``<state-dir>/gossip.records``.

The daemon (:mod:`chaos_flwr.flower.daemon`) gossips with other parties' daemons
(:mod:`chaos_flwr.gossip`) and writes here the records it holds that the party's saved state
(``party.state``) lacks; its gossip never writes ``party.state`` (the party does, in the
ClientApp or in the daemon's local service, :mod:`chaos_flwr.flower.client.service`, each in
the party's turn). Each message the party handles takes the file up when it changed
(:func:`take_heard`): every record is verified against the charter exactly as one from the
relay, so the file gives nothing a peer could not give. Once the party saved them,
the daemon's next write leaves them out.

Format: a codec map ``{"version": 1, "records": [record, ..]}``, written atomically
(temporary file, rename), mode 0600, read bounded by
:data:`~chaos_flwr.defaults.GOSSIP_FILE_MAX_BYTES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from chaos_flwr import codec
from chaos_flwr.defaults import GOSSIP_FILE_MAX_BYTES, GOSSIP_MAX_RECORDS
from chaos_flwr.errors import ChaosError, StoreError
from chaos_flwr.localfile import read_local_file, write_local_file
from chaos_flwr.membership import Record

if TYPE_CHECKING:
    from chaos_flwr.flower.client.party import Party

__all__ = ["GOSSIP_FILE", "read_heard", "take_heard", "write_heard"]

#: File name of the gossip-heard records in a party's state directory.
GOSSIP_FILE = "gossip.records"
_VERSION = 1


def write_heard(state_dir: Path, records: Sequence[Record]) -> Path:
    """Write ``records`` (at most :data:`GOSSIP_MAX_RECORDS`) atomically.

    Raises
    ------
    StoreError
        The file cannot be written, or the records pass the file's bound.
    """
    data = codec.encode(
        {"version": _VERSION, "records": [r.to_wire() for r in records[:GOSSIP_MAX_RECORDS]]}
    )
    if len(data) > GOSSIP_FILE_MAX_BYTES:
        raise StoreError(f"gossip records of {len(data)} bytes, over GOSSIP_FILE_MAX_BYTES")
    return write_local_file(
        Path(state_dir) / GOSSIP_FILE, data, what="gossip records", error=StoreError
    )


def read_heard(state_dir: Path) -> list[Record]:
    """The records in the file, shape-checked (not verified: the reader verifies them); an
    absent file holds none.

    Raises
    ------
    StoreError
        The file is not a regular file, too large, or not a gossip records file.
    """
    path = Path(state_dir) / GOSSIP_FILE
    if not path.exists():
        return []
    raw = read_local_file(
        path, what="gossip records file", error=StoreError, max_bytes=GOSSIP_FILE_MAX_BYTES
    )
    try:
        value = codec.decode(raw, max_bytes=GOSSIP_FILE_MAX_BYTES)
        if not isinstance(value, dict) or value.get("version") != _VERSION:
            raise StoreError("not a version-1 gossip records map")
        records = value.get("records")
        if not isinstance(records, list) or len(records) > GOSSIP_MAX_RECORDS:
            raise StoreError(f"'records' must be a list of at most {GOSSIP_MAX_RECORDS}")
        return [Record.from_wire(r) for r in records]
    except ChaosError as exc:
        raise StoreError(f"{path}: {exc}") from exc


def take_heard(party: Party, now: float) -> int:
    """Take up the gossip-heard records into ``party``'s peer when the file changed since
    this party last looked; returns how many records were new.

    A file that does not read, or a record that does not verify, takes nothing and is noted
    in ``party.errors`` (the relay still brings every record in time).
    """
    peer, state_dir = party.peer, party.state_dir
    load = getattr(peer, "load_records", None)
    if load is None or state_dir is None:
        return 0
    try:
        st = (Path(state_dir) / GOSSIP_FILE).stat()
    except OSError:
        return 0
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    if key == party.gossip_seen:
        return 0
    party.gossip_seen = key
    try:
        return int(load([r.to_wire() for r in read_heard(Path(state_dir))], now))
    except ChaosError as exc:
        party.errors.append(f"gossip records not taken ({type(exc).__name__}: {exc})")
        return 0
