"""What the ServerApp records: one :class:`RoundLog` per round, with its joiners' pulls
(:class:`JoinLog`) and the membership changes it relayed (:class:`MembershipEvent`).

These are plain records: the server wing fills them (:mod:`.strategy`, :mod:`.joins`,
:mod:`.view`) and the lab tools read them. They are windows, not archives: a ServerApp keeps
the newest :data:`SERVER_MAX_ROUND_LOGS` round logs (:class:`RoundLogs`), a round log at most
``FLOWER_MAX_EVIDENCE_PER_ROUND`` evidence blobs, and the view the newest
:data:`SERVER_MAX_EVENTS` membership events, so a federation running for weeks keeps a server
of constant size; whoever wants the whole history reads the logs as rounds finish.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import ConfigRecord

__all__ = [
    "SERVER_MAX_EVENTS",
    "SERVER_MAX_ROUND_LOGS",
    "JoinLog",
    "MembershipEvent",
    "RoundLog",
    "RoundLogs",
    "read_join_stats",
]

#: Round logs a ChaosStrategy keeps (``ChaosStrategy.rounds``, newest last).
SERVER_MAX_ROUND_LOGS: int = 1024
#: Membership events the server-side view keeps (``ServerView.events``, newest last; events
#: not settled yet are kept until they settle or are this far behind).
SERVER_MAX_EVENTS: int = 4096


@dataclass
class JoinLog:
    """One joiner's pull of the current certified state from its donors (through the relay).

    The joiner plans and verifies; the ServerApp only relays its requests and the donors'
    shard replies (it never assembles the state). Times are measured by the ServerApp's clock.

    Attributes
    ----------
    party, node:
        The joiner's party id and Flower node id.
    server_round, digest:
        The certified state pulled (its round and digest, checked by the joiner against the
        donors' signed receipts and the assembled bytes).
    donors:
        Party ids the joiner pulled from (>= 2 when that many holders were live).
    planned_shards, planned_bytes:
        The planner's shares per donor: shard count and bytes.
    bytes_per_donor:
        Bytes actually received from each donor (differs from the plan after a re-plan).
    shard_bytes, num_shards, total_bytes:
        The plan's shard size and count, and the state's size.
    lost:
        Donors that failed mid-pull (error, no reply, a shard that did not verify).
    pull_s:
        Measured wall time from the first relayed request to the verified state.
    lower_bound_s:
        The planner's lower bound for the same bytes and donors (assumed link rates, measured
        relay round trips as latency); ``pull_s / lower_bound_s`` is :attr:`delay_ratio`.
    steps:
        Relay steps used (one joiner exchange + one donor exchange each).
    ok, error:
        Whether the joiner holds the verified state, else why not.
    direct_bytes:
        Of :attr:`bytes_per_donor`, the bytes that came over a direct grpc link (donors that
        advertised a ``chaos-direct-addr``); the rest came through the relay.
    direct_failed:
        Donors whose direct link failed (their remaining shards went through the relay).
    rate_bps:
        The per-donor rate estimates (bytes/s) the joiner planned the shares with (assumed,
        or measured by an earlier fetch of the pull).
    phase_s:
        Seconds the joiner's direct links spent on the manifest and on the fetch (``manifest``,
        ``fetch``; as its process timed them): where a pull's time went, beside
        :attr:`pull_s`, which also holds the relay's steps and process starts.
    source:
        ``server``: the joiner took the state the ServerApp sent in one message (checked
        against the holders' receipts; :attr:`donors` is then empty, :attr:`steps` 1);
        ``pull``: the multi-source pull from the holders.
    server_refused:
        Why the joiner refused the state the ServerApp sent (its typed error), when it then
        fell back to the pull; ``""`` otherwise.
    """

    party: str
    node: int
    server_round: int = -1
    digest: bytes = b""
    donors: list[str] = field(default_factory=list)
    planned_shards: dict[str, int] = field(default_factory=dict)
    planned_bytes: dict[str, int] = field(default_factory=dict)
    bytes_per_donor: dict[str, int] = field(default_factory=dict)
    shard_bytes: int = 0
    num_shards: int = 0
    total_bytes: int = 0
    lost: list[str] = field(default_factory=list)
    pull_s: float = 0.0
    lower_bound_s: float = 0.0
    steps: int = 0
    ok: bool = False
    error: str = ""
    direct_bytes: dict[str, int] = field(default_factory=dict)
    direct_failed: list[str] = field(default_factory=list)
    rate_bps: dict[str, float] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)
    source: str = "pull"
    server_refused: str = ""

    @property
    def delay_ratio(self) -> float:
        """Measured pull time over the planner's lower bound (``inf`` when the bound is 0)."""
        return self.pull_s / self.lower_bound_s if self.lower_bound_s > 0 else float("inf")


@dataclass
class MembershipEvent:
    """One membership record (join, leave, fail, link_up, link_down) as the ServerApp relayed it.

    Attributes
    ----------
    kind, subject, record_id:
        The record's kind, its subject party (``a|b`` for a link) and id.
    server_round:
        Round in which the ServerApp first relayed it.
    first_seen:
        ServerApp clock at its first relay.
    settle_s:
        Time from the first relay until every live member (the server-side view's active
        parties, the subject of a leave/fail excluded) had applied it: had sent it, or had
        answered a message that delivered it. ``None`` while not settled; it is filled in
        place when it settles in a later round.
    """

    kind: str
    subject: str
    record_id: str
    server_round: int
    first_seen: float
    settle_s: float | None = None


@dataclass
class RoundLog:
    """What happened in one round (kept in ``ChaosStrategy.rounds``).

    Attributes
    ----------
    server_round:
        The round (0: certifying the initial state; -1: a restarted ServerApp's hello).
    eligible, trained:
        Node ids that could be sampled (active in the server-side view, not suspected, holding
        the current certified state) and those the inner strategy sampled.
    missing, errors:
        Nodes that missed a deadline / answered with an error code.
    holders:
        Party ids whose verified receipt names this round's certified state.
    unsigned_receipts:
        Parties whose receipts were taken unverified (no verifier).
    digest:
        The certified digest of this round's state.
    train_s, certify_s, join_s:
        Wall time of the train exchange, the certify exchange and the joiners' pulls.
    ask_s:
        Wall time of asking the suspects once more before training, when too few nodes were
        eligible, of sending the base's certify again to nodes it missed, and of asking the
        nodes that came during training (0: none of these; a question that carries the join's
        start includes the joiners' countersign and fetch).
    skipped:
        Why training was skipped, if it was.
    members:
        Status (``active``, ``left``, ``failed``) -> sorted party ids, from the server-side view
        (built from the signed records the ServerApp relayed) at the end of the round.
    joins:
        The pulls of the parties that joined (or caught up) in this round (:class:`JoinLog`).
    leaves, failures:
        Parties whose leave / fail record was first relayed in this round.
    events:
        Every membership record first relayed in this round (:class:`MembershipEvent`, with
        the time it took to settle).
    equivocations:
        Evidence parties reported in this round (encoded
        :class:`chaos_flwr.receipts.Equivocation`: two signed receipts of one round with
        different digests). Parties holding evidence refuse to train.
    audited, audit_bytes:
        The auditors sent the previous round's committed updates with this round's train
        messages (party ids), and the array bytes those updates added to their messages.
    """

    server_round: int
    eligible: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    errors: dict[int, int] = field(default_factory=dict)
    holders: list[str] = field(default_factory=list)
    unsigned_receipts: list[str] = field(default_factory=list)
    digest: bytes = b""
    train_s: float = 0.0
    certify_s: float = 0.0
    join_s: float = 0.0
    ask_s: float = 0.0
    skipped: str = ""
    members: dict[str, list[str]] = field(default_factory=dict)
    joins: list[JoinLog] = field(default_factory=list)
    leaves: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    events: list[MembershipEvent] = field(default_factory=list)
    equivocations: list[bytes] = field(default_factory=list)
    audited: list[str] = field(default_factory=list)
    audit_bytes: int = 0


class RoundLogs(list[RoundLog]):
    """``ChaosStrategy.rounds``: a list that keeps only the newest ``keep`` round logs.

    Parameters
    ----------
    keep:
        Round logs kept (default :data:`SERVER_MAX_ROUND_LOGS`); appending past it drops the
        oldest, counted in :attr:`dropped`.
    """

    def __init__(self, items: Iterable[RoundLog] = (), *, keep: int = SERVER_MAX_ROUND_LOGS):
        if keep < 1:
            raise ValueError(f"RoundLogs keep must be >= 1, got {keep}")
        super().__init__(items)
        self.keep = keep
        self.dropped = 0
        self._trim()

    def _trim(self) -> None:
        extra = len(self) - self.keep
        if extra > 0:
            del self[:extra]
            self.dropped += extra

    def append(self, item: RoundLog) -> None:
        """Append ``item``; the oldest log goes when more than ``keep`` are held."""
        super().append(item)
        self._trim()

    def extend(self, items: Iterable[RoundLog]) -> None:
        """Extend, then keep the newest ``keep``."""
        super().extend(items)
        self._trim()


def read_join_stats(jl: JoinLog, rec: ConfigRecord) -> None:
    """Copy the joiner's figures (plan, bytes per donor, lost donors) into its JoinLog."""

    def ints(key: str) -> list[int]:
        v = rec.get(key, [])
        return [x for x in v if isinstance(x, int)] if isinstance(v, list) else []

    def strs(key: str) -> list[str]:
        v = rec.get(key, [])
        return [x for x in v if isinstance(x, str)] if isinstance(v, list) else []

    for name, attr in (("total", "total_bytes"), ("shard-bytes", "shard_bytes")):
        v = rec.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(jl, attr, v)
    v = rec.get("num-shards")
    if isinstance(v, int) and not isinstance(v, bool):
        jl.num_shards = v
    jl.planned_shards = dict(zip(strs("plan-donors"), ints("plan-shards"), strict=False))
    jl.planned_bytes = dict(zip(strs("plan-donors"), ints("plan-bytes"), strict=False))
    jl.bytes_per_donor = dict(zip(strs("recv-donors"), ints("recv-bytes"), strict=False))
    jl.donors = sorted(set(jl.planned_bytes) | set(jl.bytes_per_donor))
    jl.lost = strs("lost")
    direct = dict(zip(strs("recv-donors"), ints("direct-bytes"), strict=False))
    jl.direct_bytes = {d: b for d, b in direct.items() if b > 0}
    jl.direct_failed = strs("direct-failed")
    rates = rec.get("rate-bps", [])
    if isinstance(rates, list):
        jl.rate_bps = {
            d: float(r)
            for d, r in zip(strs("rate-donors"), rates, strict=False)
            if isinstance(r, (int, float)) and not isinstance(r, bool)
        }
    for phase in ("manifest", "fetch"):
        v = rec.get(f"direct-{phase}-s")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6:
            jl.phase_s[phase] = float(v)
    err = rec.get("error", "")
    jl.error = err if isinstance(err, str) else ""
