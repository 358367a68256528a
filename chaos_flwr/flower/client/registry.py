"""The process registry: one party per (run, node) for every enabled ClientApp in a process.

Module-level, not on the app: Flower's simulation engine cloudpickles the ClientApp into every
worker call, so each message runs on a fresh copy of the app; the copies (and
:func:`party_for`) must share one party. :func:`forget_party` drops a cached party, as a crash
that loses the process would (its next build is a real restart).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from flwr.app import Context
from flwr.clientapp import ClientApp

from chaos_flwr.errors import ConfigError
from chaos_flwr.flower.client.lock import party_lock
from chaos_flwr.flower.client.party import Party
from chaos_flwr.flower.client.settings import state_dir_named

__all__ = [
    "Parties",
    "PartyFactory",
    "forget_party",
    "party_for",
    "register",
    "restart_marked",
    "take_restart",
]

#: Builds the party of a node from its ``Context``.
PartyFactory = Callable[[Context], Party]

#: (run id, node id) of parties whose next build is a real restart (:func:`forget_party`).
_RESTARTED: set[tuple[int, int]] = set()

#: Parties of this process by (enable() call number, run id, node id) (module docstring).
_PARTY_TABLES: dict[int, dict[tuple[int, int], Party]] = {}
_ENABLE_CALLS: list[int] = [0]


class Parties:
    """The parties of one enabled ClientApp in this process, one per (run, node)."""

    def __init__(self, factory: PartyFactory) -> None:
        self.factory = factory
        # the n-th enable() of a process: the same in the driver and in a worker that imports
        # the app's module, so an unpickled copy finds the worker's table
        self.token = _ENABLE_CALLS[0]
        _ENABLE_CALLS[0] += 1

    @property
    def by_node(self) -> dict[tuple[int, int], Party]:
        """This app's parties by (run id, node id), shared by every copy of the app."""
        return _PARTY_TABLES.setdefault(self.token, {})

    def __call__(self, context: Context) -> Party:
        key = (context.run_id, context.node_id)
        party = self.by_node.get(key)
        if party is not None and not party.is_current():
            party = None  # another process continued this party's life: take up its state
        if party is None:
            party = self.factory(context)
            self.by_node[key] = party
        return party

    def turn(self, context: Context) -> AbstractContextManager[None]:
        """This node's party's turn for one message: no other process of the party builds,
        handles or saves it meanwhile.

        Parameters
        ----------
        context
            The node's Flower ``Context``.

        Returns
        -------
        AbstractContextManager[None]
            :func:`~.lock.party_lock` on the state directory the node's settings name
            (``chaos-state-dir``, or ``chaos-state-root`` and the partition): a custom party
            factory must keep the party's state there too. Settings that name no state
            directory, or that are wrong (the party's build then says what is wrong), take no
            lock.
        """
        return party_lock(state_dir_named(context))


#: The party tables of the ClientApps enabled in this process, oldest first.
_ENABLED: list[Parties] = []


def register(parties: Parties) -> None:
    """List the parties of a newly enabled app (newest last, as :func:`party_for` looks)."""
    _ENABLED.append(parties)


def party_for(context: Context, app: ClientApp | None = None) -> Party:
    """The party of this node and run (the one the enabled ClientApp uses), built if needed.

    Churn scenarios wrap an enabled ClientApp and call :meth:`Party.leave`,
    :meth:`Party.connect` or :meth:`Party.disconnect` on what this returns. Act from inside
    a handler of the enabled app (the wrapped train/evaluate handlers hold the party's turn,
    :meth:`Parties.turn`), or within that turn: with several simulation workers, another
    process of the party saving in between would drop the action.

    Parameters
    ----------
    context:
        The node's Flower ``Context`` (the one the handlers get).
    app:
        The enabled ClientApp; default: the newest enabled app that has a party for this
        node, else the newest enabled app.

    Raises
    ------
    ConfigError
        ``app`` is not enabled, or no ClientApp was enabled in this process.
    """
    if app is not None:
        parties = getattr(app, "_chaos_parties", None)
        if not isinstance(parties, Parties):
            raise ConfigError("party_for: this ClientApp is not Chaos-enabled (chaos_flwr.enable)")
        return parties(context)
    if not _ENABLED:
        raise ConfigError("party_for: no ClientApp has been enabled (chaos_flwr.enable) here")
    key = (context.run_id, context.node_id)
    for parties in reversed(_ENABLED):
        if key in parties.by_node:
            return parties(context)  # the cached party, or its newer save if one was made since
    return _ENABLED[-1](context)


def forget_party(context: Context) -> None:
    """Drop the cached party of this node and run in every enabled app (a crash that loses the
    process: the next message builds the party anew, from its disk)."""
    key = (context.run_id, context.node_id)
    for parties in _ENABLED:
        parties.by_node.pop(key, None)
    _RESTARTED.add(key)


def restart_marked(context: Context) -> bool:
    """Whether this node's next party build is a real restart (:func:`take_restart`, without
    using the mark up)."""
    return (context.run_id, context.node_id) in _RESTARTED


def take_restart(context: Context) -> bool:
    """Whether this node's next party build is a real restart (:func:`forget_party` was
    called for it since its last build); the mark is used up."""
    key = (context.run_id, context.node_id)
    restarted = key in _RESTARTED
    _RESTARTED.discard(key)
    return restarted
