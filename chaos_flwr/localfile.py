"""Reading and writing a party's own files: regular files only, bounded in size, private keys
kept private, small files replaced atomically.

Everything a party reads from its disk (keys, the charter, its saved state, replicas, profiles)
is checked here before a byte is parsed: it must be a regular file (a FIFO would hang the
reader, a device such as ``/dev/zero`` would never end, a directory is a mistake), at most the
caller's bound, and a private key must not be a symbolic link and should not be readable by
anyone but its owner (as ssh does: a symbolic link is refused, loose permissions are logged as a
warning, since shared test or container set-ups often relax them).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import uuid
from pathlib import Path

from chaos_flwr.errors import ChaosError

__all__ = ["LOOSE_KEY_MODE_BITS", "check_local_file", "read_local_file", "write_local_file"]

LOG = logging.getLogger(__name__)

#: Bytes read per call (a large bound is never allocated up front).
READ_CHUNK_BYTES: int = 1 << 20
#: Permission bits a private key file should not have (group or others may read or write it).
LOOSE_KEY_MODE_BITS: int = 0o077


def _not_regular(path: Path, mode: int, what: str) -> str:
    kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
    return f"cannot read {path} as a {what}: it is {kind}, not a regular file"


def check_local_file(
    path: Path,
    *,
    what: str,
    error: type[ChaosError],
    max_bytes: int,
    private: bool = False,
) -> None:
    """Refuse ``path`` unless it is a regular file of at most ``max_bytes`` (checked by ``stat``
    before it is opened, so a FIFO never blocks the reader).

    Parameters
    ----------
    what:
        What the file is, for the message (``"private key"``, ``"charter"``, ...).
    error:
        The typed error to raise (the caller's: KeyFileError, CharterError, StoreError, ...).
    private:
        A private key: a symbolic link is refused, permissions open to group or others are
        logged as a warning.

    Raises
    ------
    FileNotFoundError
        Nothing at ``path`` (the caller says how to create it).
    ChaosError
        ``error``: a symbolic link (private files), not a regular file, or too large.
    """
    info = os.lstat(path) if private else os.stat(path)
    if private and stat.S_ISLNK(info.st_mode):
        raise error(
            f"{path} is a symbolic link; a {what} must be the file itself (as ssh requires): "
            "copy it in place"
        )
    if not stat.S_ISREG(info.st_mode):
        raise error(_not_regular(path, info.st_mode, what))
    if info.st_size > max_bytes:
        raise error(f"{path} is larger than {max_bytes} bytes, too large for a {what}")
    if private and info.st_mode & LOOSE_KEY_MODE_BITS:
        LOG.warning(
            "chaos-flwr: the %s %s is open to other users (mode %o); run 'chmod 600 %s'",
            what, path, stat.S_IMODE(info.st_mode), path,
        )  # fmt: skip


def read_local_file(path: Path, *, what: str, error: type[ChaosError], max_bytes: int) -> bytes:
    """Read a regular file of at most ``max_bytes`` (never blocks on a FIFO, never reads past
    the bound even if the file grows while it is read).

    Raises
    ------
    FileNotFoundError
        Nothing at ``path``.
    ChaosError
        ``error``: not a regular file, too large, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO with no writer, opened non-blocking for writing
            raise error(f"{path} is not a regular file; a {what} must be one") from exc
        raise error(f"cannot read the {what} {path}: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(_not_regular(path, info.st_mode, what))
        if info.st_size > max_bytes:
            raise error(f"{path} is larger than {max_bytes} bytes, too large for a {what}")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(READ_CHUNK_BYTES, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise error(f"{path} grew past {max_bytes} bytes while it was read ({what})")
    return b"".join(chunks)


def write_local_file(path: Path, data: bytes, *, what: str, error: type[ChaosError]) -> Path:
    """Replace ``path`` with ``data`` atomically (a temporary file beside it, mode 0600, then
    a rename: a reader sees the old file or the new one, never a part). Not synced to disk:
    for files a crash may lose (a newer one is written again), not for a party's state.

    Raises
    ------
    ChaosError
        ``error``: the file cannot be written.
    """
    tmp = path.parent / f".{path.name}-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise error(f"{path}: cannot write the {what} ({exc})") from exc
    return path
