"""A party's protocol messages answered by its daemon, which holds the party in memory.

On Flower's deployment engine every message starts a ClientApp process, which would build the
party from its state directory, handle the message and save it again. When the institution
runs its party daemon (``chaos-flwr party``), the daemon listens on ``<state-dir>/party.sock``
(:mod:`chaos_flwr.flower.local_socket`) and keeps the party built between messages:

- the ClientApp's ``query.chaos`` handler (relay, certify, join and pull messages) sends the
  message's content there (:func:`daemon_reply`) and returns the daemon's reply; it builds no
  party itself;
- the daemon (:class:`PartyService`) takes the party's turn (:func:`~.lock.party_lock`), uses
  the party it holds unless another process saved it since (then it takes up the newer save),
  handles the message (:func:`~.query.chaos_reply`) and saves before it replies, as the
  ClientApp would.

Train and evaluate messages are still handled in the ClientApp process: it trains there, on
the party it builds from the state directory. Both sides take the same turn, so they never
handle the party at once, and each takes up what the other saved (a party notes the state
file it was built from and last saved: :meth:`~.party.Party.is_current`). The daemon holds one
party, the newest run's, built for the SuperNode life the ClientApp names (its lifetime token),
and drops it when a message fails in it.

No daemon (no socket file, or a stale one) means the ClientApp handles the message itself, as
before; so does an app enabled with a party factory of its own, an unsigned run, and a message
whose thread already holds the party's turn (a wrapper such as the churn emulation took it
around the message: the daemon would wait for it), and one the daemon refuses because it holds
another party (:class:`~chaos_flwr.errors.DaemonMismatchError`, said in a warning). A daemon
that breaks off mid-request gives the message an error reply (it may have acted on it: the
ClientApp does not handle it a second time).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict

from chaos_flwr.errors import (
    ChaosError,
    ConfigError,
    DaemonMismatchError,
    DecodeError,
    OversizeError,
)
from chaos_flwr.flower.client.factory import build_party
from chaos_flwr.flower.client.lock import holds_turn, party_lock
from chaos_flwr.flower.client.party import Party
from chaos_flwr.flower.client.query import chaos_reply
from chaos_flwr.flower.client.registry import Parties, forget_party, restart_marked, take_restart
from chaos_flwr.flower.client.settings import (
    NODE_CHARTER,
    NODE_KEEP_REPLICAS,
    NODE_KEY,
    NODE_STATE_DIR,
    PartySettings,
    party_settings,
)
from chaos_flwr.flower.local_socket import LOCAL_SOCKET_FILE, local_call

__all__ = ["OP_QUERY", "PartyService", "daemon_reply"]

LOG = logging.getLogger(__name__)

#: The operation of a ``query.chaos`` message sent to the daemon.
OP_QUERY = "query.chaos"
#: Longest ``lifetime`` token a request may carry (``<pid>:<start time>``).
SERVICE_MAX_LIFETIME_CHARS = 256
#: Most settings one request's ``node_config`` or ``run_config`` may carry.
SERVICE_MAX_SETTINGS = 256

_ID_MAX = 2**64


def _encode(content: RecordDict) -> bytes:
    from flwr.common.serde import recorddict_to_proto

    return bytes(recorddict_to_proto(content).SerializeToString())


def _decode(body: bytes) -> RecordDict:
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    try:
        return recorddict_from_proto(ProtoRecordDict.FromString(body))
    except Exception as exc:  # protobuf's and Flower's own errors: the bytes are not content
        raise DecodeError(f"party daemon: message content does not parse ({exc})") from None


def daemon_reply(message: Message, context: Context) -> Message | None:
    """The reply of this node's party daemon to a ``query.chaos`` message, or ``None`` when
    no daemon answers on the party's local socket (the caller handles the message).

    Parameters
    ----------
    message, context
        The message, and the node's Flower ``Context``.

    Raises
    ------
    LocalSocketError
        The daemon took the request but no whole reply came.
    ChaosError
        The daemon refused or failed the message: its typed error (a ``ConfigError`` names the
        setting, as the ClientApp's own build would).
    """
    try:
        settings = party_settings(context)
    except ConfigError:
        return None  # the ClientApp's own build says what is wrong
    if settings.unsigned or settings.state_dir is None:
        return None
    path = settings.state_dir / LOCAL_SOCKET_FILE
    if not path.exists() or holds_turn(settings.state_dir):
        return None  # no daemon; or this thread has the turn, so the daemon would wait for it
    from chaos_flwr.flower.durable import lifetime_token

    assert settings.key_path is not None and settings.charter_path is not None
    node_config = {
        **dict(context.node_config),
        NODE_KEY: str(settings.key_path.resolve()),
        NODE_CHARTER: str(settings.charter_path.resolve()),
        NODE_STATE_DIR: str(settings.state_dir.resolve()),
        NODE_KEEP_REPLICAS: settings.keep_replicas,
    }  # as resolved here: the daemon sees neither this process's run config, environment
    # nor working directory
    restart = restart_marked(context)
    header = {
        "op": OP_QUERY,
        "run_id": int(context.run_id),
        "node_id": int(context.node_id),
        "node_config": node_config,
        "run_config": {k: v for k, v in context.run_config.items() if k.startswith("chaos-")},
        "lifetime": lifetime_token(),
        "restart": restart,
    }
    content = message.content if message.has_content() else RecordDict()
    try:
        reply = local_call(path, header, _encode(content))
    except (DaemonMismatchError, OversizeError) as exc:  # refused before anything was done
        LOG.warning("chaos-flwr: the party daemon at %s is not used: %s", path, exc)
        return None
    if reply is None:
        return None
    if restart:
        take_restart(context)  # the daemon built the party anew
    return Message(_decode(reply[1]), reply_to=message)


def _settings(value: object, what: str) -> dict[str, bool | int | float | str]:
    if not isinstance(value, dict) or len(value) > SERVICE_MAX_SETTINGS:
        raise DecodeError(f"party daemon: {what} must be an object of <= {SERVICE_MAX_SETTINGS}")
    for key, item in value.items():
        ok = isinstance(item, (bool, int, str)) or (isinstance(item, float) and math.isfinite(item))
        if not (isinstance(key, str) and ok):
            raise DecodeError(f"party daemon: {what} holds a bad setting {key!r:.80}")
    return value


def _context(header: dict[str, Any]) -> Context:
    """The node's ``Context`` a request describes (each field type- and range-checked)."""
    ids = [header.get("run_id"), header.get("node_id")]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < _ID_MAX for i in ids):
        raise DecodeError("party daemon: run_id and node_id must be integers in [0, 2**64)")
    node_config = _settings(header.get("node_config"), "node_config")
    run_config = _settings(header.get("run_config"), "run_config")
    return Context(ids[0], ids[1], node_config, RecordDict(), run_config)  # type: ignore[arg-type]


class PartyService:
    """The daemon's side: answers its party's ``query.chaos`` messages (a
    :class:`~chaos_flwr.flower.local_socket.LocalServer` handler).

    Parameters
    ----------
    state_dir
        The party's state directory (the daemon's ``--state-dir``): a request naming another
        is refused.
    party_id
        The daemon's party: a request whose settings build another party is refused.

    Attributes
    ----------
    answered : int
        Messages handled.
    """

    def __init__(self, state_dir: Path, party_id: str) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.party_id = party_id
        self.answered = 0
        self._life = ""
        self._built_with: dict[tuple[int, int], PartySettings] = {}
        self._key: tuple[int, int] | None = None
        self.parties = Parties(self._build)

    def _build(self, context: Context) -> Party:
        return build_party(context, lifetime=self._life)

    def __call__(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        """Handle one request: ``(header, body)`` in, ``({"ok": True}, reply content)`` out.

        Raises
        ------
        DecodeError
            The request is malformed (unknown operation, bad field, content that does not
            parse).
        DaemonMismatchError
            It names another state directory or another party's key (checked before anything
            is read or built: the ClientApp then handles the message itself).
        ConfigError
            Its settings do not build a party.
        """
        if header.get("op") != OP_QUERY:
            raise DecodeError(f"party daemon: unknown operation {header.get('op')!r:.80}")
        life = header.get("lifetime")
        restart = header.get("restart")
        if not isinstance(life, str) or len(life) > SERVICE_MAX_LIFETIME_CHARS:
            raise DecodeError("party daemon: lifetime must be a short string")
        if not isinstance(restart, bool):
            raise DecodeError("party daemon: restart must be true or false")
        context = _context(header)
        settings = party_settings(context)
        self._check_own(settings)
        content = _decode(body)
        with party_lock(self.state_dir):
            try:
                self._take_up(context, settings, life, restart)
                reply = chaos_reply(self.parties, content, context)
            except BaseException:
                self._drop()  # its memory may be ahead of its disk: the next one reloads
                raise
            self.answered += 1
        return {"ok": True}, _encode(reply)

    def _check_own(self, settings: PartySettings) -> None:
        """Refuse settings that name another state directory or another party's key."""
        named = settings.state_dir.resolve() if settings.state_dir is not None else None
        if settings.unsigned or named != self.state_dir:
            raise DaemonMismatchError(
                f"this party daemon holds the party of {self.state_dir}; the message's node "
                f"names {named if not settings.unsigned else 'an unsigned party'}"
            )
        if self._key is not None and self._built_with.get(self._key) == settings:
            return  # checked when it was built
        from chaos_flwr.identity import Identity

        assert settings.key_path is not None
        try:
            party_id = str(Identity.load(settings.key_path).party_id)
        except ChaosError as exc:
            raise ConfigError(f"party daemon: {exc}") from None
        if party_id != self.party_id:
            raise DaemonMismatchError(
                f"this party daemon is {self.party_id}; the message's node key is {party_id}"
            )

    def _take_up(self, context: Context, settings: PartySettings, life: str, restart: bool) -> None:
        """Hold the party for this request: the one held, unless the node, its settings or
        its SuperNode's life changed (then built anew, from the state directory)."""
        key = (context.run_id, context.node_id)
        held = self.parties.by_node.get(key)
        if (
            key != self._key
            or self._built_with.get(key) != settings
            or (held is not None and held.lifetime != life)
        ):
            self._drop()  # one party held: the newest run's (a new life takes up its save)
        if restart:
            self._drop()
            forget_party(context)  # the ClientApp's process forgot it: a real restart
        self._key = key
        self._life = life
        self.parties(context)  # the held one, or its newer save (Party.is_current)
        self._built_with[key] = settings

    def _drop(self) -> None:
        self.parties.by_node.clear()
        self._built_with.clear()
