"""Named defaults of the deterministic simulator (``chaos-flwr simulate``, ``bench sim``).

One name per tunable, units in the names; the sim modules and the CLI's simulate and bench sim
commands import them from here (the package-wide tunables stay in :mod:`chaos_flwr.defaults`).
"""

from __future__ import annotations

#: Most virtual seconds one simulated run may cover before it ends as a failure.
SIM_MAX_VIRTUAL_S: float = 3600.0
#: Most events (deliveries, ticks, timeline actions) one simulated run may process.
SIM_MAX_EVENTS: int = 5_000_000
#: One-way latency of a simulated link without an override, in seconds.
SIM_DEFAULT_LATENCY_S: float = 0.02
#: Uplink bandwidth of a simulated party without an override, in bytes/s (100 Mbit/s).
SIM_DEFAULT_BANDWIDTH_BPS: float = 12.5e6
#: Virtual seconds between two ticks of one simulated peer.
SIM_TICK_INTERVAL_S: float = 0.25
#: Virtual seconds the runner lets a scenario settle after its last event before checking.
SIM_DEFAULT_SETTLE_S: float = 30.0
#: Founders of a simulated federation (the first parties; the rest join with sponsors).
SIM_FOUNDERS: int = 3
#: Shortest pause between two automatic rejoins of a party its view shows as failed, in seconds.
SIM_REJOIN_INTERVAL_S: float = 3.0
#: Default largest number of parties of a ``chaos-flwr simulate --soak`` schedule.
SIM_SOAK_MAX_PARTIES: int = 12
#: Runs of ``chaos-flwr bench sim`` (the median is reported).
SIM_BENCH_RUNS: int = 3
#: Sim training: bytes of the deterministic aggregate array of a round's state.
SIM_TRAIN_STATE_BYTES: int = 4096
#: Sim training: most contributors per round (the relay samples, founders first).
SIM_TRAIN_MAX_CONTRIBUTORS: int = 8
#: Sim training: most parties invited per round (founders plus a sample of members).
SIM_TRAIN_MAX_INVITED: int = 12
#: Sim training: how long the relay collects ``ready`` replies before fixing the contributors.
SIM_TRAIN_COLLECT_S: float = 0.3
#: Sim training: a round not certified this long after its start is abandoned.
SIM_TRAIN_ROUND_TIMEOUT_S: float = 2.0
#: Sim training: pause between a certified round and the next one.
SIM_TRAIN_ROUND_GAP_S: float = 0.5
#: Sim training: a donor that does not answer a manifest request this long is skipped.
SIM_TRAIN_PULL_TIMEOUT_S: float = 1.0
#: Sim training: smallest shard of a simulated pull (small, so pulls use several donors).
SIM_TRAIN_MIN_SHARD_BYTES: int = 512
#: Sim training: most shards of a simulated pull.
SIM_TRAIN_MAX_SHARDS: int = 16
#: Sim training: rounds stop this long before the end so pulls and certificates settle.
SIM_TRAIN_QUIESCE_S: float = 8.0
#: Timeline events of a random soak schedule (``chaos-flwr simulate --soak``).
SIM_SOAK_EVENTS: int = 200
#: Soak: settle time after the last schedule event, in virtual seconds.
SIM_SOAK_SETTLE_S: float = 18.0
#: Soak: shortest and longest virtual gap between two schedule events, in seconds.
SIM_SOAK_GAP_MIN_S: float = 0.03
SIM_SOAK_GAP_MAX_S: float = 0.17
#: Soak: peer tick interval of a random schedule, in virtual seconds.
SIM_SOAK_TICK_INTERVAL_S: float = 0.5
#: Soak (max parties > 12): share of seeds with max_parties/2..max_parties parties.
SIM_SOAK_LARGE_SHARE: float = 0.01
#: Soak (max parties > 12): share of seeds with 13..40 parties (the rest have 5..12).
SIM_SOAK_MEDIUM_SHARE: float = 0.05
#: Soak: share of crashed parties that restart without their disk.
SIM_SOAK_DISK_LOSS: float = 0.35
