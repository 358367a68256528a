"""The puller's side of a pull, as one state machine (sans-I/O: ``now`` comes in, no I/O).

Both a joiner (on Flower: through the relay, and over direct links) and a restarted ServerApp
(resume) drive this one machine; only their carriers differ. The machine decides, a carrier
executes: every event method returns a :class:`Decision`, the carrier carries it out and feeds
the outcome back.

Stages (:class:`Stage`), and the events that move them::

    SIZE      --replies-->  MANIFEST            (sizes known: plan the shard shape, once)
    MANIFEST  --replies-->  SHARDS              (a manifest of the told shape names the digest)
    MANIFEST  --manifest->  SHARDS | MANIFEST   (one fetched over a direct link, or the relay)
    SHARDS    --replies/direct--> SHARDS | DONE (every shard verified, state hashes to digest)
    any       --error---->  FAILED

With a size hint (the ServerApp knows the size of the state it certified), the machine starts
in MANIFEST: the first holder is told the shape at once and the other holders are asked their
size (where they name their direct link) in the same step. A holder whose size differs from the
hint answers with its size instead, and the shape is planned again for it.

With a size hint *and* holders' direct addresses known before the pull (a joiner's view holds
their signed endpoints), nothing goes through the relay at first: the manifest is fetched over
the first such holder's direct link (``Decision.manifest``), then the shards are fetched over
the links, all in the carrier's first step. A direct manifest that does not come (no answer, a
refusal) is asked through the relay instead (the links still carry the shards); one that comes
but does not name the digest drops its holder, as a relayed one does.

A plan is made at most once per event: the shard *shape* when the size is known, the *shares*
per holder when the shards start (over the shape already fixed, with the rates the monitor
holds: measured on earlier transfers, else assumed). Over direct links the shares are where the
fetch starts, not where it must end: the carrier runs them as a pull queue that times every
link as it goes and moves shards from slow links to fast ones (:mod:`chaos_flwr.flower.fetch`),
and its per-link rates come back to the monitor with the results. No separate probe is taken
first: a probe's time (its slowest link's range) was idle time for every faster link.
Holders are told the shape; they never plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from chaos_flwr.defaults import PLANNER_MAX_SHARDS
from chaos_flwr.errors import ChaosError, DecodeError, ShardIntegrityError
from chaos_flwr.monitor import Monitor
from chaos_flwr.planner import Donor, TransferPlan, plan_transfer
from chaos_flwr.pull.messages import (
    ManifestReply,
    ManifestRequest,
    Reply,
    Request,
    ShardsReply,
    ShardsRequest,
    SizeReply,
    SizeRequest,
)
from chaos_flwr.state import Manifest, TrainingState
from chaos_flwr.transfer import CancelRequest, DonorStatus, PullSession, ShardRequest

__all__ = [
    "PULL_ASSUMED_BANDWIDTH_BPS",
    "PULL_DIRECT_ROUNDS_PER_DONOR",
    "PULL_MAX_STATE_BYTES",
    "PULL_REQUEST_TIMEOUT_S",
    "Decision",
    "LinkResult",
    "PullNegotiation",
    "Stage",
    "Status",
]

#: Largest training state a pull takes on (the buffer is allocated from the claimed size).
PULL_MAX_STATE_BYTES: int = 16 << 30
#: Rate assumed for a holder before anything was measured on its link (bytes/s).
PULL_ASSUMED_BANDWIDTH_BPS: float = 10e6
#: A pull over direct links cuts the state into shards of at most about this size, and at
#: least PULL_DIRECT_SHARDS_PER_DONOR per holder (shard bytes permitting): shards fine enough
#: for the fetch's pull queue to move work between links of very different rates.
PULL_DIRECT_SHARD_BYTES: int = 256 * 1024
PULL_DIRECT_SHARDS_PER_DONOR: int = 8
#: Direct fetch rounds per holder within one event (re-plans and steals between direct holders).
PULL_DIRECT_ROUNDS_PER_DONOR: int = 16
#: Floor of a shard request's timeout inside the session: the carrier's own deadline decides
#: who is lost (a relay step waits for every reply), not a local request timer.
PULL_REQUEST_TIMEOUT_S: float = 3600.0


def _direct_shards(total: int, donors: int, min_shard_bytes: int) -> int:
    """The shard count of a pull over direct links: a power of two giving shards of at most
    PULL_DIRECT_SHARD_BYTES and at least PULL_DIRECT_SHARDS_PER_DONOR shards per holder,
    within PLANNER_MAX_SHARDS and never below ``min_shard_bytes`` a shard (1 for a tiny
    state)."""
    want = max(-(-total // PULL_DIRECT_SHARD_BYTES), PULL_DIRECT_SHARDS_PER_DONOR * donors)
    k = 1
    while k < want and k < PLANNER_MAX_SHARDS and -(-total // (2 * k)) >= min_shard_bytes:
        k *= 2
    return k


class Stage(StrEnum):
    """Where a pull is (see the module docstring)."""

    SIZE = "size"
    MANIFEST = "manifest"
    SHARDS = "shards"
    DONE = "done"
    FAILED = "failed"


class Status(StrEnum):
    """What a decision asks of its carrier: more work, or the end."""

    WANT = "want"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class LinkResult:
    """What a direct link returned for one holder (the carrier measured it).

    Attributes
    ----------
    shards:
        ``(index, data, seconds since the fetch began)`` per shard received.
    nbytes, seconds:
        Bytes received and the time the link took (its rate sample).
    error:
        Why the link failed (``""``: it did not).
    """

    shards: tuple[tuple[int, bytes, float], ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Decision:
    """What the carrier does next.

    Attributes
    ----------
    status:
        ``WANT`` while work is left; ``DONE`` (the state is in
        :attr:`PullNegotiation.state`) or ``FAILED`` (:attr:`PullNegotiation.error`).
    relay:
        Holder -> request, sent through the relay; the replies come back to
        :meth:`PullNegotiation.on_replies` in one batch.
    direct:
        Holder -> ``(address, requests)``: fetch these shards over its direct link and hand the
        results to :meth:`PullNegotiation.on_direct`.
    manifest:
        Holder -> ``(address, request)`` (one holder): fetch the manifest over its direct link
        and hand it (or why not) to :meth:`PullNegotiation.on_manifest`.

    At most one of ``relay``, ``direct`` and ``manifest`` is non-empty.
    """

    status: Status
    relay: Mapping[str, Request] = field(default_factory=dict)
    direct: Mapping[str, tuple[str, tuple[ShardRequest, ...]]] = field(default_factory=dict)
    manifest: Mapping[str, tuple[str, ManifestRequest]] = field(default_factory=dict)


_FINAL = {Stage.DONE: Status.DONE, Stage.FAILED: Status.FAILED}


class PullNegotiation:
    """Pull the state certified as ``(server_round, digest)`` from ``donors`` (sans-I/O).

    Parameters
    ----------
    server_round, digest:
        The certified state.
    donors:
        Holders whose signed receipts name it (checked by the caller), in preference order.
    min_shard_bytes:
        Smallest shard of the plan.
    total_hint:
        The state's size if the caller knows it (saves a step); ``None`` asks the holders.
    rates:
        Holder -> prior rate in bytes/s (a measured estimate wins).
    direct:
        Use the direct links holders name in their replies.
    address_ok:
        Checks a named direct address (returns it normalised, raises a ChaosError to refuse).
    max_state_bytes:
        Largest state the puller takes on: a size past it (from the relay or a holder, neither
        of which the receipts bind) loses its holder before anything is allocated.
    addresses:
        Holder -> direct address known before the pull (checked with ``address_ok``): with a
        size hint, the manifest is fetched over the first one's link (module docstring); an
        address a reply names for such a holder is ignored.
    """

    def __init__(
        self,
        server_round: int,
        digest: bytes,
        donors: Sequence[str],
        *,
        min_shard_bytes: int,
        total_hint: int | None = None,
        rates: Mapping[str, float] | None = None,
        direct: bool = True,
        address_ok: Callable[[str], str] | None = None,
        max_state_bytes: int = PULL_MAX_STATE_BYTES,
        addresses: Mapping[str, str] | None = None,
    ) -> None:
        self.server_round = server_round
        self.digest = digest
        self.donors = list(dict.fromkeys(donors))
        self.min_shard_bytes = min_shard_bytes
        self.total_hint = total_hint
        self.priors = dict(rates or {})
        self.direct = direct
        self.address_ok = address_ok
        self.max_state_bytes = max_state_bytes
        self.stage = Stage.SIZE
        self.live = list(self.donors)
        self.lost: list[str] = []
        self.total: int | None = None
        self.plan: TransferPlan | None = None
        self.manifest: Manifest | None = None
        self.session: PullSession | None = None
        self.asked = ""
        self.addresses: dict[str, str] = {}
        self.direct_failed: dict[str, str] = {}
        self.received: dict[str, int] = {}
        self.direct_bytes: dict[str, int] = {}
        self.plan_rates: dict[str, float] = {}
        self.sent: dict[str, set[int]] = {}
        self.got: set[int] = set()
        self.state: TrainingState | None = None
        self.error = ""
        self.monitor = Monitor("puller", suspicion_timeout_s=1.0, heartbeat_interval_s=0.5)
        self._pending: list[ShardRequest | CancelRequest] = []
        self._owed: dict[str, tuple[ShardRequest, ...]] = {}
        self._direct_rounds = 0
        #: Why the manifest could not be had over a direct link (``""``: it could, or was not
        #: asked that way).
        self.manifest_failed = ""
        #: Holders whose address was known before the pull: one named in a reply (which the
        #: relay carries) does not replace it.
        self.known: frozenset[str] = frozenset()
        for donor, addr in (addresses or {}).items():
            if donor in self.donors:
                self._note_address(donor, addr)
        self.known = frozenset(self.addresses)

    # -- events -----------------------------------------------------------------------------
    def start(self, now: float) -> Decision:
        """The first requests: sizes, or (with a size hint) the manifest and sizes at once."""
        return self._guard(lambda: self._start(now))

    def on_replies(
        self, replies: Mapping[str, Reply | None], lost: Iterable[str], now: float
    ) -> Decision:
        """The holders' replies to the last relay requests; ``lost``: holders that did not
        answer (a ``None`` reply, or one of the wrong kind, loses its holder too)."""
        self._direct_rounds = 0
        return self._guard(lambda: self._on_replies(replies, set(lost), now))

    def on_manifest(self, donor: str, raw: bytes | None, error: str, now: float) -> Decision:
        """The manifest ``donor`` sent over its direct link (``raw``), or why there is none
        (``error``: its link is then not used again, and the relay is asked)."""
        return self._guard(lambda: self._on_direct_manifest(donor, raw, error, now))

    def on_direct(self, results: Mapping[str, LinkResult], now: float) -> Decision:
        """Shards fetched over direct links; a failed link's shards go through the relay."""
        return self._guard(lambda: self._on_direct(results, now))

    def fail(self, why: str) -> Decision:
        """End the pull as failed (the carrier gave up, e.g. out of steps)."""
        self.stage = Stage.FAILED
        self.error = why
        return Decision(Status.FAILED)

    def stats(self) -> dict[str, object]:
        """The pull's figures (plain values): plan, bytes received, losses, links, rates.

        Plan (``plan-*``: shards and bytes per holder as planned), bytes received per holder
        (``recv-*``; ``direct-bytes`` is the part of each that came over a direct link), holders
        lost, holders with a direct address and those whose link failed, and the per-holder rate
        estimates (bytes/s) the plan used (``rate-*``).
        """
        plan = self.plan
        donors = sorted(plan.assignment) if plan is not None else []
        by_donor = plan.bytes_by_donor() if plan is not None else {}
        recv = sorted(self.received)
        return {
            "total": self.total or 0,
            "shard-bytes": plan.shard_bytes if plan else 0,
            "num-shards": plan.num_shards if plan else 0,
            "plan-donors": donors,
            "plan-shards": [len(plan.assignment[d]) for d in donors] if plan else [],
            "plan-bytes": [by_donor.get(d, 0) for d in donors],
            "recv-donors": recv,
            "recv-bytes": [self.received[d] for d in recv],
            "lost": list(self.lost),
            "error": self.error,
            "direct-donors": sorted(self.addresses),
            "direct-bytes": [self.direct_bytes.get(d, 0) for d in recv],
            "direct-failed": sorted(self.direct_failed),
            "rate-donors": sorted(self.plan_rates),
            "rate-bps": [float(self.plan_rates[d]) for d in sorted(self.plan_rates)],
        }

    def rates(self) -> dict[str, float]:
        """The current rate estimate per holder (measured, else the prior)."""
        return {d: self._rate(d) for d in self.donors}

    # -- the machine ------------------------------------------------------------------------
    def _guard(self, step: Callable[[], Decision]) -> Decision:
        if self.stage in _FINAL:
            return Decision(_FINAL[self.stage])
        try:
            return step()
        except ChaosError as exc:
            return self.fail(f"{type(exc).__name__}: {exc}")

    def _rate(self, donor: str) -> float:
        measured = self.monitor.link(donor).bandwidth_bps
        if measured is not None:
            return measured
        return self.priors.get(donor, PULL_ASSUMED_BANDWIDTH_BPS)

    def _plan(self, total: int, chain: list[int] | None = None) -> TransferPlan:
        donors = [Donor(id=d, bandwidth=self._rate(d)) for d in self.live]
        if chain is None and self._usable():
            chain = [_direct_shards(total, len(donors), self.min_shard_bytes)]
        return plan_transfer(total, donors, min_shard_bytes=self.min_shard_bytes, chain=chain)

    def _lose(self, donor: str, now: float | None = None) -> None:
        if donor in self.live:
            self.live.remove(donor)
        if donor not in self.lost:
            self.lost.append(donor)
        if now is not None and self.session is not None:
            self._pending.extend(self.session.on_donor_lost(donor, now))

    def _note_address(self, donor: str, reply: Reply | str) -> None:
        addr = reply if isinstance(reply, str) else getattr(reply, "direct", "")
        if not self.direct or not addr or donor in self.known:
            return
        check = self.address_ok
        try:
            self.addresses[donor] = check(addr) if check is not None else addr
        except ChaosError as exc:
            self.direct_failed[donor] = f"{type(exc).__name__}: {exc}"

    def _start(self, now: float) -> Decision:
        if not self.live:
            return self.fail("no donor to pull from")
        hint = self.total_hint
        if hint is None or hint > self.max_state_bytes:  # no (believable) hint: ask them
            return Decision(Status.WANT, relay={d: SizeRequest() for d in self.live})
        usable = self._usable()
        first = next((d for d in self.live if d in usable), None)
        if first is None:
            return self._ask_manifest(hint, others=True)
        self.total = hint
        self.plan = self._plan(hint)
        self.stage = Stage.MANIFEST
        self.asked = first
        ask = ManifestRequest(hint, self.plan.shard_bytes, self.plan.num_shards)
        return Decision(Status.WANT, manifest={first: (usable[first], ask)})

    def _on_direct_manifest(
        self, donor: str, raw: bytes | None, error: str, now: float
    ) -> Decision:
        if self.stage != Stage.MANIFEST or donor != self.asked or self.total is None:
            raise DecodeError(f"a direct manifest from {donor} at stage {self.stage}")
        if raw is None:  # the relay is asked; the links still carry the shards
            self.manifest_failed = error or "no manifest over the direct link"
            return self._ask_manifest(self.total, others=True)
        reply = ManifestReply(self.total, raw, self.addresses.get(donor, ""))
        return self._on_manifest(reply, {}, now)

    def _ask_manifest(self, total: int, *, others: bool = False) -> Decision:
        """Plan the shard shape for ``total`` (once) and tell the first live holder."""
        if not self.live:
            return self.fail("no donor sent a manifest that names the certified digest")
        if self.plan is None or self.total != total:
            self.total = total
            self.plan = self._plan(total)
        self.stage = Stage.MANIFEST
        self.asked = self.live[0]
        ask = ManifestRequest(total, self.plan.shard_bytes, self.plan.num_shards)
        relay: dict[str, Request] = {self.asked: ask}
        if others:
            relay.update({d: SizeRequest() for d in self.live if d != self.asked})
        return Decision(Status.WANT, relay=relay)

    def _on_replies(
        self, replies: Mapping[str, Reply | None], lost: set[str], now: float
    ) -> Decision:
        known = set(self.donors)  # the relay names donors too: one it made up is ignored
        replies = {d: r for d, r in replies.items() if d in known}
        for donor in sorted(lost & known):
            self._lose(donor, now)
        if self.stage == Stage.SHARDS:
            return self._on_shard_replies(replies, now)
        sizes: dict[str, int] = {}
        for donor, reply in replies.items():
            if isinstance(reply, SizeReply | ManifestReply) and donor in self.live:
                self._note_address(donor, reply)
                sizes[donor] = reply.total
            elif donor != self.asked or self.stage == Stage.SIZE:
                self._lose(donor)
        if self.stage == Stage.SIZE:
            return self._on_sizes(sizes)
        return self._on_manifest(replies.get(self.asked), sizes, now)

    def _on_sizes(self, sizes: Mapping[str, int]) -> Decision:
        for donor in list(self.live):
            if donor not in sizes or sizes[donor] > self.max_state_bytes:
                self._lose(donor)  # silent, or a size past the bound (never allocated)
        if not self.live:
            return self.fail("no donor answered with a state size within the bound")
        return self._ask_manifest(sizes[self.live[0]])

    def _on_manifest(self, reply: Reply | None, sizes: Mapping[str, int], now: float) -> Decision:
        asked, plan, total = self.asked, self.plan, self.total
        assert plan is not None and total is not None
        if isinstance(reply, SizeReply) and asked in self.live and reply.total != total:
            if reply.total <= self.max_state_bytes:
                return self._ask_manifest(reply.total)  # the hint was wrong: plan for its size
            self._lose(asked)
            return self._ask_manifest(total)
        for donor, size in sizes.items():
            if donor != asked and size != total:
                self._lose(donor)  # it holds a state of another size
        try:
            if not isinstance(reply, ManifestReply):
                raise DecodeError("no manifest in the reply")
            manifest = Manifest.from_bytes(reply.manifest)
            manifest.check_certified(self.digest, total)
            if (manifest.shard_bytes, manifest.num_shards) != (plan.shard_bytes, plan.num_shards):
                raise DecodeError("the manifest is not of the shape asked for")
        except (ChaosError, ValueError):
            self._lose(asked)
            return self._ask_manifest(total)
        self.manifest = manifest
        return self._start_shards(now)

    def _start_shards(self, now: float) -> Decision:
        manifest, total = self.manifest, self.total
        assert manifest is not None and total is not None and self.plan is not None
        if self.addresses or set(self.plan.assignment) - set(self.live):
            # the shares, planned with the rates known now over the shape already fixed
            chain = [manifest.num_shards] if manifest.num_shards else None
            self.plan = self._plan(total, chain=chain)
        self.plan_rates = {d: self._rate(d) for d in self.live}
        donors = [Donor(id=d, bandwidth=self._rate(d)) for d in self.live]
        self.session = PullSession(
            manifest, self.plan, donors, now=now, expected_digest=self.digest,
            # one relay step carries every request: the carrier's deadline decides who is
            # lost, not a local request timer
            window=max(1, self.plan.num_shards), min_timeout_s=PULL_REQUEST_TIMEOUT_S,
        )  # fmt: skip
        self.stage = Stage.SHARDS
        self.asked = ""
        self._pending = list(self.session.poll(now))
        return self._advance(now)

    def _take(self, donor: str, shards: Iterable[tuple[int, bytes, float]]) -> set[int]:
        """Feed one holder's shards to the session; return the indices it answered."""
        session = self.session
        assert session is not None
        answered: set[int] = set()
        for index, chunk, at in shards:
            # new requests are planned once, after every holder's shards were taken (the
            # caller polls): planning after each shard would cost a scan per shard
            self._pending.extend(session.on_shard(donor, index, chunk, at, fill=False))
            if session.status(donor) == DonorStatus.BAD:
                break  # a shard failed its hash: the donor's shards are re-planned
            answered.add(index)
            if index not in self.got:  # a stolen copy that also arrived counts once
                self.got.add(index)
                self.received[donor] = self.received.get(donor, 0) + len(chunk)
        return answered

    def _on_shard_replies(self, replies: Mapping[str, Reply | None], now: float) -> Decision:
        session = self.session
        assert session is not None
        for donor, reply in replies.items():
            if not session.knows(donor):
                continue  # named at the start but lost before the shards: nothing asked of it
            if not isinstance(reply, ShardsReply):
                self._lose(donor, now)
                continue
            shards = zip(reply.index, reply.data, strict=True)
            answered = self._take(donor, ((i, d, now) for i, d in shards))
            unanswered = self.sent.get(donor, set()) - answered
            if session.status(donor) == DonorStatus.LIVE and unanswered:
                # it answered without some of the shards asked for: not a donor to wait on
                self._pending.extend(session.on_donor_lost(donor, now))
            if session.status(donor) != DonorStatus.LIVE:
                self._lose(donor)
        self._pending.extend(session.poll(now))
        return self._advance(now)

    def _on_direct(self, results: Mapping[str, LinkResult], now: float) -> Decision:
        session = self.session
        if self.stage != Stage.SHARDS or session is None:
            raise DecodeError(f"direct results at stage {self.stage}")
        owed = self._owed
        elapsed = 0.0
        for donor, res in results.items():
            elapsed = max(elapsed, res.seconds)
            before = self.received.get(donor, 0)
            self._take(donor, ((i, d, now + at) for i, d, at in res.shards))
            got = self.received.get(donor, 0) - before
            if got:
                self.direct_bytes[donor] = self.direct_bytes.get(donor, 0) + got
            self.monitor.observe_transfer(donor, res.nbytes, res.seconds)
            if session.status(donor) != DonorStatus.LIVE:
                self._lose(donor)
            elif res.error:  # the link failed: what it still owes goes through the relay
                self.direct_failed[donor] = res.error
        for donor in results:
            if session.status(donor) == DonorStatus.LIVE:
                # what a live donor owes and nobody sent (its link failed, or a donor that
                # took those shards over failed) goes through the relay
                self._pending.extend(r for r in owed.get(donor, ()) if r.index not in self.got)
        self._pending.extend(session.poll(now + elapsed))
        return self._advance(now + elapsed)

    def _usable(self) -> dict[str, str]:
        live = set(self.live)
        return {
            d: a for d, a in self.addresses.items() if d in live and d not in self.direct_failed
        }

    def _advance(self, now: float) -> Decision:
        """Finish, fetch what direct holders owe, or send the relay requests."""
        session = self.session
        assert session is not None
        if session.done:
            state = TrainingState.from_bytes(session.assemble())
            if state.digest() != self.digest or state.round != self.server_round:
                raise ShardIntegrityError("the assembled state is not the certified one")
            self.state = state
            self.stage = Stage.DONE
            return Decision(Status.DONE)
        direct = self._direct_requests()
        if direct:
            return Decision(Status.WANT, direct=direct)
        return self._relay_requests()

    def _direct_requests(self) -> dict[str, tuple[str, tuple[ShardRequest, ...]]]:
        """Split the pending actions: direct holders' shard requests are taken out."""
        session = self.session
        assert session is not None
        usable = self._usable()
        limit = PULL_DIRECT_ROUNDS_PER_DONOR * max(1, len(self.donors))
        if not usable or self._direct_rounds >= limit:
            return {}
        missing = set(session.missing())
        # shards a relay holder is asked for stay with it (no direct steal of them: the relay
        # request leaves only when this event's decision is carried out, so a steal would
        # always win and leave the relay holder's planned share unused)
        relayed = {
            i
            for d in self.live
            if d not in usable and session.status(d) == DonorStatus.LIVE
            for i in session.inflight(d)
        }
        direct: dict[str, list[ShardRequest]] = {}
        rest: list[ShardRequest | CancelRequest] = []
        for action in self._pending:
            if isinstance(action, ShardRequest) and action.donor in usable:
                if action.index in missing and action.index not in relayed:
                    direct.setdefault(action.donor, []).append(action)
                else:  # never sent: the session must not count it as in flight there
                    session.withdraw(action.donor, action.index)
            else:
                rest.append(action)
        self._pending = rest  # a direct holder's copy of a relayed shard is dropped
        if not direct:
            return {}
        self._owed = {d: tuple(rs) for d, rs in direct.items()}
        self._direct_rounds += 1
        return {d: (usable[d], rs) for d, rs in self._owed.items()}

    def _relay_requests(self) -> Decision:
        session = self.session
        assert session is not None
        missing = set(session.missing())
        by_donor: dict[str, dict[int, ShardRequest]] = {}
        for action in self._pending:
            if isinstance(action, ShardRequest):
                by_donor.setdefault(action.donor, {})[action.index] = action
            elif isinstance(action, CancelRequest):
                by_donor.get(action.donor, {}).pop(action.index, None)
        self._pending = []
        wanted = {
            d: [r for i, r in sorted(rs.items()) if i in missing] for d, rs in by_donor.items()
        }
        wanted = {d: rs for d, rs in wanted.items() if rs}
        if not wanted:
            return self.fail("no live donor holds the missing shards")
        self.sent = {d: {r.index for r in rs} for d, rs in wanted.items()}
        relay: dict[str, Request] = {
            d: ShardsRequest(
                tuple(r.index for r in rs), tuple(r.start for r in rs), tuple(r.end for r in rs)
            )
            for d, rs in wanted.items()
        }
        return Decision(Status.WANT, relay=relay)
