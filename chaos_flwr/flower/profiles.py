"""Strategy profiles: an inner Flower strategy with its arguments plus the Chaos policy (YAML).

A profile looks like::

    name: fedavg-wan
    description: FedAvg over WAN links
    inner:
      strategy: FedAvg            # a class of flwr.serverapp.strategy
      args: {fraction_train: 1.0, min_available_nodes: 2}
    chaos:
      phase_timeout_s: 20.0       # ChaosStrategy settings (numbers only), flat keys that
      poll_interval_s: 0.02       # map onto PhaseSettings / JoinSettings
      join_max_donors: 8

Profiles load by name from the repository's ``strategies/`` folder (editable install) or from
``chaos_flwr/strategies/`` (wheel), or by path.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chaos_flwr.errors import ConfigError, ProfileError
from chaos_flwr.localfile import read_local_file

__all__ = ["Profile", "available_profiles", "load_profile", "profile_dirs"]

#: Largest strategy profile file read (a profile is a few hundred bytes).
PROFILE_MAX_FILE_BYTES: int = 64 * 1024

_TOP_KEYS = {"name", "description", "inner", "chaos"}
_INNER_KEYS = {"strategy", "args"}
#: ChaosStrategy settings a profile may set as positive seconds (keys of
#: :data:`~chaos_flwr.flower.server.settings.FLAT_KEYS`).
_CHAOS_KEYS = {"phase_timeout_s", "poll_interval_s", "deadline_floor_s", "deadline_ceiling_s"}
#: ChaosStrategy settings a profile may set as positive integers.
_CHAOS_INT_KEYS = {"join_min_shard_bytes", "join_max_donors", "join_max_steps"}
#: Inner strategy arguments that take functions: not expressible in YAML.
_CALLABLE_ARGS = {"train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"}


def profile_dirs() -> list[Path]:
    """Folders searched for profiles by name, in order."""
    here = Path(__file__).resolve()
    return [here.parents[2] / "strategies", here.parents[1] / "strategies"]


def available_profiles() -> list[str]:
    """Names of the profiles found in :func:`profile_dirs`."""
    names: set[str] = set()
    for d in profile_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


@dataclass(frozen=True)
class Profile:
    """A validated strategy profile."""

    name: str
    description: str
    strategy: str
    args: dict[str, Any] = field(default_factory=dict)
    chaos: dict[str, float] = field(default_factory=dict)
    source: Path | None = None

    def build_inner(self) -> Any:
        """Instantiate the inner Flower strategy."""
        from flwr.serverapp import strategy as flwr_strategies

        cls = getattr(flwr_strategies, self.strategy)
        try:
            return cls(**self.args)
        except (TypeError, ValueError) as exc:
            raise ProfileError(
                f"{self._where()}inner.args: {self.strategy} refused them: {exc}"
            ) from exc

    def settings(self, **flat: float) -> dict[str, Any]:
        """The grouped ChaosStrategy settings (``phases=``, ``joins=``) of the ``chaos:``
        section, with ``flat`` (the same flat keys) replacing its values."""
        from chaos_flwr.flower.server.settings import settings_from_flat

        try:
            return settings_from_flat({**self.chaos, **flat})
        except ConfigError as exc:
            raise ProfileError(f"{self._where()}chaos: {exc}") from exc

    def _where(self) -> str:
        return f"{self.source}: " if self.source else ""


def _resolve(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in {".yaml", ".yml"} or p.parent != Path("."):
        if not p.exists():
            raise ProfileError(f"profile: no file at {p}")
        return p
    for d in profile_dirs():
        candidate = d / f"{p.name}.yaml"
        if candidate.is_file():
            return candidate
    raise ProfileError(
        f"profile: no profile named {str(name_or_path)!r}; available: "
        f"{', '.join(available_profiles()) or '(none)'} (or pass a path to a .yaml file)"
    )


def _strategy_class(name: object, where: str) -> type[Any]:
    from flwr.serverapp import strategy as flwr_strategies

    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}inner.strategy must be a strategy class name, got {name!r}")
    cls = getattr(flwr_strategies, name, None)
    base = flwr_strategies.Strategy
    if not (isinstance(cls, type) and issubclass(cls, base)) or cls is base:
        known = [
            n
            for n in flwr_strategies.__all__
            if isinstance(getattr(flwr_strategies, n), type)
            and issubclass(getattr(flwr_strategies, n), base)
            and n != "Strategy"
        ]
        raise ProfileError(
            f"{where}inner.strategy: unknown strategy {name!r}; use one of {', '.join(known)}"
        )
    return cls


def load_profile(name_or_path: str | Path) -> Profile:
    """Load and validate a profile; :class:`ProfileError` names the bad field."""
    path = _resolve(name_or_path)
    where = f"{path}: "
    try:
        raw = read_local_file(
            path, what="strategy profile", error=ProfileError, max_bytes=PROFILE_MAX_FILE_BYTES
        )
        data = yaml.safe_load(raw.decode("utf-8"))
    except RecursionError:
        raise ProfileError(f"{where}nested too deeply to be a profile") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ProfileError(f"{where}cannot be read as YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{where}a profile must be a mapping with keys {sorted(_TOP_KEYS)}")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ProfileError(
            f"{where}unknown field(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}"
        )
    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise ProfileError(f"{where}name must be a string")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ProfileError(f"{where}description must be a string")
    inner = data.get("inner")
    if not isinstance(inner, dict):
        raise ProfileError(f"{where}inner is missing or not a mapping (strategy:, args:)")
    unknown = set(inner) - _INNER_KEYS
    if unknown:
        raise ProfileError(
            f"{where}inner: unknown field(s) {sorted(unknown)}; allowed: strategy, args"
        )
    cls = _strategy_class(inner.get("strategy"), where)
    args = inner.get("args") or {}
    if not isinstance(args, dict):
        raise ProfileError(f"{where}inner.args must be a mapping of {cls.__name__} arguments")
    params = inspect.signature(cls.__init__).parameters
    for key, value in args.items():
        if key not in params or key == "self" or key in _CALLABLE_ARGS:
            allowed = sorted(k for k in params if k != "self" and k not in _CALLABLE_ARGS)
            raise ProfileError(
                f"{where}inner.args.{key}: not an argument of {cls.__name__}; allowed: {allowed}"
            )
        if not isinstance(value, bool | int | float | str):
            raise ProfileError(f"{where}inner.args.{key} must be a number, bool or string")
        default = params[key].default
        if isinstance(default, float) and (
            isinstance(value, bool) or not isinstance(value, int | float)
        ):
            raise ProfileError(f"{where}inner.args.{key} must be a number, got {value!r}")
        if (
            isinstance(default, int)
            and not isinstance(default, bool)
            and (isinstance(value, bool) or not isinstance(value, int))
        ):
            raise ProfileError(f"{where}inner.args.{key} must be an integer, got {value!r}")
    chaos = data.get("chaos") or {}
    if not isinstance(chaos, dict):
        raise ProfileError(f"{where}chaos must be a mapping of ChaosStrategy settings")
    checked: dict[str, float] = {}
    for key, value in chaos.items():
        if key in _CHAOS_INT_KEYS:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ProfileError(f"{where}chaos.{key} must be a positive integer, got {value!r}")
            checked[key] = value
            continue
        if key not in _CHAOS_KEYS:
            allowed = sorted(_CHAOS_KEYS | _CHAOS_INT_KEYS)
            raise ProfileError(f"{where}chaos.{key}: unknown setting; allowed: {allowed}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ProfileError(
                f"{where}chaos.{key} must be a positive number of seconds, got {value!r}"
            )
        checked[key] = float(value)
    return Profile(name, description, cls.__name__, dict(args), checked, path)
