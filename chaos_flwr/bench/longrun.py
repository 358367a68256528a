"""``chaos-flwr bench long-run``: whether a party's costs stay flat as its federation ages.

A federation of signed :class:`~chaos_flwr.flower.client.Party` objects (the ClientApp
runtime, each with its state directory, replica store and sealed ``party.state``) is driven in
this process through the ServerApp's :class:`~chaos_flwr.flower.relay.Relay`, one certify
message per party per round, as the Flower engines would deliver them: the message carries the
envelopes queued for the party, the new round's state and the previous round's receipts; the
party handles it and saves its state before its reply is read. Parties are built, and rebuilt,
by :func:`~chaos_flwr.flower.client.factory.default_party_factory` from key and charter files.

Soak
----
``rounds`` rounds and ``events`` membership events spread evenly over them: link flaps (a
link_down, then its link_up), leaves and rejoins (the leave marker removed, a real restart,
a sponsored join) and crashes and restarts (the party gets no message for
``LONGRUN_BENCH_AWAY_ROUNDS`` rounds, then restarts without its process: fresh incarnation).
The founders never leave nor crash. Along the way ``samples`` samples are taken: the mean size
of the saved party states, this process's RSS, the median time of the messages since the last
sample (handle + save), the time to rebuild a founder from its saved state (the deployment
engine does that for every message; the rebuilt party then carries on), the records and
ledger rounds a founder holds. The slopes are least-squares fits per 1,000 rounds and per
1,000 events.

Flood
-----
``--flood K``: a non-founder member mints ``K`` valid link_down records (its own signature,
rising epochs) and pushes them at the honest parties with its replies. The quiet run and the
flooded run each run in a fresh process (so their RSS compares); the report gives the honest
parties' median per-message time, RSS growth (the whole process: the relay's queues and the
minted envelopes too; the honest peers' signature-cache entries and logged rejections are listed
beside it) and saved-state size in both and their ratios, how many flood records the honest
parties refused (all they do not hold), and whom they name (``Peer.refused_by`` where the peer
has it).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos_flwr.bench.settings import (
    LONGRUN_BENCH_AWAY_ROUNDS,
    LONGRUN_BENCH_EVENTS,
    LONGRUN_BENCH_FAILURE_QUORUM,
    LONGRUN_BENCH_FLOOD_BATCH,
    LONGRUN_BENCH_FLOOD_TAIL_ROUNDS,
    LONGRUN_BENCH_FLOOD_WARMUP_ROUNDS,
    LONGRUN_BENCH_FOUNDERS,
    LONGRUN_BENCH_HEARTBEAT_S,
    LONGRUN_BENCH_MAX_SECONDS,
    LONGRUN_BENCH_PARTIES,
    LONGRUN_BENCH_ROUND_S,
    LONGRUN_BENCH_ROUNDS,
    LONGRUN_BENCH_SAMPLES,
    LONGRUN_BENCH_SEED,
    LONGRUN_BENCH_STATE_FLOATS,
    LONGRUN_BENCH_SUSPICION_S,
)

__all__ = ["LongRunSettings", "least_squares_slope", "run_long_run"]

Progress = Callable[[str], None]
#: Event kinds in the order the soak tries them (the first feasible one from a rotating start).
_EVENT_KINDS = ("link_down", "link_up", "leave", "rejoin", "crash", "restart")
_PER = 1000.0  # slopes are per this many rounds / events


@dataclass(frozen=True)
class LongRunSettings:
    """What ``chaos-flwr bench long-run`` drives (defaults in :mod:`chaos_flwr.bench.settings`).

    Attributes
    ----------
    rounds, events:
        Rounds of the soak and membership events spread over them.
    flood:
        Records the flooder mints (0: no flood part).
    parties, samples, seed:
        Federation size (``LONGRUN_BENCH_FOUNDERS`` founders), samples along the soak, seed.
    max_seconds:
        The soak's wall-time budget: past it the soak stops at the round reached
        (``stopped_early`` in the JSON; its last sample is taken there).
    """

    rounds: int = LONGRUN_BENCH_ROUNDS
    events: int = LONGRUN_BENCH_EVENTS
    flood: int = 0
    parties: int = LONGRUN_BENCH_PARTIES
    samples: int = LONGRUN_BENCH_SAMPLES
    seed: int = LONGRUN_BENCH_SEED
    max_seconds: float = LONGRUN_BENCH_MAX_SECONDS

    def __post_init__(self) -> None:
        for name in ("rounds", "events", "flood", "samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"long-run '{name}' must be an integer >= 0, got {value!r}")
        if not self.max_seconds > 0:
            raise ValueError(f"long-run 'max_seconds' must be > 0, got {self.max_seconds!r}")
        if self.parties < LONGRUN_BENCH_FOUNDERS + 1:
            raise ValueError(
                f"long-run 'parties' must be >= {LONGRUN_BENCH_FOUNDERS + 1} (founders + a mover)"
            )


def least_squares_slope(xs: list[float], ys: list[float]) -> float | None:
    """Slope of the least-squares line through ``(xs, ys)`` (``None`` with < 2 distinct xs)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def _rss_kib() -> int:
    """This process's resident set size in KiB (``/proc``; else the peak from getrusage)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") // 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


class _Federation:
    """Signed parties, their state directories and the relay between them (this process)."""

    def __init__(self, root: Path, n: int, seed: int) -> None:
        from flwr.app import Context, RecordDict

        from chaos_flwr.charter import Charter
        from chaos_flwr.flower.client.settings import NODE_CHARTER, NODE_KEY, NODE_STATE_DIR
        from chaos_flwr.flower.relay import Relay
        from chaos_flwr.identity import Identity

        ids = [Identity.from_seed(f"bench-long-run-{seed}-{i}", name=f"p{i}") for i in range(n)]
        founders = ids[:LONGRUN_BENCH_FOUNDERS]
        charter = Charter.create(
            "bench-long-run",
            founders,
            ids[LONGRUN_BENCH_FOUNDERS:],
            sponsors_required=1,
            failure_quorum=LONGRUN_BENCH_FAILURE_QUORUM,
            heartbeat_interval_s=LONGRUN_BENCH_HEARTBEAT_S,
            suspicion_timeout_s=LONGRUN_BENCH_SUSPICION_S,
        )
        charter_path = charter.save(root / "charter.json")
        self.pids = [str(i.party_id) for i in ids]
        self.founders = self.pids[:LONGRUN_BENCH_FOUNDERS]
        self.identities = dict(zip(self.pids, ids, strict=True))
        self.contexts: dict[str, Any] = {}
        for node, (pid, ident) in enumerate(zip(self.pids, ids, strict=True), start=1):
            key = ident.save(root / "keys")
            config: dict[str, bool | float | int | str] = {
                NODE_KEY: str(key),
                NODE_CHARTER: str(charter_path),
                NODE_STATE_DIR: str(root / f"state-{node}"),
            }
            self.contexts[pid] = Context(
                run_id=1, node_id=node, node_config=config, state=RecordDict(), run_config={}
            )
        self.relay = Relay()
        self.now = time.time()
        self.parties: dict[str, Any] = {}
        self.down: set[str] = set()  # crashed: no message reaches them
        self.receipts: list[bytes] = []
        self._next: list[bytes] = []
        for pid in self.pids:
            self.build(pid)

    # -- parties --------------------------------------------------------------------------------
    def build(self, pid: str, *, restart: bool = False) -> float:
        """(Re)build ``pid`` from its files and saved state; returns the seconds it took."""
        from chaos_flwr.flower.client.factory import default_party_factory
        from chaos_flwr.flower.client.registry import forget_party

        ctx = self.contexts[pid]
        if restart:
            forget_party(ctx)
        t0 = time.perf_counter()
        party = default_party_factory(ctx)
        took = time.perf_counter() - t0
        party.clock = self.clock
        self.parties[pid] = party
        return took

    def clock(self) -> float:
        """The parties' virtual clock."""
        return self.now

    def state_dir(self, pid: str) -> Path:
        """The state directory of ``pid``."""
        from chaos_flwr.flower.client.settings import NODE_STATE_DIR

        return Path(self.contexts[pid].node_config[NODE_STATE_DIR])

    def state_bytes(self, pids: list[str]) -> float:
        """Mean size of the saved ``party.state`` files of ``pids``."""
        from chaos_flwr.flower.durable import STATE_FILE

        sizes = []
        for pid in pids:
            with contextlib.suppress(OSError):
                sizes.append((self.state_dir(pid) / STATE_FILE).stat().st_size)
        return statistics.fmean(sizes) if sizes else 0.0

    def active(self) -> list[str]:
        """Party ids the first founder's view lists as active."""
        peer = self.parties[self.founders[0]].peer
        return sorted(peer.view().active())

    def member(self, pid: str) -> bool:
        """Whether ``pid`` is an active member at its current incarnation (its own view)."""
        party = self.parties[pid]
        return bool(getattr(party.peer, "is_member", False)) and not party.left

    # -- messages -------------------------------------------------------------------------------
    def message(self, pid: str, rnd: int, arrays: Any) -> float:
        """One certify message to ``pid``: returns the seconds it took to handle and save."""
        from chaos_flwr.flower.schema import server_record

        node = self.contexts[pid].node_id
        self.relay.bind(pid, node)
        record = server_record(self.relay.take(node), phase="certify", server_round=rnd)
        if self.receipts:
            record["receipts"] = list(self.receipts)
        party = self.parties[pid]
        if not self.member(pid):
            record["members"] = self.active()
        t0 = time.perf_counter()
        reply = party.process(record, arrays)
        party.persist()
        took = time.perf_counter() - t0
        self.relay.absorb(node, reply)
        blob, got, digest = (
            reply.get("receipt"),
            reply.get("receipt-round"),
            reply["receipt-digest"],
        )
        if blob and got == rnd:
            from chaos_flwr.receipts import Receipt

            self._next.append(Receipt.from_flower(pid, rnd, bytes(digest), bytes(blob)).encode())
        return took

    def round(self, rnd: int, skip: frozenset[str] = frozenset()) -> dict[str, float]:
        """Deliver round ``rnd`` to every party that is up; message seconds per party."""
        import numpy as np
        from flwr.app import Array, ArrayRecord

        self.now += LONGRUN_BENCH_ROUND_S
        values = np.full(LONGRUN_BENCH_STATE_FLOATS, float(rnd), dtype=np.float32)
        arrays = ArrayRecord({"w": Array(values)})
        self._next = []
        times = {}
        for pid in self.pids:
            if pid not in self.down and pid not in skip:
                times[pid] = self.message(pid, rnd, arrays)
        self.receipts = self._next
        return times


@dataclass
class _Soak:
    """The soak's event driver: which event comes next and the state of the movers."""

    fed: _Federation
    rng: random.Random
    away: dict[str, tuple[str, int]] = field(default_factory=dict)  # pid -> (why, since round)
    downed: list[tuple[str, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    turn: int = 0

    def movers(self) -> list[str]:
        return [p for p in self.fed.pids[LONGRUN_BENCH_FOUNDERS:] if p not in self.away]

    def _try(self, kind: str, rnd: int) -> bool:
        fed = self.fed
        if kind == "link_down":
            pairs = self._up_links()
            if not pairs:
                return False
            a, b = self.rng.choice(pairs)
            fed.parties[a].disconnect(b)
            self.downed.append((a, b))
        elif kind == "link_up":
            ready = [(a, b) for a, b in self.downed if fed.member(a) and fed.member(b)]
            if not ready:
                return False
            a, b = ready[0]
            self.downed.remove((a, b))
            fed.parties[a].connect(b)
        elif kind in ("leave", "crash"):
            movers = [p for p in self.movers() if fed.member(p)]
            if not movers:
                return False
            pid = self.rng.choice(movers)
            if kind == "leave":
                fed.parties[pid].leave()
            else:
                fed.down.add(pid)
            self.away[pid] = (kind, rnd)
        else:
            return self._come_back("leave" if kind == "rejoin" else "crash", rnd)
        return True

    def _come_back(self, why: str, rnd: int) -> bool:
        from chaos_flwr.flower.client.settings import LEFT_MARKER

        due = [p for p, (w, since) in self.away.items() if w == why]
        due = [p for p in due if rnd - self.away[p][1] >= LONGRUN_BENCH_AWAY_ROUNDS]
        if not due:
            return False
        pid = due[0]
        with contextlib.suppress(FileNotFoundError):
            (self.fed.state_dir(pid) / LEFT_MARKER).unlink()
        self.fed.down.discard(pid)
        self.fed.build(pid, restart=True)
        del self.away[pid]
        self.downed = [(a, b) for a, b in self.downed if pid not in (a, b)]
        return True

    def _up_links(self) -> list[tuple[str, str]]:
        fed = self.fed
        live = [p for p in fed.pids if p not in self.away and fed.member(p)]
        records = fed.parties[fed.founders[0]].peer.records
        out = []
        for i, a in enumerate(live):
            for b in live[i + 1 :]:
                link = records.link(a, b)
                mine = fed.parties[a].peer.records.link(a, b)
                if link is not None and link.live and mine is not None and mine.live:
                    out.append((a, b))
        return out

    def event(self, rnd: int) -> str | None:
        """Trigger the next feasible event (rotating over the kinds); its kind, or ``None``."""
        from chaos_flwr.errors import ChaosError

        for i in range(len(_EVENT_KINDS)):
            kind = _EVENT_KINDS[(self.turn + i) % len(_EVENT_KINDS)]
            try:
                done = self._try(kind, rnd)
            except ChaosError:
                done = False
            if done:
                self.turn = (self.turn + i + 1) % len(_EVENT_KINDS)
                self.counts[kind] = self.counts.get(kind, 0) + 1
                return kind
        return None


def _sample(fed: _Federation, rnd: int, events: int, times: list[float], k: int) -> dict[str, Any]:
    founder = fed.founders[k % len(fed.founders)]
    rebuild_s = fed.build(founder)  # the same life, from its saved state (as every message)
    party = fed.parties[founder]
    ledger = getattr(party, "_ledger", None)
    return {
        "round": rnd,
        "events": events,
        "state_bytes": round(fed.state_bytes(fed.pids)),
        "rss_kib": _rss_kib(),
        "message_ms": round(statistics.median(times) * 1e3, 3) if times else None,
        "rebuild_ms": round(rebuild_s * 1e3, 3),
        "records": len(getattr(party.peer, "records", ())),
        "ledger_rounds": len(ledger.rounds()) if ledger is not None else 0,
        "active": len(fed.active()),
    }


def _slopes(samples: list[dict[str, Any]], x: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for y in ("state_bytes", "rss_kib", "message_ms", "rebuild_ms", "records"):
        pts = [(float(s[x]), float(s[y])) for s in samples if s[y] is not None]
        slope = least_squares_slope([p[0] for p in pts], [p[1] for p in pts])
        out[y] = None if slope is None else round(slope * _PER, 4)
    return out


def _soak(settings: LongRunSettings, progress: Progress | None) -> dict[str, Any]:
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chaos-long-run-") as tmp:
        fed = _Federation(Path(tmp), settings.parties, settings.seed)
        soak = _Soak(fed, random.Random(settings.seed))
        every = max(1, settings.rounds // max(1, settings.samples))
        samples: list[dict[str, Any]] = []
        times: list[float] = []
        events = 0
        stopped = False
        for rnd in range(settings.rounds):
            due = (rnd + 1) * settings.events // max(1, settings.rounds)
            due -= rnd * settings.events // max(1, settings.rounds)
            for _ in range(due):
                events += soak.event(rnd) is not None
            times.extend(fed.round(rnd).values())
            late = time.perf_counter() - t_start > settings.max_seconds
            stopped = late and rnd + 1 < settings.rounds
            if (rnd + 1) % every == 0 or rnd + 1 == settings.rounds or stopped:
                samples.append(_sample(fed, rnd + 1, events, times, len(samples)))
                times = []
                if progress is not None:
                    s = samples[-1]
                    progress(
                        f"long-run: round {rnd + 1}/{settings.rounds}, {events} events, "
                        f"state {s['state_bytes']} B, rss {s['rss_kib']} KiB, message "
                        f"{s['message_ms']} ms, rebuild {s['rebuild_ms']} ms"
                    )
            if stopped:
                break
        return {
            "rounds": samples[-1]["round"] if samples else 0,
            "rounds_asked": settings.rounds,
            "stopped_early": stopped,
            "events_asked": settings.events,
            "events": events,
            "events_by_kind": dict(sorted(soak.counts.items())),
            "parties": settings.parties,
            "seconds": round(time.perf_counter() - t_start, 2),
            "slopes_per_1000_rounds": _slopes(samples, "round"),
            "slopes_per_1000_events": _slopes(samples, "events") if events else {},
            "samples": samples,
        }


# -- flood ------------------------------------------------------------------------------------
def _mint(fed: _Federation, flooder: str, victim: str, epoch: int, count: int) -> list[Any]:
    """``count`` valid link_down records of the flooder (rising epochs), as its envelopes."""
    from chaos_flwr.membership import link_body

    party = fed.parties[flooder]
    peer = party.peer
    link = peer.records.link(flooder, victim)
    inc_v = (link.inc_a if link.a == victim else link.inc_b) if link is not None else 0
    honest = [p for p in fed.pids if p != flooder]
    out: list[Any] = []
    for e in range(epoch, epoch + count):
        body = link_body(
            "link_down", peer.policy.federation, (flooder, peer.incarnation), (victim, inc_v), e
        )
        # the flooder's own signing path (one signed envelope per record, to every honest party)
        _, sent = peer._broadcast_own(honest, body, {}, fed.now)
        out.extend(sent)
    return out


def _refused_by(peer: Any) -> dict[str, int]:
    """Whom ``peer`` names as the sender of refused records (``Peer.refused_by``, if it has it)."""
    named = getattr(peer, "refused_by", None)
    if callable(named):
        named = named()
    if not isinstance(named, Mapping):
        return {}
    return {str(k): int(v) for k, v in named.items() if isinstance(v, int)}


def _flood_child(settings: LongRunSettings, quiet: bool, conn: Any) -> None:
    """One flood-mode run in a fresh process (quiet: the same rounds without the flood)."""
    try:
        conn.send(_flood_run(settings, quiet))
    finally:
        conn.close()


def _flood_run(settings: LongRunSettings, quiet: bool) -> dict[str, Any]:
    batches = -(-settings.flood // LONGRUN_BENCH_FLOOD_BATCH)
    with tempfile.TemporaryDirectory(prefix="chaos-long-run-flood-") as tmp:
        fed = _Federation(Path(tmp), settings.parties, settings.seed)
        flooder, victim = fed.pids[-1], fed.founders[0]
        honest = [p for p in fed.pids if p != flooder]
        for rnd in range(LONGRUN_BENCH_FLOOD_WARMUP_ROUNDS):
            fed.round(rnd)
        rss0 = _rss_kib()
        times: list[float] = []
        minted = 0
        link = fed.parties[flooder].peer.records.link(flooder, victim)
        epoch = (link.epoch if link is not None else 0) + 1
        first = LONGRUN_BENCH_FLOOD_WARMUP_ROUNDS
        for rnd in range(first, first + batches + LONGRUN_BENCH_FLOOD_TAIL_ROUNDS):
            if not quiet and minted < settings.flood:
                count = min(LONGRUN_BENCH_FLOOD_BATCH, settings.flood - minted)
                for o in _mint(fed, flooder, victim, epoch + minted, count):
                    fed.relay.enqueue(o.to, o.data, sender=flooder)
                minted += count
            took = fed.round(rnd)
            times.extend(took[p] for p in honest if p in took)
        held = [len(fed.parties[p].peer.records) for p in honest]
        # what the honest peers retain besides records (bounded logs and caches): RSS also
        # counts this process's relay queues and the flooder's minted envelopes
        cached = [len(getattr(fed.parties[p].peer.records.cache, "_seen", ())) for p in honest]
        logged = [len(getattr(fed.parties[p].peer, "rejections", ())) for p in honest]
        named: dict[str, int] = {}
        for p in honest:
            for who, n in _refused_by(fed.parties[p].peer).items():
                named[who] = named.get(who, 0) + n
        return {
            "minted": minted,
            "message_ms": round(statistics.median(times) * 1e3, 3),
            "message_p99_ms": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1e3, 3),
            "rss_growth_kib": _rss_kib() - rss0,
            "state_bytes": round(fed.state_bytes(honest)),
            "records_held": held,
            "signature_cache_entries": cached,
            "rejections_logged": logged,
            "flooder": flooder,
            "named": named,
            "relay_dropped": fed.relay.dropped,
        }


def _in_child(settings: LongRunSettings, quiet: bool) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_flood_child, args=(settings, quiet, child))
    proc.start()
    child.close()
    try:
        result: dict[str, Any] = parent.recv()
    finally:
        proc.join()
    return result


def _flood(settings: LongRunSettings, progress: Progress | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    if progress is not None:
        progress("long-run: flood: the quiet run")
    quiet = _in_child(settings, True)
    if progress is not None:
        progress(f"long-run: flood: {settings.flood} minted records")
    flood = _in_child(settings, False)
    base_records = min(quiet["records_held"])
    refused = sum(max(0, flood["minted"] - (n - base_records)) for n in flood["records_held"])

    def ratio(key: str) -> float | None:
        return round(flood[key] / quiet[key], 3) if quiet[key] else None

    return {
        "records": settings.flood,
        "seconds": round(time.perf_counter() - t0, 2),
        "quiet": quiet,
        "flooded": flood,
        "message_ratio": ratio("message_ms"),
        "rss_growth_ratio": ratio("rss_growth_kib"),
        "state_ratio": ratio("state_bytes"),
        "refused": refused,
        "refused_of_delivered": round(refused / (flood["minted"] * len(flood["records_held"])), 4)
        if flood["minted"]
        else None,
        "flooder": flood["flooder"],
        "named_by_peers": flood["named"],
        "flooder_named": flood["flooder"] in flood["named"],
        "refused_by_available": bool(flood["named"]) or _has_refused_by(),
    }


def _has_refused_by() -> bool:
    from chaos_flwr.peer import Peer

    return hasattr(Peer, "refused_by")


def run_long_run(
    settings: LongRunSettings | None = None, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Run the soak (and, with ``settings.flood``, the flood comparison); the JSON figures.

    Parameters
    ----------
    settings
        Sizes (defaults: :class:`LongRunSettings`).
    progress
        Called with a line of progress now and then (the CLI prints them on stderr).

    Returns
    -------
    dict
        ``settings``, ``soak`` (slopes per 1,000 rounds and events, the samples) and, in flood
        mode, ``flood`` (quiet vs flooded figures, ratios, refused, named).
    """
    settings = settings or LongRunSettings()
    result: dict[str, Any] = {"bench": "long-run", "settings": asdict(settings)}
    result["soak"] = _soak(settings, progress) if settings.rounds else None
    if settings.flood:
        result["flood"] = _flood(settings, progress)
    return result


def plot(result: Mapping[str, Any], path: Path) -> Path | None:
    """Draw the soak's samples to ``path`` (PNG); ``None`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    soak = result.get("soak") or {}
    samples = soak.get("samples") or []
    if not samples:
        return None
    keys = ("state_bytes", "rss_kib", "message_ms", "rebuild_ms")
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True)
    xs = [s["round"] for s in samples]
    for ax, key in zip(axes, keys, strict=True):
        ax.plot(xs, [s[key] for s in samples], marker=".")
        ax.set_ylabel(key)
    axes[-1].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def to_stderr(line: str) -> None:
    """Progress printer of the CLI."""
    print(line, file=sys.stderr, flush=True)
