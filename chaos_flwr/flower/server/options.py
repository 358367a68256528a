"""The ServerApp's Chaos settings read from Flower's run config (or the environment).

:func:`run_options` turns a ServerApp ``Context`` into :class:`ChaosStrategy` keyword
arguments, so a ServerApp needs no path written into its code::

    strategy = ChaosStrategy(FedAvg(), **run_options(context))

Run config keys (each falls back to its environment variable, e.g. ``$CHAOS_KEYS_DIR``, for
``flwr.simulation.run_simulation()`` scripts, which pass no run config):

- ``chaos-charter``: the federation's signed charter; else ``chaos-keys-dir``'s
  ``charter.yaml`` (the folder ``chaos-flwr federation new`` writes);
- ``chaos-unsigned``: ``true`` runs without a charter (receipts are unsigned claims);
- ``chaos-resume``: ``auto`` (default), ``fresh`` or ``require``
  (:class:`~chaos_flwr.flower.server.settings.ResumeSettings`);
- ``chaos-deadline-floor-s``, ``chaos-deadline-ceiling-s``, ``chaos-phase-timeout-s``: the
  bounds of the adaptive exchange deadlines and the deadline before a node has any reply
  history (:class:`~chaos_flwr.flower.server.settings.PhaseSettings`); when any is set,
  ``run_options`` also returns ``phases``.

A relative path is resolved against the working directory of the process that runs the
ServerApp (for ``flwr run``, Flower's, not the app's folder): give absolute paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context

from chaos_flwr.errors import ChaosError, ConfigError
from chaos_flwr.flower.client.settings import (
    NODE_CHARTER,
    RUN_KEYS_DIR,
    RUN_UNSIGNED,
    env_name,
    run_setting,
)
from chaos_flwr.flower.server.settings import (
    RESUME_DEFAULT_MODE,
    RUN_RESUME,
    PhaseSettings,
    ResumeSettings,
)

if TYPE_CHECKING:
    from chaos_flwr.charter import Charter

__all__ = [
    "RUN_CHARTER",
    "RUN_DEADLINE_CEILING",
    "RUN_DEADLINE_FLOOR",
    "RUN_PHASE_TIMEOUT",
    "run_options",
]

#: Run config key (and ``$CHAOS_CHARTER``) of the charter file the ServerApp verifies with.
RUN_CHARTER = NODE_CHARTER
#: Run config key (and ``$CHAOS_DEADLINE_FLOOR_S``) of ``PhaseSettings.deadline_floor_s``.
RUN_DEADLINE_FLOOR = "chaos-deadline-floor-s"
#: Run config key (and ``$CHAOS_DEADLINE_CEILING_S``) of ``PhaseSettings.deadline_ceiling_s``.
RUN_DEADLINE_CEILING = "chaos-deadline-ceiling-s"
#: Run config key (and ``$CHAOS_PHASE_TIMEOUT_S``) of ``PhaseSettings.phase_timeout_s``.
RUN_PHASE_TIMEOUT = "chaos-phase-timeout-s"
#: Run config key -> the ``PhaseSettings`` field it sets.
_PHASE_KEYS = {
    RUN_DEADLINE_FLOOR: "deadline_floor_s",
    RUN_DEADLINE_CEILING: "deadline_ceiling_s",
    RUN_PHASE_TIMEOUT: "phase_timeout_s",
}


def run_options(context: Context) -> dict[str, Any]:
    """:class:`ChaosStrategy` keyword arguments (``charter``, ``resume``, and ``phases`` when
    a deadline key is set) from the run config.

    Parameters
    ----------
    context:
        The ServerApp's context (its ``run_config``; missing keys fall back to the
        environment, see the module docstring).

    Returns
    -------
    dict
        ``{"charter": Charter | None, "resume": ResumeSettings}``, plus
        ``"phases": PhaseSettings`` when a deadline key is set.

    Raises
    ------
    ConfigError
        No charter is named (and ``chaos-unsigned`` is not set), the charter file is missing
        or does not verify, ``chaos-resume`` is not a mode, or a deadline key is not a
        number its setting accepts; the message names the key.
    """
    mode = run_setting(context.run_config, RUN_RESUME) or RESUME_DEFAULT_MODE
    resume = ResumeSettings(mode=str(mode).strip().lower())
    out: dict[str, Any] = {"charter": _charter(context), "resume": resume}
    phases = _phases(context)
    if phases is not None:
        out["phases"] = phases
    return out


def _phases(context: Context) -> PhaseSettings | None:
    """The deadline settings the run config names, or ``None`` when it names none."""
    fields: dict[str, float] = {}
    for key, name in _PHASE_KEYS.items():
        value = run_setting(context.run_config, key)
        if value is None:
            continue
        try:
            fields[name] = float(str(value))
        except ValueError:
            raise ConfigError(
                f"run config '{key}' must be a number of seconds, got {value!r}"
            ) from None
    if not fields:
        return None
    try:
        return PhaseSettings(**fields)
    except ConfigError as exc:
        named = [k for k, name in _PHASE_KEYS.items() if name in fields]
        raise ConfigError(f"run config {', '.join(named)}: {exc}") from exc


def _charter(context: Context) -> Charter | None:
    """The verified charter the run config names, or ``None`` for an unsigned run."""
    from chaos_flwr.charter import load_charter
    from chaos_flwr.flower.keys import charter_path

    cfg = context.run_config
    named = run_setting(cfg, RUN_CHARTER)
    keys_dir = run_setting(cfg, RUN_KEYS_DIR)
    if named is not None:
        path, key = Path(str(named)).expanduser(), RUN_CHARTER
    elif keys_dir is not None:
        path, key = charter_path(Path(str(keys_dir)).expanduser()), RUN_KEYS_DIR
    elif _truthy(run_setting(cfg, RUN_UNSIGNED)):
        return None
    else:
        raise ConfigError(
            f"run config '{RUN_CHARTER}' (the charter file) or '{RUN_KEYS_DIR}' (a folder from "
            f"'chaos-flwr federation new') is missing; set one (or ${env_name(RUN_CHARTER)} / "
            f"${env_name(RUN_KEYS_DIR)}), or '{RUN_UNSIGNED}=true' for an unsigned test run"
        )
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()}; use an absolute path)"
        raise ConfigError(f"run config '{key}': no charter file at {path}{where}")
    try:
        return load_charter(path)
    except ChaosError as exc:
        raise ConfigError(f"run config '{key}': {exc}") from exc


def _truthy(value: object) -> bool:
    """A run config / environment flag: ``True``, or a string like ``true``, ``1``, ``yes``."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
