"""The nemesis: crashes, restarts, partitions, message faults and forged envelopes.

Every action works on a :class:`~chaos_flwr.sim.runner.Simulation` and is deterministic: any
random choice draws from the simulation engine's single RNG.

- ``crash(p)``: the peer stops (no ticks, nothing delivered to it, its in-flight messages to
  others still arrive, as on a real network).
- ``restart(p, disk=True)``: a new :class:`~chaos_flwr.peer.Peer` for the same identity with a
  higher incarnation that keeps the records it held (its durable state), then asks to rejoin.
  ``disk=False``: a fresh peer (no records) with a higher incarnation, a new joiner.
- ``partition(group)`` / ``heal()``: two sides that cannot reach each other, and back.
- ``faults(...)``: drop / duplicate / reorder (random extra delay) / fixed delay rates.
- ``forge(p, count)``: send ``p`` envelopes that must be refused (a garbled copy of a real
  envelope, a truncated one, one sealed by an identity outside the charter, and a validly sealed
  envelope carrying a link record that lacks the other end's signature). Each is checked at
  delivery: it must appear in ``p``'s rejections and leave ``p``'s records and view unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..identity import Identity
from ..membership import Record, link_body
from ..wire import seal
from .network import Faults
from .world import NemesisWorld

__all__ = ["FORGE_KINDS", "ForgeCheck", "Nemesis"]

FORGE_KINDS = ("garbled", "truncated", "unknown_sender", "unsigned_record")


@dataclass(frozen=True)
class ForgeCheck:
    """Outcome of one forged envelope at delivery."""

    target: str
    kind: str
    at: float
    rejected: bool
    unchanged: bool
    error: str


class Nemesis:
    """Fault injector bound to one simulation."""

    def __init__(self, sim: NemesisWorld) -> None:
        self.sim = sim
        self._forged: dict[bytes, str] = {}
        self.checks: list[ForgeCheck] = []
        self._made = 0
        self._mallory = Identity.from_seed(b"sim-nemesis-mallory", name="mallory")

    # --- parties -----------------------------------------------------------------------------

    def crash(self, pid: str) -> None:
        """Stop ``pid``: no ticks, no deliveries."""
        self.sim.net.crashed.add(pid)
        self.sim.generation[pid] = self.sim.generation.get(pid, 0) + 1
        if self.sim.trainer is not None:
            self.sim.trainer.on_crash(pid)

    def restart(self, pid: str, *, disk: bool) -> None:
        """Bring ``pid`` back (same identity, higher incarnation), with or without its records."""
        self.sim.restart_peer(pid, disk=disk)

    # --- network -----------------------------------------------------------------------------

    def partition(self, group: list[str]) -> None:
        """Cut ``group`` off from every other party."""
        self.sim.net.partition(group)

    def heal(self) -> None:
        """Remove the partition."""
        self.sim.net.heal()

    def faults(self, faults: Faults) -> None:
        """Put message faults in force (zero rates turn them off)."""
        self.sim.net.faults = faults

    # --- forged envelopes --------------------------------------------------------------------

    def forge(self, target: str, count: int) -> None:
        """Send ``count`` envelopes to ``target`` that it must refuse (kinds in turn)."""
        sim = self.sim
        for _ in range(count):
            kind = FORGE_KINDS[self._made % len(FORGE_KINDS)]
            self._made += 1
            src, data = self._make(kind, target)
            if data is None:
                continue
            self._forged[data] = kind
            sim.net.send(src, target, data)

    def is_forged(self, data: bytes) -> str | None:
        """The forge kind of ``data``, or ``None`` for genuine traffic."""
        return self._forged.get(data) if self._forged else None

    def check_delivery(self, peer: Any, data: bytes, kind: str, now: float) -> None:
        """Deliver a forged envelope to ``peer`` and record whether it was refused harmlessly."""
        before = (peer.records.digest(), peer.view().digest, len(peer.applied))
        last = peer.rejections[-1] if peer.rejections else None
        out = peer.handle(data, now)
        after = (peer.records.digest(), peer.view().digest, len(peer.applied))
        newest = peer.rejections[-1] if peer.rejections else None
        rejected = newest is not None and newest is not last and not out
        self.checks.append(
            ForgeCheck(
                target=peer.party_id,
                kind=kind,
                at=now,
                rejected=rejected,
                unchanged=before == after,
                error=type(newest.error).__name__ if rejected and newest is not None else "",
            )
        )
        self.sim.net.note(f"forge {kind} {peer.party_id[:12]} {rejected} {before == after}")

    def _make(self, kind: str, target: str) -> tuple[str, bytes | None]:
        sim = self.sim
        rng = sim.engine.rng
        now = sim.engine.now
        others = [p for p in sim.live() if p != target and sim.net.reachable(p, target)]
        src = others[rng.randrange(len(others))] if others else target
        if kind in ("garbled", "truncated"):
            real = sim.last_delivered.get(target)
            if real is None or len(real) < 8:
                kind = "unknown_sender"
            elif kind == "garbled":
                pos = rng.randrange(len(real))
                flipped = bytearray(real)
                flipped[pos] ^= 1 + rng.randrange(255)
                return src, bytes(flipped)
            else:
                return src, real[: len(real) // 2]
        if kind == "unknown_sender":
            data = seal(
                self._mallory,
                incarnation=0,
                seq=1 + rng.randrange(1 << 30),
                timestamp=now,
                kind="rec",
                payload={"records": []},
                to=target,
            )
            return src, data
        # unsigned_record: a genuine envelope from a member carrying a link_up record that
        # lacks the other end's signature (the charter requires both ends).
        if src == target or src not in sim.peers:
            return src, None
        sender = sim.peers[src]
        third = [p for p in sorted(sim.pids) if p not in (src, target)]
        other = third[rng.randrange(len(third))] if third else target
        body = link_body(
            "link_up", sender.policy.federation, (src, sender.incarnation), (other, 0), 10**6
        )
        record = Record.sign(body, [sim.identities[src]])
        data = seal(
            sim.identities[src],
            incarnation=sender.incarnation,
            seq=(1 << 40) + rng.randrange(1 << 30),
            timestamp=now,
            kind="rec",
            payload={"records": [record.to_wire()]},
            to=target,
            federation=sender.federation_tag,
        )
        return src, data
