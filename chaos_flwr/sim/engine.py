"""Discrete-event engine: a virtual clock, an event heap with stable tie-breaking, one RNG.

Events are ``(time, seq, callback)``; two events at the same virtual time run in the order they
were scheduled (``seq`` is a counter), so a run is a pure function of the seed. Nothing here
reads the wall clock.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from ..errors import ChaosError
from .settings import SIM_MAX_EVENTS, SIM_MAX_VIRTUAL_S

__all__ = ["Engine", "SimBoundError"]


class SimBoundError(ChaosError, RuntimeError):
    """A run hit its virtual-duration or event-count bound (raise the bound or fix the storm)."""


class Engine:
    """Event queue with virtual time.

    Parameters
    ----------
    seed : int
        Seed of the single :class:`random.Random` every random choice of the run draws from.
    max_virtual_s : float, optional
        Virtual time past which scheduling an event or running one is a :class:`SimBoundError`.
    max_events : int, optional
        Most events one engine runs before it raises :class:`SimBoundError`.

    Attributes
    ----------
    now : float
        The current virtual time in seconds.
    rng : random.Random
        The run's only source of randomness.
    events : int
        Events run so far (every callback popped from the queue counts as one event).
    """

    def __init__(
        self,
        seed: int,
        *,
        max_virtual_s: float = SIM_MAX_VIRTUAL_S,
        max_events: int = SIM_MAX_EVENTS,
    ) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self.events = 0
        self.max_virtual_s = float(max_virtual_s)
        self.max_events = int(max_events)
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Schedule ``callback`` at virtual time ``when`` (never before :attr:`now`)."""
        when = max(float(when), self.now)
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        """Schedule ``callback`` ``delay`` seconds after :attr:`now`."""
        self.at(self.now + max(0.0, float(delay)), callback)

    def pending(self) -> int:
        """Events still queued."""
        return len(self._heap)

    def run(self, until: float) -> None:
        """Run every event up to and including virtual time ``until``, then set ``now = until``.

        Raises
        ------
        SimBoundError
            If ``until`` exceeds ``max_virtual_s`` or the run exceeds ``max_events``.
        """
        if until > self.max_virtual_s:
            raise SimBoundError(
                f"run until {until:g} s exceeds the bound max_virtual_s={self.max_virtual_s:g} s; "
                "shorten the scenario or raise 'max_virtual_s'"
            )
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, callback = heapq.heappop(heap)
            self.now = when
            self.events += 1
            if self.events > self.max_events:
                raise SimBoundError(
                    f"the run exceeded max_events={self.max_events} at virtual time {when:g} s; "
                    "a message storm, or raise 'max_events'"
                )
            callback()
        self.now = max(self.now, until)
