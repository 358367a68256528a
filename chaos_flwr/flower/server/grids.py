"""Grid views the ServerApp hands out: :class:`EligibleGrid` lists only some nodes (what the
inner strategy samples from), :class:`TimedGrid` notes when each reply was first pulled."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run

__all__ = ["EligibleGrid", "TimedGrid"]


class EligibleGrid(Grid):
    """A view of a Grid that lists only the eligible nodes (what the inner strategy samples)."""

    def __init__(self, grid: Grid, nodes: list[int]) -> None:
        self._grid = grid
        self._nodes = list(nodes)

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
        return list(self._nodes)

    def get_nodes(self) -> Iterable[NodeInfo]:
        return (NodeInfo(node_id=n) for n in self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self._grid.send_and_receive(messages, timeout=timeout)


class TimedGrid(EligibleGrid):
    """A Grid that notes when each reply was first pulled (reply-to message id -> clock).

    Set :attr:`held_until` when the pulls were held up until then (other work ran between
    two): a reply the next pull brings first may have come any time before, so it goes to
    :attr:`held` with that time (a message pushed before it is not to be timed by it)."""

    def __init__(self, grid: Grid, clock: Callable[[], float]) -> None:
        super().__init__(grid, [])
        self._clock = clock
        self.seen: dict[str, float] = {}
        self.held: dict[str, float] = {}
        self.held_until: float | None = None

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self._grid.pull_messages(message_ids))
        now = self._clock()
        for reply in replies:
            mid = reply.metadata.reply_to_message_id
            if mid not in self.seen and self.held_until is not None:
                self.held[mid] = self.held_until
            self.seen.setdefault(mid, now)
        self.held_until = None
        return replies
