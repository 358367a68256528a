"""The cluster monitor: liveness, link estimates and resources (sans-I/O).

A :class:`Monitor` is the part of a party that watches its neighbours. It reads no clock and
sends nothing: the peer tells it what it heard and when (``heard_from``), what probes it sent
and got back, what transfers it observed, and asks it which parties are suspected, which probes
are due, and which :class:`~chaos_flwr.planner.Donor` values to plan with.

- **Suspicion.** An accrual detector (phi accrual, as Cassandra and Akka use): per watched party
  the monitor keeps the intervals between its arrivals and, from their mean and spread, the
  chance that a live party would still be silent after the silence observed so far; its
  ``-log10`` is *phi*. A party is suspected when phi reaches ``phi_threshold`` **and** its
  silence is at least the charter's ``suspicion_timeout_s`` (a floor: the detector never
  suspects sooner than the fixed timeout did) **and** it stayed unheard across
  ``min_missed_checks`` checks of this party at least a heartbeat interval apart. The last
  condition is what makes a relayed federation safe: parties that hear each other only through
  the Flower relay get each other's envelopes once per exchange, and one exchange without a
  party's envelopes is no evidence (its previous answer may have come within a heartbeat
  interval of the one before, so it sent no heartbeat). A party that keeps answering, however
  slowly, is never suspected; one that stops is suspected once its silence passes what its own
  history makes unlikely (:meth:`Monitor.suspicion_bound`). Any message counts as a sign of
  life (heartbeats are just the messages sent when nothing else is).
- **Latency.** Half the probe round-trip time, smoothed by an exponentially weighted moving
  average (EWMA, weight ``ewma_alpha`` for the newest sample).
- **Bandwidth.** ``bytes / seconds`` of observed transfers, smoothed the same way.
- **Resources.** Compute speed and free memory as each party declares them (in heartbeats); the
  newest declaration (by its own timestamp) wins.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .defaults import (
    MONITOR_DEFAULT_BANDWIDTH_BPS,
    MONITOR_EWMA_ALPHA,
    MONITOR_HISTORY_INTERVALS,
    MONITOR_MIN_MISSED_CHECKS,
    MONITOR_MIN_STD_FRACTION,
    MONITOR_MIN_STD_S,
    MONITOR_PHI_THRESHOLD,
    MONITOR_PROBE_TIMEOUT_S,
)
from .errors import ConfigError
from .planner import Donor

__all__ = ["LinkEstimate", "Monitor", "Resources"]


@dataclass(frozen=True)
class Resources:
    """What a party declares about itself.

    Attributes
    ----------
    compute_speed : float
        Relative compute speed (samples/s or any unit the federation agrees on), >= 0.
    free_memory_bytes : int
        Free memory for training state, >= 0.
    at : float
        When the party declared it (its own clock).
    """

    compute_speed: float
    free_memory_bytes: int
    at: float = 0.0


@dataclass(frozen=True)
class LinkEstimate:
    """Smoothed estimates for the link to one party (``None`` until a sample arrived).

    Attributes
    ----------
    bandwidth_bps : float or None
        Bytes per second.
    latency_s : float or None
        One-way latency in seconds (half the round-trip time).
    bandwidth_samples, latency_samples : int
        Samples seen so far.
    """

    bandwidth_bps: float | None = None
    latency_s: float | None = None
    bandwidth_samples: int = 0
    latency_samples: int = 0


def _positive(name: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"monitor setting {name!r} must be a finite number > 0, got {value!r}")
    return float(value)


def _later_chance(z: float) -> float:
    """Chance that a normal variable exceeds its mean by ``z`` standard deviations."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _z_of_phi(phi: float) -> float:
    """The ``z`` at which ``-log10(_later_chance(z))`` equals ``phi`` (bisection; phi > 0)."""
    target = 10.0**-phi
    lo, hi = -10.0, 40.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if _later_chance(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


class Monitor:
    """Heartbeat bookkeeping, failure suspicion and link/resource estimates for one party.

    Parameters
    ----------
    party_id : str
        The party this monitor belongs to (never watched by itself).
    suspicion_timeout_s : float
        Silence after which a watched party is suspected (the charter's value).
    heartbeat_interval_s : float
        How often :meth:`heartbeat_due` fires (the charter's value).
    probe_interval_s : float
        How often each watched party is probed for its round-trip time.
    ewma_alpha : float
        Weight of the newest sample in the moving averages, in (0, 1].
    phi_threshold : float
        Phi at which a silent party is suspected (module docstring); default
        :data:`~chaos_flwr.defaults.MONITOR_PHI_THRESHOLD`.
    min_missed_checks : int
        Checks (at least ``heartbeat_interval_s`` apart) a party must stay unheard across
        before it can be suspected; default
        :data:`~chaos_flwr.defaults.MONITOR_MIN_MISSED_CHECKS`.

    Raises
    ------
    ConfigError
        If a timing or ``phi_threshold`` is not a finite positive number, ``ewma_alpha`` is
        outside (0, 1], or ``min_missed_checks`` is below 1.
    """

    def __init__(
        self,
        party_id: str,
        *,
        suspicion_timeout_s: float,
        heartbeat_interval_s: float,
        probe_interval_s: float | None = None,
        ewma_alpha: float = MONITOR_EWMA_ALPHA,
        phi_threshold: float = MONITOR_PHI_THRESHOLD,
        min_missed_checks: int = MONITOR_MIN_MISSED_CHECKS,
    ) -> None:
        self.party_id = party_id
        self.suspicion_timeout_s = _positive("suspicion_timeout_s", suspicion_timeout_s)
        self.heartbeat_interval_s = _positive("heartbeat_interval_s", heartbeat_interval_s)
        self.probe_interval_s = _positive(
            "probe_interval_s",
            probe_interval_s if probe_interval_s is not None else heartbeat_interval_s,
        )
        if not (math.isfinite(ewma_alpha) and 0.0 < ewma_alpha <= 1.0):
            raise ConfigError(f"monitor setting 'ewma_alpha' must be in (0, 1], got {ewma_alpha}")
        self.ewma_alpha = float(ewma_alpha)
        self.phi_threshold = _positive("phi_threshold", phi_threshold)
        if (
            isinstance(min_missed_checks, bool)
            or not isinstance(min_missed_checks, int)
            or (min_missed_checks < 1)
        ):
            raise ConfigError(
                "monitor setting 'min_missed_checks' must be an integer >= 1, "
                f"got {min_missed_checks!r}"
            )
        self.min_missed_checks = int(min_missed_checks)
        self._z = _z_of_phi(self.phi_threshold)
        self._intervals: dict[str, deque[float]] = {}  # party -> newest inter-arrival times
        self._missed: dict[str, int] = {}  # watched party -> counted checks it stayed unheard
        self._last_check: float | None = None  # the last check that counted as a chance
        self._watched: dict[str, float] = {}  # party -> last heard (or when watching began)
        self._last_heard: dict[str, float] = {}
        self._suspected: set[str] = set()
        self._next_heartbeat: float | None = None
        self._next_probe: dict[str, float] = {}
        self._probes: dict[tuple[str, int], float] = {}
        self._probe_nonce = 0
        self._links: dict[str, LinkEstimate] = {}
        self._resources: dict[str, Resources] = {}

    # --- liveness ----------------------------------------------------------------------------

    def watch(self, party_ids: Iterable[str], now: float) -> None:
        """Set the parties to watch; new ones get a full timeout from ``now``.

        Parties no longer in ``party_ids`` are dropped (with their suspicion).
        """
        wanted = {p for p in party_ids if p != self.party_id}
        for pid in list(self._watched):
            if pid not in wanted:
                del self._watched[pid]
                self._suspected.discard(pid)
                self._next_probe.pop(pid, None)
                self._missed.pop(pid, None)
        for pid in sorted(wanted):
            if pid not in self._watched:
                self._watched[pid] = max(self._last_heard.get(pid, now), now)
                self._next_probe[pid] = now
                self._missed[pid] = 0

    def watched(self) -> list[str]:
        """The watched parties, sorted."""
        return sorted(self._watched)

    def heard_from(self, party_id: str, now: float) -> None:
        """Note a sign of life (any verified message) from ``party_id`` at ``now``.

        Arrivals at distinct times feed the party's inter-arrival history (several envelopes
        delivered at one ``now`` are one arrival).
        """
        last = self._last_heard.get(party_id)
        if last is None or now > last:
            if last is not None:
                hist = self._intervals.setdefault(party_id, deque(maxlen=MONITOR_HISTORY_INTERVALS))
                hist.append(now - last)
            self._last_heard[party_id] = now
        if party_id in self._watched and now > self._watched[party_id]:
            self._watched[party_id] = now
        if party_id in self._missed:
            self._missed[party_id] = 0
        self._suspected.discard(party_id)

    def last_heard(self, party_id: str) -> float | None:
        """When ``party_id`` was last heard from, or ``None``."""
        return self._last_heard.get(party_id)

    def check(self, now: float) -> list[str]:
        """Parties that became suspected at ``now`` (each reported once per silence), sorted.

        A check at least ``heartbeat_interval_s`` after the previous counted one is a chance
        every silent watched party missed; a party is suspected once it missed
        ``min_missed_checks`` of them and its silence reached :meth:`suspicion_bound`.
        """
        counted = self._last_check is None or now - self._last_check >= self.heartbeat_interval_s
        if counted:
            self._last_check = now
        fresh: list[str] = []
        for pid, heard in sorted(self._watched.items()):
            if pid in self._suspected or now <= heard:
                continue
            if counted:
                self._missed[pid] = self._missed.get(pid, 0) + 1
            if self._missed.get(
                pid, 0
            ) >= self.min_missed_checks and now - heard >= self.suspicion_bound(pid):
                fresh.append(pid)
        self._suspected.update(fresh)
        return fresh

    def interval_stats(self, party_id: str) -> tuple[float, float] | None:
        """Mean and standard deviation of ``party_id``'s inter-arrival intervals (the std
        floored at ``MONITOR_MIN_STD_FRACTION`` of the mean and ``MONITOR_MIN_STD_S``), or
        ``None`` before its second arrival."""
        hist = self._intervals.get(party_id)
        if not hist:
            return None
        mean = sum(hist) / len(hist)
        var = sum((x - mean) ** 2 for x in hist) / len(hist)
        std = max(math.sqrt(var), MONITOR_MIN_STD_FRACTION * mean, MONITOR_MIN_STD_S)
        return mean, std

    def phi(self, party_id: str, now: float) -> float:
        """Suspicion level of ``party_id`` at ``now``: ``-log10`` of the chance that a live
        party with its history would still be silent (0 without history or silence)."""
        stats = self.interval_stats(party_id)
        heard = self._watched.get(party_id, self._last_heard.get(party_id))
        if stats is None or heard is None or now <= heard:
            return 0.0
        chance = _later_chance((now - heard - stats[0]) / stats[1])
        return math.inf if chance <= 0.0 else -math.log10(chance)

    def suspicion_bound(self, party_id: str) -> float:
        """Silence after which ``party_id`` is suspected (given enough missed checks): where
        phi reaches ``phi_threshold`` under its history, never below ``suspicion_timeout_s``
        (the floor alone until two arrivals gave an interval)."""
        stats = self.interval_stats(party_id)
        if stats is None:
            return self.suspicion_timeout_s
        return max(self.suspicion_timeout_s, stats[0] + self._z * stats[1])

    def suspected(self) -> list[str]:
        """Parties currently suspected, sorted."""
        return sorted(self._suspected)

    def heartbeat_due(self, now: float) -> bool:
        """Whether a heartbeat round is due at ``now`` (and if so, schedule the next one)."""
        if self._next_heartbeat is None or now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval_s
            return True
        return False

    # --- probes ------------------------------------------------------------------------------

    def probes_due(self, now: float) -> list[tuple[str, int]]:
        """``(party, nonce)`` probes to send at ``now``; each is remembered until answered.

        Unanswered probes older than ``MONITOR_PROBE_TIMEOUT_S`` are forgotten.
        """
        for key, sent in list(self._probes.items()):
            if now - sent > MONITOR_PROBE_TIMEOUT_S:
                del self._probes[key]
        due: list[tuple[str, int]] = []
        for pid in sorted(self._watched):
            if now >= self._next_probe.get(pid, now):
                self._probe_nonce += 1
                self._probes[(pid, self._probe_nonce)] = now
                self._next_probe[pid] = now + self.probe_interval_s
                due.append((pid, self._probe_nonce))
        return due

    def probe_answered(self, party_id: str, nonce: int, now: float) -> float | None:
        """Consume the answer to probe ``nonce``; returns the round-trip time or ``None``.

        An answer to an unknown (or already answered, or expired) probe is ignored.
        """
        sent = self._probes.pop((party_id, nonce), None)
        if sent is None or now < sent:
            return None
        rtt = now - sent
        self.observe_rtt(party_id, rtt)
        return rtt

    def observe_rtt(self, party_id: str, rtt_s: float) -> None:
        """Fold one round-trip time sample into the latency estimate of ``party_id``."""
        if not math.isfinite(rtt_s) or rtt_s < 0:
            return
        cur = self._links.get(party_id, LinkEstimate())
        sample = rtt_s / 2.0
        lat = (
            sample
            if cur.latency_s is None
            else (1 - self.ewma_alpha) * cur.latency_s + self.ewma_alpha * sample
        )
        self._links[party_id] = LinkEstimate(
            cur.bandwidth_bps, lat, cur.bandwidth_samples, cur.latency_samples + 1
        )

    def observe_transfer(self, party_id: str, nbytes: int, seconds: float) -> None:
        """Fold one observed transfer (``nbytes`` in ``seconds``) into the bandwidth estimate.

        Samples with no bytes or a non-positive duration carry no rate and are ignored.
        """
        if nbytes <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        cur = self._links.get(party_id, LinkEstimate())
        sample = nbytes / seconds
        bw = (
            sample
            if cur.bandwidth_bps is None
            else (1 - self.ewma_alpha) * cur.bandwidth_bps + self.ewma_alpha * sample
        )
        self._links[party_id] = LinkEstimate(
            bw, cur.latency_s, cur.bandwidth_samples + 1, cur.latency_samples
        )

    def link(self, party_id: str) -> LinkEstimate:
        """The current estimates for the link to ``party_id``."""
        return self._links.get(party_id, LinkEstimate())

    # --- resources ---------------------------------------------------------------------------

    def declare(self, party_id: str, resources: Resources) -> None:
        """Record what ``party_id`` declared; an older declaration never replaces a newer one.

        Raises
        ------
        ConfigError
            If ``compute_speed`` or ``free_memory_bytes`` is negative or not finite.
        """
        if not math.isfinite(resources.compute_speed) or resources.compute_speed < 0:
            raise ConfigError("resource field 'compute_speed' must be a finite number >= 0")
        if resources.free_memory_bytes < 0:
            raise ConfigError("resource field 'free_memory_bytes' must be >= 0")
        cur = self._resources.get(party_id)
        if cur is None or resources.at >= cur.at:
            self._resources[party_id] = resources

    def resources(self) -> dict[str, Resources]:
        """The resource table: party id -> newest declaration."""
        return dict(sorted(self._resources.items()))

    # --- planner input -----------------------------------------------------------------------

    def donors(
        self,
        candidates: Iterable[str],
        *,
        ready: Mapping[str, float] | None = None,
        overhead: float = 0.0,
        default_bandwidth_bps: float = MONITOR_DEFAULT_BANDWIDTH_BPS,
        default_latency_s: float = 0.0,
        exclude_suspected: bool = True,
    ) -> list[Donor]:
        """Planner :class:`~chaos_flwr.planner.Donor` values for ``candidates``.

        Parameters
        ----------
        candidates
            Party ids that hold the state.
        ready
            Party id -> seconds until it is free (missing: 0).
        overhead
            Per-shard overhead in seconds, for every donor.
        default_bandwidth_bps, default_latency_s
            Used for a link with no sample yet.
        exclude_suspected
            Leave out suspected parties (and this party itself always).

        Returns
        -------
        list[Donor]
            One donor per kept candidate, sorted by id.
        """
        ready = ready or {}
        out: list[Donor] = []
        for pid in sorted(set(candidates)):
            if pid == self.party_id or (exclude_suspected and pid in self._suspected):
                continue
            est = self.link(pid)
            out.append(
                Donor(
                    id=pid,
                    bandwidth=est.bandwidth_bps
                    if est.bandwidth_bps is not None
                    else default_bandwidth_bps,
                    latency=est.latency_s if est.latency_s is not None else default_latency_s,
                    ready=float(ready.get(pid, 0.0)),
                    overhead=overhead,
                )
            )
        return out
