"""A federation of signed parties whose charter fixes the aggregation rule and audits
(``rounds``), around the fake-Grid ``World`` of the join tests: the harness of the verifiable
rounds' end-to-end attack tests (tests/test_flower_verified_rounds.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fake_grid import FakeGrid
from flwr.app import ConfigRecord, Message
from flwr.serverapp import strategy as flwr_strategies
from test_flower_lib_join import World

from chaos_flwr.charter import AggregationRule, Charter, RoundRules, load_charter
from chaos_flwr.flower.keys import charter_path, key_path
from chaos_flwr.flower.rule import build_strategy
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY
from chaos_flwr.flower.server import ChaosStrategy, PhaseSettings
from chaos_flwr.identity import Identity

#: The sampling arguments of every inner strategy here (all parties train and evaluate).
SAMPLING: dict[str, int | float | bool | str] = {
    "min_available_nodes": 3,
    "min_train_nodes": 3,
    "min_evaluate_nodes": 3,
}
#: The aggregation arguments of each inner strategy the tests run (with SAMPLING added).
RULE_ARGS: dict[str, dict[str, int | float | bool | str]] = {
    "FedAvg": {},
    "FedProx": {"proximal_mu": 0.01},
    "FedAdam": {"eta": 0.05, "eta_l": 0.05, "tau": 0.001},
    "Krum": {"num_malicious_nodes": 0},
    "FedMedian": {},
    "FedTrimmedAvg": {"beta": 0.2},
}
#: Deadline of every exchange (the fake Grid answers at once).
PHASE_TIMEOUT_S = 2.0


def rule_of(name: str) -> AggregationRule:
    """The charter rule of inner strategy ``name`` (its RULE_ARGS and SAMPLING)."""
    return AggregationRule(strategy=name, args={**SAMPLING, **RULE_ARGS[name]})


class VerifiedWorld(World):
    """A :class:`World` whose charter carries ``rounds`` (re-signed by every founder).

    Parameters
    ----------
    tmp, n_parties, founders:
        As for :class:`World`.
    rule:
        The inner strategy's name (a key of :data:`RULE_ARGS`).
    auditors, min_updates:
        The charter's ``rounds.auditors`` and ``rounds.min_updates``.
    """

    def __init__(
        self,
        tmp: Path,
        n_parties: int,
        *,
        founders: int = 3,
        rule: str = "FedAvg",
        auditors: int | str | None = 1,
        min_updates: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(tmp, n_parties, founders=founders, **kw)
        self.grid: HostileGrid = HostileGrid()
        self.rule = rule_of(rule)
        rounds = RoundRules(rule=self.rule, auditors=auditors, min_updates=min_updates)
        body = {**self.charter.model_dump(), "rounds": rounds.model_dump(), "signatures": {}}
        charter = Charter.model_validate(body)
        for i in range(min(founders, n_parties)):
            charter = charter.sign(Identity.load(key_path(self.keys, i)))
        charter.verify()
        charter.save(charter_path(self.keys))
        self.charter = load_charter(charter_path(self.keys))

    def inner(self) -> flwr_strategies.Strategy:
        """A fresh inner strategy built from the charter's rule."""
        return build_strategy(self.rule)

    def strategy(self, **kw: Any) -> ChaosStrategy:
        kw.setdefault("phases", PhaseSettings(phase_timeout_s=PHASE_TIMEOUT_S))
        inner = kw.pop("inner", None) or self.inner()
        return ChaosStrategy(inner, charter=self.charter, **kw)


#: ``(message delivered, the node's reply) -> None``: a carrier's hook (may change either).
Hook = Callable[[Message, Message], None]


class HostileGrid(FakeGrid):
    """A carrier that lets a test change a message before its node gets it (``before``) or the
    node's reply before the ServerApp gets it (``after``): what a dishonest relay can do."""

    def __init__(self) -> None:
        super().__init__()
        self.before: list[Callable[[Message], None]] = []
        self.after: list[Hook] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        for msg in msgs:
            for hook in self.before:
                hook(msg)
        ids = list(super().push_messages(msgs))
        for msg, mid in zip(msgs, ids, strict=True):
            entry = self._ready.get(mid)
            if entry is not None and entry[1].has_content():
                for after in self.after:
                    after(msg, entry[1])
        return ids


def chaos_of(msg: Message) -> ConfigRecord | None:
    """The Chaos record of a message or reply (``None`` if it has none)."""
    rec = msg.content.get(CHAOS_RECORD_KEY) if msg.has_content() else None
    return rec if isinstance(rec, ConfigRecord) else None


def train_round(msg: Message) -> int | None:
    """The server round of a train message (``None`` for any other message)."""
    if not msg.metadata.message_type.startswith("train") or not msg.has_content():
        return None
    config = msg.content.get("config")
    value = config.get("server-round") if isinstance(config, ConfigRecord) else None
    return value if isinstance(value, int) else None
