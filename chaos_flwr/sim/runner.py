"""Run a scenario: build the parties, play the timeline, let it settle, check the invariants.

What counts as an *event* (``events`` in the result, and events/s in ``bench sim``): every
callback the engine pops from its queue, i.e. one message delivery (genuine, duplicate or
forged), one peer tick, or one timeline action.
"""

from __future__ import annotations

import functools
import hashlib
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ..charter import Charter
from ..errors import ChaosError, ConfigError
from ..identity import Identity
from ..membership import Policy, SignatureCache, validate_record
from ..peer import Outgoing, Peer
from .engine import Engine, SimBoundError
from .nemesis import Nemesis
from .network import Faults, Network
from .scenario import Event, Scenario, load_scenario, parse_scenario
from .settings import (
    SIM_BENCH_RUNS,
    SIM_FOUNDERS,
    SIM_REJOIN_INTERVAL_S,
    SIM_SOAK_DISK_LOSS,
    SIM_SOAK_EVENTS,
    SIM_SOAK_GAP_MAX_S,
    SIM_SOAK_GAP_MIN_S,
    SIM_SOAK_LARGE_SHARE,
    SIM_SOAK_MAX_PARTIES,
    SIM_SOAK_MEDIUM_SHARE,
    SIM_SOAK_SETTLE_S,
    SIM_SOAK_TICK_INTERVAL_S,
    SIM_TRAIN_QUIESCE_S,
    SIM_TRAIN_ROUND_TIMEOUT_S,
)
from .training import Trainer
from .trainmodel import TRAIN_TAG

__all__ = ["Simulation", "bench_sim", "random_scenario", "run_scenario", "soak"]


class Simulation:
    """One simulated federation: peers, network, engine and nemesis.

    Parameters
    ----------
    scenario : Scenario
        What to build and play.
    seed : int
        Seed of the engine's RNG (the run is a pure function of scenario and seed).
    """

    def __init__(self, scenario: Scenario, seed: int) -> None:
        self.scenario = scenario
        self.seed = seed
        self.engine = Engine(
            seed, max_virtual_s=scenario.max_virtual_s, max_events=scenario.max_events
        )
        n = scenario.parties
        self.identities_list = [
            Identity.from_seed(f"chaos-sim-party-{i}".encode(), name=f"p{i}") for i in range(n)
        ]
        self.pids = [ident.party_id for ident in self.identities_list]
        self.identities = {ident.party_id: ident for ident in self.identities_list}
        founders = self.identities_list[: min(SIM_FOUNDERS, n)]
        self.founders = [f.party_id for f in founders]
        self.charter = Charter.create(
            f"sim-{scenario.name}",
            founders,
            self.identities_list[len(founders) :],
            sponsors_required=scenario.sponsors_required,
            failure_quorum=scenario.failure_quorum,
            heartbeat_interval_s=scenario.heartbeat_interval_s,
            suspicion_timeout_s=scenario.suspicion_timeout_s,
        )
        self.cache = SignatureCache()
        self.net = Network(
            self.engine,
            self._deliver,
            latency_s=scenario.latency_s,
            bandwidth_bps=scenario.bandwidth_bps,
        )
        self.nemesis = Nemesis(self)
        self.peers: dict[str, Peer] = {}
        self.generation: dict[str, int] = {}
        self.left: set[str] = set()
        self.wants: set[str] = set()  # parties that should be members (rejoin when they are not)
        self._last_join: dict[str, float] = {}
        self.last_delivered: dict[str, bytes] = {}
        self.last_sender: dict[str, str] = {}
        self.skipped: list[str] = []
        self.tick_s = scenario.tick_interval_s
        self.trainer: Trainer | None = Trainer(self) if scenario.training else None

    # --- parties -----------------------------------------------------------------------------

    def live(self) -> list[str]:
        """Parties with a running peer (not crashed), sorted."""
        return sorted(p for p in self.peers if p not in self.net.crashed)

    def _new_peer(self, pid: str, incarnation: int) -> Peer:
        peer = Peer(
            self.identities[pid], self.charter, incarnation=incarnation, signature_cache=self.cache
        )
        self.peers[pid] = peer
        self.net.crashed.discard(pid)
        gen = self.generation.get(pid, 0) + 1
        self.generation[pid] = gen
        if self.trainer is not None and pid not in self.trainer.parties:
            self.trainer.add_party(pid)
        phase = self.engine.rng.uniform(0.0, self.tick_s)
        self.engine.after(phase, lambda: self._tick(pid, gen))
        return peer

    def _sponsors(self, pid: str) -> list[str]:
        members = [p for p in self.live() if p != pid and self.peers[p].is_member]
        if not members:
            return []
        k = min(len(members), self.scenario.sponsors_required + 2)
        return sorted(self.engine.rng.sample(members, k))

    def _join(self, pid: str) -> None:
        peer = self.peers[pid]
        now = self.engine.now
        self.wants.add(pid)
        self.left.discard(pid)
        self._last_join[pid] = now
        sponsors = self._sponsors(pid)
        try:
            if not sponsors and pid in self.founders:
                out = peer.bootstrap(now)
            elif sponsors:
                out = peer.request_join(now, sponsors)
            else:
                out = []
        except ChaosError as exc:
            self.skipped.append(f"{now:g} join {pid[:12]}: {exc}")
            return
        self._send(pid, out)

    def restart_peer(self, pid: str, *, disk: bool) -> None:
        """Replace ``pid``'s peer by a new one (higher incarnation), with or without its records."""
        old = self.peers.get(pid)
        if old is None or pid not in self.net.crashed:
            self.skipped.append(f"{self.engine.now:g} restart {pid[:12]}: not crashed")
            return
        peer = self._new_peer(pid, old.incarnation + 1)
        if disk:
            for record in old.records:
                peer.records.add(record, validated=True)
        if self.trainer is not None:
            self.trainer.on_restart(pid, disk=disk)
        if pid in self.wants:
            self._join(pid)

    # --- traffic -----------------------------------------------------------------------------

    def _send(self, src: str, out: Sequence[Outgoing]) -> None:
        send = self.net.send
        for o in out:
            send(src, o.to, o.data)

    def _deliver(self, src: str, dst: str, data: bytes) -> None:
        if self.trainer is not None and data[:16] == TRAIN_TAG:
            self.trainer.deliver(src, dst, data)
            return
        peer = self.peers.get(dst)
        if peer is None:
            return
        now = self.engine.now
        kind = self.nemesis.is_forged(data)
        if kind is not None:
            self.nemesis.check_delivery(peer, data, kind, now)
            return
        self.last_delivered[dst] = data
        self.last_sender[dst] = src
        self._send(dst, peer.handle(data, now))

    def _tick(self, pid: str, gen: int) -> None:
        if self.generation.get(pid) != gen or pid in self.net.crashed:
            return
        peer = self.peers[pid]
        now = self.engine.now
        self._send(pid, peer.tick(now))
        if (
            pid in self.wants
            and not peer.is_member
            and now - self._last_join.get(pid, -1e18) >= SIM_REJOIN_INTERVAL_S
        ):
            self._join(pid)
        self.engine.after(self.tick_s, lambda: self._tick(pid, gen))

    # --- timeline ----------------------------------------------------------------------------

    def _act(self, ev: Event) -> None:
        now = self.engine.now
        p = self.pids[ev.party] if ev.party is not None else ""
        self.net.note(f"act {now!r} {ev.action} {ev.party} {ev.a} {ev.b}")
        try:
            if ev.action == "join":
                if p not in self.peers:
                    self._new_peer(p, 0)
                if p in self.net.crashed:
                    raise ChaosError("party is crashed")
                self._join(p)
            elif ev.action == "leave":
                if p not in self.peers or p in self.net.crashed:
                    raise ChaosError("party is not running")
                self.wants.discard(p)
                self.left.add(p)
                self._send(p, self.peers[p].leave(now))
                if self.trainer is not None:
                    self.trainer.note_holder_gap(f"leave {p[:12]}")
            elif ev.action in ("link_up", "link_down"):
                assert ev.a is not None and ev.b is not None
                a, b = self.pids[ev.a], self.pids[ev.b]
                if a not in self.peers or a in self.net.crashed:
                    raise ChaosError("party a is not running")
                peer = self.peers[a]
                out = peer.connect(b, now) if ev.action == "link_up" else peer.disconnect(b, now)
                self._send(a, out)
            elif ev.action == "crash":
                self.nemesis.crash(p)
            elif ev.action == "restart":
                self.nemesis.restart(p, disk=ev.disk)
            elif ev.action == "partition":
                self.nemesis.partition([self.pids[i] for i in ev.group or []])
            elif ev.action == "heal":
                self.nemesis.heal()
            elif ev.action == "faults":
                self.nemesis.faults(
                    Faults(ev.drop, ev.duplicate, ev.reorder, ev.reorder_max_s, ev.delay_s)
                )
            elif ev.action == "forge":
                if p not in self.peers:
                    raise ChaosError("party has no peer")
                self.nemesis.forge(p, ev.count)
            elif ev.action == "flap":
                assert ev.a is not None and ev.b is not None
                a, b = self.pids[ev.a], self.pids[ev.b]
                self.net.cut(a, b)
                self.engine.after(ev.down_s, functools.partial(self.net.restore, a, b))
            elif ev.action in ("relay_restart", "equivocate", "crash_donor"):
                self._act_training(ev)
        except ChaosError as exc:
            self.skipped.append(f"{now:g} {ev.action} {ev.party}: {exc}")

    def _act_training(self, ev: Event) -> None:
        tr = self.trainer
        if tr is None:
            raise ChaosError("the scenario has no training (training: true)")
        if ev.action == "relay_restart":
            tr.restart_relay(ev.down_s)
        elif ev.action == "equivocate":
            tr.equivocate_next = True
        else:
            tr.arm_donor_kill(ev.down_s, ev.disk)

    def kill(self, pid: str, down_s: float, *, disk: bool) -> None:
        """Crash ``pid`` now and restart it ``down_s`` later (with or without its disk)."""
        if pid in self.net.crashed:
            return
        self.net.note(f"kill {self.engine.now!r} {pid[:12]}")
        self.nemesis.crash(pid)
        self.engine.after(down_s, functools.partial(self.nemesis.restart, pid, disk=disk))

    # --- the run -----------------------------------------------------------------------------

    def setup(self) -> None:
        """Create the initial peers and schedule the founders, initial joins and the timeline."""
        sc = self.scenario
        eng = self.engine
        for i in range(sc.members_at_start):
            pid = self.pids[i]
            self._new_peer(pid, 0)
        for pid in self.founders:
            if self.pids.index(pid) < sc.members_at_start:
                self.wants.add(pid)
                self._last_join[pid] = 0.0
                self._send(pid, self.peers[pid].bootstrap(0.0))
        for i in range(len(self.founders), sc.members_at_start):
            pid = self.pids[i]
            eng.at(0.5 + eng.rng.uniform(0.0, 1.0), functools.partial(self._join, pid))
        for ev in sorted(sc.events, key=lambda e: e.at):
            eng.at(ev.at, functools.partial(self._act, ev))
        if self.trainer is not None:
            end = sc.last_event_at + sc.settle_s
            stop = max(sc.last_event_at, end - SIM_TRAIN_QUIESCE_S)
            first = stop + SIM_TRAIN_ROUND_TIMEOUT_S + 0.5
            self.trainer.start()
            self.trainer.quiesce(stop, [first, first + 2.0])

    def run(self) -> dict[str, Any]:
        """Play the scenario, settle, check the invariants; return a JSON-able result."""
        self.setup()
        return self.run_rest()

    def run_rest(self) -> dict[str, Any]:
        """After :meth:`setup` (and possibly a partial ``engine.run``): finish and check."""
        sc = self.scenario
        eng = self.engine
        end = sc.last_event_at + sc.settle_s
        bound: str | None = None
        try:
            eng.run(end)
        except SimBoundError as exc:
            bound = str(exc)
        invariants = {
            "converged": self._check_converged(),
            "signatures": self._check_signatures(),
            "forged_rejected": self._check_forged(),
        }
        if self.trainer is not None:
            invariants.update(self.trainer.check(self.live(), self.wants, sc.last_event_at))
        ok = bound is None and all(v["ok"] for v in invariants.values())
        for pid in self.live():
            self.net.note(f"final {pid[:12]} {self.peers[pid].view().digest.hex()}")
        return {
            "scenario": sc.name,
            "seed": self.seed,
            "parties": sc.parties,
            "ok": ok,
            "bound": bound,
            "invariants": invariants,
            "virtual_s": eng.now,
            "events": eng.events,
            "messages": {
                "sent": self.net.sent,
                "delivered": self.net.delivered,
                "dropped": self.net.dropped,
            },
            "skipped_actions": self.skipped,
            "training": dict(self.trainer.stats) if self.trainer is not None else None,
            "trace_digest": self.net.trace_digest(),
        }

    def _check_converged(self) -> dict[str, Any]:
        groups: dict[int, list[str]] = {}
        for pid in self.live():
            if pid in self.left or pid not in self.wants:
                continue
            groups.setdefault(self.net.group_of(pid), []).append(pid)
        problems: list[str] = []
        digests: dict[str, str] = {}
        for gid, members in sorted(groups.items()):
            seen: dict[str, list[str]] = {}
            for pid in members:
                peer = self.peers[pid]
                if not peer.is_member:
                    problems.append(f"{pid[:12]} is live but not an active member")
                seen.setdefault(peer.view().digest.hex(), []).append(pid[:12])
            if len(seen) > 1:
                problems.append(f"group {gid}: {len(seen)} distinct view digests {seen}")
            digests[str(gid)] = sorted(seen)[0] if len(seen) == 1 else "diverged"
        return {
            "ok": not problems,
            "detail": problems or f"{sum(map(len, groups.values()))} live parties agree",
            "groups": digests,
        }

    def _check_signatures(self) -> dict[str, Any]:
        policy = Policy.from_charter(self.charter)
        cache = SignatureCache()
        checked: set[tuple[str, tuple[tuple[str, bytes], ...]]] = set()
        bad: list[str] = []
        for pid in self.live():
            for record in self.peers[pid].records:
                key = (record.record_id, tuple(sorted(record.signatures.items())))
                if key in checked:
                    continue
                checked.add(key)
                try:
                    validate_record(record, policy, cache)
                except ChaosError as exc:
                    bad.append(f"{pid[:12]} holds {record.kind} {record.record_id[:12]}: {exc}")
        return {
            "ok": not bad,
            "detail": bad or f"{len(checked)} distinct records re-verified",
            "records": len(checked),
        }

    def _check_forged(self) -> dict[str, Any]:
        checks = self.nemesis.checks
        bad = [
            f"{c.kind} to {c.target[:12]} at {c.at:g}: "
            f"rejected={c.rejected} unchanged={c.unchanged}"
            for c in checks
            if not (c.rejected and c.unchanged)
        ]
        return {
            "ok": not bad,
            "detail": bad or f"{len(checks)} forged envelopes refused with no state change",
            "delivered": len(checks),
            "errors": sorted({c.error for c in checks}),
        }


def run_scenario(scenario: Scenario | str, seed: int) -> dict[str, Any]:
    """Run one scenario (a :class:`Scenario`, a file path or a shipped name) with ``seed``.

    Returns
    -------
    dict
        JSON-able: ``ok``, ``invariants`` (each with ``ok`` and ``detail``), ``bound`` (the
        bound that ended the run, or ``None``), ``events``, ``messages``, ``trace_digest`` and
        ``wall_s`` (measured around the run, never read inside it).
    """
    sc = load_scenario(scenario) if isinstance(scenario, str) else scenario
    t0 = time.perf_counter()
    result = Simulation(sc, seed).run()
    result["wall_s"] = time.perf_counter() - t0
    return result


def _party_count(rng: random.Random, max_parties: int) -> int:
    """5..``max_parties`` parties, mostly small: the cost of a seed grows with n^2."""
    if max_parties <= 12:
        return rng.randint(5, max_parties)
    u = rng.random()
    if u < SIM_SOAK_LARGE_SHARE:
        return rng.randint(max(13, max_parties // 2), max_parties)
    if u < SIM_SOAK_LARGE_SHARE + SIM_SOAK_MEDIUM_SHARE:
        return rng.randint(13, max(13, min(max_parties, 40)))
    return rng.randint(5, 12)


#: Event kinds of a soak schedule and their weights.
_SOAK_KINDS = [
    ("crash", 6),
    ("join", 2),
    ("leave", 2),
    ("partition", 3),
    ("flap", 4),
    ("link", 2),
    ("faults", 3),
    ("forge", 2),
    ("relay_restart", 2),
    ("equivocate", 1),
    ("crash_donor", 2),
]


class _Schedule:
    """The events of a soak schedule so far, and who is pending, crashed or left."""

    def __init__(self, rng: random.Random, n: int, pending: list[int]) -> None:
        self.rng = rng
        self.n = n
        self.pending = pending
        self.crashed_until: dict[int, float] = {}
        self.left: set[int] = set()
        self.evs: list[dict[str, Any]] = []

    def add(self, choice: str, t: float, up: list[int]) -> None:
        """Add the events of one drawn ``choice`` at ``t`` (none if it does not apply)."""
        rng, n, evs = self.rng, self.n, self.evs
        if choice == "join" and (self.pending or self.left):
            self._join(t)
        elif choice == "crash" and len(self.crashed_until) < (n - 1) // 2 and up:
            p = rng.choice(up)
            back = t + rng.uniform(0.5, 5.0)
            self.crashed_until[p] = back
            evs.append({"at": t, "action": "crash", "party": p})
            disk = rng.random() >= SIM_SOAK_DISK_LOSS
            evs.append({"at": back, "action": "restart", "party": p, "disk": disk})
        elif choice == "leave":
            cand = [i for i in up if i >= SIM_FOUNDERS and i not in self.left]
            if cand:
                p = rng.choice(cand)
                self.left.add(p)
                evs.append({"at": t, "action": "leave", "party": p})
        elif choice == "partition":
            group = sorted(rng.sample(range(n), rng.randint(1, max(1, n // 2))))
            evs.append({"at": t, "action": "partition", "group": group})
            evs.append({"at": t + rng.uniform(0.5, 4.0), "action": "heal"})
        elif choice == "flap" and len(up) >= 2:
            a, b = rng.sample(up, 2)
            evs.append({"at": t, "action": "flap", "a": a, "b": b, "down_s": rng.uniform(0.1, 1.5)})
        elif choice == "link" and len(up) >= 2:
            a, b = rng.sample(up, 2)
            evs.append({"at": t, "action": "link_up", "a": a, "b": b})
            if rng.random() < 0.5:
                evs.append({"at": t + rng.uniform(0.5, 3.0), "action": "link_down", "a": b, "b": a})
        elif choice == "faults":
            evs.append(self._faults(t))
        elif choice == "forge" and up:
            evs.append(
                {"at": t, "action": "forge", "party": rng.choice(up), "count": rng.randint(1, 4)}
            )
        elif choice == "relay_restart":
            evs.append({"at": t, "action": "relay_restart", "down_s": rng.uniform(0.2, 2.0)})
        elif choice == "equivocate":
            evs.append({"at": t, "action": "equivocate"})
        elif choice == "crash_donor":
            self._crash_donor(t, up)

    def _join(self, t: float) -> None:
        k = self.rng.randint(1, 3)  # concurrent joins at one instant
        for _ in range(k):
            if self.pending:
                j = self.pending.pop(0)
            elif self.left:
                j = min(self.left)
                self.left.discard(j)
            else:
                break
            self.evs.append({"at": t, "action": "join", "party": j})

    def _faults(self, t: float) -> dict[str, Any]:
        rng = self.rng
        if rng.random() < 0.3:
            return {"at": t, "action": "faults"}
        return {
            "at": t,
            "action": "faults",
            "drop": round(rng.uniform(0, 0.15), 3),
            "duplicate": round(rng.uniform(0, 0.15), 3),
            "reorder": round(rng.uniform(0, 0.5), 3),
            "reorder_max_s": round(rng.uniform(0, 0.5), 3),
            "delay_s": round(rng.uniform(0, 0.05), 3),
        }

    def _crash_donor(self, t: float, up: list[int]) -> None:
        # a party that lost its disk pulls at its next invitation: kill one of its donors
        rng = self.rng
        cand = [i for i in up if i not in self.crashed_until]
        if len(cand) >= 2 and len(self.crashed_until) < (self.n - 1) // 2:
            p = rng.choice(cand)
            back = t + rng.uniform(0.3, 1.5)
            self.crashed_until[p] = back
            self.evs.append({"at": t, "action": "crash", "party": p})
            self.evs.append({"at": back, "action": "restart", "party": p, "disk": False})
        self.evs.append(
            {
                "at": t,
                "action": "crash_donor",
                "down_s": rng.uniform(0.5, 3.0),
                "disk": rng.random() < 0.5,
            }
        )


def random_scenario(
    seed: int, max_parties: int = SIM_SOAK_MAX_PARTIES, events: int = SIM_SOAK_EVENTS
) -> Scenario:
    """A random Jepsen-style schedule over 5..``max_parties`` parties (a pure function of seed).

    About ``events`` timeline events: joins (some concurrent), leaves and rejoins, crashes with
    restarts with or without disk, partitions and heals, link flaps, link records, message
    drop/duplicate/reorder/delay, forged envelopes, relay restarts, relay equivocation and a
    donor dying mid transfer; it ends with faults off and the network healed. Training is on.
    """
    if max_parties < 5:
        raise ConfigError(f"'max_parties' must be >= 5, got {max_parties}")
    if events < 1:
        raise ConfigError(f"'events' must be >= 1, got {events}")
    rng = random.Random(seed)
    n = _party_count(rng, max_parties)
    initial = n - rng.randint(0, min(5, n // 4))
    sched = _Schedule(rng, n, pending=list(range(initial, n)))
    evs = sched.evs
    t = 3.0
    names = [k for k, _ in _SOAK_KINDS]
    weights = [w for _, w in _SOAK_KINDS]
    while len(evs) < events:
        t += rng.uniform(SIM_SOAK_GAP_MIN_S, SIM_SOAK_GAP_MAX_S)
        for i in [i for i, until in sched.crashed_until.items() if until <= t]:
            del sched.crashed_until[i]
        choice = rng.choices(names, weights)[0]
        up = [i for i in range(n) if i not in sched.crashed_until and i not in sched.pending]
        sched.add(choice, t, up)
    end = max(e["at"] for e in evs) + 0.5
    evs.append({"at": end, "action": "faults"})
    evs.append({"at": end, "action": "heal"})
    return parse_scenario(
        {
            "name": f"soak-{seed}",
            "parties": n,
            "initial": initial,
            "training": True,
            "settle_s": SIM_SOAK_SETTLE_S,
            "tick_interval_s": SIM_SOAK_TICK_INTERVAL_S,
            "events": evs,
        },
        f"soak seed {seed}",
    )


def _soak_one(args: tuple[int, int, int]) -> dict[str, Any]:
    """One soak seed, summarised (a top-level function, so worker processes can run it)."""
    s, max_parties, events = args
    sc = random_scenario(s, max_parties, events)
    result = run_scenario(sc, s)
    out: dict[str, Any] = {
        "seed": s,
        "parties": sc.parties,
        "schedule_events": len(sc.events),
        "actions": [ev.action for ev in sc.events],
        "events": int(result["events"]),
        "wall_s": float(result["wall_s"]),
        "training": result.get("training") or {},
        "ok": bool(result["ok"]),
        "trace_digest": result["trace_digest"],
    }
    if not result["ok"]:
        out["failure"] = {
            "seed": s,
            "parties": sc.parties,
            "bound": result["bound"],
            "invariants": {k: v["detail"] for k, v in result["invariants"].items() if not v["ok"]},
            "replay": f"chaos-flwr simulate --soak 1 --seed {s} --max-parties "
            f"{max_parties} --events {events} --json",
        }
    return out


def soak(
    runs: int,
    seed: int,
    max_parties: int = SIM_SOAK_MAX_PARTIES,
    events: int = SIM_SOAK_EVENTS,
    workers: int = 1,
) -> dict[str, Any]:
    """Run ``runs`` random schedules (seeds ``seed .. seed+runs-1``); report failures.

    Parameters
    ----------
    runs, seed
        How many schedules, and the first seed.
    max_parties, events
        Passed to :func:`random_scenario`.
    workers
        Processes to run seeds in (each seed is still a pure function of its seed; the
        report is the same for any ``workers``, except the wall times).

    Returns
    -------
    dict
        JSON-able: ``runs``, ``seeds``, ``events`` (engine events), ``schedule_events``
        (timeline actions), ``events_per_s`` (engine events per second of simulation, per
        process), ``wall_s``, ``parties`` (min / median / max), ``faults`` (injected faults by
        kind), ``training`` (summed counters), ``digest`` (over every seed's trace digest) and
        ``failures`` (each with the seed, the failing invariants and a replay command).
    """
    if runs < 0 or workers < 1:
        raise ConfigError(f"'runs' must be >= 0 and 'workers' >= 1, got {runs}, {workers}")
    t0 = time.perf_counter()
    jobs = [(s, max_parties, events) for s in range(seed, seed + runs)]
    if workers > 1 and runs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            rows = list(pool.map(_soak_one, jobs, chunksize=1))
    else:
        rows = [_soak_one(j) for j in jobs]
    faults: dict[str, int] = {}
    training: dict[str, int] = {}
    trace = hashlib.sha256()
    for row in rows:
        for action in row["actions"]:
            faults[action] = faults.get(action, 0) + 1
        for k, v in row["training"].items():
            training[k] = training.get(k, 0) + int(v)
        trace.update(row["trace_digest"].encode())
    sizes = [int(r["parties"]) for r in rows]
    total = sum(int(r["events"]) for r in rows)
    sim_s = sum(float(r["wall_s"]) for r in rows)
    return {
        "runs": runs,
        "seeds": [seed, seed + runs - 1],
        "max_parties": max_parties,
        "parties": {
            "min": min(sizes, default=0),
            "median": statistics.median(sizes) if sizes else 0,
            "max": max(sizes, default=0),
            "over_100": sum(1 for n in sizes if n > 100),
        },
        "events": total,
        "schedule_events": sum(int(r["schedule_events"]) for r in rows),
        "events_per_s": total / sim_s if sim_s > 0 else 0.0,
        "workers": workers,
        "wall_s": time.perf_counter() - t0,
        "faults": dict(sorted(faults.items())),
        "training": dict(sorted(training.items())),
        "digest": trace.hexdigest(),
        "failures": [r["failure"] for r in rows if not r["ok"]],
        "ok": all(r["ok"] for r in rows),
    }


def bench_sim(parties: int = 200, runs: int = SIM_BENCH_RUNS, seed: int = 0) -> dict[str, Any]:
    """Simulator throughput on the shipped ``scale-200`` timeline resized to ``parties``.

    An event is one engine callback: a message delivery, a peer tick or a timeline action.
    """
    base = load_scenario("scale-200")
    data = base.model_dump()
    data["parties"] = parties
    data["events"] = [
        e
        for e in data["events"]
        if all((e.get(k) is None or e.get(k) < parties) for k in ("party", "a", "b"))
    ]
    data["name"] = f"scale-{parties}"
    sc = parse_scenario(data, "bench sim")
    rows = [run_scenario(sc, seed) for _ in range(runs)]
    rates = [r["events"] / r["wall_s"] for r in rows]
    return {
        "parties": parties,
        "runs": runs,
        "event": "one engine callback: a message delivery, a peer tick or a timeline action",
        "events": rows[0]["events"],
        "deliveries": rows[0]["messages"]["delivered"],
        "virtual_s": rows[0]["virtual_s"],
        "events_per_s": statistics.median(rates),
        "events_per_s_runs": rates,
        "wall_s_runs": [r["wall_s"] for r in rows],
        "deterministic": len({r["trace_digest"] for r in rows}) == 1,
        "ok": all(r["ok"] for r in rows),
    }
