"""What the churn emulation has done on a node: its once-only actions and the newest round.

The marks live in Flower's ``Context.state`` (record ``chaos-churn``). On the simulation engine
with several workers that is not enough: a message handed to a worker carries a copy of the
node's Context taken when it was sent, and the last reply to come back sets the node's Context,
so a message that waited for its party's turn (:mod:`chaos_flwr.flower.client.lock`) while
another one acted would erase that action's mark, and a later message would act again (a link
taken down again after it came back up). So when the node's party has a state directory, the
marks are also kept in ``<state-dir>/churn.state`` (written within the party's turn; a file of
another run is ignored), and a mark in either place counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError, StoreError
from chaos_flwr.localfile import read_local_file, write_local_file

__all__ = ["done_events", "mark_done", "note_round", "seen_round"]

#: ``Context.state`` record where the wrapper keeps its marks.
STATE_KEY = "chaos-churn"
#: The marks' file name in the party's state directory.
MARKS_FILE = "churn.state"
#: Largest marks file read, in bytes (a few hundred event indexes).
CHURN_MARKS_MAX_BYTES = 64 * 1024


def _record(context: Any) -> Any:
    """The emulation's record in ``context.state`` (made empty when absent)."""
    from flwr.app import ConfigRecord

    record = context.state.config_records.get(STATE_KEY)
    if record is None:
        record = ConfigRecord()
        context.state[STATE_KEY] = record
    return record


def _path(context: Any) -> Path | None:
    from chaos_flwr.flower.client.settings import party_settings

    try:
        state_dir = party_settings(context).state_dir
    except ConfigError:
        return None
    return None if state_dir is None else state_dir / MARKS_FILE


def _read(context: Any) -> tuple[set[int], int]:
    """The done events and the newest round in the node's marks file (empty: none, or of
    another run).

    Raises
    ------
    StoreError
        The file is not a regular file, too large, or not marks.
    """
    path = _path(context)
    if path is None:
        return set(), -1
    try:
        raw = read_local_file(
            path, what="churn marks", error=StoreError, max_bytes=CHURN_MARKS_MAX_BYTES
        )
    except FileNotFoundError:
        return set(), -1
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: not churn marks ({exc})") from None
    ints = isinstance(value, dict) and all(type(value.get(k)) is int for k in ("run", "seen"))
    done = value.get("done") if isinstance(value, dict) else None
    if not ints or not isinstance(done, list) or not all(type(d) is int for d in done):
        raise StoreError(f"{path}: not churn marks (want run, seen: int; done: list of int)")
    if value["run"] != int(context.run_id):
        return set(), -1
    return set(done), int(value["seen"])


def _write(context: Any, done: set[int], seen: int) -> None:
    path = _path(context)
    if path is None:
        return
    data = json.dumps({"run": int(context.run_id), "done": sorted(done), "seen": seen})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{path.parent}: cannot make the party's state directory ({exc})") from exc
    write_local_file(path, data.encode(), what="churn marks", error=StoreError)


def done_events(context: Any) -> set[int]:
    """Indexes of the scenario's once-only actions this node already took in this run."""
    done = _record(context).get("done", [])
    marked = {int(d) for d in done} if isinstance(done, list) else set()
    return marked | _read(context)[0]


def mark_done(context: Any, done: set[int]) -> None:
    """Record ``done`` as the actions taken (before acting: once, even when refused)."""
    _record(context)["done"] = sorted(done)
    _write(context, done, seen_round(context))


def seen_round(context: Any) -> int:
    """The newest round of a message this node took in this run (-1: none)."""
    seen = _record(context).get("seen", -1)
    mine = seen if isinstance(seen, int) and not isinstance(seen, bool) else -1
    return max(mine, _read(context)[1])


def note_round(context: Any, rnd: int) -> None:
    """A message of round ``rnd`` was taken: later ones are of this round at least."""
    if rnd > seen_round(context):
        _record(context)["seen"] = rnd
        _write(context, done_events(context), rnd)
