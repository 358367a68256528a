"""Churn scenarios for Flower apps: who joins, leaves, drops a link or crashes, and when.

A scenario is a YAML file (``examples/multi_institution/churn.yaml``)::

    name: five-institutions
    rounds: 8
    institutions: 5          # partitions 0..4 are members from the start
    joiners: 1               # partitions 5.. are outside until their join event
    events:
      - {round: 3, kind: join, party: 5}
      - {round: 4, kind: link-down, party: 1, peer: 2}
      - {round: 4, kind: leave, party: 4}
      - {round: 5, kind: crash, party: 3}
      - {round: 6, kind: server-kill}
      - {round: 7, kind: return, party: 3}

Parties are named by their Flower ``partition-id``. An event "at round r" takes effect at the
first message of round ``r`` that the party's node sees (train, evaluate or ``query.chaos``).

How each event is emulated on the client side, by :func:`apply` (a wrapper put *outermost*
around an enabled ``ClientApp``, so the app itself keeps its Chaos diff):

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
- ``server-kill``: the orchestrator (:mod:`chaos_flwr.flower.demo`) kills the process tree
  running the ServerApp during that round and starts a new run that resumes from the parties'
  replicas (run config ``churn-start-round`` = that round). On the client side, the train
  handlers of that round take ``FLOWER_CHURN_KILL_TRAIN_DELAY_S`` longer in the first run, so
  that the kill lands while the parties train (simulated rounds are shorter than the
  orchestrator's polling), not at an arbitrary point of the round.

Context.state is per run, so in a resumed run (``churn-start-round`` = r) the once-only
actions of rounds before r are not repeated: they happened in the killed run.

Which round a message belongs to is read from the message itself (``server-round`` of a train
or evaluate config, else the Chaos record's phase and round), so the emulation does not depend
on process memory: Flower may run a node's messages in different worker processes. Flags that
must happen once (a leave, a link drop) are kept in ``Context.state``, which Flower carries
per node and run.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from chaos_flwr.defaults import (
    FLOWER_CHURN_KILL_TRAIN_DELAY_S,
    FLOWER_CHURN_MAX_FILE_BYTES,
    FLOWER_CHURN_RUN_CONFIG_KEY,
    FLOWER_CHURN_START_ROUND_KEY,
)
from chaos_flwr.errors import ChaosError, ConfigError
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY

__all__ = [
    "CLIENT_EVENTS",
    "ChurnEvent",
    "ChurnScenario",
    "NodeCrashedError",
    "NodeLeftError",
    "NodeNotJoinedError",
    "apply",
    "load_scenario",
    "message_round",
]

EventKind = Literal["join", "leave", "link-down", "link-up", "crash", "return", "server-kill"]
#: Event kinds that the client-side wrapper acts on (``server-kill`` is the orchestrator's).
CLIENT_EVENTS = frozenset({"join", "leave", "link-down", "link-up", "crash", "return"})
_LINK_EVENTS = frozenset({"link-down", "link-up"})
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
#: ``Context.state`` record where the wrapper keeps its once-only flags.
_STATE_KEY = "chaos-churn"


class NodeNotJoinedError(ChaosError):
    """A message reached a node whose join event has not come yet (the node is not there)."""


class NodeCrashedError(ChaosError):
    """A message reached a node that the scenario has crashed (until its ``return`` event)."""


class NodeLeftError(ChaosError):
    """A message reached the node of a party that left (its institution shut the node down)."""


class ChurnEvent(BaseModel):
    """One event of a scenario.

    Attributes
    ----------
    round : int
        The round it happens in (``1 .. rounds``).
    kind : str
        ``join``, ``leave``, ``link-down``, ``link-up``, ``crash``, ``return`` or
        ``server-kill``.
    party : int or None
        The partition id of the party concerned (not for ``server-kill``).
    peer : int or None
        The other end of a link event.
    """

    model_config = _STRICT

    round: int = Field(ge=1)
    kind: EventKind
    party: int | None = Field(default=None, ge=0)
    peer: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _fields_for_kind(self) -> ChurnEvent:
        if self.kind == "server-kill":
            if self.party is not None or self.peer is not None:
                raise ValueError("party/peer: a server-kill names no party")
            return self
        if self.party is None:
            raise ValueError(f"party: a {self.kind} event needs the party's partition id")
        if self.kind in _LINK_EVENTS:
            if self.peer is None:
                raise ValueError(f"peer: a {self.kind} event needs the other end's partition id")
            if self.peer == self.party:
                raise ValueError("peer: a link's two ends must differ")
        elif self.peer is not None:
            raise ValueError(f"peer: a {self.kind} event names no peer")
        return self

    def label(self) -> str:
        """A short human-readable name, e.g. ``crash p3 @r5``."""
        if self.kind == "server-kill":
            return f"server-kill @r{self.round}"
        who = f"p{self.party}" + (f"-p{self.peer}" if self.peer is not None else "")
        return f"{self.kind} {who} @r{self.round}"


class ChurnScenario(BaseModel):
    """A churn scenario: the federation's parties and the events, in round order.

    Attributes
    ----------
    name : str
        Label of the scenario.
    rounds : int
        Federated rounds of the run.
    institutions : int
        Parties present from the start (partition ids ``0 .. institutions-1``).
    joiners : int
        Parties that join later (partition ids after the institutions).
    events : list of ChurnEvent
        Sorted by round (ties keep the file's order).
    """

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=128)
    rounds: int = Field(ge=1, le=10_000)
    institutions: int = Field(ge=1, le=1024)
    joiners: int = Field(default=0, ge=0, le=1024)
    events: tuple[ChurnEvent, ...] = ()

    @property
    def num_parties(self) -> int:
        """Partitions of the run (institutions and joiners)."""
        return self.institutions + self.joiners

    @model_validator(mode="after")
    def _consistent(self) -> ChurnScenario:
        joined = set(range(self.institutions))
        crashed: set[int] = set()
        left: set[int] = set()
        kills = 0
        last_round = 0
        for i, ev in enumerate(self.events):
            where = f"events[{i}]"
            if ev.round < last_round:
                raise ValueError(f"{where}.round: events must be in round order")
            last_round = ev.round
            if ev.round > self.rounds:
                raise ValueError(f"{where}.round: {ev.round} is past rounds={self.rounds}")
            if ev.kind == "server-kill":
                kills += 1
                if ev.round < 2:
                    raise ValueError(f"{where}.round: the server can be killed from round 2 on")
                continue
            assert ev.party is not None
            for name, pid in (("party", ev.party), ("peer", ev.peer)):
                if pid is not None and pid >= self.num_parties:
                    raise ValueError(
                        f"{where}.{name}: partition {pid} is not in 0..{self.num_parties - 1}"
                    )
            if ev.kind == "join":
                if ev.party < self.institutions:
                    raise ValueError(
                        f"{where}.party: partition {ev.party} is an institution (member from "
                        f"the start); joiners are {self.institutions}..{self.num_parties - 1}"
                    )
                if ev.party in joined:
                    raise ValueError(f"{where}.party: partition {ev.party} joins twice")
                joined.add(ev.party)
                continue
            if ev.party not in joined:
                raise ValueError(f"{where}.party: partition {ev.party} has not joined yet")
            if ev.party in left:
                raise ValueError(f"{where}.party: partition {ev.party} has already left")
            if ev.kind == "crash":
                if ev.party in crashed:
                    raise ValueError(f"{where}.party: partition {ev.party} is already down")
                crashed.add(ev.party)
            elif ev.kind == "return":
                if ev.party not in crashed:
                    raise ValueError(f"{where}.party: partition {ev.party} did not crash")
                crashed.discard(ev.party)
            elif ev.party in crashed:
                raise ValueError(f"{where}.party: partition {ev.party} is down at that round")
            elif ev.kind == "leave":
                left.add(ev.party)
            elif ev.peer is not None and (ev.peer not in joined or ev.peer in left):
                raise ValueError(f"{where}.peer: partition {ev.peer} is not a member then")
        if kills > 1:
            raise ValueError("events: at most one server-kill per scenario")
        return self

    # -- questions the wrapper and the report ask ---------------------------------------------
    def join_round(self, party: int) -> int:
        """First round the party is there (0 for institutions)."""
        for ev in self.events:
            if ev.kind == "join" and ev.party == party:
                return ev.round
        return 0 if party < self.institutions else self.rounds + 1

    def is_down(self, party: int, server_round: int) -> bool:
        """Whether the party is crashed (or not yet joined) in ``server_round``."""
        if server_round < self.join_round(party):
            return True
        down = False
        for ev in self.events:
            if ev.round > server_round or ev.party != party:
                continue
            if ev.kind == "crash":
                down = True
            elif ev.kind == "return":
                down = False
        return down

    def gone_round(self, party: int) -> int | None:
        """First round the node of a party that left is shut down (the round after its leave:
        the leave record gets out with the node's replies of the leave round)."""
        for ev in self.events:
            if ev.kind == "leave" and ev.party == party:
                return ev.round + 1
        return None

    def actions(self, party: int, server_round: int) -> list[tuple[int, ChurnEvent]]:
        """Once-only actions (leave, link-down, link-up) due for the party by ``server_round``,
        each with its index in :attr:`events`."""
        return [
            (i, ev)
            for i, ev in enumerate(self.events)
            if ev.party == party
            and ev.kind in {"leave", "link-down", "link-up"}
            and ev.round <= server_round
        ]

    def server_kill_round(self) -> int | None:
        """Round during which the ServerApp is killed, if the scenario kills it."""
        for ev in self.events:
            if ev.kind == "server-kill":
                return ev.round
        return None


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "scenario"


def parse_scenario(data: Any, source: str = "scenario") -> ChurnScenario:
    """Validate a scenario mapping; :class:`ConfigError` names the first bad field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a churn scenario is a mapping, got {type(data).__name__}")
    if isinstance(data.get("events"), list):
        data = {**data, "events": tuple(data["events"])}
    try:
        return ChurnScenario.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = _field_path(tuple(err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if ":" in msg.split(" ", 1)[0]:  # the validator already named the field
            raise ConfigError(f"{source}: {msg}") from None
        raise ConfigError(f"{source}: {where}: {msg}") from None


def load_scenario(path: Path | str) -> ChurnScenario:
    """Read and validate a churn scenario YAML file.

    Raises
    ------
    ConfigError
        The file is missing, too large, not YAML, or a field is wrong (the field is named).
    """
    p = Path(path)
    try:
        if p.stat().st_size > FLOWER_CHURN_MAX_FILE_BYTES:
            raise ConfigError(f"{p}: larger than {FLOWER_CHURN_MAX_FILE_BYTES} bytes")
        text = p.read_text("utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the churn scenario: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    return parse_scenario(data, str(p))


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
        rnd = message_round(message, start)
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
        done = _done_events(context)
        for idx, ev in due:
            if idx in done:
                continue
            done.add(idx)  # once, even when the party refuses: a refusal is not a crash
            _mark_done(context, done)
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

    forget = getattr(client, "forget_party", None)
    if forget is not None:
        forget(context)


def _done_events(context: Any) -> set[int]:
    record = context.state.config_records.get(_STATE_KEY)
    if record is None:
        return set()
    done = record.get("done", [])
    return {int(d) for d in done} if isinstance(done, list) else set()


def _mark_done(context: Any, done: set[int]) -> None:
    from flwr.app import ConfigRecord

    context.state[_STATE_KEY] = ConfigRecord({"done": sorted(done)})


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
    from chaos_flwr.flower.client import party_for

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


def _wrap(fn: Handler, emulator: _Emulator) -> Handler:
    def wrapped(message: Any, context: Any) -> Any:
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
    for name in list(registered):
        registered[name] = _wrap(registered[name], emulator)
    app._chaos_churn = True
    return app
