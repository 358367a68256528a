"""The churn scenario format: who joins, leaves, drops a link or crashes, and when.

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
:mod:`chaos_flwr.lab.churn` emulates the events on the client side; the ``server-kill`` is the
orchestrator's (:mod:`chaos_flwr.lab.demo`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from chaos_flwr.errors import ConfigError
from chaos_flwr.lab.settings import FLOWER_CHURN_MAX_FILE_BYTES
from chaos_flwr.localfile import read_local_file

__all__ = [
    "CLIENT_EVENTS",
    "ChurnEvent",
    "ChurnScenario",
    "EventKind",
    "load_scenario",
    "parse_scenario",
]

EventKind = Literal["join", "leave", "link-down", "link-up", "crash", "return", "server-kill"]
#: Event kinds that the client-side wrapper acts on (``server-kill`` is the orchestrator's).
CLIENT_EVENTS = frozenset({"join", "leave", "link-down", "link-up", "crash", "return"})
_LINK_EVENTS = frozenset({"link-down", "link-up"})
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


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
        raw = read_local_file(
            p, what="churn scenario", error=ConfigError, max_bytes=FLOWER_CHURN_MAX_FILE_BYTES
        )
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read the churn scenario: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{p}: nested too deeply to be a churn scenario") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    return parse_scenario(data, str(p))
