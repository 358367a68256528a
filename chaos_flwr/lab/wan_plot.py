"""The timeline of ``chaos-flwr bench flower-wan``: one row per run, its events over time.

:func:`timeline_rows` takes the bench's JSON (:func:`~chaos_flwr.lab.wan_bench.measure_flower_wan`)
apart into rows (a label and events, each a kind, seconds from the run's start and a round);
:func:`plot_timeline` draws them into a PNG with matplotlib's Agg backend: round ends as ticks,
the joiner's SuperNode start and its first trained round, ServerApp kills, disk losses and the
first round finished after each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError
from chaos_flwr.lab.render import pyplot

__all__ = ["EVENT_KINDS", "WAN_TIMELINE_PNG", "plot_timeline", "timeline_rows"]

#: File name of the timeline when ``--plot`` names none.
WAN_TIMELINE_PNG = "flower-wan-timeline.png"

#: Event kind -> (marker, colour, legend label) in the timeline.
EVENT_KINDS: dict[str, tuple[str, str, str]] = {
    "round": ("|", "0.35", "round finished"),
    "join": (">", "tab:green", "joiner's SuperNode started"),
    "joined": ("*", "tab:green", "joiner's first trained round"),
    "kill": ("X", "tab:red", "ServerApp SIGKILL"),
    "disk_loss": ("D", "darkred", "SuperLink host's disk lost"),
    "resume": ("o", "tab:blue", "first round after the loss"),
}
#: Height of one run's row in the timeline figure, in inches (plus a fixed margin).
ROW_HEIGHT_IN = 0.45


def _check(rows: Sequence[Mapping[str, Any]]) -> None:
    """Refuse rows the plot cannot draw (:class:`ConfigError`)."""
    if not rows:
        raise ConfigError("timeline: no runs to plot")
    for row in rows:
        if not isinstance(row.get("label"), str) or not row["label"]:
            raise ConfigError(f"timeline: every row needs a label, got {row.get('label')!r}")
        for ev in row.get("events", []):
            kind, t = ev.get("kind"), ev.get("t")
            if kind not in EVENT_KINDS:
                raise ConfigError(f"timeline: unknown event kind {kind!r} in {row['label']!r}")
            ok = isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t)
            if not ok or t < 0:
                raise ConfigError(f"timeline: event time {t!r} in {row['label']!r} is not >= 0")


def plot_timeline(rows: Sequence[Mapping[str, Any]], path: Path | str, title: str = "") -> Path:
    """Draw ``rows`` (each ``label`` and ``events``: ``kind``, ``t`` in seconds from the run's
    start, ``round`` or None) into a PNG at ``path``; return the path.

    Raises
    ------
    ConfigError
        No rows, a row without a label, an unknown event kind or a time that is not a finite
        number >= 0; or matplotlib is missing.
    """
    _check(rows)
    plt = pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 2.2 + ROW_HEIGHT_IN * len(rows)), dpi=100,
                           layout="constrained")  # fmt: skip
    seen: set[str] = set()
    for y, row in enumerate(reversed(rows)):
        ax.axhline(y, color="0.9", lw=0.8, zorder=0)
        for ev in row.get("events", []):
            marker, colour, label = EVENT_KINDS[ev["kind"]]
            size = 14 if ev["kind"] == "round" else 8
            ax.plot([ev["t"]], [y], marker=marker, color=colour, ms=size, ls="none",
                    label=None if label in seen else label)  # fmt: skip
            seen.add(label)
            if ev["kind"] != "round" and ev.get("round") is not None:
                ax.annotate(f"r{ev['round']}", (ev["t"], y), xytext=(3, 5), fontsize=7,
                            textcoords="offset points")  # fmt: skip
    ax.set_yticks(range(len(rows)), [str(r["label"]) for r in reversed(rows)], fontsize=8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel("seconds from the run's start")
    ax.set_title(title or "flower-wan timeline", fontsize=10)
    fig.legend(fontsize=7, loc="outside lower center", ncol=3, frameon=False)
    fig.savefig(out)
    plt.close(fig)
    return out


def timeline_rows(fig: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of :func:`plot_timeline` from the bench's JSON: per placement, its join runs
    (plain, Chaos) and its server-loss runs (Chaos, plain with a checkpoint, plain)."""
    rows: list[dict[str, Any]] = []
    names = {"fedavg": "plain", "chaos": "Chaos", "plain_checkpoint": "plain+checkpoint",
             "plain": "plain", "direct": "Chaos direct"}  # fmt: skip
    for place, p in fig.get("placements", {}).items():
        for part, runs in (("join", p.get("runs") or {}), ("loss", p.get("loss_runs") or {})):
            for mode, reps in runs.items():
                for i, run in enumerate(reps):
                    rows.append({"label": f"{place} {part} {names.get(mode, mode)} #{i + 1}",
                                 "events": list(run.get("events") or [])})  # fmt: skip
    return rows
