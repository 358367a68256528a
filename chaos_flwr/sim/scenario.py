"""YAML scenarios for the simulator, validated with pydantic.

A scenario names how many parties there are, how many are members from the start, the network,
the charter timings and a timeline of events. Parties are referred to by index ``0..parties-1``
(the first ``SIM_FOUNDERS`` are the founders). Unknown fields and bad values are refused with a
:class:`~chaos_flwr.errors.ConfigError` naming the field path (e.g. ``events.2.party``).

Example::

    name: churn-5
    parties: 5
    initial: 4
    events:
      - {at: 5, action: join, party: 4}
      - {at: 8, action: crash, party: 2}
      - {at: 20, action: restart, party: 2, disk: true}
      - {at: 10, action: faults, drop: 0.05, duplicate: 0.05, reorder: 0.2, reorder_max_s: 0.3}
      - {at: 12, action: forge, party: 1, count: 4}

With ``training: true`` the federation also trains (:mod:`chaos_flwr.sim.training`: a relay,
certified digests, replicas, pulls) and four more actions apply: ``relay_restart`` (down for
``down_s``), ``equivocate`` (the relay's next round shows two contributor sets),
``crash_donor`` (the next donor asked for a shard crashes mid transfer and restarts ``down_s``
later, with or without ``disk``). ``flap`` (fields ``a``, ``b``, ``down_s``) cuts one link for
a while, with or without training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigError
from .settings import (
    SIM_DEFAULT_BANDWIDTH_BPS,
    SIM_DEFAULT_LATENCY_S,
    SIM_DEFAULT_SETTLE_S,
    SIM_MAX_EVENTS,
    SIM_MAX_VIRTUAL_S,
    SIM_TICK_INTERVAL_S,
)

__all__ = [
    "Event",
    "Scenario",
    "load_scenario",
    "parse_scenario",
    "scenario_from_yaml",
    "scenario_names",
]

SCENARIO_DIR = Path(__file__).parent / "scenarios"

Action = Literal[
    "join",
    "leave",
    "link_up",
    "link_down",
    "crash",
    "restart",
    "partition",
    "heal",
    "faults",
    "forge",
    "flap",
    "relay_restart",
    "equivocate",
    "crash_donor",
]
_NEEDS_PARTY = {"join", "leave", "crash", "restart", "forge"}
_NEEDS_LINK = {"link_up", "link_down", "flap"}


class Event(BaseModel):
    """One timeline event (which fields apply depends on ``action``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: float = Field(ge=0.0)
    action: Action
    party: int | None = Field(default=None, ge=0)
    a: int | None = Field(default=None, ge=0)
    b: int | None = Field(default=None, ge=0)
    disk: bool = True
    group: list[int] | None = None
    count: int = Field(default=3, ge=1, le=1000)
    drop: float = Field(default=0.0, ge=0.0, le=1.0)
    duplicate: float = Field(default=0.0, ge=0.0, le=1.0)
    reorder: float = Field(default=0.0, ge=0.0, le=1.0)
    reorder_max_s: float = Field(default=0.0, ge=0.0, le=60.0)
    delay_s: float = Field(default=0.0, ge=0.0, le=60.0)
    down_s: float = Field(default=1.0, ge=0.0, le=600.0)

    @model_validator(mode="after")
    def _fields_for_action(self) -> Event:
        if self.action in _NEEDS_PARTY and self.party is None:
            raise ValueError(f"action {self.action!r} needs field 'party'")
        if self.action in _NEEDS_LINK and (self.a is None or self.b is None or self.a == self.b):
            raise ValueError(f"action {self.action!r} needs fields 'a' and 'b' (two parties)")
        if self.action == "partition" and not self.group:
            raise ValueError("action 'partition' needs field 'group' (a non-empty list)")
        return self


class Scenario(BaseModel):
    """A simulated federation and its timeline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    parties: int = Field(ge=2, le=2000)
    initial: int | None = Field(default=None, ge=1)
    latency_s: float = Field(default=SIM_DEFAULT_LATENCY_S, ge=0.0, le=10.0)
    bandwidth_bps: float = Field(default=SIM_DEFAULT_BANDWIDTH_BPS, gt=0.0)
    heartbeat_interval_s: float = Field(default=1.0, gt=0.0, le=60.0)
    suspicion_timeout_s: float = Field(default=3.0, gt=0.0, le=600.0)
    sponsors_required: int = Field(default=1, ge=0, le=16)
    failure_quorum: int = Field(default=2, ge=1, le=16)
    settle_s: float = Field(default=SIM_DEFAULT_SETTLE_S, ge=0.0)
    max_virtual_s: float = Field(default=SIM_MAX_VIRTUAL_S, gt=0.0)
    max_events: int = Field(default=SIM_MAX_EVENTS, ge=1)
    tick_interval_s: float = Field(default=SIM_TICK_INTERVAL_S, gt=0.0, le=60.0)
    training: bool = False
    events: list[Event] = Field(default_factory=list)

    @model_validator(mode="after")
    def _indices(self) -> Scenario:
        n = self.parties
        if self.initial is not None and self.initial > n:
            raise ValueError(f"field 'initial' ({self.initial}) exceeds 'parties' ({n})")
        for i, ev in enumerate(self.events):
            for name in ("party", "a", "b"):
                value = getattr(ev, name)
                if value is not None and value >= n:
                    raise ValueError(f"events.{i}.{name}: party {value} is not below {n}")
            for value in ev.group or []:
                if not 0 <= value < n:
                    raise ValueError(f"events.{i}.group: party {value} is not in 0..{n - 1}")
        return self

    @property
    def members_at_start(self) -> int:
        """Parties that are members when the timeline starts."""
        return self.parties if self.initial is None else self.initial

    @property
    def last_event_at(self) -> float:
        """Virtual time of the last timeline event (0 if none)."""
        return max((ev.at for ev in self.events), default=0.0)


def _format(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "scenario"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    """Validate a scenario given as a mapping (parsed YAML).

    Raises
    ------
    ConfigError
        If a field is unknown or a value is bad (the message names the field path).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a scenario must be a YAML mapping, got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_format(exc)}; fix the scenario file") from None


def scenario_names() -> list[str]:
    """Names of the shipped scenarios (``chaos_flwr/sim/scenarios/*.yaml``)."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def load_scenario(file_or_name: str | Path) -> Scenario:
    """Load a scenario from a YAML file path or the name of a shipped scenario.

    Raises
    ------
    ConfigError
        If the file is missing or unreadable, is not YAML, or fails validation.
    """
    path = Path(file_or_name)
    if not path.exists():
        shipped = SCENARIO_DIR / f"{file_or_name}.yaml"
        if not shipped.exists():
            raise ConfigError(
                f"scenario {str(file_or_name)!r} is neither a file nor a shipped scenario "
                f"({', '.join(scenario_names())})"
            )
        path = shipped
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"scenario {str(path)!r} cannot be read: {exc}") from None
    return scenario_from_yaml(text, str(path))


def scenario_from_yaml(text: str, source: str = "scenario") -> Scenario:
    """Parse and validate a scenario given as YAML text.

    Raises
    ------
    ConfigError
        If the text is not YAML, not a mapping, or fails validation.
    """
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise ConfigError(f"scenario {source!r} cannot be read as YAML: {exc}") from None
    return parse_scenario(data, source)
