"""A pull in progress as plain, versioned values: it outlives the process that started it.

On Flower's deployment engine every message runs in a new ClientApp process, so a joiner's
pull is saved between its relay steps (in the party's sealed state file). The saved form is an
explicit dict of plain values (codec-encodable), version :data:`PULL_SAVED_VERSION`; reading
checks every field's type and bound and raises :class:`~chaos_flwr.errors.DecodeError` (a
value of another version too), so the on-disk format never depends on private fields.

Only a pull between events is saved (a decision's direct fetches are carried out within one
process); the monitor's measured rates are kept as the restored pull's priors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from chaos_flwr.errors import ChaosError, DecodeError
from chaos_flwr.planner import TransferPlan
from chaos_flwr.pull.negotiation import PULL_REQUEST_TIMEOUT_S, PullNegotiation, Stage
from chaos_flwr.state import Manifest
from chaos_flwr.transfer import PullSession

__all__ = ["PULL_SAVED_VERSION", "load_negotiation", "save_negotiation"]

#: Version of the saved form; a value of another version is refused (the pull starts again).
PULL_SAVED_VERSION: int = 2

#: Stages a pull may be saved at (between events).
_SAVED_STAGES = frozenset({Stage.SIZE, Stage.MANIFEST, Stage.SHARDS})


def save_negotiation(pull: PullNegotiation) -> dict[str, Any]:
    """``pull`` as plain values; only a pull waiting for relay replies can be saved.

    Raises
    ------
    DecodeError
        The pull is not at a stage that can be saved (done or failed).
    """
    if pull.stage not in _SAVED_STAGES:
        raise DecodeError(f"a pull at stage {pull.stage} is not saved; save it between steps")
    plan = pull.plan
    return {
        "v": PULL_SAVED_VERSION,
        "round": pull.server_round,
        "digest": pull.digest,
        "donors": list(pull.donors),
        "min-shard": pull.min_shard_bytes,
        "hint": pull.total_hint,
        "direct": pull.direct,
        "rates": pull.rates(),
        "stage": pull.stage.value,
        "live": list(pull.live),
        "lost": list(pull.lost),
        "total": pull.total,
        "plan": None if plan is None else _plan_value(plan),
        "manifest": b"" if pull.manifest is None else pull.manifest.to_bytes(),
        "session": None if pull.session is None else pull.session.snapshot(),
        "asked": pull.asked,
        "addresses": dict(pull.addresses),
        "known": sorted(pull.known),
        "direct-failed": dict(pull.direct_failed),
        "received": dict(pull.received),
        "direct-bytes": dict(pull.direct_bytes),
        "plan-rates": dict(pull.plan_rates),
        "sent": {d: sorted(i) for d, i in pull.sent.items()},
        "got": sorted(pull.got),
    }


def _plan_value(plan: TransferPlan) -> dict[str, Any]:
    return {
        "shard-bytes": plan.shard_bytes,
        "num-shards": plan.num_shards,
        "assignment": {d: list(s) for d, s in plan.assignment.items()},
        "rates": dict(plan.rates),
        "makespan": plan.makespan,
        "finish": dict(plan.finish_times),
    }


def _field(value: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    got = value.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(got, kinds) or (isinstance(got, bool) and bool not in kinds):
        raise DecodeError(f"saved pull field {key!r}: expected {kind}, got {type(got).__name__}")
    return got


def _strs(value: Mapping[str, Any], key: str) -> list[str]:
    got = _field(value, key, list)
    if not all(isinstance(x, str) for x in got):
        raise DecodeError(f"saved pull field {key!r}: must list party ids")
    return list(got)


def _map(value: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> dict[str, Any]:
    got = _field(value, key, dict)
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in got.values()):
        raise DecodeError(f"saved pull field {key!r}: values must be {kind}")
    return dict(got)


def _indices(values: list[Any], key: str) -> list[int]:
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in values):
        raise DecodeError(f"saved pull field {key!r}: must list shard indices")
    return values


def _plan_of(value: Any, total: int | None) -> TransferPlan | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DecodeError("saved pull field 'plan': expected a map")
    assignment = _field(value, "assignment", dict)
    if not all(
        isinstance(s, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in s)
        for s in assignment.values()
    ):
        raise DecodeError("saved pull field 'plan.assignment': must map ids to shard indices")
    return TransferPlan(
        num_shards=_field(value, "num-shards", int),
        shard_bytes=_field(value, "shard-bytes", int),
        assignment={d: tuple(s) for d, s in assignment.items()},
        makespan=float(_field(value, "makespan", (int, float))),
        finish_times=_map(value, "finish", (int, float)),
        total_bytes=total,
        rates=_map(value, "rates", (int, float)),
    )


def load_negotiation(
    value: Mapping[str, Any], *, address_ok: Callable[[str], str] | None = None
) -> PullNegotiation:
    """Rebuild a pull from :func:`save_negotiation`'s value (every field checked).

    Raises
    ------
    DecodeError
        Another version, a missing or mistyped field, a manifest or saved shard that does not
        verify, or a stage that is never saved.
    """
    if value.get("v") != PULL_SAVED_VERSION:
        raise DecodeError(
            f"saved pull: version {value.get('v')!r}, this version reads {PULL_SAVED_VERSION}"
        )
    try:
        stage = Stage(_field(value, "stage", str))
    except ValueError as exc:
        raise DecodeError(f"saved pull field 'stage': {exc}") from exc
    if stage not in _SAVED_STAGES:
        raise DecodeError(f"saved pull field 'stage': {stage} is never saved")
    pull = PullNegotiation(
        _field(value, "round", int),
        _field(value, "digest", bytes),
        _strs(value, "donors"),
        min_shard_bytes=_field(value, "min-shard", int),
        total_hint=_field(value, "hint", (int, type(None))),
        rates=_map(value, "rates", (int, float)),
        direct=_field(value, "direct", bool),
        address_ok=address_ok,
    )
    pull.stage = stage
    pull.live, pull.lost = _strs(value, "live"), _strs(value, "lost")
    pull.total = _field(value, "total", (int, type(None)))
    pull.plan = _plan_of(value.get("plan"), pull.total)
    pull.asked = _field(value, "asked", str)
    pull.addresses = _map(value, "addresses", str)
    pull.known = frozenset(d for d in _strs(value, "known") if d in pull.addresses)
    pull.direct_failed = _map(value, "direct-failed", str)
    pull.received = _map(value, "received", int)
    pull.direct_bytes = _map(value, "direct-bytes", int)
    pull.plan_rates = _map(value, "plan-rates", (int, float))
    pull.sent = {d: set(_indices(s, "sent")) for d, s in _map(value, "sent", list).items()}
    pull.got = set(_indices(_field(value, "got", list), "got"))
    _restore_session(pull, value)
    return pull


def _restore_session(pull: PullNegotiation, value: Mapping[str, Any]) -> None:
    raw, snapshot = _field(value, "manifest", bytes), value.get("session")
    if not raw:
        if pull.stage == Stage.SHARDS:
            raise DecodeError("saved pull at stage shards has no manifest")
        return
    try:
        pull.manifest = Manifest.from_bytes(raw)
        if snapshot is not None:
            if not isinstance(snapshot, dict):
                raise DecodeError("saved pull field 'session': expected a map")
            pull.session = PullSession.restore(
                pull.manifest,
                snapshot,
                expected_digest=pull.digest,
                window=max(1, pull.manifest.num_shards),
                min_timeout_s=PULL_REQUEST_TIMEOUT_S,
            )
    except (ChaosError, ValueError) as exc:
        raise DecodeError(f"saved pull: {type(exc).__name__}: {exc}") from exc
    if pull.stage == Stage.SHARDS and pull.session is None:
        raise DecodeError("saved pull at stage shards has no session")
