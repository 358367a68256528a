"""The demo's report: accuracy per round, every churn event and how long it took to settle,
every join's shares per donor and its delay against the planner's lower bound.

The inputs are what the example's ServerApp writes to its ``progress-path`` (one JSON line per
finished round, each carrying every :class:`~chaos_flwr.flower.RoundLog` of the run so far, so a
killed ServerApp leaves its history behind) for the churn-free FedAvg run and for each run of
the churn scenario (a second run after a server kill). :func:`build_report` turns them into
``report.json``; :func:`render_table` into the terminal summary (rich); :func:`plot_report`
into ``report.png`` (matplotlib, Agg).

``report.json`` layout (all times in seconds, accuracies in [0, 1]):

- ``scenario``: name, rounds, parties, events (as in the YAML);
- ``accuracy``: ``{"fedavg": {round: acc}, "chaos": {round: acc}}`` (the chaos curve is the
  first run up to the kill, then the resumed run);
- ``final_accuracy``: both, ``gap`` (chaos - fedavg) and ``within_gap`` (``|gap| <=`` the
  allowed gap, 2 points by default);
- ``rounds``: per round of the churn run, parties sampled (sent a train message) and trained
  (answered it), eligible, holders, members by status from the server-side view, and which
  run (1 or 2) did it;
- ``events``: per scenario event, what the ServerApp saw (membership records with their
  settle time, rounds until a crashed party stopped being sampled, the resume after a kill);
- ``joins``: every join pull: donors, planned and received bytes per donor, pull time, lower
  bound and their ratio, and the time from the join round's start to the joiner's first
  training reply;
- ``server_restart``: the kill round, the resumed round, time from the new run's start to its
  first finished round, and the resume pull (shares per holder);
- ``runs``: wall time and exit code of each simulation run, pids killed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chaos_flwr.defaults import FLOWER_DEMO_MAX_ACCURACY_GAP
from chaos_flwr.errors import ConfigError
from chaos_flwr.flower.churn import ChurnScenario

__all__ = [
    "build_report",
    "plot_report",
    "read_progress",
    "render_table",
    "write_report",
]

_MEMBERSHIP_KIND = {
    "join": "join",
    "leave": "leave",
    "link-down": "link_down",
    "link-up": "link_up",
    "crash": "fail",
    "return": "join",
}


def read_progress(path: Path | str) -> list[dict[str, Any]]:
    """Read a ``progress-path`` file (one JSON object per line); a torn last line is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    out: list[dict[str, Any]] = []
    for line in p.read_text("utf-8", "replace").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # the writer was killed mid-line
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _accuracy(lines: Sequence[Mapping[str, Any]], first_round: int = 0) -> dict[int, float]:
    return {
        int(line["round"]): float(line["accuracy"])
        for line in lines
        if line.get("accuracy") is not None and int(line["round"]) >= first_round
    }


def _round_logs(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The newest copy of every RoundLog of one run (the last line carries them all)."""
    for line in reversed(lines):
        logs = line.get("chaos_rounds")
        if isinstance(logs, list):
            return [r for r in logs if isinstance(r, dict)]
    return []


def _partition_of(party_ids: Mapping[int, str]) -> dict[str, int]:
    return {pid: part for part, pid in party_ids.items()}


def _subject_parts(subject: str, parts: Mapping[str, int]) -> list[int]:
    return sorted(parts[s] for s in subject.split("|") if s in parts)


def build_report(
    scenario: ChurnScenario,
    *,
    baseline: Sequence[Mapping[str, Any]],
    chaos_runs: Sequence[Sequence[Mapping[str, Any]]],
    party_ids: Mapping[int, str],
    run_info: Sequence[Mapping[str, Any]] = (),
    resumed_run_start: float | None = None,
    max_gap: float = FLOWER_DEMO_MAX_ACCURACY_GAP,
) -> dict[str, Any]:
    """Build the report (module docstring) from the runs' progress lines.

    Parameters
    ----------
    scenario:
        The churn scenario that was run.
    baseline:
        Progress lines of the churn-free plain FedAvg run.
    chaos_runs:
        Progress lines of each run of the scenario (the second one resumed after a kill).
    party_ids:
        Partition id -> party id (from :func:`chaos_flwr.flower.keys.load_federation`).
    run_info:
        Free-form facts per run (wall time, exit code, pids), copied into ``runs``.
    resumed_run_start:
        Wall-clock time (``time.time()``) the resumed run was launched.
    max_gap:
        Largest accuracy gap called a match.
    """
    parts = _partition_of(party_ids)
    kill_round = scenario.server_kill_round()
    acc_fedavg = _accuracy(baseline)
    acc_chaos: dict[int, float] = {}
    logs: list[tuple[int, dict[str, Any]]] = []
    resume_logs: list[dict[str, Any]] = []
    line_time: dict[int, float] = {}
    for run_no, lines in enumerate(chaos_runs, start=1):
        # a resumed run re-evaluates the initial model as its round 0: not part of the curve
        first = 0 if run_no == 1 else 1
        nodes: dict[int, int] = {}
        for line in lines:
            for node, party in (line.get("node_parties") or {}).items():
                if party in parts:
                    nodes[int(node)] = parts[party]
        for rnd, acc in _accuracy(lines, first).items():
            acc_chaos[rnd] = acc
        for line in lines:
            if int(line["round"]) >= first:
                line_time[int(line["round"])] = float(line["time"])
        for i, rlog in enumerate(_round_logs(lines)):
            if run_no > 1 and i == 0 and not rlog.get("trained"):
                # a resumed run's first log is its hello (the resume), named after the round
                # it resumed from: that round's own log is the first run's
                resume_logs.append(dict(rlog))
                continue
            rlog = dict(rlog)
            failed = {int(n) for n in rlog.get("errors", {})} | {
                int(n) for n in rlog.get("missing", [])
            }
            # sampled: the inner strategy sent it a train message; trained: and it answered
            rlog["sampled_partitions"] = sorted(
                nodes.get(int(n), -1) for n in rlog.get("trained", [])
            )
            rlog["trained_partitions"] = sorted(
                nodes.get(int(n), -1) for n in rlog.get("trained", []) if int(n) not in failed
            )
            logs.append((run_no, rlog))
    by_round: dict[int, tuple[int, dict[str, Any]]] = {}
    for run_no, rlog in logs:
        rnd = int(rlog.get("server_round", -1))
        if rnd >= 0:
            by_round[rnd] = (run_no, rlog)  # a redone round: the resumed run's copy wins

    rounds_out = []
    for rnd in sorted(by_round):
        run_no, rlog = by_round[rnd]
        rounds_out.append(
            {
                "round": rnd,
                "run": run_no,
                "accuracy": acc_chaos.get(rnd),
                "sampled": len(rlog["sampled_partitions"]),
                "trained": len(rlog["trained_partitions"]),
                "eligible": len(rlog.get("eligible", [])),
                "holders": len(rlog.get("holders", [])),
                "missing": len(rlog.get("missing", [])),
                "errors": len(rlog.get("errors", {})),
                "skipped": rlog.get("skipped", ""),
                "members": {
                    status: [parts.get(p, p) for p in ids]
                    for status, ids in (rlog.get("members") or {}).items()
                },
                "sampled_partitions": rlog["sampled_partitions"],
                "trained_partitions": rlog["trained_partitions"],
            }
        )

    membership = [
        (run_no, ev)
        for run_no, rlog in [*logs, *((len(chaos_runs), r) for r in resume_logs)]
        for ev in rlog.get("events", []) or []
    ]
    joins_out = _joins(logs, parts, scenario, line_time, by_round)
    events_out = []
    for i, ev in enumerate(scenario.events):
        entry: dict[str, Any] = {"index": i, "label": ev.label(), **ev.model_dump()}
        if ev.kind == "server-kill":
            entry["settled"] = bool(len(chaos_runs) > 1 and _accuracy(chaos_runs[-1], 1))
            events_out.append(entry)
            continue
        want = _MEMBERSHIP_KIND[ev.kind]
        subject = {ev.party} if ev.peer is None else {ev.party, ev.peer}
        seen = [
            m
            for _, m in membership
            if m.get("kind") == want
            and set(_subject_parts(str(m.get("subject", "")), parts)) == subject
            and int(m.get("server_round", -1)) >= ev.round - 1
        ]
        seen.sort(key=lambda m: float(m.get("first_seen", 0.0)))
        if seen:
            rec = seen[0]
            entry["record"] = {
                "kind": rec.get("kind"),
                "record_id": rec.get("record_id"),
                "server_round": rec.get("server_round"),
                "settle_s": rec.get("settle_s"),
            }
        settle = entry.get("record", {}).get("settle_s")
        if ev.kind == "crash":
            # from the server side: the first round from the crash on that did not sample it
            # (the crash round itself may still sample it: its train message then fails)
            entry["excluded_in_round"] = _first_round_without(by_round, ev.party, ev.round)
            entry["settled"] = entry["excluded_in_round"] is not None
        elif ev.kind == "return":
            entry["trains_again_in_round"] = _first_round_with(by_round, ev.party, ev.round)
            entry["settled"] = entry["trains_again_in_round"] is not None
        elif ev.kind == "join":
            j = next((j for j in joins_out if j["partition"] == ev.party), None)
            entry["trains_in_round"] = j["first_trained_round"] if j else None
            entry["settled"] = bool(j and j["ok"] and j["first_trained_round"] is not None)
        else:
            entry["settled"] = settle is not None
        entry["settle_s"] = settle
        events_out.append(entry)

    restart: dict[str, Any] = {"kill_round": kill_round}
    if kill_round is not None and len(chaos_runs) > 1:
        resumed = chaos_runs[-1]
        first_line = next((line for line in resumed if int(line["round"]) >= 1), None)
        last_pull = next(
            (line.get("last_pull") for line in reversed(resumed) if line.get("last_pull")), None
        )
        restart.update(
            {
                "resumed_at_round": int(first_line["round"]) if first_line else None,
                "restart_to_first_round_s": (
                    float(first_line["time"]) - resumed_run_start
                    if first_line is not None and resumed_run_start is not None
                    else None
                ),
                "resume_pull": last_pull,
                "resumed_from_round": resume_logs[0].get("server_round") if resume_logs else None,
                "resume_holders": [parts.get(h, h) for h in resume_logs[0].get("holders", [])]
                if resume_logs
                else [],
            }
        )
    final_fedavg = acc_fedavg[max(acc_fedavg)] if acc_fedavg else None
    final_chaos = acc_chaos[max(acc_chaos)] if acc_chaos else None
    gap = (
        final_chaos - final_fedavg if final_chaos is not None and final_fedavg is not None else None
    )
    return {
        "scenario": {
            "name": scenario.name,
            "rounds": scenario.rounds,
            "institutions": scenario.institutions,
            "joiners": scenario.joiners,
            "events": [ev.model_dump() for ev in scenario.events],
        },
        "party_ids": {str(k): v for k, v in party_ids.items()},
        "accuracy": {
            "fedavg": {str(k): v for k, v in sorted(acc_fedavg.items())},
            "chaos": {str(k): v for k, v in sorted(acc_chaos.items())},
        },
        "final_accuracy": {
            "fedavg": final_fedavg,
            "chaos": final_chaos,
            "gap": gap,
            "max_gap": max_gap,
            "within_gap": gap is not None and abs(gap) <= max_gap,
        },
        "rounds": rounds_out,
        "events": events_out,
        "joins": joins_out,
        "server_restart": restart,
        "runs": list(run_info),
    }


def _first_round_without(
    by_round: Mapping[int, tuple[int, Mapping[str, Any]]], partition: int | None, start: int
) -> int | None:
    """First round from ``start`` on that trained without sampling ``partition``."""
    for rnd in sorted(r for r in by_round if r >= start):
        rlog = by_round[rnd][1]
        if rlog.get("trained") and partition not in rlog.get("sampled_partitions", []):
            return rnd
    return None


def _first_round_with(
    by_round: Mapping[int, tuple[int, Mapping[str, Any]]], partition: int | None, start: int
) -> int | None:
    """First round from ``start`` on in which ``partition`` trained."""
    for rnd in sorted(r for r in by_round if r >= start):
        if int(partition or 0) in by_round[rnd][1].get("trained_partitions", []):
            return rnd
    return None


def _joins(
    logs: Sequence[tuple[int, Mapping[str, Any]]],
    parts: Mapping[str, int],
    scenario: ChurnScenario,
    line_time: Mapping[int, float],
    by_round: Mapping[int, tuple[int, Mapping[str, Any]]],
) -> list[dict[str, Any]]:
    out = []
    seen: set[tuple[str, int]] = set()
    for run_no, rlog in logs:
        for j in rlog.get("joins", []) or []:
            party = str(j.get("party", ""))
            key = (party, int(j.get("server_round", -1)))
            if key in seen:
                continue
            seen.add(key)
            part = parts.get(party)
            pull_s = float(j.get("pull_s", 0.0) or 0.0)
            bound = float(j.get("lower_bound_s", 0.0) or 0.0)
            rnd = int(rlog.get("server_round", -1))
            first_trained = _first_round_with(by_round, part, rnd) if part is not None else None
            # from the start of the round of the scenario event that made it pull (its join, or
            # its return after a crash) to the end of the first round it trained in
            starts = [
                ev.round
                for ev in scenario.events
                if ev.party == part and ev.kind in ("join", "return") and ev.round <= rnd + 1
            ]
            join_round = max(starts) if starts else rnd
            start = line_time.get(join_round - 1)
            end = line_time.get(first_trained) if first_trained is not None else None
            out.append(
                {
                    "partition": part,
                    "party": party,
                    "run": run_no,
                    "round": rnd,
                    "pulled_round": j.get("server_round"),
                    "ok": bool(j.get("ok")),
                    "error": j.get("error", ""),
                    "donors": [parts.get(d, d) for d in j.get("donors", [])],
                    "planned_shards": {
                        str(parts.get(d, d)): v for d, v in (j.get("planned_shards") or {}).items()
                    },
                    "planned_bytes": {
                        str(parts.get(d, d)): v for d, v in (j.get("planned_bytes") or {}).items()
                    },
                    "bytes_per_donor": {
                        str(parts.get(d, d)): v for d, v in (j.get("bytes_per_donor") or {}).items()
                    },
                    "lost": [parts.get(d, d) for d in j.get("lost", [])],
                    "total_bytes": j.get("total_bytes"),
                    "pull_s": pull_s,
                    "lower_bound_s": bound,
                    "delay_ratio": pull_s / bound if bound > 0 else None,
                    "first_trained_round": first_trained,
                    "join_to_training_s": end - start
                    if end is not None and start is not None
                    else None,
                }
            )
    return out


def write_report(report: Mapping[str, Any], out_dir: Path | str) -> Path:
    """Write ``report.json`` into ``out_dir`` (created); return its path."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "report.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str), encoding="utf-8")
    return path


def plot_report(report: Mapping[str, Any], out_dir: Path | str) -> Path:
    """Plot accuracy over rounds (FedAvg without churn vs Chaos under churn), each scenario
    event marked at its round; write ``report.png`` into ``out_dir`` and return its path.

    Raises
    ------
    ConfigError
        matplotlib is not installed (``pip install -c constraints.txt -e '.[examples]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "report.png needs matplotlib: pip install -c constraints.txt -e '.[examples]'"
        ) from exc
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
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
    for i, ev in enumerate(report["events"]):
        x = ev["round"] - 0.5 + 0.08 * (i % 3)
        ax.axvline(x, color=colors.get(ev["kind"], "gray"), linestyle=":", linewidth=1.2)
        ax.text(
            x, 0.02 + 0.07 * (i % 4), ev["label"].split(" @")[0], rotation=90, fontsize=7,
            color=colors.get(ev["kind"], "gray"), transform=ax.get_xaxis_transform(),
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
    ax.legend(loc="lower right")
    path = folder / "report.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(value: Any, spec: str = ".3f", none: str = "-") -> str:
    if value is None:
        return none
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def render_table(report: Mapping[str, Any]) -> list[Any]:
    """The summary as rich renderables (accuracy per round, events, joins), to print in order."""
    from rich.table import Table

    acc = Table(title="Accuracy on the global test set")
    acc.add_column("round", justify="right")
    acc.add_column("FedAvg (no churn)", justify="right")
    acc.add_column("Chaos (churn)", justify="right")
    acc.add_column("trained", justify="right")
    acc.add_column("members (active / left / failed)")
    rounds = {r["round"]: r for r in report["rounds"]}
    fed, cha = report["accuracy"]["fedavg"], report["accuracy"]["chaos"]
    for rnd in sorted({int(k) for k in fed} | {int(k) for k in cha}):
        r = rounds.get(rnd, {})
        members = r.get("members") or {}
        mem = " / ".join(
            ",".join(str(p) for p in members.get(s, [])) or "-"
            for s in ("active", "left", "failed")
        )
        acc.add_row(
            str(rnd),
            _fmt(fed.get(str(rnd)), ".4f"),
            _fmt(cha.get(str(rnd)), ".4f"),
            ",".join(str(p) for p in r.get("trained_partitions", [])) or _fmt(r.get("trained")),
            mem if members else "-",
        )
    final = report["final_accuracy"]
    acc.caption = (
        f"final: Chaos {_fmt(final['chaos'], '.4f')} vs FedAvg {_fmt(final['fedavg'], '.4f')} "
        f"(gap {_fmt(final['gap'], '+.4f')}, allowed {final['max_gap']:.2f}: "
        f"{'OK' if final['within_gap'] else 'NOT within'})"
    )
    ev = Table(title="Churn events")
    ev.add_column("event")
    ev.add_column("record seen (round)")
    ev.add_column("settle", justify="right")
    ev.add_column("effect")
    ev.add_column("settled")
    restart = report.get("server_restart", {})
    for e in report["events"]:
        rec = e.get("record") or {}
        if e["kind"] == "server-kill":
            effect = (
                f"resumed at round {_fmt(restart.get('resumed_at_round'))}, first round done "
                f"{_fmt(restart.get('restart_to_first_round_s'), '.1f')} s after the new run "
                "started"
            )
        elif e["kind"] == "crash":
            effect = f"not sampled from round {_fmt(e.get('excluded_in_round'))}"
        elif e["kind"] == "return":
            effect = f"trains again in round {_fmt(e.get('trains_again_in_round'))}"
        elif e["kind"] == "join":
            effect = f"trains in round {_fmt(e.get('trains_in_round'))}"
        else:
            effect = ""
        settle = e.get("settle_s")
        ev.add_row(
            e["label"],
            f"{rec.get('kind')} (r{rec.get('server_round')})" if rec else "-",
            f"{settle * 1000:.0f} ms" if isinstance(settle, int | float) else "-",
            effect,
            "yes" if e.get("settled") else "NO",
        )
    jt = Table(title="Joins: shares per donor, delay vs the planner's lower bound")
    jt.add_column("joiner")
    jt.add_column("round", justify="right")
    jt.add_column("bytes per donor (planned -> received)")
    jt.add_column("pull", justify="right")
    jt.add_column("lower bound", justify="right")
    jt.add_column("ratio", justify="right")
    jt.add_column("join -> training", justify="right")
    for j in report["joins"]:
        shares = ", ".join(
            f"p{d}: {j['planned_bytes'].get(d, 0)}->{j['bytes_per_donor'].get(d, 0)}"
            for d in sorted(set(j["planned_bytes"]) | set(j["bytes_per_donor"]))
        )
        jt.add_row(
            f"p{j['partition']}" + ("" if j["ok"] else f" FAILED: {j['error']}"),
            str(j["round"]),
            shares or "-",
            f"{j['pull_s'] * 1000:.0f} ms",
            f"{j['lower_bound_s'] * 1000:.1f} ms",
            _fmt(j["delay_ratio"], ".1f") + "x" if j["delay_ratio"] is not None else "-",
            _fmt(j["join_to_training_s"], ".1f") + " s"
            if j["join_to_training_s"] is not None
            else "-",
        )
    return [acc, ev, jt]
