"""Churn emulation for Flower apps: a ClientApp wrapper that plays a churn scenario.

The scenario format is :mod:`chaos_flwr.lab.scenario`. How each event is emulated on the
client side, by :func:`apply` (a wrapper put *outermost* around an enabled ``ClientApp``, so the
app itself keeps its Chaos diff):

- ``join``: before its round the node is not there: every message to it fails (an error
  reply, as from a node that is not connected). From its round on the node answers, and its
  Chaos party is built on the first message it handles (it holds nothing and must join).
- ``leave``: the party signs a leave record (``party_for(ctx).leave()``) on its first message
  of that round and answers the rest of the round as the party decides (the leave record goes
  out with those replies); from the next round on its node is shut down: every message fails.
- ``link-down`` / ``link-up``: ``party_for(ctx).disconnect(peer)`` / ``.connect(peer)``.

  An action the party refuses (e.g. a link-down with no link up) is reported on stderr and not
  retried; the node goes on answering (a refused action is not a crash).
- ``crash`` .. ``return``: every message from the crash round until the return round fails
  (no useful reply). In simulation the party's process memory survives a crash unless the
  simulation itself is restarted in between (a ``server-kill``), in which case the returning
  party really restarts from its disk.
- ``server-kill``: the orchestrator (:mod:`chaos_flwr.lab.demo`) kills the process tree
  running the ServerApp during that round and starts a new run that resumes from the parties'
  replicas (run config ``churn-start-round`` = that round). On the client side, the train
  handlers of that round take ``FLOWER_CHURN_KILL_TRAIN_DELAY_S`` longer in the first run, so
  that the kill lands while the parties train (simulated rounds are shorter than the
  orchestrator's polling), not at an arbitrary point of the round.

Context.state is per run, so in a resumed run (``churn-start-round`` = r) the once-only
actions of rounds before r are not repeated: they happened in the killed run.

Which round a message belongs to is read from the message itself (``server-round`` of a train
or evaluate config, else the Chaos record's phase and round), so the emulation does not depend
on process memory: Flower may run a node's messages in different worker processes. It is never
below the newest round of a message the node took before, since messages come in time order:
a join message that carries round ``r - 1``'s state to a node that came between rounds goes
out after round ``r``'s query to it, so it belongs to round ``r``. That round and the flags
that must happen once (a leave, a link drop) are kept in ``Context.state``, which Flower
carries per node and run, and in the party's state directory (:mod:`.churn_marks`: with
several simulation workers a message may carry a stale copy of the Context).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chaos_flwr.errors import ChaosError, ConfigError
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY
from chaos_flwr.lab.churn_marks import Marks
from chaos_flwr.lab.scenario import ChurnEvent, ChurnScenario, load_scenario
from chaos_flwr.lab.settings import (
    FLOWER_CHURN_KILL_TRAIN_DELAY_S,
    FLOWER_CHURN_RUN_CONFIG_KEY,
    FLOWER_CHURN_START_ROUND_KEY,
)

if TYPE_CHECKING:
    from chaos_flwr.flower.client.registry import Parties

__all__ = [
    "NodeCrashedError",
    "NodeLeftError",
    "NodeNotJoinedError",
    "apply",
    "message_round",
]


class NodeNotJoinedError(ChaosError):
    """A message reached a node whose join event has not come yet (the node is not there)."""


class NodeCrashedError(ChaosError):
    """A message reached a node that the scenario has crashed (until its ``return`` event)."""


class NodeLeftError(ChaosError):
    """A message reached the node of a party that left (its institution shut the node down)."""


@functools.lru_cache(maxsize=8)
def _cached_scenario(path: str, mtime_ns: int) -> ChurnScenario:
    return load_scenario(path)


def _int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def message_round(message: Any, start_round: int = 0) -> int:
    """The round a message belongs to, read from the message itself.

    Train/evaluate messages carry ``server-round`` in their config; a Chaos record in phase
    ``relay`` (sent during round ``r``'s training) names the certified round ``r - 1``, one in
    phase ``certify`` names ``r``. Messages with neither (a restarted server's ``hello``)
    belong to ``start_round``.
    """
    content = message.content if message.has_content() else None
    if content is None:
        return start_round
    config = content.config_records.get("config")
    if config is not None and _int(config.get("server-round")) is not None:
        return int(config["server-round"])
    record = content.config_records.get(CHAOS_RECORD_KEY)
    if record is not None:
        rnd = _int(record.get("round"))
        phase = record.get("phase")
        if rnd is not None and rnd >= 0:
            if phase == "relay":
                return rnd + 1
            if phase in ("certify", "pull", "join"):  # join: a joiner's relayed pull
                return rnd
    return start_round


class _Emulator:
    """Applies a scenario to the messages of one ClientApp (one instance per app).

    It holds nothing but the scenario: Flower's simulation engine pickles the ClientApp into
    every call of a worker, so the wrapper must not rely on memory between messages.
    """

    def __init__(self, scenario: ChurnScenario | None) -> None:
        self.fixed = scenario

    def scenario(self, context: Any) -> ChurnScenario | None:
        if self.fixed is not None:
            return self.fixed
        path = context.run_config.get(FLOWER_CHURN_RUN_CONFIG_KEY, "")
        if not path:
            return None
        if not isinstance(path, str):
            raise ConfigError(f"run_config '{FLOWER_CHURN_RUN_CONFIG_KEY}' must be a path string")
        p = Path(path)
        try:
            mtime = p.stat().st_mtime_ns
        except OSError as exc:
            raise ConfigError(
                f"run_config '{FLOWER_CHURN_RUN_CONFIG_KEY}': no scenario file at {p}"
            ) from exc
        return _cached_scenario(str(p), mtime)

    def before(self, message: Any, context: Any) -> None:
        scenario = self.scenario(context)
        if scenario is None:
            return
        pid = _int(context.node_config.get("partition-id"))
        if pid is None:
            raise ConfigError("node_config 'partition-id' is needed by the churn emulation")
        start = _int(context.run_config.get(FLOWER_CHURN_START_ROUND_KEY, 0)) or 0
        marks = Marks.load(context)
        rnd = max(message_round(message, start), marks.seen)
        if rnd < scenario.join_round(pid):
            raise NodeNotJoinedError(
                f"churn: partition {pid} joins at round {scenario.join_round(pid)}, this is "
                f"round {rnd}"
            )
        if scenario.is_down(pid, rnd):
            _forget(context)  # a crash loses the process: the party comes back from its disk
            raise NodeCrashedError(f"churn: partition {pid} is crashed in round {rnd}")
        gone = scenario.gone_round(pid)
        if gone is not None and rnd >= gone:
            raise NodeLeftError(f"churn: partition {pid} left; its node is shut down")
        marks.note_round(rnd)  # a message the node takes: later ones are of this round on
        kill = scenario.server_kill_round()
        if (
            kill is not None
            and rnd == kill
            and start < kill
            and str(message.metadata.message_type).startswith("train")
        ):
            # the server is killed while the parties train: training takes this long here
            time.sleep(FLOWER_CHURN_KILL_TRAIN_DELAY_S)
        # once-only actions of rounds before a resumed run's start happened in the killed run
        due = [(i, ev) for i, ev in scenario.actions(pid, rnd) if ev.round >= start]
        if not due:
            return
        for idx, ev in due:
            if idx in marks.done:
                continue
            marks.mark_done(idx)  # once, even when the party refuses: a refusal is not a crash
            try:
                _act(ev, context)
            except ChaosError as exc:
                print(
                    f"chaos-flwr churn: partition {pid}: {ev.label()} refused: "
                    f"{type(exc).__name__}: {exc}",
                    file=sys.stderr,
                )


def _forget(context: Any) -> None:
    from chaos_flwr.flower import client

    client.forget_party(context)  # looked up per call, like party_for


def _peer_party_id(context: Any, partition: int) -> str:
    from chaos_flwr.flower.client import RUN_KEYS_DIR
    from chaos_flwr.flower.keys import key_path
    from chaos_flwr.identity import Identity

    keys_dir = context.run_config.get(RUN_KEYS_DIR, "")
    if not isinstance(keys_dir, str) or not keys_dir:
        raise ConfigError(
            f"run_config '{RUN_KEYS_DIR}' is needed to name partition {partition}'s party in a "
            "link event"
        )
    return str(Identity.load(key_path(keys_dir, partition)).party_id)


def _act(ev: ChurnEvent, context: Any) -> None:
    from chaos_flwr.flower.client import party_for  # looked up per call: tests patch it

    party = party_for(context)
    if ev.kind == "leave":
        party.leave()
    elif ev.kind == "link-down":
        assert ev.peer is not None
        party.disconnect(_peer_party_id(context, ev.peer))
    elif ev.kind == "link-up":
        assert ev.peer is not None
        party.connect(_peer_party_id(context, ev.peer))


Handler = Callable[[Any, Any], Any]


def _wrap(fn: Handler, emulator: _Emulator, parties: Parties | None) -> Handler:
    def wrapped(message: Any, context: Any) -> Any:
        if emulator.scenario(context) is None:  # no churn: the message as it is (its
            return fn(message, context)  # query.chaos may go to the party daemon)
        # an action and the message it rides on are one turn of the party (another process
        # of it saving in between would drop the action: chaos_flwr.flower.client.lock); the
        # message is handled in this process then (the action is in this process's party)
        with parties.turn(context) if parties is not None else contextlib.nullcontext():
            emulator.before(message, context)
            return fn(message, context)

    wrapped.__name__ = getattr(fn, "__name__", "churn_wrapped")
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    return wrapped


def apply(app: Any, scenario: ChurnScenario | Path | str | None = None) -> Any:
    """Wrap every handler of an (enabled) ``ClientApp`` with the churn emulation.

    Apply it *after* :func:`chaos_flwr.flower.enable`, so it is the outermost layer.

    Parameters
    ----------
    app:
        A ``ClientApp`` built with decorators.
    scenario:
        The scenario, or a path to its YAML; ``None`` reads the path from the run config key
        ``churn-scenario`` on every message (an empty value means no churn: the wrapper then
        passes every message through unchanged).

    Returns
    -------
    ClientApp
        The same ``app``.
    """
    if isinstance(scenario, str | Path):
        scenario = load_scenario(scenario)
    registered: dict[str, Handler] | None = getattr(app, "_registered_funcs", None)
    if registered is None:
        raise ConfigError("app: churn.apply needs a ClientApp built with decorators")
    if getattr(app, "_chaos_churn", False):
        raise ConfigError("app: the churn emulation is already applied to this ClientApp")
    emulator = _Emulator(scenario)
    from chaos_flwr.flower.client.registry import Parties

    parties = getattr(app, "_chaos_parties", None)  # the enabled app's party table
    if not isinstance(parties, Parties):
        parties = None
    for name in list(registered):
        registered[name] = _wrap(registered[name], emulator, parties)
    app._chaos_churn = True
    return app
