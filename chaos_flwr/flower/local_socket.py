"""The local socket between a party's ClientApps and its daemon: ``<state-dir>/party.sock``.

One request and one reply per connection, each a frame::

    b"CHLS" | version (1 byte) | header length (u32) | body length (u64) | header | body

The header is a JSON object (at most :data:`LOCAL_SOCKET_MAX_HEADER_BYTES`), the body opaque
bytes (at most :data:`LOCAL_SOCKET_MAX_BODY_BYTES`, read as they arrive, never allocated up
front). A reply header ``{"error": <name>, "message": <text>}`` is an error the caller raises
again as the :class:`~chaos_flwr.errors.ChaosError` of that name.

Only the institution's own processes get an answer: the socket file is made with mode 0600
(the process umask is narrowed while it is bound), and the daemon reads the connecting
process's credentials (``SO_PEERCRED``) and serves only its own user and root; any other is
disconnected unanswered and counted. Concurrent connections past
:data:`LOCAL_SOCKET_MAX_CONNECTIONS` get a ``busy`` error reply; a peer that stalls in the
middle of a frame is dropped after :data:`LOCAL_SOCKET_IO_TIMEOUT_S`.

A path longer than ``AF_UNIX`` allows (107 bytes) is reached through the directory's file
descriptor (``/proc/self/fd/<fd>/party.sock``), so a deep state directory works too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chaos_flwr import errors
from chaos_flwr.errors import ChaosError, ConfigError, DecodeError, OversizeError, TransportError

__all__ = [
    "LOCAL_SOCKET_FILE",
    "LocalServer",
    "LocalSocketError",
    "local_call",
]

LOG = logging.getLogger(__name__)

#: The socket's file name in the party's state directory.
LOCAL_SOCKET_FILE = "party.sock"
#: Largest frame header (a JSON object: the node's settings and the operation).
LOCAL_SOCKET_MAX_HEADER_BYTES: int = 64 * 1024
#: Largest frame body: Flower's own bound on one message (gRPC's 2 GiB - 1).
LOCAL_SOCKET_MAX_BODY_BYTES: int = 2**31 - 1
#: Requests the daemon handles at once; one more gets a ``busy`` error reply.
LOCAL_SOCKET_MAX_CONNECTIONS: int = 8
#: Longest pause of a peer in the middle of a frame, in seconds, before it is dropped.
LOCAL_SOCKET_IO_TIMEOUT_S: float = 30.0
#: How long a ClientApp waits to connect (a local socket answers in well under a millisecond).
LOCAL_SOCKET_CONNECT_S: float = 1.0
#: Longest wait of a stopping daemon for the requests it is handling to finish, in seconds.
LOCAL_SOCKET_STOP_WAIT_S: float = 60.0
#: Longest wait of a ClientApp for the daemon's reply, in seconds: the party's turn
#: (FLOWER_PARTY_LOCK_WAIT_S, 900 s) and the handling itself, a join's pull included.
LOCAL_SOCKET_REPLY_WAIT_S: float = 1200.0

_MAGIC = b"CHLS"
_VERSION = 1
_PREFIX = struct.Struct(">4sBIQ")
_CRED = struct.Struct("3i")
_AF_UNIX_MAX = 107
_BODY_CHUNK = 4 * 1024 * 1024

#: A handler of one request: (header, body) -> (reply header, reply body).
Handler = Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]]


class LocalSocketError(TransportError):
    """The party's local socket broke off or refused a request (a daemon that died mid-way,
    a malformed or oversized frame, a busy daemon)."""


@contextlib.contextmanager
def _addressable(path: Path) -> Iterator[str]:
    """``path`` as ``AF_UNIX`` can take it: itself, or through its directory's descriptor."""
    if len(os.fsencode(str(path))) <= _AF_UNIX_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _head(header: dict[str, Any], body: bytes) -> bytes:
    """A frame's prefix and header; past the bounds an :class:`OversizeError` (nothing sent)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > LOCAL_SOCKET_MAX_HEADER_BYTES or len(body) > LOCAL_SOCKET_MAX_BODY_BYTES:
        raise OversizeError(
            f"local socket frame of {len(raw)} + {len(body)} bytes is past its bounds "
            f"({LOCAL_SOCKET_MAX_HEADER_BYTES} + {LOCAL_SOCKET_MAX_BODY_BYTES})"
        )
    return _PREFIX.pack(_MAGIC, _VERSION, len(raw), len(body)) + raw


def _send(sock: socket.socket, header: dict[str, Any], body: bytes) -> None:
    sock.sendall(_head(header, body))
    sock.sendall(body)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _BODY_CHUNK))
        if not chunk:
            raise LocalSocketError(f"local socket closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _receive(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    """One frame; a malformed or oversized one is a :class:`DecodeError` (or its subclass)."""
    magic, version, n_header, n_body = _PREFIX.unpack(_read_exact(sock, _PREFIX.size))
    if magic != _MAGIC or version != _VERSION:
        raise DecodeError(f"local socket: not a chaos-flwr frame (magic {magic!r} v{version})")
    if n_header > LOCAL_SOCKET_MAX_HEADER_BYTES or n_body > LOCAL_SOCKET_MAX_BODY_BYTES:
        raise OversizeError(
            f"local socket frame of {n_header} + {n_body} bytes refused (bounds "
            f"{LOCAL_SOCKET_MAX_HEADER_BYTES} + {LOCAL_SOCKET_MAX_BODY_BYTES})"
        )
    try:
        header = json.loads(_read_exact(sock, n_header))
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"local socket: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise DecodeError("local socket: header is not a JSON object")
    return header, _read_exact(sock, n_body)


def _raise_error_reply(header: dict[str, Any]) -> None:
    """Raise the error a reply header carries (the ChaosError subclass it names)."""
    name, text = header.get("error"), header.get("message", "")
    if name is None:
        return
    cls = LocalSocketError if name == "LocalSocketError" else getattr(errors, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, ChaosError)):
        cls = ChaosError
    try:
        exc = cls(f"party daemon: {text}")
    except TypeError:
        exc = ChaosError(f"party daemon: {name}: {text}")
    raise exc


def local_call(
    path: Path, header: dict[str, Any], body: bytes, *, reply_wait_s: float | None = None
) -> tuple[dict[str, Any], bytes] | None:
    """Send one request to the daemon listening on ``path`` and return its reply.

    Parameters
    ----------
    path
        The socket (``<state-dir>/party.sock``).
    header, body
        The request.
    reply_wait_s
        Longest wait for the reply; default :data:`LOCAL_SOCKET_REPLY_WAIT_S`.

    Returns
    -------
    tuple[dict, bytes] or None
        The reply; ``None`` when no daemon listens there (no socket file, or a stale one):
        nothing was sent, and the caller handles the message itself.

    Raises
    ------
    LocalSocketError
        The request was sent (the daemon may have acted on it) but no whole reply came.
    ChaosError
        The daemon refused the request: the error it names, raised again here.
    OversizeError
        The request is past the frame's bounds (nothing was sent).
    """
    wait = LOCAL_SOCKET_REPLY_WAIT_S if reply_wait_s is None else reply_wait_s
    head = _head(header, body)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(LOCAL_SOCKET_CONNECT_S)
        try:
            with _addressable(path) as address:
                sock.connect(address)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK, errno.ENOTDIR):
                return None  # no daemon listens there
            if exc.errno in (errno.EACCES, errno.EPERM):
                LOG.warning("chaos-flwr: %s: not this user's party daemon (%s)", path, exc)
                return None
            raise LocalSocketError(f"{path}: cannot connect to the party daemon: {exc}") from exc
        sock.settimeout(wait)
        try:
            sock.sendall(head)
            sock.sendall(body)
            reply = _receive(sock)
        except (OSError, DecodeError) as exc:
            if isinstance(exc, LocalSocketError):
                raise
            raise LocalSocketError(f"{path}: the party daemon's reply broke off: {exc}") from exc
    finally:
        sock.close()
    _raise_error_reply(reply[0])
    return reply


class LocalServer:
    """The daemon's end: serves ``handler`` on ``<state_dir>/party.sock`` until stopped.

    Parameters
    ----------
    path
        The socket file to make (its directory must exist).
    handler
        Called once per request, from the connection's thread; a :class:`ChaosError` it
        raises goes back as an error reply, anything else as an ``internal`` error (logged).

    Attributes
    ----------
    handled, refused : int
        Requests answered (errors included), and connections refused (another user, busy,
        a malformed frame).
    """

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = Path(path)
        self.handler = handler
        self.handled = 0
        self.refused = 0
        self._slots = threading.BoundedSemaphore(LOCAL_SOCKET_MAX_CONNECTIONS)
        self._count = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._inode = -1
        self._lock_fd = -1
        self._busy = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind (mode 0600) and start accepting.

        Raises
        ------
        ConfigError
            Another daemon already answers on this socket.
        TransportError
            The socket cannot be made.
        """
        self._hold_daemon_lock()
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # a stale socket of a daemon that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            with _addressable(self.path) as address:
                sock.bind(address)
        except OSError as exc:
            sock.close()
            self._release_daemon_lock()
            raise TransportError(f"{self.path}: cannot make the local socket: {exc}") from exc
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._inode = os.lstat(self.path).st_ino
        sock.listen(LOCAL_SOCKET_MAX_CONNECTIONS)
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="chaos-local", daemon=True)
        self._thread.start()

    def _hold_daemon_lock(self) -> None:
        """Hold ``<socket>.lock`` (an ``flock``) while serving: a second daemon is refused
        before it touches the first one's socket; the kernel drops it when this one dies."""
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TransportError(f"{lock}: cannot open the daemon's lock: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(
                    f"{self.path}: another party daemon already answers here"
                ) from None
            raise TransportError(f"{lock}: cannot take the daemon's lock: {exc}") from exc
        self._lock_fd = fd

    def _release_daemon_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def stop(self) -> None:
        """Stop accepting, let the requests in hand finish (at most
        :data:`LOCAL_SOCKET_STOP_WAIT_S`: a reply whose state is saved still goes out), and
        remove the socket file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout=LOCAL_SOCKET_STOP_WAIT_S)
        self._release_daemon_lock()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _tally(self, refused: bool) -> None:
        with self._count:
            if refused:
                self.refused += 1
            else:
                self.handled += 1

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if not _same_user(conn):
                self._tally(refused=True)
                return
            if not self._slots.acquire(blocking=False):
                self._tally(refused=True)
                with contextlib.suppress(OSError):
                    _send(conn, {"error": "LocalSocketError", "message": "busy"}, b"")
                return
            with self._idle:
                self._busy += 1
            try:
                self._answer(conn)
            finally:
                self._slots.release()
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(LOCAL_SOCKET_IO_TIMEOUT_S)
        try:
            header, body = _receive(conn)
        except (OSError, DecodeError) as exc:
            self._tally(refused=True)
            LOG.warning("chaos-flwr party: local request refused: %s", exc)
            name = type(exc).__name__ if isinstance(exc, DecodeError) else "LocalSocketError"
            with contextlib.suppress(OSError):
                _send(conn, {"error": name, "message": f"request refused: {exc}"}, b"")
            return
        try:
            reply = self.handler(header, body)
        except ChaosError as exc:
            reply = ({"error": type(exc).__name__, "message": str(exc)}, b"")
        except Exception as exc:  # a bug must not kill the daemon: the caller gets an error
            LOG.exception("chaos-flwr party: local request failed")
            reply = ({"error": "ChaosError", "message": f"internal: {exc!r}"}, b"")
        self._tally(refused=False)
        with contextlib.suppress(OSError):
            try:
                _send(conn, *reply)
            except OversizeError as exc:  # a reply past the frame's bounds: said, not sent
                _send(conn, {"error": "OversizeError", "message": str(exc)}, b"")


def _same_user(conn: socket.socket) -> bool:
    """Whether the connecting process runs as this process's user (or as root)."""
    try:
        _pid, uid, _gid = _CRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        )
    except (OSError, AttributeError):
        return False
    return uid in (os.geteuid(), 0)
