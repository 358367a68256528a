"""Named defaults for every tunable in chaos-flwr.

One name per tunable: code that needs a default imports it from here (or from the strategy
profile schema, which uses these names as its own defaults). Units are in the names.
Sections are grouped by layer; keep each addition in its layer's section.
"""

from __future__ import annotations

# --- planner ---------------------------------------------------------------------------------
#: Largest shard count the planner considers (top of the default power-of-two chain). The
#: planner scans the whole chain and keeps the best point, so a longer chain never worsens the
#: modelled makespan, while the rounding loss (up to one shard time per donor) shrinks with K;
#: planning 100 donors over the 13-point chain to 4096 stays well under 5 ms.
PLANNER_MAX_SHARDS: int = 4096
#: Smallest shard the default chain allows, in bytes; keeps per-shard overhead in check.
PLANNER_MIN_SHARD_BYTES: int = 64 * 1024

# --- codec / wire ----------------------------------------------------------------------------
#: Deepest nesting of lists/maps the canonical decoder accepts.
CODEC_MAX_DEPTH: int = 32
#: Largest envelope (bytes on the wire) a party accepts; bigger input is refused unparsed.
WIRE_MAX_ENVELOPE_BYTES: int = 64 * 1024 * 1024
#: Sequence numbers a :class:`chaos_flwr.wire.ReplayGuard` remembers per sender (out-of-order
#: envelopes are accepted inside this window, never twice; older ones are refused).
WIRE_REPLAY_WINDOW: int = 1024
#: Furthest in the future (past the receiver's ``now``) an envelope timestamp may be, in
#: seconds; ``None`` turns the check off (the default: parties' clocks are not synchronised).
WIRE_MAX_CLOCK_SKEW_S: float | None = None
#: Oldest an envelope timestamp may be (before the receiver's ``now``), in seconds; ``None``
#: turns the check off (the default: the sequence window already refuses replays).
WIRE_MAX_AGE_S: float | None = None

# --- identity / charter ----------------------------------------------------------------------
#: File mode of a private key file written by ``Identity.save`` / ``chaos-flwr keygen``.
IDENTITY_KEY_FILE_MODE: int = 0o600
#: File mode of the public key file written beside it.
IDENTITY_PUB_FILE_MODE: int = 0o644
#: File name suffix of private key files.
IDENTITY_KEY_SUFFIX: str = ".key"
#: File name suffix of public key files.
IDENTITY_PUB_SUFFIX: str = ".pub"
#: Largest key file the loader reads, in bytes (a PEM Ed25519 key is about 120 bytes).
IDENTITY_MAX_KEY_FILE_BYTES: int = 64 * 1024
#: Largest charter file ``load_charter`` reads, in bytes.
CHARTER_MAX_FILE_BYTES: int = 4 * 1024 * 1024
#: Default member signatures a join needs besides the joiner's (``admission.sponsors_required``).
CHARTER_DEFAULT_SPONSORS_REQUIRED: int = 1
#: Default suspecting neighbours a fail record needs (``failure_quorum``).
CHARTER_DEFAULT_FAILURE_QUORUM: int = 2
#: Default pause between two heartbeats of a party, in seconds (``heartbeat_interval_s``).
CHARTER_DEFAULT_HEARTBEAT_INTERVAL_S: float = 1.0
#: Default silence after which a neighbour is suspected, in seconds (``suspicion_timeout_s``).
CHARTER_DEFAULT_SUSPICION_TIMEOUT_S: float = 5.0
#: Default number of parties holding a replica of the training state (``replication.replicas``).
CHARTER_DEFAULT_REPLICAS: int = 3
#: Default number of certified rounds each replica keeps (``replication.keep_rounds``).
CHARTER_DEFAULT_KEEP_ROUNDS: int = 2

# --- membership / monitor / peer -------------------------------------------------------------
#: Weight of the newest sample in the monitor's bandwidth and latency moving averages.
MONITOR_EWMA_ALPHA: float = 0.3
#: Bandwidth assumed for a link with no observed transfer yet, in bytes/s (100 Mbit/s).
MONITOR_DEFAULT_BANDWIDTH_BPS: float = 12.5e6
#: Unanswered probes older than this are forgotten, in seconds.
MONITOR_PROBE_TIMEOUT_S: float = 30.0
#: How often a peer probes each watched party for its round-trip time, in heartbeat intervals.
PEER_PROBE_EVERY_HEARTBEATS: int = 5
#: Pause before a pending join, link request or suspicion vote is sent again, in seconds.
PEER_RETRY_INTERVAL_S: float = 1.0
#: Shortest pause between two anti-entropy inventories sent to the same party, in seconds.
PEER_ANTI_ENTROPY_INTERVAL_S: float = 0.5
#: Most records one anti-entropy reply carries (the rest follow on the next exchange).
PEER_MAX_RECORDS_PER_MESSAGE: int = 2048
#: Most rejections a peer keeps in its log (oldest dropped first).
PEER_MAX_REJECTIONS_LOGGED: int = 10000
#: Verified signatures a membership SignatureCache remembers before it starts afresh.
MEMBERSHIP_SIGNATURE_CACHE_ENTRIES: int = 1 << 16
#: Largest record *proof* (an ``own`` envelope standing in for its sender's record signature).
MEMBERSHIP_PROOF_MAX_BYTES: int = 4096
#: Most deliveries one ``MemoryNetwork.run`` makes before it calls it a message storm.
MEMORY_CARRIER_MAX_DELIVERIES: int = 10_000_000

# --- flower ----------------------------------------------------------------------------------
#: Pause between two pulls of replies while a Chaos phase waits (Flower's own grids use 0.1-3 s).
FLOWER_POLL_INTERVAL_S: float = 0.02
#: Leave the model out of Chaos train messages to parties that hold it (they restore it).
FLOWER_ELIDE_HELD_ARRAYS: bool = True
#: Most envelopes one relay message carries to one party; the rest wait for the next exchange.
FLOWER_MAX_ENVELOPES_PER_MESSAGE: int = 4096
#: Most envelopes the relay queues for one party before dropping the oldest.
FLOWER_MAX_QUEUED_ENVELOPES: int = 16384
#: Most envelopes of one sender the relay queues for one party (past it that sender's oldest go),
#: and most of them one message carries: a flooding party fills its own share of a receiver's
#: queue and messages, never the share of the others.
FLOWER_MAX_QUEUED_PER_SENDER: int = 4096
FLOWER_MAX_ENVELOPES_PER_SENDER_PER_MESSAGE: int = 64
#: Verified receipts a state needs before a restarted ServerApp resumes from it (1: the newest
#: state any verified party holds, e.g. after a kill mid certify; a newer round with fewer
#: receipts is skipped, never re-certified).
FLOWER_RESUME_MIN_RECEIPTS: int = 1
#: Lifetime of a ``query.chaos`` message, in phase timeouts (stale relay traffic expires).
FLOWER_CHAOS_TTL_PHASES: float = 2.0
#: Direct pulls (chaos_flwr.flower.fetch, over authenticated links to signed endpoints):
#: the fixed part of the bound of the manifest and all direct fetches of one pull step (the
#: largest request/reply: LINK_* below). The whole bound adds the state's bytes at
#: FLOWER_DIRECT_MIN_BPS (``chaos_flwr.flower.fetch.direct_budget_s``), and the ServerApp
#: waits for a step that may pull directly that much longer than the joiner's deadline.
FLOWER_DIRECT_TIMEOUT_S: float = 10.0
#: The slowest total rate of a pull's direct links (bytes/s) that the direct-link bound still
#: waits for: a state of ``n`` bytes is given FLOWER_DIRECT_TIMEOUT_S + n / this (23.4 s at
#: 64 MiB, 64 s at 256 MiB), so a large state is not cut off at a fixed bound and handed to
#: the slower relay; links slower than this fall back to the relay for what they still owe.
FLOWER_DIRECT_MIN_BPS: float = 5e6
#: The longest that bound gets, in seconds (a state over 1.45 GB needs links faster than
#: FLOWER_DIRECT_MIN_BPS to come over them in one step): a joiner that crashed mid-pull holds
#: its step at most this much longer than its reply history says.
FLOWER_DIRECT_MAX_S: float = 300.0
#: How long a ClientApp waits to connect to its own ``chaos-direct-addr`` to see whether the
#: party daemon serves there (a loopback or local connect answers in well under a millisecond).
FLOWER_DIRECT_PROBE_CONNECT_S: float = 0.5
#: Bytes of a link's first request in a direct fetch, before its rate is known (whole
#: shards, at least one): small, so every link is timed early and a slow one holds little
#: that the others must wait for or copy.
FLOWER_DIRECT_BATCH_BYTES: int = 64 * 1024
#: Once timed, a link is asked for about this many seconds of its rate per request (whole
#: shards, at least one): one request is in flight per link, so each request's fixed cost (a
#: round trip, the donor's read) is idle link time that a fast link's larger batch spreads
#: thinner (chaos-flwr bench direct-pull: a 20 MB/s donor gave about 15 MB/s with 256 KiB
#: requests), while a slow link's batch stays small for the end game.
FLOWER_DIRECT_BATCH_S: float = 0.05
#: How long a party's link server serves a restarted ServerApp the certified states it holds
#: (the relay's read grant, written when the hello names the ServerApp's link key; a resume
#: pull takes seconds, a newer hello renews it).
FLOWER_RELAY_GRANT_S: float = 900.0
#: node_config key of the address a signed party serves direct links at (optional,
#: ``host:port``, any host; it signs it in its endpoint record).
FLOWER_DIRECT_NODE_KEY: str = "chaos-direct-addr"

#: ``chaos-flwr bench direct-pull`` defaults: state size (MiB), donor uplinks (MB/s: testbed5's
#: donors), pulls.
DIRECT_BENCH_MODEL_MIB: float = 16.0
DIRECT_BENCH_RATES_MB_S: tuple[float, ...] = (20.0, 10.0, 2.5, 1.25)
DIRECT_BENCH_REPEATS: int = 3

# --- gossip over direct links (chaos_flwr/gossip.py, the party daemon) ---------------------------
#: Peers a party daemon asks per gossip round.
GOSSIP_FANOUT: int = 3
#: Seconds between a party daemon's gossip rounds.
GOSSIP_INTERVAL_S: float = 2.0
#: Bound of one gossip exchange (connect, request and reply), in seconds.
GOSSIP_TIMEOUT_S: float = 5.0
#: Seconds without a gossip exchange after which a peer heard before is suspected (many
#: rounds: a slow or busy daemon is not a dead one).
GOSSIP_SUSPECT_S: float = 30.0
#: Asks in a row that got no answer at all a suspicion also needs (a peer that answers slowly,
#: refuses, or is asked seldom in a large federation is not silent).
GOSSIP_SUSPECT_MISSES: int = 3
#: Most records one gossip reply carries or is accepted with (the frontier of a federation of
#: n parties holds about 3 n records plus one per link).
GOSSIP_MAX_RECORDS: int = 4096
#: Most failure votes one gossip reply carries or is accepted with.
GOSSIP_MAX_VOTES: int = 256
#: Largest gossip-heard records file a party reads (``<state-dir>/gossip.records``), bytes.
GOSSIP_FILE_MAX_BYTES: int = 8 * 1024 * 1024

# --- authenticated direct links (flower/direct.py, transport/tls.py) -----------------------------
#: Link requests a donor serves at once; more are refused with LinkBusyError (bounds memory).
LINK_MAX_CONCURRENT_REQUESTS: int = 4
#: Link requests one party may have in service at one donor at once (a pull and a gossip
#: exchange); more: LinkBusyError. So no one party holds every slot.
LINK_MAX_CONCURRENT_PER_PEER: int = 2
#: Seconds a link server waits for the request message of a call whose dialler it has
#: authenticated; then the call is cut (TransportError) and its slot freed.
LINK_REQUEST_READ_S: float = 10.0
#: Seconds a link server gives a connection to finish its TLS handshake.
LINK_HANDSHAKE_S: float = 10.0
#: Seconds a link connection with no call in progress stays open (the dialler reconnects).
LINK_IDLE_CONNECTION_S: float = 300.0
#: Channels a link dialler keeps open at most (least recently used closed first); a party's
#: channel is also closed when it is dialled at a new endpoint.
LINK_DIALER_MAX_CHANNELS: int = 64
#: Largest link request message a donor reads (bytes); larger: RequestTooLargeError.
LINK_MAX_REQUEST_BYTES: int = 64 * 1024
#: Most reply bytes one link request may ask for; more: ReplyTooLargeError (no amplification).
LINK_MAX_REPLY_BYTES: int = 4 * 1024 * 1024
#: Largest link reply a dialler reads: LINK_MAX_REPLY_BYTES plus room for the codec's framing.
LINK_MAX_REPLY_FRAME_BYTES: int = LINK_MAX_REPLY_BYTES + 64 * 1024
#: Most ranges one link request may name (a dialler sends at most this many; more:
#: RequestTooLargeError); at about 20 encoded bytes a range, far below LINK_MAX_REQUEST_BYTES.
LINK_MAX_RANGES_PER_REQUEST: int = 1024
#: Most shards a manifest asked over a direct link may name (32 bytes each in the reply).
LINK_MAX_MANIFEST_SHARDS: int = 65536
#: Manifests a donor keeps per (round, digest, shape), so joiners asking the same one cost one
#: hash of the state.
LINK_MANIFESTS_CACHED: int = 8
#: Reply bytes one party may take from a donor per window; more: LinkQuotaError.
LINK_PEER_WINDOW_BYTES: int = 512 * 1024 * 1024
#: Length of that window, in seconds.
LINK_PEER_WINDOW_S: float = 1.0
#: Peers whose window a donor tracks at once (charter parties bound it anyway).
LINK_MAX_TRACKED_PEERS: int = 4096
#: Validity of a link certificate from its creation, in seconds.
LINK_CERT_VALIDITY_S: float = 30 * 24 * 3600.0
#: Largest link certificate (DER) an endpoint record may carry or a peer may present.
LINK_CERT_MAX_BYTES: int = 2048
#: Longest host name an endpoint record may carry (DNS limit).
ENDPOINT_MAX_HOST_CHARS: int = 253
#: Folder layout of :func:`chaos_flwr.flower.keys.make_federation`: key file prefix
#: (``party-<partition-id>.key``) and charter file name.
FLOWER_FEDERATION_KEY_PREFIX: str = "party-"
FLOWER_FEDERATION_CHARTER_FILE: str = "charter.yaml"
#: Founders (the first partitions) and federation name of a ``make_federation`` charter.
FLOWER_FEDERATION_FOUNDERS: int = 3
FLOWER_FEDERATION_NAME: str = "chaos-flwr-federation"
#: Most holders one joiner pulls the current state from (all live holders up to this).
FLOWER_JOIN_MAX_DONORS: int = 8
#: A non-member that is still not admitted asks new sponsors after this long.
FLOWER_JOIN_RETRY_S: float = 10.0
#: Smallest shard of a joiner's pull, in bytes (small enough that small models still split).
FLOWER_JOIN_MIN_SHARD_BYTES: int = 1024
#: Most relay steps (joiner exchange + donor exchange) one joiner pull may take.
FLOWER_JOIN_MAX_STEPS: int = 16
#: A node that comes while a round trains, admitted by its own signed records, trains in
#: that round (``JoinSettings.during_round``, :mod:`chaos_flwr.flower.server.latejoin`).
FLOWER_JOIN_DURING_ROUND: bool = True

# --- state / store / transfer ----------------------------------------------------------------
#: Alignment of each array's data inside a serialised state, in bytes (zero-copy numpy views).
STATE_ALIGN_BYTES: int = 64
#: Largest state header (names, dtypes, shapes, meta) the decoder accepts, in bytes.
STATE_MAX_HEADER_BYTES: int = 64 * 1024 * 1024
#: Size of one read or write the replica store issues, in bytes (bounds memory when hashing).
STORE_IO_CHUNK_BYTES: int = 4 * 1024 * 1024
#: Largest certificate a replica file may carry, in bytes.
STORE_MAX_CERTIFICATE_BYTES: int = 16 * 1024 * 1024
#: Shard requests a joiner keeps in flight per donor (pipelining hides the link latency).
TRANSFER_WINDOW: int = 2
#: A shard request times out after this many times its expected service time ...
TRANSFER_TIMEOUT_FACTOR: float = 4.0
#: ... but never sooner than this many seconds.
TRANSFER_MIN_TIMEOUT_S: float = 2.0
#: Weight of the newest observation in a donor's smoothed rate estimate (0 < alpha <= 1).
TRANSFER_RATE_EWMA_ALPHA: float = 0.5
#: Uploads a donor serves at once; further shard requests wait in its queue.
DONOR_MAX_CONCURRENT_UPLOADS: int = 4

# --- transport / shaping ---------------------------------------------------------------------
#: Largest message (request or reply) the grpc carrier sends or accepts, in bytes.
TRANSPORT_MAX_MESSAGE_BYTES: int = 256 * 1024 * 1024
#: Address a carrier's server listens on (loopback; a namespace-local address in netns mode).
TRANSPORT_HOST: str = "127.0.0.1"
#: Size of one streamed chunk of a grpc carrier reply, in bytes (the unit the shaper paces).
TRANSPORT_CHUNK_BYTES: int = 256 * 1024
#: Default bound on one grpc carrier request (connect + reply), in seconds.
TRANSPORT_REQUEST_TIMEOUT_S: float = 60.0
#: Longest the grpc carrier waits for a peer's channel to become ready, in seconds.
TRANSPORT_CONNECT_TIMEOUT_S: float = 5.0
#: Grace given to in-flight calls when a grpc carrier stops, in seconds.
TRANSPORT_STOP_GRACE_S: float = 0.5
#: Event-loop turns ``GrpcCarrier.close`` gives queued pushes to go out before it stops.
TRANSPORT_PUSH_DRAIN_SPINS: int = 1000
#: Token-bucket depth of a shaped link, in bytes (how far a burst may run ahead of the rate).
SHAPING_BURST_BYTES: int = 64 * 1024
#: Largest WAN profile file ``load_profile`` reads, in bytes.
SHAPING_MAX_PROFILE_BYTES: int = 1024 * 1024
#: Default tbf bucket of a netns-shaped veth, in bytes.
NETNS_TBF_BURST_BYTES: int = 32 * 1024
#: tbf bucket of a netns star link in seconds of its rate (at least NETNS_TBF_BURST_BYTES).
NETNS_TBF_BURST_S: float = 0.002
#: tbf queue limit of a netns star link, bytes: above TCP's per-socket queue cap
#: (net.ipv4.tcp_limit_output_bytes, 4 MiB here), so a shaped link delays and never drops (a
#: 256 KiB limit dropped enough to stall a connection past the pull engine's 5 s timeout).
NETNS_STAR_LIMIT_BYTES: int = 8 * 1024 * 1024
#: TCP unsent-data cap (net.ipv4.tcp_notsent_lowat) inside a netns star's donor namespaces,
#: bytes: keeps a donor's socket from buffering seconds of replies ahead of its link.
NETNS_NOTSENT_LOWAT_BYTES: int = 128 * 1024
#: MTU of a netns star's veths and bridge (jumbo frames: a sixth of the packets of 1500, which
#: on 2 cores is the difference between a CPU-bound and a link-bound transfer).
NETNS_STAR_MTU: int = 9000
#: Default tbf queue limit (bytes queued before drop) of a netns-shaped veth.
NETNS_TBF_LIMIT_BYTES: int = 256 * 1024
#: Longest one ``ip``/``tc`` command may take, in seconds.
NETNS_COMMAND_TIMEOUT_S: float = 10.0

# --- flower: churn scenarios, the demo and its report ------------------------------------------
#: Rounds of a party's receipt ledger kept in its saved state (chaos_flwr.flower.durable).
FLOWER_DURABLE_LEDGER_ROUNDS: int = 4
#: Largest saved party state (records, pending envelopes, a join pull's partial shards), bytes.
FLOWER_DURABLE_MAX_BYTES: int = 1 << 30
#: Whether a party's saved state is fsynced (only power loss needs it; see flower/durable.py).
FLOWER_DURABLE_FSYNC: bool = False

# --- membership compaction and flood resistance (chaos_flwr.membership, chaos_flwr.flood) ------
#: Largest incarnation or epoch a record may carry (larger is a DecodeError on input): far above
#: any honest history, far enough below 2**63 that no counter derived from it overflows.
MEMBERSHIP_MAX_COUNTER: int = 2**62
#: Records a charter party may newly sign per minute, as a receiving peer meters them, when the
#: charter has no ``limits`` section (an honest party signs a handful per membership event).
FLOOD_RECORDS_PER_MINUTE: float = 600.0
#: Records a party may sign in one burst beyond that rate: a base ...
FLOOD_RECORD_BURST_BASE: int = 256
#: ... plus this many per charter party, so a newcomer's sync of a whole record frontier (a party
#: signs at most three frontier records per other party: a link, a sponsorship, a fail vote)
#: never exceeds one signer's burst.
FLOOD_RECORD_BURST_PER_PARTY: int = 4
#: Newest ``AppliedChange`` entries a peer keeps in ``Peer.applied`` (older ones are dropped;
#: ``Peer.applied_total`` counts them all).
PEER_APPLIED_WINDOW: int = 10000

# --- deadlines and suspicion that follow the federation (issue 15) ----------------------------
#: Phi (−log10 of the chance that a live party's next arrival is still to come) above which a
#: silent party is suspected; 8 is Cassandra's default (a 1e-8 false-suspicion chance per check
#: under the learned distribution).
MONITOR_PHI_THRESHOLD: float = 8.0
#: Inter-arrival intervals the accrual detector keeps per party (the newest ones).
MONITOR_HISTORY_INTERVALS: int = 100
#: Smallest standard deviation the detector assumes, as a fraction of the mean interval (a very
#: regular party is not suspected the moment it is a little late) ...
MONITOR_MIN_STD_FRACTION: float = 0.25
#: ... and in seconds.
MONITOR_MIN_STD_S: float = 0.1
#: Checks of this party (its ticks, at least a heartbeat interval apart) a watched party must
#: stay unheard across before it can be suspected: where parties hear each other only through
#: relayed messages, one message without a party's envelopes is no evidence (the party may have
#: had no heartbeat due when it last answered); two in a row are.
MONITOR_MIN_MISSED_CHECKS: int = 2
#: Least a Chaos exchange waits for a node that has a reply history (its adaptive deadline is
#: never shorter), in seconds (a joiner's step that may fetch over direct links is waited for
#: its own direct-link bound longer: ``chaos_flwr.flower.fetch.direct_step_wait_s``).
FLOWER_DEADLINE_FLOOR_S: float = 15.0
#: Most a Chaos exchange waits for any node, in seconds (also capped by ``start(timeout=)``);
#: a node with no reply history yet (the first round) is waited for this long unless a phase
#: timeout is configured.
FLOWER_DEADLINE_CEILING_S: float = 600.0
#: Quantile of a node's reply times (per kind of message) its adaptive deadline starts from.
FLOWER_DEADLINE_QUANTILE: float = 0.95
#: Margin over that quantile, as a fraction of it (0.5: a deadline of 1.5 x the quantile).
FLOWER_DEADLINE_MARGIN: float = 0.5
#: Reply times kept per node and kind of message (the newest ones).
FLOWER_DEADLINE_HISTORY: int = 20
#: Certified rounds a party's replica store keeps on disk by default (node config
#: ``chaos-keep-replicas``): what recovery
#: needs, the newest certified round a party holds and the one before it (a resume goes back to
#: it when a certify cut short by a server kill left the newest without its receipt quorum).
#: Disk per party: this many times the model's size.
STORE_DEFAULT_KEEP_REPLICAS: int = CHARTER_DEFAULT_KEEP_ROUNDS

# --- verifiable rounds (chaos_flwr.rounds) -----------------------------------------------------
#: Rota positions past the charter's auditor count whose audits also count (a view that differs
#: by one member, or a crashed auditor, still lets a round become final).
AUDIT_ROTA_SPARE: int = 1
#: Audits kept per auditor by a party's round guard and by the ServerApp (its oldest-kept go
#: first: an honest auditor signs one per round, and only the last few rounds are in play).
ROUNDS_MAX_AUDITS_KEPT: int = 16

# --- the aggregation rule the charter fixes (issue 14, helper "rule") ------------------------
#: Fewest signed update commitments a certify must carry when the charter's ``rounds`` section
#: leaves ``min_updates`` out.
ROUND_DEFAULT_MIN_UPDATES: int = 1
#: Auditors per round when the charter fixes an aggregation rule and leaves ``auditors`` out.
ROUND_DEFAULT_AUDITORS: int = 1
#: Auditors per round when the charter fixes no aggregation rule (nothing to recompute).
ROUND_DEFAULT_AUDITORS_WITHOUT_RULE: int = 0
#: Relative tolerance with which a recomputed aggregate matches a certified one when their
#: digests differ (arithmetic that is not bitwise deterministic across machines: BLAS, SIMD
#: summation order); see :func:`chaos_flwr.flower.rule.states_match`.
RULE_RTOL: float = 1e-6
#: Absolute tolerance of the same comparison (for values near zero).
RULE_ATOL: float = 1e-8
