"""Adaptive exchange deadlines: per node, from its own observed reply times (sans-I/O).

:class:`ReplyTimes` keeps, per node and kind of message (``"<phase>:<message type>"``, e.g.
``relay:train`` for a trainer, ``relay:query.chaos`` for a node only relayed to), the newest
reply times the ServerApp measured, and turns them into a deadline: the
``deadline_quantile`` of the history times ``1 + deadline_margin``, clamped to
``[floor_s, deadline_ceiling_s]``; with no history, the configured phase timeout or
the ceiling (:class:`~chaos_flwr.flower.server.settings.PhaseSettings`). It reads no clock:
the courier tells it what it measured.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from chaos_flwr.defaults import FLOWER_DEADLINE_HISTORY
from chaos_flwr.flower.server.settings import PhaseSettings

__all__ = ["ReplyTimes", "quantile"]


def quantile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (``q`` in (0, 1]; at least one value)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


@dataclass
class ReplyTimes:
    """Reply-time history per ``(kind, node)`` and the deadlines it gives (module docstring).

    Parameters
    ----------
    settings:
        Floor, ceiling, quantile, margin and the deadline without history.
    history:
        Reply times kept per node and kind; default
        :data:`~chaos_flwr.defaults.FLOWER_DEADLINE_HISTORY`.
    """

    settings: PhaseSettings
    history: int = FLOWER_DEADLINE_HISTORY
    _times: dict[tuple[str, int], deque[float]] = field(default_factory=dict)

    def observe(self, kind: str, node: int, seconds: float) -> None:
        """Note that ``node`` answered a ``kind`` message ``seconds`` after it was pushed."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        self._times.setdefault((kind, node), deque(maxlen=self.history)).append(seconds)

    def samples(self, kind: str, node: int) -> list[float]:
        """The kept reply times of ``node`` to ``kind`` messages, oldest first."""
        return list(self._times.get((kind, node), ()))

    def deadline(self, kind: str, node: int) -> float:
        """How long to wait for ``node``'s reply to a ``kind`` message (module docstring)."""
        s = self.settings
        times = self._times.get((kind, node))
        if not times:
            return s.first_deadline_s
        wait = quantile(times, s.deadline_quantile) * (1.0 + s.deadline_margin)
        return min(max(wait, s.floor_s), s.deadline_ceiling_s)

    def stall_bound(self, timeout: float) -> float:
        """How long an exchange whose waited nodes all stalled may wait on for their first
        answer (``stall_s`` of :func:`chaos_flwr.flower.relay.exchange`): the deadline
        ceiling, never past the phase's ``timeout``."""
        return min(timeout, self.settings.deadline_ceiling_s)

    def exchange_deadline(self, kinds: Mapping[int, str], wait_for: Iterable[int]) -> float:
        """An exchange's deadline: the latest deadline of the nodes it waits for (the first
        deadline when it waits for none)."""
        waits = [self.deadline(kinds[n], n) for n in wait_for if n in kinds]
        return max(waits) if waits else self.settings.first_deadline_s
