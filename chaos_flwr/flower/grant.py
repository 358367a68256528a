"""The relay's read grant, on disk: ``<state-dir>/relay.grant``.

A restarted ServerApp rebuilds the newest certified state from the parties' replicas. Over
direct links it dials the parties' link servers (their daemons), but it holds no charter key,
so a link server serves it only on a grant its own party wrote: the SHA-256 of the
SubjectPublicKeyInfo of the ServerApp's link certificate (a fresh key per run), named in the
hello it sends, for :data:`~chaos_flwr.defaults.FLOWER_RELAY_GRANT_S` seconds. A granted
dialler is served under the name :data:`RELAY_READER`: byte ranges and manifests of the
certified states the party keeps, within the same per-peer limits; never gossip, never a
member's standing (a key a charter party's binding names is always served as that party,
granted or not: :class:`~chaos_flwr.transport.links.LinkServer`). It reads nothing the
ServerApp did not relay or aggregate itself: every state a party keeps was certified through
it. A hello that names no key, or one to a party that left, removes the grant.

Format: a codec map ``{"version": 1, "federation": str, "spki": 32 bytes, "expires": unix
seconds}``, written atomically (mode 0600), read bounded; a newer hello replaces it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from chaos_flwr import codec
from chaos_flwr.defaults import FLOWER_RELAY_GRANT_S
from chaos_flwr.errors import ChaosError, StoreError
from chaos_flwr.localfile import read_local_file, write_local_file

__all__ = [
    "RELAY_GRANT_FILE",
    "RELAY_READER",
    "RelayGrants",
    "take_hello",
    "write_grant",
]

LOG = logging.getLogger(__name__)

#: File name of the relay's read grant in a party's state directory.
RELAY_GRANT_FILE = "relay.grant"
#: The name a granted dialler is served under (never a party id: those are ``p`` + hex).
RELAY_READER = "relay"
_VERSION = 1
_MAX_BYTES = 512
_SPKI_BYTES = 32


def write_grant(
    state_dir: Path, federation: str, spki: bytes, *, ttl_s: float = FLOWER_RELAY_GRANT_S
) -> Path:
    """Grant the link key whose SubjectPublicKeyInfo hashes to ``spki`` reads for ``ttl_s``
    seconds from now (wall clock: the link server is another process on this host).

    Raises
    ------
    StoreError
        ``spki`` is not 32 bytes, ``ttl_s`` is not positive, or the file cannot be written.
    """
    if not isinstance(spki, bytes) or len(spki) != _SPKI_BYTES:
        raise StoreError(f"a relay grant names a {_SPKI_BYTES}-byte key digest")
    if not ttl_s > 0:
        raise StoreError(f"a relay grant lasts a positive time, got {ttl_s}")
    data = codec.encode(
        {"version": _VERSION, "federation": federation, "spki": spki,
         "expires": time.time() + ttl_s}
    )  # fmt: skip
    return write_local_file(
        Path(state_dir) / RELAY_GRANT_FILE, data, what="relay grant", error=StoreError
    )


def take_hello(
    state_dir: Path | None, federation: str | None, spki: object, *, left: bool = False
) -> str:
    """Grant the key a hello names (``spki``, its :data:`~chaos_flwr.flower.schema.RELAY_SPKI_KEY`
    field), or remove the grant when the hello names none (``None``) or the party ``left``;
    returns ``""``, or why not (the party notes it). A party without a state directory or a
    federation (unsigned) serves no links and writes nothing."""
    if state_dir is None or federation is None:
        return ""
    try:
        if spki is None or left:
            (Path(state_dir) / RELAY_GRANT_FILE).unlink(missing_ok=True)
        elif not isinstance(spki, bytes):
            raise StoreError("a hello's relay key digest is not bytes; no relay grant")
        else:
            write_grant(state_dir, federation, spki)
    except OSError as exc:
        return f"StoreError: cannot remove the relay grant ({exc})"
    except StoreError as exc:
        return f"StoreError: {exc}"
    return ""


def _load(path: Path) -> tuple[bytes, float, str] | None:
    """The grant in ``path`` as ``(spki, expires, federation)``; ``None`` if there is none.

    Raises
    ------
    StoreError
        The file is not a regular file, too large, or not a relay grant.
    """
    try:
        raw = read_local_file(path, what="relay grant", error=StoreError, max_bytes=_MAX_BYTES)
    except FileNotFoundError:
        return None
    try:
        value = codec.decode(raw, max_bytes=_MAX_BYTES)
    except ChaosError as exc:
        raise StoreError(f"{path}: not a relay grant ({exc})") from exc
    if not isinstance(value, dict) or value.get("version") != _VERSION:
        raise StoreError(f"{path}: not a version-{_VERSION} relay grant")
    spki, expires, fed = value.get("spki"), value.get("expires"), value.get("federation")
    if not isinstance(spki, bytes) or len(spki) != _SPKI_BYTES:
        raise StoreError(f"{path}: 'spki' must be {_SPKI_BYTES} bytes")
    if not isinstance(expires, float) or not isinstance(fed, str):
        raise StoreError(f"{path}: 'expires' must be a float and 'federation' a string")
    return spki, expires, fed


class RelayGrants:
    """The readers a link server serves besides members: ``{spki: RELAY_READER}`` while the
    party's grant holds, the file read again only when it changed (a callable for
    :class:`~chaos_flwr.transport.links.LinkServer`'s ``readers``).

    A grant file that does not read grants nothing (logged once per change of the file).
    """

    def __init__(
        self, state_dir: Path, federation: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.path = Path(state_dir) / RELAY_GRANT_FILE
        self.federation, self.clock = federation, clock
        self._seen: tuple[int, int, int] | None = None
        self._grant: tuple[bytes, float, str] | None = None

    def __call__(self) -> dict[bytes, str]:
        try:
            st = self.path.stat()
        except OSError:
            return {}
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._seen:
            self._seen = key
            try:
                self._grant = _load(self.path)
            except StoreError as exc:
                self._grant = None
                LOG.warning("chaos-flwr: the relay grant grants nothing: %s", exc)
        grant = self._grant
        if grant is None or grant[2] != self.federation or self.clock() >= grant[1]:
            return {}
        return {grant[0]: RELAY_READER}
