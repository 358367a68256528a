"""Simulated network: per-link latency, per-sender uplink bandwidth, faults, and delivery.

A message of ``n`` bytes sent at virtual time ``t`` from ``a`` to ``b`` leaves ``a``'s uplink
when it is free: serialisation starts at ``start = max(t, uplink_free[a])`` and ends at
``done = start + n / bandwidth(a)``; it arrives at ``done + latency(a, b) + extra``, where
``extra`` is the fixed ``delay_s`` fault plus, with probability ``reorder``, a uniform draw in
``[0, reorder_max_s]``. Drops and duplicates are drawn per message from the engine's RNG.
A message is lost if either end is crashed or the ends are in different partition groups, at
send time or at arrival.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .engine import Engine
from .settings import SIM_DEFAULT_BANDWIDTH_BPS, SIM_DEFAULT_LATENCY_S

__all__ = ["Faults", "Network"]


@dataclass
class Faults:
    """Message faults in force (all off by default).

    Attributes
    ----------
    drop, duplicate, reorder : float
        Per-message probabilities in ``[0, 1]``.
    reorder_max_s : float
        Largest random extra delay of a reordered message.
    delay_s : float
        Fixed extra delay added to every message.
    """

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_max_s: float = 0.0
    delay_s: float = 0.0


class Network:
    """Links between simulated parties.

    Parameters
    ----------
    engine : Engine
        The event engine (clock, queue, RNG).
    deliver : Callable[[str, str, bytes], None]
        Called as ``deliver(src, dst, data)`` when a message arrives.
    latency_s : float, optional
        One-way latency of every link without an override.
    bandwidth_bps : float, optional
        Uplink bandwidth of every party without an override, in bytes per second.
    link_latency_s : Mapping[tuple[str, str], float], optional
        One-way latency overrides per (unordered) pair.
    uplink_bps : Mapping[str, float], optional
        Uplink bandwidth overrides per party.

    Attributes
    ----------
    faults : Faults
    crashed : set[str]
    sent, delivered, dropped : int
    """

    def __init__(
        self,
        engine: Engine,
        deliver: Callable[[str, str, bytes], None],
        *,
        latency_s: float = SIM_DEFAULT_LATENCY_S,
        bandwidth_bps: float = SIM_DEFAULT_BANDWIDTH_BPS,
        link_latency_s: Mapping[tuple[str, str], float] | None = None,
        uplink_bps: Mapping[str, float] | None = None,
    ) -> None:
        self.engine = engine
        self._deliver = deliver
        self.latency_s = float(latency_s)
        self.bandwidth_bps = float(bandwidth_bps)
        self._link_latency = {tuple(sorted(k)): float(v) for k, v in (link_latency_s or {}).items()}
        self._uplink = {k: float(v) for k, v in (uplink_bps or {}).items()}
        self._uplink_free: dict[str, float] = {}
        self._group: dict[str, int] = {}
        self._cuts: set[tuple[str, str]] = set()
        self.faults = Faults()
        self.crashed: set[str] = set()
        self.sent = 0
        self.delivered = 0
        self.dropped = 0
        self._trace = hashlib.sha256()

    # --- topology and faults -----------------------------------------------------------------

    def latency(self, a: str, b: str) -> float:
        """One-way latency between ``a`` and ``b``."""
        key = (a, b) if a < b else (b, a)
        return self._link_latency.get(key, self.latency_s)

    def bandwidth(self, a: str) -> float:
        """Uplink bandwidth of ``a`` in bytes per second."""
        return self._uplink.get(a, self.bandwidth_bps)

    def partition(self, group_a: Iterable[str]) -> None:
        """Split the network: ``group_a`` on one side, every other party on the other."""
        self._group = {pid: 1 for pid in sorted(group_a)}

    def heal(self) -> None:
        """Remove any partition and every cut link."""
        self._group = {}
        self._cuts.clear()

    def cut(self, a: str, b: str) -> None:
        """Cut the link between ``a`` and ``b`` only (a link flap; :meth:`restore` undoes it)."""
        self._cuts.add((a, b) if a < b else (b, a))

    def restore(self, a: str, b: str) -> None:
        """Restore a link cut with :meth:`cut`."""
        self._cuts.discard((a, b) if a < b else (b, a))

    def reachable(self, a: str, b: str) -> bool:
        """Whether a message from ``a`` to ``b`` would get through now (ignoring random drops)."""
        if a in self.crashed or b in self.crashed:
            return False
        if self._cuts and ((a, b) if a < b else (b, a)) in self._cuts:
            return False
        return self._group.get(a, 0) == self._group.get(b, 0)

    def group_of(self, a: str) -> int:
        """The partition side of ``a`` (0 when there is no partition)."""
        return self._group.get(a, 0)

    # --- traffic -----------------------------------------------------------------------------

    def note(self, line: str) -> None:
        """Fold one line into the trace digest."""
        self._trace.update(line.encode())
        self._trace.update(b"\n")

    def trace_digest(self) -> str:
        """Hex digest of everything noted so far."""
        return self._trace.copy().hexdigest()

    def arrival_time(self, src: str, nbytes: int) -> float:
        """Reserve ``src``'s uplink for ``nbytes`` now; return when serialisation ends."""
        now = self.engine.now
        start = max(now, self._uplink_free.get(src, now))
        done = start + nbytes / self.bandwidth(src)
        self._uplink_free[src] = done
        return done

    def send(self, src: str, dst: str, data: bytes) -> None:
        """Send ``data`` from ``src`` to ``dst`` subject to the faults in force."""
        self.sent += 1
        if not self.reachable(src, dst):
            self.dropped += 1
            return
        rng = self.engine.rng
        f = self.faults
        if f.drop > 0.0 and rng.random() < f.drop:
            self.dropped += 1
            return
        copies = 2 if f.duplicate > 0.0 and rng.random() < f.duplicate else 1
        done = self.arrival_time(src, len(data) * copies)
        for _ in range(copies):
            extra = f.delay_s
            if f.reorder > 0.0 and rng.random() < f.reorder:
                extra += rng.uniform(0.0, f.reorder_max_s)
            self.engine.at(done + self.latency(src, dst) + extra, _Delivery(self, src, dst, data))

    def _arrive(self, src: str, dst: str, data: bytes) -> None:
        if not self.reachable(src, dst):
            self.dropped += 1
            return
        self.delivered += 1
        tag = hashlib.blake2b(data, digest_size=8).hexdigest()
        self.note(f"{self.engine.now!r} {src[:12]} {dst[:12]} {tag}")
        self._deliver(src, dst, data)


class _Delivery:
    """A scheduled arrival (a small callable object: cheaper than a closure per message)."""

    __slots__ = ("data", "dst", "net", "src")

    def __init__(self, net: Network, src: str, dst: str, data: bytes) -> None:
        self.net = net
        self.src = src
        self.dst = dst
        self.data = data

    def __call__(self) -> None:
        self.net._arrive(self.src, self.dst, self.data)
