"""Named defaults for every tunable in chaos-flwr.

One name per tunable: code that needs a default imports it from here (or from the strategy
profile schema, which uses these names as its own defaults). Units are in the names.
Sections are grouped by layer; keep each addition in its layer's section.
"""

from __future__ import annotations

# --- planner ---------------------------------------------------------------------------------
#: Largest shard count the planner considers (top of the default power-of-two chain).
PLANNER_MAX_SHARDS: int = 1024
#: Smallest shard the default chain allows, in bytes; keeps per-shard overhead in check.
PLANNER_MIN_SHARD_BYTES: int = 64 * 1024

# --- codec / wire ----------------------------------------------------------------------------
#: Deepest nesting of lists/maps the canonical decoder accepts.
CODEC_MAX_DEPTH: int = 32
#: Largest envelope (bytes on the wire) a party accepts; bigger input is refused unparsed.
WIRE_MAX_ENVELOPE_BYTES: int = 64 * 1024 * 1024

# --- flower ----------------------------------------------------------------------------------
#: Longest a Chaos relay phase (one send_and_receive of ``query.chaos``) waits for replies.
FLOWER_PHASE_TIMEOUT_S: float = 30.0
#: Message type of the Chaos relay exchange (Flower allows ``query.<action>``).
FLOWER_CHAOS_MESSAGE_TYPE: str = "query.chaos"
#: Key of the ConfigRecord that carries Chaos envelopes inside a Flower RecordDict.
FLOWER_CHAOS_RECORD_KEY: str = "chaos"
#: Most envelopes one relay message carries to one party; the rest wait for the next exchange.
FLOWER_MAX_ENVELOPES_PER_MESSAGE: int = 4096
#: Most envelopes the relay queues for one party before dropping the oldest.
FLOWER_MAX_QUEUED_ENVELOPES: int = 16384
#: How long the runner waits for a SuperLink it started to answer on /health.
FLOWER_SUPERLINK_STARTUP_TIMEOUT_S: float = 30.0
#: Default wall-time bound of one simulation run started by the runner.
FLOWER_RUN_TIMEOUT_S: float = 300.0
#: Grace between SIGTERM and SIGKILL when the runner stops the processes it started.
FLOWER_STOP_GRACE_S: float = 5.0
#: Virtual SuperNodes of the multi-institution example's simulation federation.
FLOWER_EXAMPLE_SUPERNODES: int = 5
