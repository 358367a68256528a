"""A party's processes take turns: one message at a time per state directory.

A party's protocol state lives in its state directory (:mod:`chaos_flwr.flower.durable`), and
every message is handled as *load, handle, save*. Flower's deployment engine runs a SuperNode's
messages one after the other, but its simulation engine runs them on whichever worker is free:
with two workers (``client-resources-num-cpus = 1`` on two cores), two messages to one node run
at the same time in two processes (on flwr 1.42, four queries to one node ran two at a time:
``tests/test_flower_message_concurrency.py``). That happens to a node dropped for lateness
whose next message comes while its training still runs, or to a donor two joiners ask at once.
Both processes would load the same state, sign envelopes with the same sequence numbers
(receivers refuse the second as a replay) and save over each other's records, ledger and
pending envelopes.

:func:`party_lock` is held for the whole of one message, from the party's build to its save
(the training in between too, as on the deployment engine): an exclusive ``flock`` on
``<state-dir>/party.lock``, which the kernel releases when its process dies, so a crashed
ClientApp never leaves the party locked. A process waits at most
:data:`FLOWER_PARTY_LOCK_WAIT_S` for its turn, then refuses the message with
:class:`~chaos_flwr.errors.StoreError`. Taking it again in the thread that holds it is a no-op.
A child forked during a turn (a data loader's workers, a process pool the training starts)
closes its copies of the held lock files at once, so a child that outlives the message never
keeps the party locked. A party without a state directory keeps its state in its process's
memory and takes no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from chaos_flwr.errors import StoreError

__all__ = [
    "FLOWER_PARTY_LOCK_POLL_S",
    "FLOWER_PARTY_LOCK_WAIT_S",
    "LOCK_FILE",
    "holds_turn",
    "party_lock",
]

LOG = logging.getLogger(__name__)

#: Longest wait (seconds) of a ClientApp process for another process of the same party to
#: finish its message, training included; then the message is refused (a StoreError reply,
#: which the ServerApp treats as any error reply). Above a round's usual deadlines: the
#: waiting message is the later one, and its reply counts even when it comes late.
FLOWER_PARTY_LOCK_WAIT_S: float = 900.0
#: Pause between two tries of a lock another process holds, in seconds.
FLOWER_PARTY_LOCK_POLL_S: float = 0.02
#: The lock's file name in the party's state directory.
LOCK_FILE = "party.lock"

_FDS: set[int] = set()  # the lock files this process has open
_HELD: set[tuple[str, int]] = set()  # (state dir, thread) pairs holding their party's lock
_GUARD = threading.Lock()  # over both; held across a fork, so no fork sees them half-changed
# (nothing done under _GUARD may fork or call out: set changes, mkdir, open and close only)


def _before_fork() -> None:
    _GUARD.acquire()


def _after_fork_in_parent() -> None:
    _GUARD.release()


def _after_fork_in_child() -> None:
    """In a child forked during a turn: close its copies of the lock files (never unlock: the
    flock belongs to the parent's open file, which closing a copy leaves held)."""
    global _GUARD
    for fd in _FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _FDS.clear()
    _HELD.clear()
    _GUARD = threading.Lock()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


@contextlib.contextmanager
def party_lock(
    state_dir: Path | None,
    *,
    wait_s: float | None = None,
    poll_s: float = FLOWER_PARTY_LOCK_POLL_S,
) -> Iterator[None]:
    """Hold the lock of the party whose state is in ``state_dir`` (module docstring).

    Parameters
    ----------
    state_dir
        The party's state directory (created if missing); ``None``: no lock.
    wait_s
        Longest wait for another process's turn to end; default
        :data:`FLOWER_PARTY_LOCK_WAIT_S`.
    poll_s
        Pause between tries.

    Raises
    ------
    StoreError
        Another process held the lock for ``wait_s``, or the lock file cannot be opened.
    """
    if state_dir is None:
        yield
        return
    key = (str(state_dir.resolve()), threading.get_ident())
    with _GUARD:
        again = key in _HELD
    if again:  # this thread already holds it (a handler inside a handler)
        yield
        return
    with _GUARD:
        fd = _open(state_dir)
        _FDS.add(fd)
    owner = os.getpid()
    try:
        _acquire(fd, state_dir, FLOWER_PARTY_LOCK_WAIT_S if wait_s is None else wait_s, poll_s)
        with _GUARD:
            _HELD.add(key)
        try:
            yield
        finally:
            with _GUARD:
                _HELD.discard(key)
    finally:
        if os.getpid() == owner:  # a child forked in the turn closed its copy when forked
            with _GUARD:
                _FDS.discard(fd)
                os.close(fd)  # releases the flock


def holds_turn(state_dir: Path) -> bool:
    """Whether the calling thread holds the party's lock on ``state_dir`` now (e.g. a churn
    wrapper took the turn around the message): another process of the party cannot have it."""
    with _GUARD:
        return (str(state_dir.resolve()), threading.get_ident()) in _HELD


def _open(state_dir: Path) -> int:
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        return os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StoreError(f"{state_dir / LOCK_FILE}: cannot open the party's lock ({exc})") from exc


def _acquire(fd: int, state_dir: Path, wait_s: float, poll_s: float) -> None:
    """Take the flock on ``fd`` within ``wait_s``; a file system without flock is warned
    about and not locked (the deployment engine runs one message at a time, but a party
    daemon's local service beside it would then go unguarded: keep the state directory on a
    file system with locks)."""
    t0 = time.monotonic()
    until = t0 + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if time.monotonic() > t0 + poll_s:
                LOG.info(
                    "chaos-flwr: %s: waited %.2f s for another process of this party to "
                    "finish its message", state_dir, time.monotonic() - t0,
                )  # fmt: skip
            return
        except BlockingIOError:
            if time.monotonic() >= until:
                raise StoreError(
                    f"{state_dir}: another process or thread of this party has held its lock "
                    f"for {wait_s:g} s (FLOWER_PARTY_LOCK_WAIT_S); this message is refused"
                ) from None
            time.sleep(poll_s)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise StoreError(f"{state_dir / LOCK_FILE}: cannot lock ({exc})") from exc
            LOG.warning(
                "chaos-flwr: %s cannot be locked on this file system (%s): two simulation "
                "workers of one party could overlap; use one worker per party or a local "
                "state directory", state_dir, exc,
            )  # fmt: skip
            return
