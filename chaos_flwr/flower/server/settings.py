"""The ServerApp's Chaos settings, one frozen group per concept, validated once.

:class:`PhaseSettings` (how long an exchange waits and how often it looks),
:class:`JoinSettings` (a joiner's pull through the relay) and :class:`ResumeSettings` (a
restarted ServerApp rebuilding the certified state) are what
:class:`~chaos_flwr.flower.server.strategy.ChaosStrategy` takes instead of a long keyword list.
:func:`settings_from_flat` maps the flat keys a strategy profile's ``chaos:`` section uses
(``phase_timeout_s``, ``join_max_donors``, ...) onto them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from chaos_flwr.defaults import (
    FLOWER_DEADLINE_CEILING_S,
    FLOWER_DEADLINE_FLOOR_S,
    FLOWER_DEADLINE_MARGIN,
    FLOWER_DEADLINE_QUANTILE,
    FLOWER_JOIN_DURING_ROUND,
    FLOWER_JOIN_MAX_DONORS,
    FLOWER_JOIN_MAX_STEPS,
    FLOWER_JOIN_MIN_SHARD_BYTES,
    FLOWER_POLL_INTERVAL_S,
    FLOWER_RESUME_MIN_RECEIPTS,
)
from chaos_flwr.errors import ConfigError

__all__ = [
    "FLAT_KEYS",
    "JOIN_DEFAULT_SOURCE",
    "JOIN_SOURCES",
    "JOIN_SOURCE_AUTO",
    "JOIN_SOURCE_PEERS",
    "JOIN_SOURCE_SERVER",
    "RESUME_AUTO",
    "RESUME_DEFAULT_MODE",
    "RESUME_FRESH",
    "RESUME_MODES",
    "RESUME_REQUIRE",
    "RUN_RESUME",
    "JoinSettings",
    "PhaseSettings",
    "ResumeSettings",
    "settings_from_flat",
]


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class PhaseSettings:
    """How one exchange of a round waits: adaptive deadlines per node.

    A node's deadline in an exchange is the ``deadline_quantile`` of its own reply times to
    that kind of message (train, evaluate, a Chaos query, per phase) times
    ``1 + deadline_margin``, never below ``deadline_floor_s`` nor above ``deadline_ceiling_s``;
    an exchange waits for its non-suspect nodes until the latest of their deadlines (capped by
    ``start(timeout=...)``). A node with no reply history yet (the first round) is waited for
    ``phase_timeout_s``, or the ceiling when none is configured: a slow deployment or a big
    model is waited for as FedAvg waits, and a crashed node is not waited for beyond what its
    own history allows (:class:`~chaos_flwr.flower.server.deadlines.ReplyTimes`).

    Attributes
    ----------
    phase_timeout_s:
        Deadline for nodes with no reply history (the first round); ``None`` (default): the
        ceiling. Profile key ``phase_timeout_s``, run config ``chaos-phase-timeout-s``.
    poll_interval_s:
        Pause between pulls while a phase waits; default
        :data:`~chaos_flwr.defaults.FLOWER_POLL_INTERVAL_S`.
    deadline_floor_s, deadline_ceiling_s:
        Bounds of every adaptive deadline (the floor lowered to a smaller configured
        ``phase_timeout_s``: :attr:`floor_s`); defaults
        :data:`~chaos_flwr.defaults.FLOWER_DEADLINE_FLOOR_S` and
        :data:`~chaos_flwr.defaults.FLOWER_DEADLINE_CEILING_S`. Profile keys of the same
        name, run config ``chaos-deadline-floor-s`` / ``chaos-deadline-ceiling-s``.
    deadline_quantile, deadline_margin:
        The quantile of a node's reply times and the fractional margin over it; defaults
        :data:`~chaos_flwr.defaults.FLOWER_DEADLINE_QUANTILE` and
        :data:`~chaos_flwr.defaults.FLOWER_DEADLINE_MARGIN`.

    Raises
    ------
    ConfigError
        A timing is not > 0 (``poll_interval_s``: negative), the ceiling is below the floor,
        the quantile is outside (0, 1] or the margin is negative.
    """

    phase_timeout_s: float | None = None
    poll_interval_s: float = FLOWER_POLL_INTERVAL_S
    deadline_floor_s: float = FLOWER_DEADLINE_FLOOR_S
    deadline_ceiling_s: float = FLOWER_DEADLINE_CEILING_S
    deadline_quantile: float = FLOWER_DEADLINE_QUANTILE
    deadline_margin: float = FLOWER_DEADLINE_MARGIN

    def __post_init__(self) -> None:
        if self.phase_timeout_s is not None and not self.phase_timeout_s > 0:
            raise ConfigError(f"phase_timeout_s must be > 0, got {self.phase_timeout_s}")
        if not self.poll_interval_s >= 0:
            raise ConfigError(f"poll_interval_s must be >= 0, got {self.poll_interval_s}")
        if not self.deadline_floor_s > 0:
            raise ConfigError(f"deadline_floor_s must be > 0, got {self.deadline_floor_s}")
        if not self.deadline_ceiling_s >= self.deadline_floor_s:
            raise ConfigError(
                f"deadline_ceiling_s ({self.deadline_ceiling_s}) must be >= deadline_floor_s "
                f"({self.deadline_floor_s})"
            )
        if not 0 < self.deadline_quantile <= 1:
            raise ConfigError(f"deadline_quantile must be in (0, 1], got {self.deadline_quantile}")
        if not self.deadline_margin >= 0:
            raise ConfigError(f"deadline_margin must be >= 0, got {self.deadline_margin}")

    @property
    def floor_s(self) -> float:
        """The least an adaptive deadline is: ``deadline_floor_s``, or a configured
        ``phase_timeout_s`` below it (a node whose history is fast is then never waited for
        longer than the fixed timeout would have)."""
        if self.phase_timeout_s is None:
            return self.deadline_floor_s
        return min(self.deadline_floor_s, self.phase_timeout_s)

    @property
    def first_deadline_s(self) -> float:
        """The deadline for a node with no reply history: ``phase_timeout_s``, else the
        ceiling."""
        return self.deadline_ceiling_s if self.phase_timeout_s is None else self.phase_timeout_s

    def deadline(self, timeout: float) -> float:
        """The time budget of a wait with no history to go by: :attr:`first_deadline_s`,
        capped by the run's ``timeout``."""
        return min(timeout, self.first_deadline_s)


#: The ServerApp sends the state itself when the relay is the only path: no donor offered is
#: known to serve direct links (:class:`JoinSettings`).
JOIN_SOURCE_AUTO = "auto"
#: The ServerApp always sends the state it holds (in one message; the joiner checks it).
JOIN_SOURCE_SERVER = "server"
#: Always the multi-source pull from the holders (planner-sized shards, direct links if any).
JOIN_SOURCE_PEERS = "peers"
#: The sources, in the order the docs list them.
JOIN_SOURCES = (JOIN_SOURCE_AUTO, JOIN_SOURCE_SERVER, JOIN_SOURCE_PEERS)
#: The default source: the server's copy when the relay is the only path.
JOIN_DEFAULT_SOURCE = JOIN_SOURCE_AUTO


@dataclass(frozen=True)
class JoinSettings:
    """How a live party that lacks the certified state gets it: from the ServerApp in one
    message, or pulled in shards from its holders.

    Attributes
    ----------
    source:
        ``auto`` (default, :data:`JOIN_DEFAULT_SOURCE`): when the relay is the only path (no
        donor offered is known to serve a direct link: none named one in a pull the ServerApp
        carried) the ServerApp sends the certified state it holds in the join exchange, in
        one message per joiner, like plain Flower sends the model in a train message; the
        joiner checks it against the holders' signed receipts and the round's audits before
        taking it up, and trains in the next round. Otherwise (direct links known) the
        multi-source pull. ``server``: the ServerApp's copy whenever it holds the state.
        ``peers``: always the multi-source pull. A copy the joiner refuses (any check fails)
        falls back to the pull in the same join. Set as
        ``ChaosStrategy(joins=JoinSettings(source=...))``.
    min_shard_bytes:
        Smallest shard the joiner plans; default
        :data:`~chaos_flwr.defaults.FLOWER_JOIN_MIN_SHARD_BYTES`.
    max_donors:
        Most donors one joiner is offered; default
        :data:`~chaos_flwr.defaults.FLOWER_JOIN_MAX_DONORS`.
    max_steps:
        Most relay steps before the pull is given up; default
        :data:`~chaos_flwr.defaults.FLOWER_JOIN_MAX_STEPS`.
    during_round:
        A node that comes while a round trains, and whose own signed records admit it (a
        founder, or a charter with ``admission.sponsors_required: 0``), takes the state the
        round trains from (the ServerApp's copy) and trains in that round
        (:mod:`~chaos_flwr.flower.server.latejoin`); not with ``source="peers"``. Default
        :data:`~chaos_flwr.defaults.FLOWER_JOIN_DURING_ROUND`.

    Raises
    ------
    ConfigError
        A count is not a positive integer, or ``source`` is not one of :data:`JOIN_SOURCES`.
    """

    min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES
    max_donors: int = FLOWER_JOIN_MAX_DONORS
    max_steps: int = FLOWER_JOIN_MAX_STEPS
    source: str = JOIN_DEFAULT_SOURCE
    during_round: bool = FLOWER_JOIN_DURING_ROUND

    def __post_init__(self) -> None:
        if self.source not in JOIN_SOURCES:
            raise ConfigError(
                f"JoinSettings.source must be one of {', '.join(JOIN_SOURCES)}; got {self.source!r}"
            )
        if not isinstance(self.during_round, bool):
            raise ConfigError(
                f"JoinSettings.during_round must be a bool, got {self.during_round!r}"
            )
        for name in ("min_shard_bytes", "max_donors", "max_steps"):
            _positive_int("JoinSettings", name, getattr(self, name))


#: Run config key (and ``$CHAOS_RESUME``) of :attr:`ResumeSettings.mode`.
RUN_RESUME = "chaos-resume"
#: Resume from the newest certified state the parties hold, else start at round 0 (today's).
RESUME_AUTO = "auto"
#: Ignore the parties' replicas: certify the initial state above every round a party signed.
RESUME_FRESH = "fresh"
#: Resume or stop: a :class:`~chaos_flwr.errors.ResumeError` when no state can be resumed.
RESUME_REQUIRE = "require"
#: The modes, in the order the docs list them.
RESUME_MODES = (RESUME_AUTO, RESUME_FRESH, RESUME_REQUIRE)
#: The default mode.
RESUME_DEFAULT_MODE = RESUME_AUTO


@dataclass(frozen=True)
class ResumeSettings:
    """A restarted ServerApp rebuilding the newest certified state from the parties.

    Attributes
    ----------
    mode:
        ``auto`` (default): resume from the newest certified state the parties hold, else
        certify the initial state; ``fresh``: ignore the parties' replicas and certify the
        initial state under a round number above every round any party signed; ``require``:
        resume, or stop with :class:`~chaos_flwr.errors.ResumeError`. Run config
        ``chaos-resume`` (see :func:`~chaos_flwr.flower.server.options.run_options`).
    enabled:
        Whether to resume at all (default ``True``; ``False`` skips even the hello, so rounds
        start at 0 whatever the parties signed: only for tests of a first run).
    min_receipts:
        Verified receipts a state needs to be resumed from; default
        :data:`~chaos_flwr.defaults.FLOWER_RESUME_MIN_RECEIPTS` (the newest state any
        verified party holds).
    min_shard_bytes:
        Smallest shard of the resume pull; default
        :data:`~chaos_flwr.defaults.FLOWER_JOIN_MIN_SHARD_BYTES`.

    Raises
    ------
    ConfigError
        ``min_receipts`` or ``min_shard_bytes`` is not a positive integer, or ``mode`` is not
        one of :data:`RESUME_MODES`.
    """

    enabled: bool = True
    min_receipts: int = FLOWER_RESUME_MIN_RECEIPTS
    min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES
    mode: str = RESUME_DEFAULT_MODE

    def __post_init__(self) -> None:
        if self.mode not in RESUME_MODES:
            raise ConfigError(
                f"ResumeSettings.mode (run config '{RUN_RESUME}') must be one of "
                f"{', '.join(RESUME_MODES)}; got {self.mode!r}"
            )
        if self.mode == RESUME_REQUIRE and not self.enabled:
            raise ConfigError("ResumeSettings: mode 'require' needs enabled=True")
        _positive_int("ResumeSettings", "min_receipts", self.min_receipts)
        _positive_int("ResumeSettings", "min_shard_bytes", self.min_shard_bytes)


#: Flat key (a profile's ``chaos:`` section) -> (settings group keyword, field).
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "phase_timeout_s": ("phases", "phase_timeout_s"),
    "poll_interval_s": ("phases", "poll_interval_s"),
    "deadline_floor_s": ("phases", "deadline_floor_s"),
    "deadline_ceiling_s": ("phases", "deadline_ceiling_s"),
    "join_min_shard_bytes": ("joins", "min_shard_bytes"),
    "join_max_donors": ("joins", "max_donors"),
    "join_max_steps": ("joins", "max_steps"),
}

_GROUPS: dict[str, Any] = {"phases": PhaseSettings(), "joins": JoinSettings()}


def settings_from_flat(flat: Mapping[str, float]) -> dict[str, Any]:
    """The grouped settings (``phases=``, ``joins=``) that flat profile keys describe.

    Parameters
    ----------
    flat:
        Keys of :data:`FLAT_KEYS` (a profile's checked ``chaos:`` section) -> values.

    Returns
    -------
    dict
        Keyword arguments of ``ChaosStrategy``: one settings object per group named, the
        defaults for every field not named.

    Raises
    ------
    ConfigError
        A key is not in :data:`FLAT_KEYS`, or a value fails its group's validation.
    """
    fields: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key not in FLAT_KEYS:
            raise ConfigError(f"unknown Chaos setting {key!r}; allowed: {sorted(FLAT_KEYS)}")
        group, name = FLAT_KEYS[key]
        fields.setdefault(group, {})[name] = value
    return {group: replace(_GROUPS[group], **values) for group, values in fields.items()}
