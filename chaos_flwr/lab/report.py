"""The demo's report: accuracy per round, every churn event and how long it took to settle,
every join's shares per donor and its delay against the planner's lower bound.

The inputs are what the example's ServerApp writes to its ``progress-path`` (one JSON line per
finished round, each carrying every :class:`~chaos_flwr.flower.RoundLog` of the run so far, so a
killed ServerApp leaves its history behind) for the churn-free FedAvg run and for each run of
the churn scenario (a second run after a server kill). :func:`build_report` turns them into
``report.json``; :mod:`chaos_flwr.lab.render` draws it (``report.png``, the terminal summary).

``report.json`` layout (all times in seconds, accuracies in [0, 1]):

- ``scenario``: name, rounds, parties, events (as in the YAML);
- ``accuracy``: ``{"fedavg": {round: acc}, "chaos": {round: acc}}`` (the chaos curve is the
  first run up to the kill, then the resumed run);
- ``final_accuracy``: both, ``gap`` (chaos - fedavg) and ``within_gap`` (``|gap| <=`` the
  allowed gap, 2 points by default);
- ``rounds``: per round of the churn run, parties sampled (sent a train message) and trained
  (answered it), eligible, holders, members by status from the server-side view (a party whose
  signed ``fail`` record the ServerApp saw counts as failed from that round on, until a ``join``
  record), and which run (1 or 2) did it;
- ``events``: per scenario event, what the ServerApp saw (membership records with their
  settle time, rounds until a crashed party stopped being sampled, the resume after a kill);
- ``joins``: every join pull: donors, planned and received bytes per donor, pull time, lower
  bound and their ratio, and the time from the join round's start to the joiner's first
  training reply;
- ``server_restart``: the kill round, the resumed round, time from the new run's start to its
  first finished round split into the engine's start-up, Chaos's own resume (hello, pull,
  verification) and the round itself, and the resume pull (shares per holder);
- ``runs``: wall time and exit code of each simulation run, pids killed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_flwr.lab.scenario import ChurnEvent, ChurnScenario
from chaos_flwr.lab.settings import FLOWER_DEMO_MAX_ACCURACY_GAP

__all__ = ["build_report", "read_progress", "trained_nodes", "write_report"]

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


def trained_nodes(rlog: Mapping[str, Any]) -> list[int]:
    """Nodes that trained in a RoundLog: sampled (sent a train message) and answered it.

    ``RoundLog.trained`` lists the sampled nodes; those that missed the deadline or answered
    with an error did not train. The live feed and the report count with this one rule.
    """
    failed = {int(n) for n in rlog.get("errors", {})} | {int(n) for n in rlog.get("missing", [])}
    return [int(n) for n in rlog.get("trained", []) if int(n) not in failed]


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


@dataclass(frozen=True)
class _ChaosHistory:
    """The churn runs' progress lines, merged: what every part of the report reads."""

    parts: Mapping[str, int]
    accuracy: dict[int, float]
    logs: list[tuple[int, dict[str, Any]]]
    resume_logs: list[dict[str, Any]]
    line_time: dict[int, float]
    by_round: dict[int, tuple[int, dict[str, Any]]]


def _run_logs(
    lines: Sequence[Mapping[str, Any]], run_no: int, parts: Mapping[str, int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One run's RoundLogs with sampled/trained partitions added, and its resume log (if any)."""
    nodes: dict[int, int] = {}
    for line in lines:
        for node, party in (line.get("node_parties") or {}).items():
            if party in parts:
                nodes[int(node)] = parts[party]
    logs: list[dict[str, Any]] = []
    resume_logs: list[dict[str, Any]] = []
    for i, rlog in enumerate(_round_logs(lines)):
        if run_no > 1 and i == 0 and not rlog.get("trained"):
            # a resumed run's first log is its hello (the resume), named after the round
            # it resumed from: that round's own log is the first run's
            resume_logs.append(dict(rlog))
            continue
        rlog = dict(rlog)
        # sampled: the inner strategy sent it a train message; trained: and it answered
        rlog["sampled_partitions"] = sorted(nodes.get(int(n), -1) for n in rlog.get("trained", []))
        rlog["trained_partitions"] = sorted(nodes.get(n, -1) for n in trained_nodes(rlog))
        logs.append(rlog)
    return logs, resume_logs


def _history(
    chaos_runs: Sequence[Sequence[Mapping[str, Any]]], parts: Mapping[str, int]
) -> _ChaosHistory:
    acc_chaos: dict[int, float] = {}
    logs: list[tuple[int, dict[str, Any]]] = []
    resume_logs: list[dict[str, Any]] = []
    line_time: dict[int, float] = {}
    for run_no, lines in enumerate(chaos_runs, start=1):
        # a resumed run re-evaluates the initial model as its round 0: not part of the curve
        first = 0 if run_no == 1 else 1
        for rnd, acc in _accuracy(lines, first).items():
            acc_chaos[rnd] = acc
        for line in lines:
            if int(line["round"]) >= first:
                line_time[int(line["round"])] = float(line["time"])
        run_logs, run_resumes = _run_logs(lines, run_no, parts)
        logs.extend((run_no, rlog) for rlog in run_logs)
        resume_logs.extend(run_resumes)
    by_round: dict[int, tuple[int, dict[str, Any]]] = {}
    for run_no, rlog in logs:
        rnd = int(rlog.get("server_round", -1))
        if rnd >= 0:
            by_round[rnd] = (run_no, rlog)  # a redone round: the resumed run's copy wins
    return _ChaosHistory(parts, acc_chaos, logs, resume_logs, line_time, by_round)


def _membership(history: _ChaosHistory) -> list[dict[str, Any]]:
    """Every membership record the ServerApp saw (each run's RoundLogs, the resumes' too)."""
    return [
        ev
        for rlog in [*(r for _, r in history.logs), *history.resume_logs]
        for ev in rlog.get("events", []) or []
    ]


def _down_by_round(history: _ChaosHistory) -> dict[int, set[str]]:
    """Round -> parties a signed ``fail`` record (seen by then, not undone by a later ``join``
    record) marks failed, whatever the server-side view's own statuses say."""
    timeline = sorted(
        (int(ev.get("server_round", -1)), float(ev.get("first_seen", 0.0)), ev)
        for ev in _membership(history)
        if ev.get("kind") in ("fail", "join")
    )
    down: set[str] = set()
    out: dict[int, set[str]] = {}
    pending = iter(timeline)
    nxt = next(pending, None)
    for rnd in sorted(history.by_round):
        while nxt is not None and nxt[0] <= rnd:
            subject = str(nxt[2].get("subject", ""))
            if nxt[2].get("kind") == "fail":
                down.add(subject)
            else:
                down.discard(subject)
            nxt = next(pending, None)
        out[rnd] = set(down)
    return out


def _members(rlog: Mapping[str, Any], down: set[str], parts: Mapping[str, int]) -> dict[str, Any]:
    """Members by status from the server's view, a party with a signed fail record as failed."""
    members = {str(k): list(v) for k, v in (rlog.get("members") or {}).items()}
    if members and down:
        for status in list(members):
            members[status] = [p for p in members[status] if p not in down]
        members["failed"] = sorted(set(members.get("failed", [])) | down)
    return {status: [parts.get(p, p) for p in ids] for status, ids in members.items()}


def _rounds(history: _ChaosHistory) -> list[dict[str, Any]]:
    parts = history.parts
    down = _down_by_round(history)
    rounds_out = []
    for rnd in sorted(history.by_round):
        run_no, rlog = history.by_round[rnd]
        rounds_out.append(
            {
                "round": rnd,
                "run": run_no,
                "accuracy": history.accuracy.get(rnd),
                "sampled": len(rlog["sampled_partitions"]),
                "trained": len(rlog["trained_partitions"]),
                "eligible": len(rlog.get("eligible", [])),
                "holders": len(rlog.get("holders", [])),
                "missing": len(rlog.get("missing", [])),
                "errors": len(rlog.get("errors", {})),
                "skipped": rlog.get("skipped", ""),
                "members": _members(rlog, down[rnd], parts),
                "sampled_partitions": rlog["sampled_partitions"],
                "trained_partitions": rlog["trained_partitions"],
            }
        )
    return rounds_out


def _first_record(
    ev: ChurnEvent, membership: Sequence[Mapping[str, Any]], parts: Mapping[str, int]
) -> dict[str, Any] | None:
    """The earliest membership record the ServerApp saw for the scenario event ``ev``."""
    want = _MEMBERSHIP_KIND[ev.kind]
    subject = {ev.party} if ev.peer is None else {ev.party, ev.peer}
    seen = [
        m
        for m in membership
        if m.get("kind") == want
        and set(_subject_parts(str(m.get("subject", "")), parts)) == subject
        and int(m.get("server_round", -1)) >= ev.round - 1
    ]
    seen.sort(key=lambda m: float(m.get("first_seen", 0.0)))
    if not seen:
        return None
    rec = seen[0]
    return {
        "kind": rec.get("kind"),
        "record_id": rec.get("record_id"),
        "server_round": rec.get("server_round"),
        "settle_s": rec.get("settle_s"),
    }


def _event_effect(
    entry: dict[str, Any],
    ev: ChurnEvent,
    history: _ChaosHistory,
    joins: Sequence[Mapping[str, Any]],
) -> None:
    """Add to ``entry`` what the event did to the rounds, and whether it settled."""
    settle = entry.get("record", {}).get("settle_s")
    if ev.kind == "crash":
        # from the server side: the first round from the crash on that did not sample it
        # (the crash round itself may still sample it: its train message then fails)
        entry["excluded_in_round"] = _first_round_without(history.by_round, ev.party, ev.round)
        entry["settled"] = entry["excluded_in_round"] is not None
    elif ev.kind == "return":
        entry["trains_again_in_round"] = _first_round_with(history.by_round, ev.party, ev.round)
        entry["settled"] = entry["trains_again_in_round"] is not None
    elif ev.kind == "join":
        j = next((j for j in joins if j["partition"] == ev.party), None)
        entry["trains_in_round"] = j["first_trained_round"] if j else None
        entry["settled"] = bool(j and j["ok"] and j["first_trained_round"] is not None)
    else:
        entry["settled"] = settle is not None
    entry["settle_s"] = settle


def _events(
    scenario: ChurnScenario,
    chaos_runs: Sequence[Sequence[Mapping[str, Any]]],
    history: _ChaosHistory,
    joins: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    membership = _membership(history)
    events_out = []
    for i, ev in enumerate(scenario.events):
        entry: dict[str, Any] = {"index": i, "label": ev.label(), **ev.model_dump()}
        if ev.kind == "server-kill":
            entry["settled"] = bool(len(chaos_runs) > 1 and _accuracy(chaos_runs[-1], 1))
            events_out.append(entry)
            continue
        record = _first_record(ev, membership, history.parts)
        if record is not None:
            entry["record"] = record
        _event_effect(entry, ev, history, joins)
        events_out.append(entry)
    return events_out


def _elapsed(end: Mapping[str, Any] | None, start: float | None) -> float | None:
    return float(end["time"]) - start if end is not None and start is not None else None


def _resume_split(
    resumed: Sequence[Mapping[str, Any]],
    first_line: Mapping[str, Any] | None,
    history: _ChaosHistory,
    resumed_run_start: float | None,
) -> dict[str, Any]:
    """The time from the new run's launch to its first round, in three parts.

    ``engine_startup_s``: launch until the new ServerApp evaluated the initial model (its
    round-0 progress line: Flower, and in simulation Ray, started). ``chaos_resume_s``: from
    there until the first resumed round began (the hello exchange, the multi-source pull and
    its verification), i.e. the rest minus that round's own train, certify and join phases
    (``first_round_s``). ``resume_pull_s``: the pull alone, as the ServerApp timed it.
    """
    up = next((line for line in resumed if int(line["round"]) == 0), None)
    out: dict[str, Any] = {
        "engine_startup_s": _elapsed(up, resumed_run_start),
        "chaos_resume_s": None,
        "first_round_s": None,
        "resume_pull_s": None,
    }
    pull = next((line["last_pull"] for line in reversed(resumed) if line.get("last_pull")), None)
    if isinstance(pull, Mapping) and pull.get("seconds") is not None:
        out["resume_pull_s"] = float(pull["seconds"])
    if first_line is None or up is None:
        return out
    run_no, rlog = history.by_round.get(int(first_line["round"]), (0, {}))
    phases = ("ask_s", "train_s", "certify_s", "join_s")
    own = sum(float(rlog.get(k, 0.0) or 0.0) for k in phases) if run_no > 1 else 0.0
    out["first_round_s"] = own
    out["chaos_resume_s"] = max(0.0, float(first_line["time"]) - float(up["time"]) - own)
    return out


def _restart(
    kill_round: int | None,
    chaos_runs: Sequence[Sequence[Mapping[str, Any]]],
    history: _ChaosHistory,
    resumed_run_start: float | None,
) -> dict[str, Any]:
    restart: dict[str, Any] = {"kill_round": kill_round}
    if kill_round is None or len(chaos_runs) <= 1:
        return restart
    parts, resume_logs = history.parts, history.resume_logs
    resumed = chaos_runs[-1]
    first_line = next((line for line in resumed if int(line["round"]) >= 1), None)
    last_pull = next(
        (line.get("last_pull") for line in reversed(resumed) if line.get("last_pull")), None
    )
    restart.update(
        {
            "resumed_at_round": int(first_line["round"]) if first_line else None,
            "restart_to_first_round_s": _elapsed(first_line, resumed_run_start),
            **_resume_split(resumed, first_line, history, resumed_run_start),
            "resume_pull": last_pull,
            "resumed_from_round": resume_logs[0].get("server_round") if resume_logs else None,
            "resume_holders": [parts.get(h, h) for h in resume_logs[0].get("holders", [])]
            if resume_logs
            else [],
        }
    )
    return restart


def _final_accuracy(
    acc_fedavg: Mapping[int, float], acc_chaos: Mapping[int, float], max_gap: float
) -> dict[str, Any]:
    final_fedavg = acc_fedavg[max(acc_fedavg)] if acc_fedavg else None
    final_chaos = acc_chaos[max(acc_chaos)] if acc_chaos else None
    gap = (
        final_chaos - final_fedavg if final_chaos is not None and final_fedavg is not None else None
    )
    return {
        "fedavg": final_fedavg,
        "chaos": final_chaos,
        "gap": gap,
        "max_gap": max_gap,
        "within_gap": gap is not None and abs(gap) <= max_gap,
    }


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
    acc_fedavg = _accuracy(baseline)
    history = _history(chaos_runs, parts)
    joins_out = _joins(history.logs, parts, scenario, history.line_time, history.by_round)
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
            "chaos": {str(k): v for k, v in sorted(history.accuracy.items())},
        },
        "final_accuracy": _final_accuracy(acc_fedavg, history.accuracy, max_gap),
        "rounds": _rounds(history),
        "events": _events(scenario, chaos_runs, history, joins_out),
        "joins": joins_out,
        "server_restart": _restart(
            scenario.server_kill_round(), chaos_runs, history, resumed_run_start
        ),
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
    chosen: dict[tuple[str, int], tuple[int, Mapping[str, Any], Mapping[str, Any]]] = {}
    for run_no, rlog in logs:
        for j in rlog.get("joins", []) or []:
            key = (str(j.get("party", "")), int(j.get("server_round", -1)))
            if key not in chosen or (j.get("ok") and not chosen[key][2].get("ok")):
                chosen[key] = (run_no, rlog, j)  # the first pull of a state, or the first ok
    for run_no, rlog, j in chosen.values():
        party = str(j.get("party", ""))
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
