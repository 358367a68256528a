"""The demo's report drawn: ``report.png`` (matplotlib, Agg) and the terminal summary (rich).

Both read the ``report.json`` mapping built by :func:`chaos_flwr.lab.report.build_report`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError

__all__ = ["event_labels", "plot_report", "pyplot", "render_table", "report_figure"]


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or :class:`ConfigError` if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "report.png needs matplotlib: pip install -c constraints.txt -e '.[examples]'"
        ) from exc
    return plt


def plot_report(report: Mapping[str, Any], out_dir: Path | str) -> Path:
    """Plot accuracy over rounds (FedAvg without churn vs Chaos under churn), each scenario
    event marked at its round; write ``report.png`` into ``out_dir`` and return its path.

    Raises
    ------
    ConfigError
        matplotlib is not installed (``pip install -c constraints.txt -e '.[examples]'``).
    """
    plt = pyplot()
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    fig = report_figure(report)
    path = folder / "report.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def report_figure(report: Mapping[str, Any]) -> Any:
    """The matplotlib figure of :func:`plot_report` (laid out, not saved)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for key, label, style in (
        ("fedavg", "FedAvg, no churn", "o--"),
        ("chaos", "ChaosStrategy(FedAvg), churn scenario", "s-"),
    ):
        curve = report["accuracy"].get(key, {})
        xs = sorted(int(r) for r in curve)
        ax.plot(xs, [curve[str(x)] for x in xs], style, label=label, markersize=4)
    colors = {
        "join": "tab:green",
        "leave": "tab:orange",
        "link-down": "tab:purple",
        "link-up": "tab:purple",
        "crash": "tab:red",
        "return": "tab:blue",
        "server-kill": "black",
    }
    for rnd, (kind, label) in event_labels(report).items():
        color = colors.get(kind, "gray")
        ax.axvline(rnd - 0.5, color=color, linestyle=":", linewidth=1.2)
        ax.text(
            rnd - 0.5, 0.03, label, rotation=90, fontsize=7, color=color, va="bottom",
            ha="right", transform=ax.get_xaxis_transform(),
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1},
        )  # fmt: skip
    final = report["final_accuracy"]
    ax.set_title(
        f"{report['scenario']['name']}: final accuracy Chaos {final['chaos']:.3f} vs "
        f"FedAvg {final['fedavg']:.3f}"
        if final["chaos"] is not None and final["fedavg"] is not None
        else report["scenario"]["name"]
    )
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy on the global test set")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")  # the curves rise to the right; event labels sit at the bottom
    fig.tight_layout()
    return fig


def event_labels(report: Mapping[str, Any]) -> dict[int, tuple[str, str]]:
    """Round -> (kind of its first event, one label naming all its events) for the plot.

    Events of one round share one marker and one label, so no two labels are drawn at the
    same place.
    """
    out: dict[int, tuple[str, str]] = {}
    for ev in report["events"]:
        text = str(ev["label"]).split(" @")[0]
        kind, prev = out.get(int(ev["round"]), (str(ev["kind"]), ""))
        out[int(ev["round"])] = (kind, f"{prev}, {text}" if prev else text)
    return out


def _fmt(value: Any, spec: str = ".3f", none: str = "-") -> str:
    if value is None:
        return none
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def render_table(report: Mapping[str, Any]) -> list[Any]:
    """The summary as rich renderables (accuracy per round, events, joins), to print in order."""
    return [_accuracy_table(report), _events_table(report), _joins_table(report)]


def _parties(partitions: Any) -> str:
    """Partitions as party names (``p0 p3``), never a bare number."""
    return " ".join(f"p{p}" for p in partitions)


def _trained_cell(rnd: int, r: Mapping[str, Any]) -> str:
    if rnd == 0:
        return "initial"  # round 0 certifies the initial model: nobody trains
    if not r:
        return "-"
    return _parties(r.get("trained_partitions", [])) or "none"


def _accuracy_table(report: Mapping[str, Any]) -> Any:
    from rich.table import Table

    acc = Table(title="Accuracy on the global test set")
    acc.add_column("round", justify="right")
    acc.add_column("FedAvg\nno churn", justify="right")
    acc.add_column("Chaos\nchurn", justify="right")
    acc.add_column("trained")
    acc.add_column("members\nactive / left / failed")
    rounds = {r["round"]: r for r in report["rounds"]}
    fed, cha = report["accuracy"]["fedavg"], report["accuracy"]["chaos"]
    for rnd in sorted({int(k) for k in fed} | {int(k) for k in cha}):
        r = rounds.get(rnd, {})
        members = r.get("members") or {}
        mem = " / ".join(_parties(members.get(s, [])) or "-" for s in ("active", "left", "failed"))
        acc.add_row(
            str(rnd),
            _fmt(fed.get(str(rnd)), ".4f"),
            _fmt(cha.get(str(rnd)), ".4f"),
            _trained_cell(rnd, r),
            mem if members else "-",
        )
    final = report["final_accuracy"]
    acc.caption = (
        f"final: Chaos {_fmt(final['chaos'], '.4f')} vs FedAvg {_fmt(final['fedavg'], '.4f')} "
        f"(gap {_fmt(final['gap'], '+.4f')}, allowed {final['max_gap']:.2f}: "
        f"{'OK' if final['within_gap'] else 'NOT within'})"
    )
    return acc


def _event_effect(e: Mapping[str, Any], restart: Mapping[str, Any]) -> str:
    if e["kind"] == "server-kill":
        return f"resumed at round {_fmt(restart.get('resumed_at_round'))} (below)"
    if e["kind"] == "crash":
        return f"not sampled from round {_fmt(e.get('excluded_in_round'))}"
    if e["kind"] == "return":
        return f"trains again in round {_fmt(e.get('trains_again_in_round'))}"
    if e["kind"] == "join":
        return f"trains in round {_fmt(e.get('trains_in_round'))}"
    return ""


def _events_table(report: Mapping[str, Any]) -> Any:
    from rich.table import Table

    ev = Table(title="Churn events")
    ev.add_column("event")
    ev.add_column("record seen (round)")
    ev.add_column("settle", justify="right")
    ev.add_column("effect")
    ev.add_column("settled")
    restart = report.get("server_restart", {})
    for e in report["events"]:
        rec = e.get("record") or {}
        effect = _event_effect(e, restart)
        settle = e.get("settle_s")
        ev.add_row(
            e["label"],
            f"{rec.get('kind')} (r{rec.get('server_round')})" if rec else "-",
            f"{settle * 1000:.0f} ms" if isinstance(settle, int | float) else "-",
            effect,
            "yes" if e.get("settled") else "NO",
        )
    if restart.get("resumed_at_round") is not None:
        ev.caption = _restart_caption(restart)
        ev.caption_justify = "left"
    return ev


def _restart_caption(restart: Mapping[str, Any]) -> str:
    """The server restart's time split: Flower's start-up apart from Chaos's own resume."""
    rnd = _fmt(restart.get("resumed_at_round"))
    return (
        f"server restart: round {rnd} done "
        f"{_fmt(restart.get('restart_to_first_round_s'), '.1f')} s after the new run's launch\n"
        f"= engine start-up {_fmt(restart.get('engine_startup_s'), '.1f')} s + Chaos resume "
        f"{_fmt(restart.get('chaos_resume_s'), '.1f')} s (hello, pull, verification; "
        f"the pull {_fmt(restart.get('resume_pull_s'), '.2f')} s)\n"
        f"+ round {rnd} itself {_fmt(restart.get('first_round_s'), '.1f')} s"
    )


def _size(n: Any) -> str:
    value = float(n or 0)
    for unit in ("B", "KB", "MB"):
        if value < 1000 or unit == "MB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} MB"


def _shares(j: Mapping[str, Any]) -> str:
    """One line per donor: planned bytes, and what came if it differs."""
    lines = []
    for d in sorted(set(j["planned_bytes"]) | set(j["bytes_per_donor"])):
        planned, got = j["planned_bytes"].get(d, 0), j["bytes_per_donor"].get(d, 0)
        tail = "" if planned == got else f" -> {_size(got)}"
        lines.append(f"p{d} {_size(planned)}{tail}")
    return "\n".join(lines) or "-"


def _joins_table(report: Mapping[str, Any]) -> Any:
    from rich.table import Table

    jt = Table(title="Joins: bytes per donor, pull time vs the planner's lower bound")
    jt.add_column("joiner")
    jt.add_column("round", justify="right")
    jt.add_column("per donor\n(planned -> got)")
    jt.add_column("pull", justify="right")
    jt.add_column("bound", justify="right")
    jt.add_column("ratio", justify="right")
    jt.add_column("join ->\ntraining", justify="right")
    for j in report["joins"]:
        jt.add_row(
            f"p{j['partition']}" + ("" if j["ok"] else f"\nFAILED: {j['error']}"),
            str(j["round"]),
            _shares(j),
            f"{j['pull_s'] * 1000:.0f} ms",
            f"{j['lower_bound_s'] * 1000:.1f} ms",
            _fmt(j["delay_ratio"], ".1f") + "x" if j["delay_ratio"] is not None else "-",
            _fmt(j["join_to_training_s"], ".1f") + " s"
            if j["join_to_training_s"] is not None
            else "-",
        )
    return jt
