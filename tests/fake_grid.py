"""An in-process Flower Grid for tests: ``push_messages`` calls node handlers directly.

Each node is a handler ``(Message, Context) -> Message`` (a ``ClientApp`` is one) with its own
``Context``. A node can be made dead (no reply ever comes), failing (every message gets an error
reply with ``ErrorCode.NODE_UNAVAILABLE``, as Flower sends for a vanished SuperNode) or slow
(its reply shows up only after a delay on the grid's clock).
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["FakeGrid", "FakeNode", "set_task_identity"]

Handler = Callable[[Message, Context], Message]


def set_task_identity(run_id: int = 1, node_id: int = 0, task_id: int = 0) -> None:
    """Set Flower's process task identity, which ``Message(...)`` needs outside a running app."""
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = task_id


@dataclass
class FakeNode:
    """One simulated SuperNode."""

    node_id: int
    handler: Handler
    context: Context
    mode: str = "ok"  # "ok" | "dead" | "error"
    delay_s: float = 0.0
    received: list[str] = field(default_factory=list)


class FakeGrid(Grid):
    """A Grid whose nodes are in-process handlers (see module docstring).

    Parameters
    ----------
    clock:
        Time source for slow nodes (tests pass a virtual clock and advance it in ``sleep``).
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._run = Run.create_empty(run_id=1)
        self._nodes: dict[int, FakeNode] = {}
        self._ready: dict[str, tuple[float, Message]] = {}
        self._now = 0.0
        self._clock = clock or (lambda: self._now)
        self._ids = itertools.count(1001)
        self.pushed = 0
        set_task_identity()

    # -- test controls ------------------------------------------------------------------------
    def add_node(
        self,
        handler: Handler,
        *,
        node_config: dict[str, int | float | str] | None = None,
        run_config: dict[str, int | float | str] | None = None,
        node_id: int | None = None,
    ) -> FakeNode:
        """Add a node running ``handler``; returns it (its ``mode`` can be changed later)."""
        nid = next(self._ids) if node_id is None else node_id
        ctx = Context(
            run_id=1,
            node_id=nid,
            node_config=dict(node_config or {}),
            state=RecordDict(),
            run_config=dict(run_config or {}),
        )
        node = FakeNode(nid, handler, ctx)
        self._nodes[nid] = node
        return node

    def remove_node(self, node_id: int) -> None:
        """Unregister a node (as when a SuperNode disconnects cleanly)."""
        self._nodes.pop(node_id, None)

    def node(self, node_id: int) -> FakeNode:
        """The node with ``node_id``."""
        return self._nodes[node_id]

    def advance(self, seconds: float) -> None:
        """Advance the grid's own clock (used when no clock was given)."""
        self._now += seconds

    # -- Grid API -----------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids: list[str] = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            self.pushed += 1
            node = self._nodes.get(msg.metadata.dst_node_id)
            if node is None or node.mode == "dead":
                continue
            node.received.append(msg.metadata.message_type)
            if node.mode == "error":
                reply = Message(
                    Error(ErrorCode.NODE_UNAVAILABLE, "node is unavailable"), reply_to=msg
                )
            else:
                # the handler sees a copy, as it would after serialisation
                inbound = Message(
                    copy.deepcopy(msg.content),
                    dst_node_id=msg.metadata.dst_node_id,
                    message_type=msg.metadata.message_type,
                    group_id=msg.metadata.group_id or None,
                )
                inbound.metadata.__dict__["_message_id"] = mid
                reply = node.handler(inbound, node.context)
                reply.metadata.__dict__["_reply_to_message_id"] = mid
                reply.metadata.__dict__["_src_node_id"] = node.node_id
            self._ready[mid] = (self._clock() + node.delay_s, reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        now = self._clock()
        out: list[Message] = []
        for mid in message_ids:
            entry = self._ready.get(mid)
            if entry is not None and entry[0] <= now:
                out.append(entry[1])
                del self._ready[mid]
        return out

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        return list(self.pull_messages(ids))
