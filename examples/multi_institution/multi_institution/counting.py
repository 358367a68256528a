"""A Grid that counts the messages the ServerApp sends, per round, and the trainers per round.

The bench (``chaos-flwr bench flower-overhead``) compares plain FedAvg with ChaosStrategy by the
messages each round sends; both modes go through this same wrapper, so they are counted the same
way: every message handed to ``push_messages`` or ``send_and_receive`` counts once, by its
``message_type``, in the round :meth:`CountingGrid.round_done` last opened. Messages sent before
the first ``train`` message (Chaos's hello and the certification of the initial state) are the
run's *setup*, not a round's. A trainer is a node whose ``train`` reply came with content.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run

TRAIN = "train"


class CountingGrid(Grid):
    """Delegates to ``grid``; counts what goes through it (module docstring)."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.setup: Counter[str] = Counter()
        self.rounds: list[Counter[str]] = []
        self.trainers: list[set[int]] = []
        self.first_train_at: float | None = None  # wall clock (time.time) of the first train push
        self.first_train_to: dict[int, float] = {}  # node -> wall clock of its first train push
        self._round = 1

    # -- counting -----------------------------------------------------------------------------
    def round_done(self, server_round: int) -> None:
        """Round ``server_round`` ended: later messages count for the next round."""
        self._round = server_round + 1

    def _slot(self, index: int) -> int:
        while len(self.rounds) <= index:
            self.rounds.append(Counter())
            self.trainers.append(set())
        return index

    def _count(self, messages: list[Message]) -> None:
        for msg in messages:
            kind = msg.metadata.message_type
            if kind == TRAIN and self.first_train_at is None:
                self.first_train_at = time.time()
            if kind == TRAIN:
                self.first_train_to.setdefault(msg.metadata.dst_node_id, time.time())
            if self.first_train_at is None:
                self.setup[kind] += 1
            else:
                self.rounds[self._slot(self._round - 1)][kind] += 1

    def _replies(self, replies: list[Message]) -> list[Message]:
        for reply in replies:
            if reply.metadata.message_type == TRAIN and reply.has_content():
                self.trainers[self._slot(self._round - 1)].add(reply.metadata.src_node_id)
        return replies

    def summary(self) -> dict[str, object]:
        """The counts as JSON-ready values (rounds in order, from round 1)."""
        return {
            "setup_messages": dict(self.setup),
            "messages_per_round": [dict(c) for c in self.rounds],
            "trainers_per_round": [len(t) for t in self.trainers],
            "first_train_at": self.first_train_at,
            "first_train_to": {str(n): t for n, t in sorted(self.first_train_to.items())},
        }

    # -- the Grid, delegated ------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        return self._grid.get_nodes()  # type: ignore[attr-defined,no-any-return]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        self._count(msgs)
        return self._grid.push_messages(msgs)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._replies(list(self._grid.pull_messages(message_ids)))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        msgs = list(messages)
        self._count(msgs)
        return self._replies(list(self._grid.send_and_receive(msgs, timeout=timeout)))
