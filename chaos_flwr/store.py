"""The replica store: a party's certified training states on disk.

One file per round, ``round-<12 to 19 digits>.replica`` (zero-padded to 12), laid out as
(integers big-endian)::

    magic     8 bytes   b"CHAOSRP" + format version byte
    hlen      4 bytes   length of the header
    header    hlen      codec.encode({"certificate": bytes, "round": r,
                                      "state_bytes": n, "state_digest": 32 bytes})
    hcheck    32 bytes  sha256(magic + hlen + header)
    state     n bytes   TrainingState.to_bytes()

Writes are atomic: the file is written under a temporary name in the same directory, fsynced,
renamed over its final name, and the directory is fsynced. A crash at any point leaves either
no file for the round (only a temporary file, removed when the store is next opened) or the
complete file; the previous rounds are never touched before the new one is durable.

Loads are verified: magic and version, header checksum, the file length, the SHA-256 of the
state against the header's digest, and the round inside the state against the file name. Any
mismatch raises :class:`~chaos_flwr.errors.StoreError`. Serving a byte range (a shard) reads
only that range with ``os.pread`` from an open file descriptor; replica files are immutable
once renamed, so a donor serves them while its training loop writes the next round, and a
pruned file stays readable through descriptors that are already open. Opening a store removes
temporary files only when the process that wrote them is gone (the writer's pid is in the
name), so a reader that opens the directory never breaks a put in progress.

This module does I/O (files); it reads no clock. One writer per directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from . import codec
from .defaults import (
    STORE_DEFAULT_KEEP_REPLICAS,
    STORE_IO_CHUNK_BYTES,
    STORE_MAX_CERTIFICATE_BYTES,
)
from .errors import DecodeError, StoreError
from .state import Manifest, TrainingState, shard_range

__all__ = ["REPLICA_MAGIC", "Replica", "ReplicaStore"]

#: The first bytes of every replica file: ``b"CHAOSRP"`` and the format version.
REPLICA_MAGIC: bytes = b"CHAOSRP\x01"
_U32 = struct.Struct(">I")
# 12 digits at least (zero-padded so names sort), up to 19: every round in [0, 2**63)
_NAME = re.compile(r"^round-(\d{12,19})\.replica$")
_TMP_PREFIX = ".tmp-round-"
_HEADER_KEYS = {"certificate", "round", "state_bytes", "state_digest"}


def _file_name(round_: int) -> str:
    return f"round-{round_:012d}.replica"


def _round_of(name: str) -> int | None:
    """The round a replica file name holds; ``None`` unless it is the canonical name of a
    round in ``[0, 2**63)`` (so two names never hold one round)."""
    m = _NAME.match(name)
    if m is None:
        return None
    round_ = int(m.group(1))
    return round_ if round_ < 2**63 and _file_name(round_) == name else None


def _write_replica(
    fd: int, tmp: Path, state: TrainingState, fields: dict[str, Any], known: bytes = b""
) -> bytes:
    """Write a replica file to ``fd``: header, state bytes, then the header with its digest.

    The header is written first with a zero digest (the same length), the state streamed and
    hashed (unless its digest is ``known``), then the header rewritten in place with the
    digest and its checksum, and synced. Returns the state digest.
    """
    total = fields["state_bytes"]
    header = codec.encode(fields)
    prefix = REPLICA_MAGIC + _U32.pack(len(header))
    _write_chunk(fd, prefix + header + bytes(32))
    h = hashlib.sha256()
    written = 0
    for chunk in state.iter_chunks():
        view = memoryview(chunk).cast("B")
        for pos in range(0, len(view), STORE_IO_CHUNK_BYTES):
            piece = view[pos : pos + STORE_IO_CHUNK_BYTES]
            if not known:
                h.update(piece)
            _write_chunk(fd, piece)
            written += len(piece)
    if written != total:
        raise StoreError(f"{tmp}: wrote {written} bytes, expected {total}")
    digest = known or h.digest()
    fields["state_digest"] = digest
    header = codec.encode(fields)
    check = hashlib.sha256(prefix + header).digest()
    os.pwrite(fd, prefix + header + check, 0)
    os.fsync(fd)
    return digest


def _write_chunk(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd`` (a module-level hook so tests can slow writes down)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _pread_exact(fd: int, n: int, offset: int, path: Path) -> bytes:
    out = os.pread(fd, n, offset)
    if len(out) != n:
        raise StoreError(f"{path}: truncated (wanted {n} bytes at offset {offset})")
    return out


def _writer_alive(tmp_name: str) -> bool:
    """True if the process that owns temporary file ``tmp_name`` still runs (keep its file)."""
    parts = tmp_name[len(_TMP_PREFIX) :].split("-")
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Replica:
    """One stored round, open for reading (a file descriptor kept open until :meth:`close`).

    Attributes
    ----------
    round : int
    total_bytes : int
        Length of the serialised state.
    state_digest : bytes
        SHA-256 of the serialised state (verified at open unless ``verify=False``).
    certificate : bytes
        The opaque certificate stored with the state (``b""`` if none).
    path : pathlib.Path
    """

    def __init__(self, path: Path, *, verify: bool = True) -> None:
        self.path = path
        try:  # non-blocking: a FIFO planted under a replica's name must not hang the store
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(f"{path}: cannot open replica ({exc.strerror})") from exc
        try:
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                raise StoreError(f"{path}: not a regular file (a FIFO, device or directory)")
            self._read_header()
            if verify:
                self._verify_stream()
        except BaseException:
            os.close(self._fd)
            raise

    def _read_header(self) -> None:
        path = self.path
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, len(REPLICA_MAGIC) + _U32.size, 0)
        if len(head) < len(REPLICA_MAGIC) + _U32.size or head[:7] != REPLICA_MAGIC[:7]:
            raise StoreError(f"{path}: not a chaos-flwr replica file (bad magic); remove it")
        if head[7] != REPLICA_MAGIC[7]:
            raise StoreError(
                f"{path}: replica format version {head[7]} is not supported (this build reads "
                f"{REPLICA_MAGIC[7]}); upgrade chaos-flwr or remove the file"
            )
        (hlen,) = _U32.unpack_from(head, len(REPLICA_MAGIC))
        limit = STORE_MAX_CERTIFICATE_BYTES + 4096
        if hlen > limit or len(head) + hlen + 32 > size:
            raise StoreError(f"{path}: header length {hlen} is past the end of the file")
        header = _pread_exact(self._fd, hlen, len(head), path)
        check = _pread_exact(self._fd, 32, len(head) + hlen, path)
        if hashlib.sha256(head + header).digest() != check:
            raise StoreError(f"{path}: header checksum mismatch (corrupt file); remove it")
        try:
            obj = codec.decode(header)
        except DecodeError as exc:
            raise StoreError(f"{path}: malformed header ({exc})") from exc
        if not isinstance(obj, dict) or set(obj) != _HEADER_KEYS:
            raise StoreError(f"{path}: header has missing or unknown fields")
        self.round: int = obj["round"]
        self.total_bytes: int = obj["state_bytes"]
        self.state_digest: bytes = obj["state_digest"]
        self.certificate: bytes = obj["certificate"]
        if not (
            type(self.round) is int
            and type(self.total_bytes) is int
            and isinstance(self.state_digest, bytes)
            and len(self.state_digest) == 32
            and isinstance(self.certificate, bytes)
        ):
            raise StoreError(f"{path}: header field has the wrong type")
        self._offset = len(head) + hlen + 32
        if size != self._offset + self.total_bytes:
            raise StoreError(
                f"{path}: file is {size} bytes, the header promises "
                f"{self._offset + self.total_bytes} (truncated or padded); remove it"
            )
        named = _round_of(path.name)
        if named is not None and named != self.round:
            raise StoreError(f"{path}: the header says round {self.round}, the name says {named}")

    def _iter_ranges(self, start: int, end: int) -> Iterator[bytes]:
        pos = start
        while pos < end:
            n = min(STORE_IO_CHUNK_BYTES, end - pos)
            yield _pread_exact(self._fd, n, self._offset + pos, self.path)
            pos += n

    def _verify_stream(self) -> None:
        h = hashlib.sha256()
        for chunk in self._iter_ranges(0, self.total_bytes):
            h.update(chunk)
        if h.digest() != self.state_digest:
            raise StoreError(
                f"{self.path}: state digest mismatch (corrupt replica); remove it and fetch "
                "the round from a neighbour"
            )

    def read(self, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of the serialised state (only that range is read).

        Raises
        ------
        StoreError
            If the range is outside ``[0, total_bytes]`` or the read comes up short.
        """
        if not 0 <= start <= end <= self.total_bytes:
            raise StoreError(
                f"range: [{start}, {end}) is outside the state [0, {self.total_bytes})"
            )
        return _pread_exact(self._fd, end - start, self._offset + start, self.path)

    def read_shard(self, index: int, shard_bytes: int) -> bytes:
        """Return shard ``index`` for shards of ``shard_bytes`` (the planner's numbering)."""
        start, end = shard_range(self.total_bytes, shard_bytes, index)
        return self.read(start, end)

    def state_bytes(self) -> bytes:
        """Return the whole serialised state (one read)."""
        return self.read(0, self.total_bytes)

    def load(self) -> TrainingState:
        """Load and verify the state (digest and round), with arrays viewing one buffer.

        Raises
        ------
        StoreError
            If the digest, the format or the round does not match.
        """
        data = self.state_bytes()
        if hashlib.sha256(data).digest() != self.state_digest:
            raise StoreError(f"{self.path}: state digest mismatch (corrupt replica); remove it")
        try:
            state = TrainingState.from_bytes(data)
        except DecodeError as exc:
            raise StoreError(f"{self.path}: state does not decode ({exc})") from exc
        if state.round != self.round:
            raise StoreError(f"{self.path}: state is round {state.round}, header says {self.round}")
        return state

    def manifest(self, shard_bytes: int, *, num_shards: int | None = None) -> Manifest:
        """Build the manifest for ``shard_bytes`` by streaming the file (bounded memory)."""
        w = self.total_bytes
        k = -(-w // shard_bytes) if num_shards is None else num_shards
        hashes = []
        whole = hashlib.sha256()
        for i in range(k):
            start, end = shard_range(w, shard_bytes, i)
            h = hashlib.sha256()
            for chunk in self._iter_ranges(start, end):
                h.update(chunk)
                whole.update(chunk)
            hashes.append(h.digest())
        digest = whole.digest()
        if digest != self.state_digest:
            raise StoreError(f"{self.path}: state digest mismatch while building a manifest")
        return Manifest(w, shard_bytes, tuple(hashes), digest)

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Replica:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class ReplicaStore:
    """Certified training states of the last ``keep_rounds`` rounds, in one directory.

    Parameters
    ----------
    directory : str or os.PathLike
        Created if missing. Leftover temporary files of interrupted writes are removed.
    keep_rounds : int, optional
        Rounds kept after each :meth:`put` (the highest round numbers), >= 1; default
        :data:`~chaos_flwr.defaults.STORE_DEFAULT_KEEP_REPLICAS` (the newest round and the one
        before it: what a resume needs). On Flower a party's store keeps the node config's
        ``chaos-keep-replicas`` (:mod:`chaos_flwr.flower.client.settings`). The disk it uses is
        about ``keep_rounds`` times the serialised state (the model's arrays, the strategy's
        state and a small header).
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep_rounds: int = STORE_DEFAULT_KEEP_REPLICAS
    ) -> None:
        if isinstance(keep_rounds, bool) or not isinstance(keep_rounds, int) or keep_rounds < 1:
            raise StoreError(f"keep_rounds: got {keep_rounds!r}; give an int >= 1")
        self.directory = Path(directory)
        self.keep_rounds = keep_rounds
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"directory: cannot create {self.directory} ({exc})") from exc
        for entry in self.directory.iterdir():
            if entry.name.startswith(_TMP_PREFIX) and not _writer_alive(entry.name):
                with contextlib.suppress(OSError):
                    entry.unlink()

    def path_of(self, round_: int) -> Path:
        """Return the file path of ``round_`` (whether or not it exists)."""
        return self.directory / _file_name(round_)

    def rounds(self) -> list[int]:
        """Return the stored round numbers, ascending (by file name; not verified)."""
        out = []
        for entry in self.directory.iterdir():
            round_ = _round_of(entry.name)
            if round_ is not None:
                out.append(round_)
        return sorted(out)

    def put(
        self,
        state: TrainingState | bytes | bytearray | memoryview,
        certificate: bytes = b"",
        *,
        digest: bytes = b"",
    ) -> Path:
        """Store a state atomically and prune old rounds.

        Parameters
        ----------
        state : TrainingState or bytes-like
            The state, or its serialised bytes (decoded to check them and read the round).
        certificate : bytes, optional
            Opaque certificate (e.g. signed receipts naming the state digest).
        digest : bytes, optional
            The state's SHA-256 digest when the caller has just computed or checked it: the
            state is then written without hashing it again. A wrong digest is not trusted
            blindly: the replica then fails its check when it is read (:meth:`get`).

        Returns
        -------
        pathlib.Path
            The replica file.

        Raises
        ------
        StoreError
            If the write fails, or the round is already stored with a different digest.
        """
        if not isinstance(state, TrainingState):
            try:
                state = TrainingState.from_bytes(state)
            except DecodeError as exc:
                raise StoreError(
                    f"state: bytes are not a serialised TrainingState ({exc})"
                ) from exc
        if not isinstance(certificate, (bytes, bytearray)):
            raise StoreError("certificate: give bytes (or b'' for none)")
        if not isinstance(digest, bytes) or len(digest) not in (0, 32):
            raise StoreError("digest: give the state's 32-byte SHA-256 digest (or b'')")
        if len(certificate) > STORE_MAX_CERTIFICATE_BYTES:
            raise StoreError(
                f"certificate: {len(certificate)} bytes exceeds STORE_MAX_CERTIFICATE_BYTES"
            )
        final = self.path_of(state.round)
        fields: dict[str, Any] = {
            "certificate": bytes(certificate),
            "round": state.round,
            "state_bytes": state.serialized_size(),
            "state_digest": bytes(32),
        }
        tmp = self.directory / f"{_TMP_PREFIX}{state.round}-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StoreError(f"{tmp}: cannot create ({exc.strerror})") from exc
        try:
            try:
                digest = _write_replica(fd, tmp, state, fields, digest)
            finally:
                os.close(fd)
            if final.exists():
                self._check_same(final, digest)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"{final}: write failed ({exc})") from exc
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._prune()
        return final

    def _check_same(self, final: Path, digest: bytes) -> None:
        try:
            with Replica(final, verify=False) as old:
                same = old.state_digest == digest
        except StoreError:
            return  # a corrupt file for this round may be replaced by a good one
        if not same:
            raise StoreError(
                f"{final}: round already stored with a different state digest; a party keeps "
                "one certified state per round (remove the file to override)"
            )

    def discard(self, round_: int) -> None:
        """Remove a stored round (a state its owner no longer vouches for: a refuted one), so it
        is neither served nor taken up again, and the older rounds it would push out stay.

        Raises
        ------
        StoreError
            If the file cannot be removed.
        """
        try:
            self.path_of(round_).unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreError(f"{self.path_of(round_)}: cannot remove ({exc.strerror})") from exc
        _fsync_dir(self.directory)

    def _prune(self) -> None:
        # no directory fsync here (one per put was a third of a 1 MiB put's time): a pruned
        # file that a power loss brings back is an older certified state, still verified on
        # load, and the next put prunes it again. A file that cannot be removed (or a directory
        # that cannot be listed) fails nothing: the state just put is stored, and the next put
        # tries again
        with contextlib.suppress(OSError):
            rounds = self.rounds()
            for r in rounds[: max(0, len(rounds) - self.keep_rounds)]:
                with contextlib.suppress(OSError):
                    self.path_of(r).unlink()

    def open(self, round_: int, *, verify: bool = True) -> Replica:
        """Open a stored round for serving byte ranges (verified by streaming unless told not to).

        Raises
        ------
        StoreError
            If the round is not stored, or the file is corrupt or foreign.
        """
        path = self.path_of(round_)
        if not path.exists():
            # no path in the message: a link server sends it to the peer that asked
            raise StoreError(f"round: {round_} is not stored by this party; have {self.rounds()}")
        return Replica(path, verify=verify)

    def get(self, round_: int) -> TrainingState:
        """Load and verify the state of ``round_``.

        Raises
        ------
        StoreError
            If the round is missing, or the file is corrupt or foreign.
        """
        with self.open(round_, verify=False) as replica:
            return replica.load()

    def certificate(self, round_: int) -> bytes:
        """Return the certificate stored with ``round_`` (header checked, state not hashed)."""
        with self.open(round_, verify=False) as replica:
            return replica.certificate

    def latest(self) -> TrainingState | None:
        """Return the newest stored state (verified), or ``None`` if the store is empty.

        Raises
        ------
        StoreError
            If the newest file is corrupt or foreign (older rounds stay loadable with
            :meth:`get`).
        """
        rounds = self.rounds()
        if not rounds:
            return None
        return self.get(rounds[-1])
