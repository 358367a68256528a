"""What the churn emulation has done on a node: its once-only actions and the newest round.

The marks live in Flower's ``Context.state`` (record ``chaos-churn``). On the simulation engine
with several workers that is not enough: a message handed to a worker carries a copy of the
node's Context taken when it was sent, and the last reply to come back sets the node's Context,
so a message that waited for its party's turn (:mod:`chaos_flwr.flower.client.lock`) while
another one acted would erase that action's mark, and a later message would act again (a link
taken down again after it came back up). So when the node's party has a state directory, the
marks are also kept in ``<state-dir>/churn.state`` (a file of another run is ignored), and a
mark in either place counts. The churn wrapper reads and writes them within the party's turn
when the app is Chaos-enabled (:func:`chaos_flwr.lab.churn.apply`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_flwr.errors import StoreError
from chaos_flwr.localfile import read_local_file, write_local_file

__all__ = ["CHURN_MARKS_MAX_BYTES", "MARKS_FILE", "STATE_KEY", "Marks"]

#: ``Context.state`` record where the wrapper keeps its marks.
STATE_KEY = "chaos-churn"
#: The marks' file name in the party's state directory.
MARKS_FILE = "churn.state"
#: Largest marks file read, in bytes (a few thousand event indexes).
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
    from chaos_flwr.flower.client.settings import state_dir_named

    state_dir = state_dir_named(context)
    return None if state_dir is None else state_dir / MARKS_FILE


def _read(path: Path | None, run_id: int) -> tuple[set[int], int]:
    """The done events and the newest round in a marks file (empty: none, or another run's).

    Raises
    ------
    StoreError
        The file is not a regular file, too large, or not marks.
    """
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
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise StoreError(f"{path}: not churn marks ({type(exc).__name__})") from None
    ints = isinstance(value, dict) and all(type(value.get(k)) is int for k in ("run", "seen"))
    done = value.get("done") if isinstance(value, dict) else None
    if not ints or not isinstance(done, list) or not all(type(d) is int for d in done):
        raise StoreError(f"{path}: not churn marks (want run, seen: int; done: list of int)")
    if value["run"] != run_id:
        return set(), -1
    return set(done), int(value["seen"])


@dataclass
class Marks:
    """A node's marks for one message: read once (:meth:`load`), saved on every change.

    Attributes
    ----------
    context:
        The node's Flower ``Context`` (its ``state`` holds the marks too).
    path:
        The node's marks file (``None``: its settings name no state directory).
    done:
        Indexes of the scenario's once-only actions this node already took in this run.
    seen:
        The newest round of a message this node took in this run (-1: none).
    """

    context: Any
    path: Path | None
    done: set[int] = field(default_factory=set)
    seen: int = -1

    @classmethod
    def load(cls, context: Any) -> Marks:
        """The marks of ``context``'s node: its ``Context.state`` and its marks file.

        Parameters
        ----------
        context
            The node's Flower ``Context``.

        Returns
        -------
        Marks
            A mark in either place counts.

        Raises
        ------
        StoreError
            The marks file is not a regular file, too large, or not marks.
        """
        path = _path(context)
        done, seen = _read(path, int(context.run_id))
        record = _record(context)
        held = record.get("done", [])
        done |= {int(d) for d in held} if isinstance(held, list) else set()
        mine = record.get("seen", -1)
        if type(mine) is int:
            seen = max(seen, mine)
        return cls(context, path, done, seen)

    def note_round(self, rnd: int) -> None:
        """A message of round ``rnd`` was taken: later ones are of this round at least.

        Raises
        ------
        StoreError
            The marks file cannot be written.
        """
        if rnd > self.seen:
            self.seen = rnd
            self._save()

    def mark_done(self, idx: int) -> None:
        """Action ``idx`` is taken (marked before acting: once, even when refused).

        Raises
        ------
        StoreError
            The marks file cannot be written.
        """
        self.done.add(idx)
        self._save()

    def _save(self) -> None:
        record = _record(self.context)
        record["done"] = sorted(self.done)
        record["seen"] = self.seen
        if self.path is None:
            return
        run = int(self.context.run_id)
        data = json.dumps({"run": run, "done": sorted(self.done), "seen": self.seen})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"{self.path.parent}: cannot make the state directory ({exc})"
            ) from exc
        write_local_file(self.path, data.encode(), what="churn marks", error=StoreError)
