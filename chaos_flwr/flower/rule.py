"""The federation's aggregation rule on the Flower side: build it, check it, recompute with it.

The charter (:class:`~chaos_flwr.charter.RoundRules`) fixes the inner strategy and its
arguments as an :class:`~chaos_flwr.charter.AggregationRule`. This module turns that rule into
a Flower strategy (:func:`build_strategy`), checks that a ServerApp's inner strategy is the rule
(:func:`check_inner`), and lets any party recompute the state a round must certify from the
base state and the committed updates, exactly as the ServerApp's ``aggregate_train`` computes it
(:func:`recompute`); :func:`states_match` compares a recomputed state with a certified one.

Recomputing is bitwise: the same numpy build, the same updates in the same order and the same
base give the same digest. :func:`states_match` falls back to a documented tolerance
(:data:`RULE_RTOL`, :data:`RULE_ATOL`) for arithmetic that is not bitwise deterministic across
machines (BLAS kernels, SIMD summation order).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType, Metadata, RecordDict
from flwr.app.message import make_message
from flwr.common.constant import SType
from flwr.common.typing import NDArray
from flwr.serverapp import strategy as flwr_strategies
from flwr.serverapp.exception import AggregationError, InconsistentMessageReplies
from flwr.serverapp.strategy import Strategy
from pydantic import ValidationError

from chaos_flwr.charter import AggregationRule
from chaos_flwr.defaults import RULE_ATOL, RULE_RTOL
from chaos_flwr.errors import AuditError, ConfigError, ProfileError
from chaos_flwr.flower.profiles import Profile, load_profile
from chaos_flwr.flower.server.state import (
    certified_state,
    restore_strategy_state,
    strategy_state_of,
)
from chaos_flwr.state import TrainingState, npy_view

__all__ = [
    "RULE_ATOL",
    "RULE_RTOL",
    "build_strategy",
    "check_inner",
    "recompute",
    "rule_of_profile",
    "states_match",
]

#: Constructor arguments that take functions (metrics aggregation only: they never change the
#: aggregated arrays, and a rule's arguments are scalars).
_CALLABLE_ARGS = frozenset({"train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"})
#: Time to live of the stand-in train replies handed to ``aggregate_train`` (metadata only:
#: no strategy reads it; Flower's default message TTL, one hour).
_REPLY_TTL_S: float = 3600.0
#: numpy dtype kinds compared within the tolerance (others, bytes and str, compare equal).
_NUMERIC_KINDS = frozenset("biufc")


def rule_of_profile(profile: Profile | str | Path) -> AggregationRule:
    """The aggregation rule of a strategy profile: its inner strategy and arguments.

    Parameters
    ----------
    profile
        A loaded :class:`~chaos_flwr.flower.profiles.Profile`, or a shipped profile's name or a
        path to a profile file.

    Returns
    -------
    AggregationRule
        The rule a charter's ``rounds.rule`` carries for this profile: its strategy and its
        arguments but the sampling ones (:data:`SAMPLING_ARGS`, the server's to choose).

    Raises
    ------
    ProfileError
        If the profile cannot be loaded, or its strategy or arguments cannot make a rule (e.g.
        a strategy a party cannot recompute).
    """
    loaded = profile if isinstance(profile, Profile) else load_profile(profile)
    try:
        args = {k: v for k, v in loaded.args.items() if k not in SAMPLING_ARGS}
        return AggregationRule(strategy=loaded.strategy, args=args)
    except ValidationError as exc:
        where = f"{loaded.source}: " if loaded.source else ""
        reasons = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        raise ProfileError(f"{where}inner: not an aggregation rule: {reasons}") from None


def _strategy_class(rule: AggregationRule) -> type[Strategy]:
    cls = getattr(flwr_strategies, rule.strategy, None)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(
            f"aggregation rule: flwr.serverapp.strategy has no strategy {rule.strategy!r}"
        )
    return cls


def _arg_names(cls: type[Strategy]) -> list[str]:
    """The scalar constructor arguments of ``cls`` (no ``self``, no functions, no ``**``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in params
        if p.name != "self" and p.name not in _CALLABLE_ARGS and p.kind in plain
    ]


def _kind(value: object) -> str | None:
    """The scalar kind of a value or argument default (``None``: no scalar default)."""
    for kind, types in (("a bool", bool), ("an integer", int), ("a number", float)):
        if isinstance(value, types):
            return kind
    return "a string" if isinstance(value, str) else None


#: The kinds of value an argument with a default of each kind takes (an int for a float).
_ACCEPTED: dict[str, frozenset[str | None]] = {
    "a bool": frozenset({"a bool"}),
    "an integer": frozenset({"an integer"}),
    "a number": frozenset({"an integer", "a number"}),
    "a string": frozenset({"a string"}),
}


def build_strategy(rule: AggregationRule) -> Strategy:
    """Instantiate the rule's Flower strategy with its arguments.

    Raises
    ------
    ConfigError
        If an argument is not a scalar argument of the strategy, is not of the kind its default
        is (a number, an integer, a bool, a string), or the strategy refuses it.
    """
    cls = _strategy_class(rule)
    allowed = _arg_names(cls)
    unknown = sorted(set(rule.args) - set(allowed))
    if unknown:
        raise ConfigError(
            f"aggregation rule: args.{unknown[0]} is not an argument of {rule.strategy} "
            f"(unknown: {unknown}); allowed: {allowed}"
        )
    defaults = inspect.signature(cls.__init__).parameters
    for key, value in rule.args.items():
        expected = _kind(defaults[key].default)
        if expected is not None and _kind(value) not in _ACCEPTED[expected]:
            raise ConfigError(
                f"aggregation rule: args.{key} of {rule.strategy} must be {expected}, got "
                f"{value!r} (a YAML float needs a dot: 1.0e-3, not 1e-3)"
            )
    try:
        strategy = cls(**rule.args)
    except (TypeError, ValueError) as exc:
        why = f"{rule.strategy} refused its args {rule.args}: {exc}"
        raise ConfigError(f"aggregation rule: {why}") from exc
    return strategy


def _same(a: Any, b: Any) -> bool:
    """Equal scalar settings (``1 == 1.0`` counts; ``True == 1`` does not)."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # e.g. arrays: not a scalar setting
        return False


#: Arguments of Flower's strategies that steer only sampling (how many nodes, which
#: fraction), not the aggregate: :func:`check_inner` compares them only when the rule names
#: them, so a charter's rule fits a server sampling as its deployment needs.
SAMPLING_ARGS: frozenset[str] = frozenset(
    {
        "fraction_train",
        "fraction_evaluate",
        "min_train_nodes",
        "min_evaluate_nodes",
        "min_available_nodes",
    }
)


def check_inner(rule: AggregationRule, inner: Strategy) -> None:
    """Check that a ServerApp's inner strategy is the federation's aggregation rule.

    The class must be the rule's exactly, and every scalar constructor argument of that class
    (given in the rule or left to its default; sampling arguments, :data:`SAMPLING_ARGS`, only
    when the rule gives them) must have the value the rule gives: each is
    compared as the attribute of the same name on ``inner`` and on a strategy built from the
    rule (Flower's strategies keep their arguments as attributes of the same name).

    Raises
    ------
    ConfigError
        Naming the mismatch: the class, or the first argument whose value differs.
    """
    cls = _strategy_class(rule)
    if type(inner) is not cls:
        raise ConfigError(
            f"the inner strategy is {type(inner).__name__}; the charter's aggregation rule is "
            f"{rule.strategy} (build the inner strategy from the rule, or amend the charter)"
        )
    reference = build_strategy(rule)
    for name in _arg_names(cls):
        if name in SAMPLING_ARGS and name not in rule.args:
            continue  # whom the server samples is its business; what it computes is not
        if not hasattr(reference, name):
            if name in rule.args:
                raise ConfigError(
                    f"aggregation rule: {rule.strategy} keeps no attribute {name!r}; the "
                    "argument cannot be checked against a running strategy"
                )
            continue
        want, have = getattr(reference, name), getattr(inner, name, None)
        if not _same(want, have):
            raise ConfigError(
                f"the inner {rule.strategy}'s {name} is {have!r}; the charter's aggregation "
                f"rule gives {want!r} (build the inner strategy from the rule)"
            )


class _InPlace(Array):
    """An update's Array as the rule's strategy reads it: :meth:`numpy` views its ``.npy``
    bytes in place (read-only; :func:`~chaos_flwr.state.npy_view`) instead of copying them,
    and its bytes may be a view too (an auditor's material read in place)."""

    @classmethod
    def of(cls, array: Array) -> Array:
        out = cls.__new__(cls)
        out.dtype, out.shape, out.stype = array.dtype, tuple(array.shape), array.stype
        out.data = array.data
        return out

    def numpy(self) -> NDArray:
        if self.stype != SType.NUMPY:
            return super().numpy()
        return npy_view(self.data)


def _record_copy(record: ArrayRecord) -> ArrayRecord:
    """A new ArrayRecord of :class:`_InPlace` arrays sharing the record's bytes (set one by
    one: the constructor would rebuild each Array from ``bytes``)."""
    out = ArrayRecord()
    for name, array in record.items():
        out[name] = _InPlace.of(array)
    return out


def _reply(update: RecordDict, server_round: int, index: int) -> Message:
    """A train reply Message carrying a copy of ``update`` (the strategy's aggregate_train
    reads only the content; FedMedian and FedTrimmedAvg pop arrays from it, so the caller's
    records are copied, not their arrays' bytes)."""
    content = RecordDict()
    for key, record in update.items():
        content[key] = _record_copy(record) if isinstance(record, ArrayRecord) else record
    metadata = Metadata(
        run_id=0,
        message_id=f"recompute-{server_round}-{index}",
        src_node_id=index + 1,
        dst_node_id=0,
        reply_to_message_id="",
        group_id=str(server_round),
        created_at=0.0,
        ttl=_REPLY_TTL_S,
        message_type=MessageType.TRAIN,
    )
    return make_message(metadata, content)  # no TaskIdentity needed (parties run it too)


def recompute(
    rule: AggregationRule,
    base: TrainingState,
    server_round: int,
    updates: Sequence[RecordDict],
) -> TrainingState:
    """The state round ``server_round`` certifies: ``updates`` aggregated with the rule.

    The rule's strategy is built, given back the base's strategy state (e.g. FedAdam's
    moments), primed as ``configure_train`` primes it (FedOpt strategies keep the base arrays
    as ``current_arrays``), and its ``aggregate_train`` is called with one train reply per
    update, in the given order (float sums depend on it: callers sort by party id).

    Parameters
    ----------
    rule
        The federation's aggregation rule.
    base
        The certified state the updates were trained from (round ``server_round - 1``).
    server_round
        The round being certified.
    updates
        The train replies' contents, as the ServerApp's inner strategy received them (one
        ArrayRecord and one MetricRecord with the weight each). They are not modified.

    Returns
    -------
    TrainingState
        :func:`~chaos_flwr.flower.server.state.certified_state` of the aggregate, the round and
        the strategy's new state: its digest is the one the round's receipts must name.

    Raises
    ------
    AuditError
        If there are no updates, the strategy refuses them (inconsistent records, a Krum or
        trimmed mean that cannot be computed) or aggregates them to nothing.
    ConfigError
        If the rule cannot be built (see :func:`build_strategy`).
    """
    if not updates:
        raise AuditError(f"round {server_round}: no updates to aggregate")
    strategy = build_strategy(rule)
    restore_strategy_state(strategy, base.strategy_state)
    if hasattr(strategy, "current_arrays"):  # FedOpt: what its configure_train sets (copies,
        # in the ArrayRecord's order, without a round trip through .npy bytes)
        names = sorted(base.arrays, key=lambda n: n.encode("utf-8"))
        strategy.current_arrays = {k: np.array(base.arrays[k]) for k in names}
    replies = [_reply(u, server_round, i) for i, u in enumerate(updates)]
    try:
        aggregated, _ = strategy.aggregate_train(server_round, replies)
    except (AggregationError, InconsistentMessageReplies, ValueError) as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        raise AuditError(
            f"round {server_round}: {rule.strategy} refused the {len(updates)} update(s): {reason}"
        ) from exc
    if aggregated is None:
        raise AuditError(
            f"round {server_round}: {rule.strategy} aggregated the {len(updates)} update(s) "
            "to nothing"
        )
    return certified_state(aggregated, server_round, strategy_state_of(strategy))


def _arrays_close(a: TrainingState, b: TrainingState) -> bool:
    if set(a.arrays) != set(b.arrays):
        return False
    for name, x in a.arrays.items():
        y = b.arrays[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype.kind not in _NUMERIC_KINDS:
            if not np.array_equal(x, y):
                return False
        elif not np.allclose(x, y, rtol=RULE_RTOL, atol=RULE_ATOL):
            return False
    return True


def states_match(a: TrainingState, b: TrainingState) -> bool:
    """Whether a recomputed state matches a certified one.

    Equal digests match. Otherwise the states match when they have the same round, the same
    array names, shapes and dtypes, and arrays (and strategy-state arrays, e.g. FedAdam's
    moments) equal within :data:`RULE_RTOL` / :data:`RULE_ATOL` (for arithmetic that is not
    bitwise deterministic across machines).
    """
    if a.digest() == b.digest():
        return True
    if a.round != b.round or not _arrays_close(a, b):
        return False
    if a.strategy_state == b.strategy_state:
        return True
    if not a.strategy_state or not b.strategy_state:
        return False
    try:
        sa = TrainingState.from_bytes(a.strategy_state)
        sb = TrainingState.from_bytes(b.strategy_state)
    except (ValueError, TypeError):  # opaque strategy states (chaos_state) compare bitwise
        return False
    return _arrays_close(sa, sb)
