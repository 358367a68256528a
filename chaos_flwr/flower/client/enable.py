"""The client side's one hook into Flower: :func:`enable` makes an existing ``ClientApp`` a
Chaos party.

The change to a plain Flower app is::

    from chaos_flwr.flower import enable   # 1
    app = ClientApp()
    ...                                     # @app.train() / @app.evaluate() as before
    enable(app)                             # 2

:func:`enable` registers the ``query.chaos`` handler and wraps the app's train/evaluate handlers
(in Flower's ``ClientApp._registered_funcs``, the only place this package touches Flower's
internals; see docs/internals.md) so that Chaos records riding on those messages are taken off
before the handler sees them and the party's outgoing envelopes and receipt are put on the
reply.

A party that cannot take part because of its settings (a
:class:`~chaos_flwr.errors.ConfigError`, e.g. a missing ``chaos-key``) answers every message
with an error reply whose one-line reason starts with
:data:`~chaos_flwr.flower.client.settings.CONFIG_ERROR_MARK` and names the setting, the node
and its partition, instead of raising: the engine then logs no traceback, and the ServerApp
stops with that reason when no party can take part (see
:class:`~chaos_flwr.errors.PartyConfigError`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from chaos_flwr.errors import ChaosError, ConfigError
from chaos_flwr.flower.client import proofs
from chaos_flwr.flower.client.factory import default_party_factory
from chaos_flwr.flower.client.query import chaos_reply
from chaos_flwr.flower.client.registry import Parties, PartyFactory, register
from chaos_flwr.flower.client.service import daemon_reply
from chaos_flwr.flower.client.settings import CONFIG_ERROR_MARK, NODE_PARTITION_ID
from chaos_flwr.flower.held import restore_held
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY, split_chaos

__all__ = ["enable"]

_LOG = logging.getLogger("chaos_flwr")

Handler = Callable[[Message, Context], Message]


def _config_error_reply(message: Message, context: Context, exc: ConfigError) -> Message:
    """The error reply of a party whose settings are wrong: one line, no traceback."""
    where = f"node {context.node_id}"
    partition = context.node_config.get(NODE_PARTITION_ID)
    if partition is not None:
        where += f" ({NODE_PARTITION_ID} {partition})"
    reason = f"{CONFIG_ERROR_MARK}: {where}: {exc}"
    _LOG.error("chaos-flwr: %s cannot take part: %s", where, exc)
    return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)


def _answer_config_errors(fn: Handler) -> Handler:
    """``fn``, with a :class:`ConfigError` turned into the error reply of a misconfigured party."""

    def guarded(message: Message, context: Context) -> Message:
        try:
            return fn(message, context)
        except ConfigError as exc:
            return _config_error_reply(message, context, exc)

    guarded.__name__ = getattr(fn, "__name__", "guarded")
    guarded.__doc__ = getattr(fn, "__doc__", None)
    return guarded


def _wrap(
    fn: Callable[[Message, Context], Message], parties: Parties
) -> Callable[[Message, Context], Message]:
    def wrapped(message: Message, context: Context) -> Message:
        with parties.turn(context):  # from the party's build to its save, training included
            return handled(message, context)

    def handled(message: Message, context: Context) -> Message:
        content = message.content if message.has_content() else None  # with audit material
        record = split_chaos(message)
        if record is not None and parties(context).left:
            # a party that left answers nothing more as a member (its leave record waits in
            # ``pending`` for the next relay message)
            return Message(
                Error(ErrorCode.MOD_FAILED_PRECONDITION, "party left the federation"),
                reply_to=message,
            )
        if record is not None and message.metadata.message_type.startswith("train"):
            party = parties(context)
            proofs.take_refutations(party, record)  # before it trains on a refuted state
            if record.get("phase") == "certify":  # an initial state rides on its first train
                party.take_certified(
                    record, next(iter(message.content.array_records.values()), None)
                )
            try:
                restore_held(message, party)  # the state it holds, left out by the ServerApp
            except ChaosError as exc:
                party.errors.append(f"{type(exc).__name__}: {exc}")
                return Message(
                    Error(ErrorCode.MOD_FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}"),
                    reply_to=message,
                )
            if party.check_receipts(record):
                # it will not train on a round that was shown two ways (evidence goes out
                # with its next relay reply)
                return Message(
                    Error(ErrorCode.MOD_FAILED_PRECONDITION, str(party.evidence[0].error())),
                    reply_to=message,
                )
        reply = fn(message, context)
        if record is None:
            return reply
        arrays = message.content.array_records
        first = next(iter(arrays.values()), None)
        party = parties(context)
        commitment = b""
        if reply.has_content() and message.metadata.message_type.startswith("train"):
            # signed over what the aggregation reads, on the state it trained from
            commitment = proofs.commit(party, record, reply.content)
        out = party.process(record, first, content)
        if commitment:
            out["commit"] = commitment
        party.persist()
        if reply.has_content():
            content = RecordDict(dict(reply.content.items()))
            content[CHAOS_RECORD_KEY] = out
            reply.content = content
        return reply

    wrapped.__name__ = getattr(fn, "__name__", "wrapped")
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    return _answer_config_errors(wrapped)


def enable(app: ClientApp, *, party_factory: PartyFactory | None = None) -> ClientApp:
    """Make ``app`` a Chaos party: register ``query.chaos`` and wrap train/evaluate handlers.

    Call it after the app's ``@app.train()`` / ``@app.evaluate()`` handlers are registered.

    Parameters
    ----------
    app:
        A ``ClientApp`` built with decorators (not with a legacy ``client_fn``).
    party_factory:
        Builds the party of a node from its ``Context``; default
        :func:`default_party_factory`, which reads ``node_config``. Each message is handled
        in the party's turn, a lock on the state directory the node's settings name
        (:meth:`~.registry.Parties.turn`): a factory of its own keeps the party's state there.

    Returns
    -------
    ClientApp
        The same ``app``.
    """
    parties = Parties(party_factory or default_party_factory)
    registered: dict[str, Callable[[Message, Context], Message]] | None = getattr(
        app, "_registered_funcs", None
    )
    if registered is None or getattr(app, "_call", None) is not None:
        raise ConfigError(
            "app: chaos_flwr.flower.enable needs a ClientApp built with @app.train()/"
            "@app.evaluate() decorators, not one built from a legacy client_fn"
        )
    if "query.chaos" in registered:
        raise ConfigError("app: Chaos is already enabled on this ClientApp")
    for name in list(registered):
        if name.startswith(("train.", "evaluate.")):
            registered[name] = _wrap(registered[name], parties)
    app._chaos_parties = parties  # type: ignore[attr-defined]
    register(parties)

    own_factory = party_factory is not None and party_factory is not default_party_factory

    @app.query("chaos")
    @_answer_config_errors
    def chaos_query(message: Message, context: Context) -> Message:
        # the party daemon's, when it holds the party (it takes the turn there)
        if not own_factory:
            reply = daemon_reply(message, context)
            if reply is not None:
                return reply
        with parties.turn(context):  # from the party's build to its save
            content = message.content if message.has_content() else RecordDict()
            return Message(chaos_reply(parties, content, context), reply_to=message)

    return app
