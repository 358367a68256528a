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
    FLOWER_JOIN_MAX_DONORS,
    FLOWER_JOIN_MAX_STEPS,
    FLOWER_JOIN_MIN_SHARD_BYTES,
    FLOWER_PHASE_TIMEOUT_S,
    FLOWER_POLL_INTERVAL_S,
    FLOWER_RESUME_MIN_RECEIPTS,
)
from chaos_flwr.errors import ConfigError

__all__ = [
    "FLAT_KEYS",
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
    """How one exchange of a round waits.

    Attributes
    ----------
    phase_timeout_s:
        Deadline of each exchange in seconds (capped by ``start(timeout=...)``); default
        :data:`~chaos_flwr.defaults.FLOWER_PHASE_TIMEOUT_S`.
    poll_interval_s:
        Pause between pulls while a phase waits; default
        :data:`~chaos_flwr.defaults.FLOWER_POLL_INTERVAL_S`.

    Raises
    ------
    ConfigError
        ``phase_timeout_s`` is not > 0, or ``poll_interval_s`` is negative.
    """

    phase_timeout_s: float = FLOWER_PHASE_TIMEOUT_S
    poll_interval_s: float = FLOWER_POLL_INTERVAL_S

    def __post_init__(self) -> None:
        if not self.phase_timeout_s > 0:
            raise ConfigError(f"phase_timeout_s must be > 0, got {self.phase_timeout_s}")
        if not self.poll_interval_s >= 0:
            raise ConfigError(f"poll_interval_s must be >= 0, got {self.poll_interval_s}")

    def deadline(self, timeout: float) -> float:
        """One exchange's time budget: the phase timeout, capped by the run's ``timeout``."""
        return min(timeout, self.phase_timeout_s)


@dataclass(frozen=True)
class JoinSettings:
    """A joiner's pull of the certified state from its donors, through the relay.

    Attributes
    ----------
    min_shard_bytes:
        Smallest shard the joiner plans; default
        :data:`~chaos_flwr.defaults.FLOWER_JOIN_MIN_SHARD_BYTES`.
    max_donors:
        Most donors one joiner is offered; default
        :data:`~chaos_flwr.defaults.FLOWER_JOIN_MAX_DONORS`.
    max_steps:
        Most relay steps before the pull is given up; default
        :data:`~chaos_flwr.defaults.FLOWER_JOIN_MAX_STEPS`.

    Raises
    ------
    ConfigError
        A value is not a positive integer.
    """

    min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES
    max_donors: int = FLOWER_JOIN_MAX_DONORS
    max_steps: int = FLOWER_JOIN_MAX_STEPS

    def __post_init__(self) -> None:
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
