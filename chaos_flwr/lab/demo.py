"""``chaos-flwr demo``: the multi-institution example under its churn scenario, in simulation.

Three simulation runs of the same app, data, seed and rounds (``flwr run`` through
:func:`chaos_flwr.lab.simulation.run_simulation_app`, each with its own SuperLink, stopped by
pid):

1. **baseline**: plain Flower FedAvg, no churn, every party there from round 1;
2. **churn**: ``ChaosStrategy(FedAvg)`` with signed parties (keys and a founder-signed charter
   from :func:`chaos_flwr.flower.keys.make_federation`, read through the run config
   ``chaos-keys-dir``; replicas under ``chaos-state-root``) and the scenario applied by the
   example's ``churn_app``. At the scenario's ``server-kill`` round the process running the
   ServerApp (``flwr-simulation``, which in simulation also hosts the virtual SuperNodes and
   Ray) is killed with SIGKILL mid-round: the closest thing to killing a server that the
   simulation engine has, and it kills the parties' processes too, so what survives is what
   they keep on disk;
3. **resume**: a new run of the same app on the same state root; ``ChaosStrategy`` rebuilds the
   newest certified state from the parties' replicas (verified receipts, shards from several
   holders) and finishes the rounds.

The report (:mod:`chaos_flwr.lab.report`) is written as ``report.json`` and ``report.png``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.example import example_dir
from chaos_flwr.lab.launch import app_folder
from chaos_flwr.lab.render import plot_report
from chaos_flwr.lab.report import build_report, read_progress, trained_nodes, write_report
from chaos_flwr.lab.scenario import ChurnScenario, load_scenario, parse_scenario
from chaos_flwr.lab.settings import (
    FLOWER_CHURN_RUN_CONFIG_KEY,
    FLOWER_CHURN_START_ROUND_KEY,
    FLOWER_DEMO_MAX_ACCURACY_GAP,
    FLOWER_DEMO_PHASE_TIMEOUT_S,
    FLOWER_DEMO_RUN_TIMEOUT_S,
    FLOWER_PROGRESS_RUN_CONFIG_KEY,
)
from chaos_flwr.lab.simulation import federation_options, run_simulation_app

__all__ = [
    "DemoResult",
    "DemoSettings",
    "churn_figures",
    "default_scenario",
    "demo_cli",
    "progress_text",
    "run_demo",
]

#: Called with (run label, newest progress line) whenever a run finishes a round.
ProgressFn = Callable[[str, dict[str, Any]], None]


def default_scenario() -> Path:
    """The churn scenario shipped with the example (``examples/multi_institution/churn.yaml``)."""
    return example_dir() / "churn.yaml"


@dataclass
class DemoResult:
    """What :func:`run_demo` produced.

    Attributes
    ----------
    report:
        The report (also in ``report.json``).
    report_path, plot_path:
        ``report.json`` and ``report.png`` (``None`` when the plot was not made).
    work_dir:
        Keys, replicas and progress files of the runs.
    """

    report: dict[str, Any]
    report_path: Path
    plot_path: Path | None
    work_dir: Path
    runs: list[Any] = field(default_factory=list)


class _Tail:
    """Reads new progress lines of a file and hands each to ``on_line``."""

    def __init__(self, path: Path, label: str, on_progress: ProgressFn | None) -> None:
        self.path = path
        self.label = label
        self.on_progress = on_progress
        self.seen = 0
        self.last_round = -1

    def poll(self) -> None:
        lines = read_progress(self.path)
        for line in lines[self.seen :]:
            self.last_round = max(self.last_round, int(line.get("round", -1)))
            if self.on_progress is not None:
                self.on_progress(self.label, line)
        self.seen = len(lines)


def _check_run(run: Any, label: str, *, killed_ok: bool = False) -> None:
    if killed_ok and run.killed:
        return
    if run.returncode != 0:
        raise TransportError(f"the {label} run failed (exit {run.returncode}):\n{run.log[-3000:]}")


@dataclass(frozen=True)
class DemoSettings:
    """What a demo run may change besides the scenario, its rounds and the time bound.

    Attributes
    ----------
    local_epochs:
        Override the example's local epochs (fewer: a faster, rougher demo).
    app_dir:
        The Flower app (default: the multi-institution example).
    max_gap:
        Largest accuracy gap (churn vs churn-free FedAvg) called a match.
    keep_work:
        Keep ``work/`` (keys, replicas, progress) after the run.
    workers:
        Simulation workers run at once (``None``: the app's ``federation.toml``; see
        :func:`~chaos_flwr.lab.simulation.run_simulation_app`).
    """

    local_epochs: int | None = None
    app_dir: Path | None = None
    max_gap: float = FLOWER_DEMO_MAX_ACCURACY_GAP
    keep_work: bool = True
    workers: int | None = None


def _scenario(
    scenario: ChurnScenario | Path | str | None, rounds: int | None
) -> tuple[ChurnScenario, Path | None]:
    """The scenario to run, and its file when it is one unchanged (else ``None``)."""
    if scenario is None:
        scenario = default_scenario()
    if isinstance(scenario, str | Path):
        scenario_path: Path | None = Path(scenario).resolve()
        scen = load_scenario(Path(scenario).resolve())
    else:
        scen = scenario
        scenario_path = None
    if rounds is not None:
        scen = parse_scenario({**scen.model_dump(), "rounds": rounds}, "scenario (rounds)")
        scenario_path = None
    return scen, scenario_path


class _Launcher:
    """Starts the demo's simulation runs, each with its progress file, and keeps their facts."""

    def __init__(
        self,
        app: Path,
        work: Path,
        common: dict[str, object],
        *,
        num_supernodes: int,
        timeout_s: float,
        on_progress: ProgressFn | None,
        workers: int | None = None,
    ) -> None:
        self.app = app
        self.work = work
        self.common = common
        self.num_supernodes = num_supernodes
        self.workers = workers
        self.timeout_s = timeout_s
        self.on_progress = on_progress
        self.runs: list[Any] = []
        self.info: list[dict[str, Any]] = []

    def launch(
        self, label: str, extra: dict[str, object], kill_round: int | None
    ) -> tuple[Any, Path]:
        """Run one simulation (its ServerApp killed in ``kill_round``); return it, its progress."""
        progress = self.work / f"progress-{label}.jsonl"
        tail = _Tail(progress, label, self.on_progress)

        def kill_when() -> bool:
            tail.poll()
            return kill_round is not None and tail.last_round >= kill_round - 1

        t0 = time.time()
        run = run_simulation_app(
            self.app,
            run_config={**self.common, **extra, FLOWER_PROGRESS_RUN_CONFIG_KEY: str(progress)},
            num_supernodes=self.num_supernodes,
            timeout_s=self.timeout_s,
            kill_when=kill_when,
            workers=self.workers,
        )
        tail.poll()
        (self.work / f"{label}.log").write_text(run.log, encoding="utf-8")
        self.runs.append(run)
        self.info.append(
            {
                "label": label,
                "started": t0,
                "wall_s": run.wall_s,
                "returncode": run.returncode,
                "killed_pids": len(run.killed),
                "pids_seen": len(run.pids),
            }
        )
        return run, progress


def _chaos_runs(
    launcher: _Launcher, scen: ChurnScenario, chaos_cfg: dict[str, object]
) -> tuple[list[list[dict[str, Any]]], float | None]:
    """The churn run and, after its server kill, the resumed run: their progress lines."""
    kill_round = scen.server_kill_round()
    chaos_run, chaos_progress = launcher.launch("chaos", chaos_cfg, kill_round)
    _check_run(chaos_run, "churn", killed_ok=True)
    chaos_lines = [read_progress(chaos_progress)]
    resumed_start: float | None = None
    if kill_round is not None:
        if not chaos_run.killed:
            raise TransportError(
                f"the churn run ended before its server-kill round {kill_round} "
                f"(exit {chaos_run.returncode}):\n{chaos_run.log[-3000:]}"
            )
        resumed_start = time.time()
        resumed, resumed_progress = launcher.launch(
            "resume", {**chaos_cfg, FLOWER_CHURN_START_ROUND_KEY: kill_round}, None
        )
        _check_run(resumed, "resumed")
        chaos_lines.append(read_progress(resumed_progress))
    return chaos_lines, resumed_start


def _common_config(scen: ChurnScenario, local_epochs: int | None) -> dict[str, object]:
    common: dict[str, object] = {
        "num-server-rounds": scen.rounds,
        # fewest parties a round trains with: the scenario takes several away at once
        "min-nodes": max(1, scen.institutions - 2),
        # the first exchange of a run waits for Ray to start its workers (tens of seconds on a
        # loaded machine); a node that misses it stays a suspect. Churned nodes answer at once
        # (with an error), so a long deadline costs nothing when nothing is slow.
        "phase-timeout-s": FLOWER_DEMO_PHASE_TIMEOUT_S,
    }
    if local_epochs is not None:
        common["local-epochs"] = local_epochs
    return common


def _fresh_work(work: Path, scen: ChurnScenario, scenario_path: Path | None) -> Path:
    """Empty ``work`` (created); return the scenario file, written there unless given."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if scenario_path is not None:
        return scenario_path
    import yaml

    path = work / "churn.yaml"
    path.write_text(yaml.safe_dump(scen.model_dump(mode="json"), sort_keys=False))
    return path


def run_demo(
    out_dir: Path | str,
    *,
    scenario: ChurnScenario | Path | str | None = None,
    rounds: int | None = None,
    timeout_s: float = FLOWER_DEMO_RUN_TIMEOUT_S,
    plot: bool = True,
    on_progress: ProgressFn | None = None,
    settings: DemoSettings | None = None,
) -> DemoResult:
    """Run the baseline, the churn run and (after a server kill) the resumed run; report.

    Parameters
    ----------
    out_dir:
        Where ``report.json``, ``report.png`` and the ``work/`` folder go (created).
    scenario:
        The churn scenario (default :func:`default_scenario`).
    rounds:
        Override the scenario's rounds (events past it are refused by validation).
    timeout_s:
        Wall-time bound of each simulation run.
    plot:
        Write ``report.png`` (needs matplotlib).
    on_progress:
        Called per finished round of each run (label ``fedavg``, ``chaos``, ``resume``).
    settings:
        Local epochs, app, allowed accuracy gap, whether to keep ``work/`` (default
        :class:`DemoSettings`).
    """
    from chaos_flwr.flower.keys import fedavg_rounds, load_federation, make_federation

    settings = settings or DemoSettings()
    app = settings.app_dir or example_dir()
    scen, scenario_path = _scenario(scenario, rounds)
    federation_options(app_folder(app), scen.num_parties, settings.workers)  # before work/ goes
    out = Path(out_dir).resolve()
    work = out / "work"
    scenario_path = _fresh_work(work, scen, scenario_path)
    keys = make_federation(  # FedAvg is the federation's rule: one rota auditor per round
        work / "keys",
        scen.num_parties,
        founders=scen.institutions,
        seed="chaos-flwr-demo",
        rounds=fedavg_rounds(),
    )
    launcher = _Launcher(
        app,
        work,
        _common_config(scen, settings.local_epochs),
        num_supernodes=scen.num_parties,
        timeout_s=timeout_s,
        on_progress=on_progress,
        workers=settings.workers,
    )
    base_run, base_progress = launcher.launch("fedavg", {"mode": "fedavg"}, None)
    _check_run(base_run, "FedAvg baseline")
    chaos_cfg: dict[str, object] = {
        "mode": "chaos",
        "chaos-keys-dir": str(keys),
        "chaos-state-root": str(work / "state"),
        FLOWER_CHURN_RUN_CONFIG_KEY: str(scenario_path),
    }
    chaos_lines, resumed_start = _chaos_runs(launcher, scen, chaos_cfg)
    report = build_report(
        scen,
        baseline=read_progress(base_progress),
        chaos_runs=chaos_lines,
        party_ids=load_federation(keys).party_ids,
        run_info=launcher.info,
        resumed_run_start=resumed_start,
        max_gap=settings.max_gap,
    )
    report_path = write_report(report, out)
    plot_path = plot_report(report, out) if plot else None
    if not settings.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    if not report["accuracy"]["chaos"]:
        raise ConfigError(f"the churn run reported no accuracy; see {report_path}")
    return DemoResult(report, report_path, plot_path, work, launcher.runs)


def progress_text(line: dict[str, Any], *, resumed: bool = False) -> str:
    """One line of the demo's live feed for a progress line: accuracy, how many trained (the
    report's count: sampled and answered), membership records filed, join pulls. In a
    ``resumed`` run, round 0's line only says the new ServerApp is up (it evaluated its own
    initial model before resuming the parties' state)."""
    acc = line.get("accuracy")
    if resumed and line["round"] == 0:
        return "  ServerApp up: resuming the newest certified state from the parties"
    extra = ""
    logs = line.get("chaos_rounds") or []
    rlog = next((r for r in reversed(logs) if r.get("server_round") == line["round"]), None)
    if rlog is not None:
        extra = f"  trained {len(trained_nodes(rlog))}"
        sampled = len(rlog.get("trained", []))
        if sampled != len(trained_nodes(rlog)):
            extra += f" of {sampled} sampled"
        kinds = [e.get("kind") for e in rlog.get("events", [])]
        if kinds:
            extra += "  records: " + ", ".join(str(k) for k in kinds)
        for j in rlog.get("joins", []):
            extra += f"  join pull {'ok' if j.get('ok') else 'failed'}"
    acc_s = f"{acc:.4f}" if isinstance(acc, float) else "-"
    return f"  round {line['round']:>3}  accuracy {acc_s}{extra}"


def demo_cli(
    out: str,
    *,
    scenario: str | None = None,
    rounds: int | None = None,
    timeout_s: float = FLOWER_DEMO_RUN_TIMEOUT_S,
    plot: bool = True,
    workers: int | None = None,
) -> DemoResult:
    """``chaos-flwr demo``: :func:`run_demo` with rich progress and the summary tables."""
    from rich.console import Console

    from chaos_flwr.lab.render import render_table

    console = Console()
    titles = {
        "fedavg": "FedAvg, no churn",
        "chaos": "ChaosStrategy(FedAvg), churn",
        "resume": "ChaosStrategy(FedAvg), resumed after the server kill",
    }
    current = {"label": ""}

    def on_progress(label: str, line: dict[str, Any]) -> None:
        if label != current["label"]:
            current["label"] = label
            console.rule(titles.get(label, label))
        console.print(progress_text(line, resumed=label == "resume"))

    try:
        with console.status("running the demo (3 simulation runs)..."):
            result = run_demo(
                out,
                scenario=scenario,
                rounds=rounds,
                timeout_s=timeout_s,
                plot=plot,
                on_progress=on_progress,
                settings=DemoSettings(workers=workers),
            )
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise SystemExit(2) from None
    for table in render_table(result.report):
        console.print(table)
    console.print(f"report: {result.report_path}")
    if result.plot_path is not None:
        console.print(f"plot:   {result.plot_path}")
    return result


def churn_figures(engine: str, work_dir: Path) -> dict[str, Any]:
    """The figures of ``chaos-flwr bench flower-churn``: join-to-training and restart-to-resume
    times on the ``deployment`` engine (:func:`~chaos_flwr.lab.deploy_churn.measure_deploy_churn`)
    or in ``simulation`` (the demo's scenario, from its report)."""
    if engine == "deployment":
        from chaos_flwr.lab.deploy_churn import measure_deploy_churn

        fig = measure_deploy_churn(work_dir)
        fig.pop("progress", None)
        return {"engine": engine, **fig}
    res = run_demo(work_dir, plot=False)
    rep = res.report
    keys = ["partition", "round", "ok", "donors", "bytes_per_donor", "pull_s", "lower_bound_s"]
    keys += ["delay_ratio", "join_to_training_s"]
    return {
        "engine": engine,
        "joins": [{k: j[k] for k in keys} for j in rep["joins"]],
        "server_restart": rep["server_restart"],
        "events": [
            {"event": e["label"], "settle_s": e.get("settle_s"), "settled": e.get("settled")}
            for e in rep["events"]
        ],
        "final_accuracy": rep["final_accuracy"],
    }
