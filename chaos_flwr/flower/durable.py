"""A party's protocol state on disk, so that it outlives one ClientApp process.

Flower's deployment engine starts a new ClientApp process for every message. Everything a
:class:`~chaos_flwr.flower.client.Party` must remember between two messages is saved in its
state directory (``<state-dir>/party.state``) before the handler returns (so before any
envelope of that message leaves the process) and loaded when the party is built.

What is saved
-------------
- the signed membership records the peer holds and the digest of the charter it verified
  them under (see *Sealed records* below);
- the peer's incarnation, last sequence number and replay-guard state;
- the outgoing envelopes not yet handed to the relay (``Party.pending``);
- the join progress: when a sponsored join was asked, the links asked, and the joiner's
  pull in progress (:mod:`chaos_flwr.pull.saved`: an explicit, versioned value holding the
  plan, the manifest and the verified shards received so far);
- the receipt ledger (recent rounds) and the equivocation evidence;
- the **lifetime** token: which SuperNode process this party life belongs to.

Same life or a real restart?
----------------------------
A ClientApp process started by the same SuperNode process (same parent pid and parent start
time) continues the saved life: same incarnation, sequence numbers go on above the saved one,
so receivers' replay guards accept them. A new SuperNode process (a crash and restart, a new
simulation worker, :func:`~chaos_flwr.flower.client.forget_party`) is a *real restart*: the
records and replay state are taken up, but the party starts a fresh incarnation (sequence
numbers start again, which only a higher incarnation allows).

Format and failure
------------------
One codec document: ``MAGIC || sha256(body) || seal || body``, written to a temporary file
and renamed over the old one. The seal is the party's own Ed25519 signature of the hash
(deterministic, so the party recomputes it on load without a public key): a file the party's
key did not seal is refused like a corrupt one, so whoever can write the state directory but
lacks the key cannot plant a state the party would take up. A SIGKILL mid-write leaves the
previous file (the page cache outlives a killed process). The file is not fsynced by default
(:data:`~chaos_flwr.defaults.FLOWER_DURABLE_FSYNC`): only a power loss or kernel crash could
lose or tear it, and that also ends the SuperNode process, so the next start is a real restart
in any case (fresh incarnation); what a stale or torn file can then give is records (which
re-verify or are refused), an older replay snapshot (safe for all it covers) and a receipt
ledger; a torn file fails its hash and is discarded. A save of a 12 KB state took 6 ms
(median) with fsync on the test machine and 0.5 ms without, and a simulation party saves
after every message.

Sealed records
--------------
Every record the peer holds was verified (or signed) by this party before it was saved. When
:func:`load` checked the seal (``SavedParty.sealed``) and the file names the charter the party
runs under now (``SavedParty.charter``), the factory takes the records up without verifying
their signatures again (:meth:`chaos_flwr.peer.Peer.load_records` with ``sealed=True``): a
start then costs what decoding the file costs, not one Ed25519 check per record, so the cost
per message on the deployment engine does not grow with the federation's age. Changing any
record breaks the hash or, if the hash is recomputed, the seal (only the party's key makes
it), and the file is refused with :class:`~chaos_flwr.errors.StoreError`. A file saved under
another charter (or before the field existed) has its records verified one by one.

The body names its format (``"format"``, :data:`SAVED_FORMAT`). Format 1 (no field; it held
a pickled pull) is migrated: the pickled pull is dropped unread (that pull starts again), the
rest is kept; an unknown format is refused. A pull too large for
:data:`~chaos_flwr.defaults.FLOWER_DURABLE_MAX_BYTES` is not saved (the rest is).

A file that is unreadable, truncated or fails its hash (or names another party) raises
:class:`~chaos_flwr.errors.StoreError` from :func:`load`; the party factory then discards it
with a logged warning (renamed ``party.state.bad``) and starts as a real restart (fresh
incarnation, records from the relay), never continuing a life it cannot prove it had.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_flwr import codec
from chaos_flwr.defaults import (
    FLOWER_DURABLE_FSYNC,
    FLOWER_DURABLE_LEDGER_ROUNDS,
    FLOWER_DURABLE_MAX_BYTES,
)
from chaos_flwr.errors import ChaosError, StoreError
from chaos_flwr.localfile import read_local_file

__all__ = [
    "SAVED_FORMAT",
    "STATE_FILE",
    "STATE_MAGIC",
    "SavedParty",
    "lifetime_token",
    "load",
    "save",
]

LOG = logging.getLogger(__name__)

#: File name of the saved party state in its state directory.
STATE_FILE = "party.state"
#: The first bytes of a saved party state (format version 1).
STATE_MAGIC = b"CHAOSPS\x01"
#: Magic of a *sealed* file: the hash is followed by the party's 64-byte seal of it.
SEALED_MAGIC = b"CHAOSPS\x02"
#: Largest state file read: the body's bound plus magic, hash and seal.
_FILE_MAX_BYTES = FLOWER_DURABLE_MAX_BYTES + len(SEALED_MAGIC) + 32 + 64
#: Format of the saved body (2: the join pull as explicit values; 1: pickled, migrated).
SAVED_FORMAT = 2
#: Domain of a seal: ``seal(SEAL_DOMAIN || sha256(body))``.
SEAL_DOMAIN = b"chaos-flwr/party.state/v1\x00"
_TMP_PREFIX = ".tmp-party-"


def lifetime_token() -> str:
    """Identify the SuperNode process this ClientApp process runs under.

    The parent's pid and its start time (``/proc/<ppid>/stat``, field 22), so a recycled pid
    is not mistaken for the same process. Where ``/proc`` is missing, the pid alone.
    """
    ppid = os.getppid()
    start = ""
    with contextlib.suppress(OSError, IndexError):
        raw = Path(f"/proc/{ppid}/stat").read_text()
        start = raw.rsplit(")", 1)[1].split()[19]
    return f"{ppid}:{start}"


@dataclass
class SavedParty:
    """What a party keeps between two messages (see the module docstring).

    Attributes
    ----------
    party_id, lifetime:
        Whose state this is, and the SuperNode process life it was saved in.
    incarnation, seq, replay:
        The peer's incarnation, last sealed sequence number and replay-guard snapshot.
    records:
        The wire form of every record the peer holds.
    pending:
        Outgoing envelopes not handed to the relay yet, as ``(to, data)``.
    join_asked, links_asked:
        When (and of whom) a sponsored join was asked; the links asked.
    joining:
        The join pull in progress (:func:`chaos_flwr.pull.save_negotiation`'s value), or
        ``None``.
    joins_done:
        The figures of finished pulls (plain dicts).
    receipts, evidence, evidence_sent:
        Encoded receipts of the ledger's recent rounds, encoded equivocation evidence, and
        how much evidence was already reported.
    charter:
        Digest of the charter the records were verified under (``b""``: unknown).
    rounds:
        The verifiable rounds' state of :class:`~chaos_flwr.flower.client.party.Party`: its
        last commitment, the audits it keeps and sends, the round it rolled back from
        (checked field by field when taken up).
    sealed:
        Set by :func:`load` (never saved): the file's seal was checked against the party's
        key, so the records are this party's own verified records.
    """

    party_id: str
    lifetime: str
    incarnation: int
    seq: int
    replay: dict[str, list[int]] = field(default_factory=dict)
    records: list[Any] = field(default_factory=list)
    pending: list[tuple[str, bytes]] = field(default_factory=list)
    join_asked: tuple[float | None, tuple[str, ...]] = (None, ())
    links_asked: list[tuple[str, int, int]] = field(default_factory=list)
    joining: dict[str, Any] | None = None
    joins_done: list[dict[str, Any]] = field(default_factory=list)
    receipts: list[bytes] = field(default_factory=list)
    evidence: list[bytes] = field(default_factory=list)
    evidence_sent: int = 0
    charter: bytes = b""
    rounds: dict[str, Any] = field(default_factory=dict)
    sealed: bool = field(default=False, compare=False)

    def to_value(self) -> dict[str, Any]:
        """The codec tree of this state."""
        at, who = self.join_asked
        return {
            "format": SAVED_FORMAT,
            "party": self.party_id,
            "lifetime": self.lifetime,
            "incarnation": self.incarnation,
            "seq": self.seq,
            # decimal strings: a replay bitmap may use all 64 bits (the codec's ints are signed)
            "replay": {k: [str(x) for x in v] for k, v in self.replay.items()},
            "records": list(self.records),
            "pending": [[to, data] for to, data in self.pending],
            "join_asked": [-1.0 if at is None else float(at), list(who)],
            "links_asked": [list(x) for x in self.links_asked],
            "joining": self.joining,
            "joins_done": list(self.joins_done),
            "receipts": list(self.receipts),
            "evidence": list(self.evidence),
            "evidence_sent": self.evidence_sent,
            "charter": self.charter,
            "rounds": dict(self.rounds),
        }

    @classmethod
    def from_value(cls, value: Any) -> SavedParty:
        """Rebuild from :meth:`to_value` output (``StoreError`` if a field is malformed)."""
        value = _migrate(value)
        try:
            at, who = value["join_asked"]
            state = cls(
                party_id=_typed(value["party"], str),
                lifetime=_typed(value["lifetime"], str),
                incarnation=_typed(value["incarnation"], int),
                seq=_typed(value["seq"], int),
                replay={str(k): [int(x) for x in v] for k, v in value["replay"].items()},
                records=list(value["records"]),
                pending=[(_typed(t, str), _typed(d, bytes)) for t, d in value["pending"]],
                join_asked=(None if float(at) < 0 else float(at), tuple(str(x) for x in who)),
                links_asked=[(str(a), int(b), int(c)) for a, b, c in value["links_asked"]],
                joining=None if value["joining"] is None else _typed(value["joining"], dict),
                joins_done=[dict(x) for x in value["joins_done"]],
                receipts=[_typed(x, bytes) for x in value["receipts"]],
                evidence=[_typed(x, bytes) for x in value["evidence"]],
                evidence_sent=_typed(value["evidence_sent"], int),
                charter=_typed(value.get("charter", b""), bytes),
                rounds=_typed(value.get("rounds", {}), dict),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"saved party state: malformed field ({exc!r})") from exc
        return state

    def joiner_pull(self) -> Any:
        """The join pull in progress, or ``None`` (``StoreError`` if it does not read back)."""
        if self.joining is None:
            return None
        from chaos_flwr.flower.client.joiner import JoinerPull

        try:
            return JoinerPull.from_value(self.joining)
        except ChaosError as exc:
            raise StoreError(f"saved party state: join pull unreadable ({exc})") from exc


def _migrate(value: Any) -> Any:
    """Bring a saved state of an older format to :data:`SAVED_FORMAT` (StoreError if not)."""
    if not isinstance(value, dict):
        raise StoreError("saved party state: not a map")
    fmt = value.get("format", 1)
    if fmt == SAVED_FORMAT:
        return value
    if fmt != 1:
        raise StoreError(f"saved party state: format {fmt!r} is unknown (this reads 1-2)")
    if value.get("joining"):  # a pickled pull is never unpickled: it starts again
        LOG.warning("chaos-flwr: a saved format-1 join pull is dropped; the pull starts again")
    return {**value, "format": SAVED_FORMAT, "joining": None}


def _typed(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def ledger_receipts(ledger: Any) -> list[bytes]:
    """Encoded receipts of the newest ``FLOWER_DURABLE_LEDGER_ROUNDS`` rounds of a ledger."""
    if ledger is None:
        return []
    rounds = sorted(getattr(ledger, "_rounds", {}))[-FLOWER_DURABLE_LEDGER_ROUNDS:]
    return [r.encode() for rnd in rounds for r in ledger.receipts(rnd)]


def save(
    state_dir: Path,
    state: SavedParty,
    *,
    fsync: bool = FLOWER_DURABLE_FSYNC,
    seal: Callable[[bytes], bytes] | None = None,
) -> Path:
    """Write ``state`` atomically to ``<state_dir>/party.state``.

    Temporary file, rename over the old file: a process killed at any point leaves either
    the old or the new state, whole. With ``fsync`` the file and the directory are also
    fsynced (survives a power loss; not needed for safety, see the module docstring).
    With ``seal`` (the party's ``Identity.sign``: Ed25519 signatures are deterministic) the
    file carries ``seal(SEAL_DOMAIN || sha256(body))``, which :func:`load` recomputes: only the
    holder of the party's key can write a file its party takes up.

    Raises
    ------
    StoreError
        The directory or file cannot be written.
    """
    body = codec.encode(state.to_value())
    if len(body) > FLOWER_DURABLE_MAX_BYTES and state.joining is not None:
        # the pull's shards make it too large: save the rest, the pull starts again
        LOG.warning("chaos-flwr: the join pull in progress is too large to save; it restarts")
        body = codec.encode(dataclasses.replace(state, joining=None).to_value())
    if len(body) > FLOWER_DURABLE_MAX_BYTES:
        raise StoreError(f"saved party state is {len(body)} bytes, over FLOWER_DURABLE_MAX_BYTES")
    digest = hashlib.sha256(body).digest()
    if seal is None:
        data = STATE_MAGIC + digest + body
    else:
        data = SEALED_MAGIC + digest + seal(SEAL_DOMAIN + digest) + body
    final = state_dir / STATE_FILE
    tmp = state_dir / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        if fsync:
            dfd = os.open(state_dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StoreError(f"{final}: cannot save the party state ({exc})") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return final


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (a module-level hook so tests can kill a write half-way)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def load(
    state_dir: Path, party_id: str, *, seal: Callable[[bytes], bytes] | None = None
) -> SavedParty | None:
    """Read the saved state of ``party_id`` from ``state_dir``; ``None`` when there is none.

    Leftover temporary files of a killed writer are removed. With ``seal`` (see :func:`save`)
    the file must be sealed by it: an unsealed file, or one sealed by another key, is refused;
    the state returned then has ``sealed`` set.

    Raises
    ------
    StoreError
        The file is unreadable, truncated, fails its hash or its seal, is malformed, or
        belongs to another party.
    """
    with contextlib.suppress(OSError):
        for stale in state_dir.glob(f"{_TMP_PREFIX}*"):
            pid = stale.name[len(_TMP_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                stale.unlink()
    path = state_dir / STATE_FILE
    try:
        raw = read_local_file(
            path, what="saved party state", error=StoreError, max_bytes=_FILE_MAX_BYTES
        )
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"{path}: unreadable ({exc})") from exc
    sealed = raw.startswith(SEALED_MAGIC)
    head = len(STATE_MAGIC) + 32 + (64 if sealed else 0)
    if len(raw) < head or not (sealed or raw.startswith(STATE_MAGIC)):
        raise StoreError(f"{path}: not a saved party state (bad magic or truncated)")
    digest = raw[len(STATE_MAGIC) : len(STATE_MAGIC) + 32]
    body = raw[head:]
    if hashlib.sha256(body).digest() != digest:
        raise StoreError(f"{path}: hash mismatch (corrupt saved party state)")
    if seal is not None:
        tag = raw[len(STATE_MAGIC) + 32 : head] if sealed else b""
        if not hmac.compare_digest(tag, seal(SEAL_DOMAIN + digest)):
            raise StoreError(f"{path}: not sealed by this party's key (refused)")
    try:
        value = codec.decode(body, max_bytes=FLOWER_DURABLE_MAX_BYTES)
    except ChaosError as exc:
        raise StoreError(f"{path}: cannot decode ({exc})") from exc
    if not isinstance(value, dict):
        raise StoreError(f"{path}: not a saved party state")
    state = SavedParty.from_value(value)
    if state.party_id != party_id:
        raise StoreError(f"{path}: saved for party {state.party_id}, not {party_id}")
    state.sealed = seal is not None  # the seal was checked above
    return state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def load_or_discard(
    state_dir: Path, party_id: str, *, seal: Callable[[bytes], bytes] | None = None
) -> SavedParty | None:
    """:func:`load`, but a bad file is logged (warning), renamed ``party.state.bad`` and
    treated as absent: the party then starts as a real restart."""
    try:
        return load(state_dir, party_id, seal=seal)
    except StoreError as exc:
        LOG.warning("chaos-flwr: discarding the saved party state: %s", exc)
        with contextlib.suppress(OSError):
            os.replace(state_dir / STATE_FILE, state_dir / f"{STATE_FILE}.bad")
        return None


def state_file_stamp(state_dir: Path) -> tuple[int, int]:
    """(inode, mtime in ns) of ``<state_dir>/party.state`` now; ``(-1, -1)`` when there is
    none. A save by another process changes it (:func:`save` renames a new file over)."""
    try:
        st = (state_dir / STATE_FILE).stat()
    except OSError:
        return (-1, -1)
    return (st.st_ino, st.st_mtime_ns)
