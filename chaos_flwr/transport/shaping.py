"""Shaped WAN links for the grpc carrier: token buckets per direction and a latency model.

A WAN profile (YAML) gives every party an access link: ``up_mb_s`` (what it can send, MB/s,
1 MB = 10**6 bytes), ``down_mb_s`` (what it can receive; omitted = unlimited) and
``latency_ms`` (the one-way delay of its access link). Optional ``links`` entries cap one
directed pair ``src -> dst`` further (a per-peer bucket), and ``storage`` describes the shared
storage the ``checkpoint`` baseline writes to and reads from.

Model
-----
* A byte sent from ``a`` to ``b`` passes ``a``'s uplink bucket, the ``a -> b`` link bucket (if
  any), and ``b``'s downlink bucket; each bucket holds at most ``burst`` bytes of credit.
* A message from ``a`` to ``b`` is delayed by ``latency(a) + latency(b)`` once before its first
  byte (propagation); its bytes are then paced by the buckets (pipelined, so latency is not paid
  per chunk).
* Buckets run on the caller's event loop and read a monotonic clock; concurrent users of one
  bucket share its rate (each takes credit when it asks, so the later asker waits longer).

Example profile::

    parties:
      joiner: {up_mb_s: 40, down_mb_s: 200, latency_ms: 2}
      d1: {up_mb_s: 5, latency_ms: 10}
    links:
      - {src: d1, dst: joiner, mb_s: 4}
    storage: {up_mb_s: 20, down_mb_s: 20, latency_ms: 5}
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..defaults import SHAPING_BURST_BYTES, SHAPING_MAX_PROFILE_BYTES
from ..errors import ConfigError

__all__ = [
    "LinkSpec",
    "PairSpec",
    "Shaper",
    "TokenBucket",
    "WanProfile",
    "load_profile",
    "parse_profile",
]

MB = 1_000_000


class TokenBucket:
    """A token bucket of ``rate`` bytes/s holding at most ``burst`` bytes of credit.

    Parameters
    ----------
    rate : float
        Bytes per second (> 0, finite).
    burst : int, optional
        Credit ceiling in bytes (>= 1).
    clock : callable, optional
        Monotonic clock in seconds (tests may pass a fake one).
    """

    def __init__(
        self,
        rate: float,
        burst: int = SHAPING_BURST_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
            raise ConfigError(f"rate: token bucket rate must be a finite number > 0, got {rate!r}")
        if burst < 1:
            raise ConfigError(f"burst: token bucket burst must be >= 1 byte, got {burst!r}")
        self.rate = float(rate)
        self.burst = int(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self.bytes_total = 0

    def take(self, nbytes: int) -> float:
        """Take credit for ``nbytes`` now and return the seconds the caller must wait."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        self.bytes_total += nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may pass at this bucket's rate."""
        wait = self.take(nbytes)
        if wait > 0:
            await asyncio.sleep(wait)


_FORBID = ConfigDict(extra="forbid", frozen=True)


class LinkSpec(BaseModel):
    """One party's access link (or the storage link)."""

    model_config = _FORBID
    up_mb_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    down_mb_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    latency_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @property
    def up_bps(self) -> float | None:
        """Uplink in bytes/s (``None`` = unlimited)."""
        return None if self.up_mb_s is None else self.up_mb_s * MB

    @property
    def down_bps(self) -> float | None:
        """Downlink in bytes/s (``None`` = unlimited)."""
        return None if self.down_mb_s is None else self.down_mb_s * MB

    @property
    def latency_s(self) -> float:
        """One-way access delay in seconds."""
        return self.latency_ms / 1000.0


class PairSpec(BaseModel):
    """A further cap on one directed pair ``src -> dst``."""

    model_config = _FORBID
    src: str = Field(min_length=1)
    dst: str = Field(min_length=1)
    mb_s: float = Field(gt=0, allow_inf_nan=False)


class WanProfile(BaseModel):
    """A WAN profile: access links per party, optional pair caps, optional storage link."""

    model_config = _FORBID
    name: str = "wan"
    parties: dict[str, LinkSpec] = Field(min_length=1)
    links: list[PairSpec] = Field(default_factory=list)
    storage: LinkSpec | None = None

    def link(self, party: str) -> LinkSpec:
        """The access link of ``party`` (unlimited, zero latency when not listed)."""
        return self.parties.get(party, LinkSpec())

    def pair_cap_bps(self, src: str, dst: str) -> float | None:
        """The ``src -> dst`` pair cap in bytes/s, if the profile sets one."""
        caps = [p.mb_s * MB for p in self.links if p.src == src and p.dst == dst]
        return min(caps) if caps else None

    def one_way_s(self, src: str, dst: str) -> float:
        """The one-way delay of ``src -> dst`` in seconds."""
        return self.link(src).latency_s + self.link(dst).latency_s

    def path_bps(self, src: str, dst: str) -> float:
        """The bottleneck rate of ``src -> dst`` in bytes/s (``inf`` when nothing caps it)."""
        rates = [self.link(src).up_bps, self.link(dst).down_bps, self.pair_cap_bps(src, dst)]
        known = [r for r in rates if r is not None]
        return min(known) if known else math.inf


def _field_of(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "profile"
    return f"{loc}: {first['msg']}"


def parse_profile(data: Mapping[str, Any] | Any, *, source: str = "profile") -> WanProfile:
    """Validate a decoded profile mapping.

    Raises
    ------
    ConfigError
        Naming the first bad field (e.g. ``parties.d1.up_mb_s: Input should be greater than 0``).
    """
    if not isinstance(data, Mapping):
        kind = type(data).__name__
        raise ConfigError(f"{source}: a WAN profile must be a YAML mapping, got {kind}")
    try:
        profile = WanProfile.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(f"{source}: bad WAN profile field {_field_of(err)}; fix it") from None
    for pair in profile.links:
        for end in (pair.src, pair.dst):
            if end not in profile.parties:
                raise ConfigError(
                    f"{source}: links: party {end!r} is not listed under 'parties'; add it"
                )
    return profile


def load_profile(path: Path | str) -> WanProfile:
    """Load and validate a WAN profile YAML file.

    Raises
    ------
    ConfigError
        If the file is missing, too large, not YAML, or has a bad field (named in the message).
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > SHAPING_MAX_PROFILE_BYTES:
            raise ConfigError(
                f"{p}: WAN profile is {size} bytes, more than SHAPING_MAX_PROFILE_BYTES "
                f"({SHAPING_MAX_PROFILE_BYTES})"
            )
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(
            f"{p}: cannot read the WAN profile ({err.strerror}); check the path"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: WAN profile is not valid YAML ({err}); fix the syntax") from None
    return parse_profile(data, source=str(p))


class Shaper:
    """The buckets and delays of one party's links under a :class:`WanProfile`.

    Parameters
    ----------
    profile : WanProfile
    party_id : str
        Whose end this is.
    burst : int, optional
        Depth of every bucket in bytes.
    clock : callable, optional
        Monotonic clock for the buckets.

    Notes
    -----
    The sending side paces with :meth:`send_bucket_chain` (its uplink and the pair cap), the
    receiving side with its downlink (:meth:`recv_bucket`). Pacing at the receiver happens as
    chunks are consumed, so TCP/HTTP-2 flow control pushes back on the sender.
    """

    def __init__(
        self,
        profile: WanProfile,
        party_id: str,
        *,
        burst: int = SHAPING_BURST_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profile = profile
        self.party_id = party_id
        self._burst = burst
        self._clock = clock
        own = profile.link(party_id)
        self.up = None if own.up_bps is None else TokenBucket(own.up_bps, burst, clock)
        self.down = None if own.down_bps is None else TokenBucket(own.down_bps, burst, clock)
        self._pairs: dict[str, TokenBucket | None] = {}

    def delay_to(self, peer: str) -> float:
        """One-way propagation delay to ``peer`` in seconds."""
        return self.profile.one_way_s(self.party_id, peer)

    def _pair(self, peer: str) -> TokenBucket | None:
        if peer not in self._pairs:
            cap = self.profile.pair_cap_bps(self.party_id, peer)
            self._pairs[peer] = None if cap is None else TokenBucket(cap, self._burst, self._clock)
        return self._pairs[peer]

    async def pace_send(self, peer: str, nbytes: int) -> None:
        """Wait until ``nbytes`` may leave toward ``peer`` (uplink, then the pair cap)."""
        waits = [b.take(nbytes) for b in (self.up, self._pair(peer)) if b is not None]
        if waits and max(waits) > 0:
            await asyncio.sleep(max(waits))

    async def pace_recv(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be taken in through the downlink."""
        if self.down is not None:
            await self.down.acquire(nbytes)
