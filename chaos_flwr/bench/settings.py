"""Named defaults of the benchmarks (``chaos-flwr bench ...``), beside the code they tune.

One name per tunable, units in the names; the bench modules and the CLI's bench commands
import them from here (the package-wide tunables stay in :mod:`chaos_flwr.defaults`).
"""

from __future__ import annotations

# --- planner (``chaos-flwr bench planner``) ---------------------------------------------------
#: Seed of the benchmark's WAN-like instance generator (``chaos-flwr bench planner``).
PLANNER_BENCH_SEED: int = 20250512
#: State size the planner benchmark plans for, in bytes (a 1.5 GB training state).
PLANNER_BENCH_TOTAL_BYTES: int = 1_500_000_000
#: Timed repetitions per benchmark size (the median is reported).
PLANNER_BENCH_REPEATS: int = 200
#: Time limit of one MILP solve in the benchmark, in seconds.
PLANNER_BENCH_MILP_TIME_LIMIT_S: float = 5.0
#: Wall-clock budget for all MILP solves of one benchmark size, in seconds; sizes whose
#: remaining chain points would exceed it are reported as skipped.
PLANNER_BENCH_MILP_BUDGET_S: float = 15.0

# --- envelope hot path (``chaos-flwr bench wire``) --------------------------------------------
#: Approximate payload sizes ``chaos-flwr bench wire`` times, in bytes.
WIRE_BENCH_PAYLOAD_BYTES: tuple[int, ...] = (64, 1024, 16 * 1024, 256 * 1024)
#: Iterations per timed run of ``chaos-flwr bench wire``.
WIRE_BENCH_REPEATS: int = 500
#: Fewest iterations per timed run (large payloads run ``repeats * 1 KiB / size`` of them).
WIRE_BENCH_MIN_REPEATS: int = 20
#: Timed runs per figure of ``chaos-flwr bench wire`` (the median is reported).
WIRE_BENCH_ROUNDS: int = 5

# --- membership events (``chaos-flwr bench events``) ------------------------------------------
#: Seed of ``chaos-flwr bench events`` (which peers leave, link and fail).
EVENTS_BENCH_SEED: int = 20250513
#: Events of each type ``chaos-flwr bench events`` triggers by default.
EVENTS_BENCH_REPEATS: int = 50
#: Longest ``chaos-flwr bench events`` waits for one event to be applied everywhere, in seconds.
EVENTS_BENCH_EVENT_TIMEOUT_S: float = 10.0
#: Founders of the bench federation (the others join with one founder as sponsor).
EVENTS_BENCH_FOUNDERS: int = 3
#: Heartbeat interval of the bench charter, in seconds (the bench's virtual clock).
EVENTS_BENCH_HEARTBEAT_S: float = 1.0
#: Suspicion timeout of the bench charter, in seconds (the bench's virtual clock).
EVENTS_BENCH_SUSPICION_S: float = 3.0
#: Failure quorum of the bench charter.
EVENTS_BENCH_FAILURE_QUORUM: int = 2
#: Random extra links per peer on top of the bench's ring.
EVENTS_BENCH_CHORDS_PER_PEER: int = 1
#: Worker processes ``chaos-flwr bench events`` spreads the peers over (one per core here).
EVENTS_BENCH_WORKERS: int = 2
#: Whether ``chaos-flwr bench events`` pins each worker process to its own CPU.
EVENTS_BENCH_PIN_WORKERS: bool = True
#: Ed25519 verifications per round when ``chaos-flwr bench events`` measures their cost.
EVENTS_BENCH_VERIFY_SAMPLES: int = 2000
#: Idle pause before each timed seal when ``chaos-flwr bench events`` measures the wake-up
#: cost (an idle process's caches are cold when its next message arrives), in seconds.
EVENTS_BENCH_IDLE_PROBE_S: float = 0.01
#: Seals timed after an idle pause (and, times ten, back to back) for that wake-up cost.
EVENTS_BENCH_IDLE_PROBE_SAMPLES: int = 20

# --- state transfer (``chaos-flwr bench scale-out``) ------------------------------------------
#: Default state size of ``chaos-flwr bench scale-out``, in MiB.
SCALE_OUT_STATE_MIB: int = 256
#: Bandwidth of the storage link of the ``checkpoint`` method when the profile names none, MB/s.
SCALE_OUT_STORAGE_MB_S: float = 20.0
#: Runs per method whose median the scale-out benchmark reports.
SCALE_OUT_RUNS: int = 3
#: Longest one scale-out transfer may take before the benchmark gives up, in seconds.
SCALE_OUT_TIMEOUT_S: float = 300.0
#: Seconds between progress reports of a running scale-out transfer (CLI progress bar).
SCALE_OUT_PROGRESS_INTERVAL_S: float = 0.1
#: Link speed of every donor in the donor-count sweep, in MB/s.
SCALE_OUT_SWEEP_MB_S: float = 5.0
#: Donor counts of the sweep.
SCALE_OUT_SWEEP_DONORS: tuple[int, ...] = (2, 4, 8, 16)
#: Longest a donor process may take to start and report its port, in seconds.
SCALE_OUT_DONOR_STARTUP_S: float = 30.0
#: The scale-out benchmark's request timeout factor (PullSession ``timeout_factor``); looser
#: than the engine default because CPU stalls on a shared 2-core machine are not link failures
#: (a killed donor is still detected at once: its connection closes).
SCALE_OUT_TIMEOUT_FACTOR: float = 10.0
#: ... and the benchmark's shortest request timeout (PullSession ``min_timeout_s``), seconds.
SCALE_OUT_MIN_TIMEOUT_S: float = 5.0

# --- long-lived federations (``chaos-flwr bench long-run``) -----------------------------------
#: Rounds the long-run soak drives by default (issue #18: 10,000).
LONGRUN_BENCH_ROUNDS: int = 10_000
#: Membership events (link flaps, leaves and rejoins, crashes and restarts) spread over them.
LONGRUN_BENCH_EVENTS: int = 10_000
#: Records the flooder mints for the issue's figure (``--flood 100000``; tests use fewer).
LONGRUN_BENCH_FLOOD_RECORDS: int = 100_000
#: Parties of the soak federation: 3 founders, the rest leave, rejoin, crash and restart.
LONGRUN_BENCH_PARTIES: int = 5
#: Founders of the soak federation (never leave nor crash: they sponsor the rejoins).
LONGRUN_BENCH_FOUNDERS: int = 3
#: Samples taken along a run (evenly spaced rounds; the slopes are fitted to them).
LONGRUN_BENCH_SAMPLES: int = 40
#: Seed of the soak (which links flap, which party leaves or crashes).
LONGRUN_BENCH_SEED: int = 20261203
#: Virtual seconds per round (the parties' clock; the charter's timers run on it).
LONGRUN_BENCH_ROUND_S: float = 1.0
#: Heartbeat interval of the soak charter, in virtual seconds.
LONGRUN_BENCH_HEARTBEAT_S: float = 1.0
#: Suspicion timeout of the soak charter, in virtual seconds.
LONGRUN_BENCH_SUSPICION_S: float = 3.0
#: Failure quorum of the soak charter.
LONGRUN_BENCH_FAILURE_QUORUM: int = 2
#: Rounds a left party stays out, and a crashed party stays down, before it comes back.
LONGRUN_BENCH_AWAY_ROUNDS: int = 6
#: Float32 values in the soak's training state (small: the protocol's costs are measured).
LONGRUN_BENCH_STATE_FLOATS: int = 64
#: Rounds before the flood starts (everyone joined and linked) and the quiet run's baseline.
LONGRUN_BENCH_FLOOD_WARMUP_ROUNDS: int = 8
#: Rounds after the last flood batch (the quiet run drives as many rounds in all).
LONGRUN_BENCH_FLOOD_TAIL_ROUNDS: int = 4
#: Flood records the flooder pushes with each of its replies (the relay delivers at most
#: ``FLOWER_MAX_ENVELOPES_PER_MESSAGE`` envelopes per message).
LONGRUN_BENCH_FLOOD_BATCH: int = 4096
#: Wall-time budget of the soak, in seconds: past it the soak stops at the round it reached
#: (the JSON says so), so a build whose costs grow with age still ends.
LONGRUN_BENCH_MAX_SECONDS: float = 3600.0
