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
