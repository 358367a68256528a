"""How soon a joiner trains, Chaos vs plain FedAvg, on Flower's simulation engine (issue #16
item 4): the example app with a ``MODEL_MIB`` MiB model, ``FOUNDERS`` institutions from the
start and one allowlisted institution whose SuperNode comes at round ``JOIN_AT`` (a churn
scenario: before that round every message to it fails, as to a node that is not there).

Figures per run, from the ServerApp's progress lines: the round in which the joiner first
trains (the first round with every node a trainer) and the joiner's time from its first
message (the end of round ``JOIN_AT - 1``, when round ``JOIN_AT``'s messages go out) to the end
of that round. In Chaos mode the joiner is first admitted (a join record it and a sponsor
sign, relayed through the ServerApp) and then takes the certified state: with the default
``JoinSettings.source`` from the ServerApp in one message, the relay being the only path. It is
there when round ``JOIN_AT`` starts, so that happens before the round's training
(``JoinRelay.newcomers_first``) and it trains in round ``JOIN_AT``, as a FedAvg joiner whose
first message is round ``JOIN_AT``'s train message.

Run ``python tests/test_flower_join_timing.py [repeats] [model MiB]`` for the figures as JSON
(medians over the repeats, FedAvg and Chaos interleaved); the slow test runs one pair.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from chaos_flwr.lab.example import example_dir
from chaos_flwr.lab.overhead import hidden_for_mib
from chaos_flwr.lab.report import read_progress

#: Model size of the figure (MiB), institutions from the start, the joiner's round, rounds of
#: a figure run (rounds after the joiner's first give its round time); the test stops at the
#: round a Chaos joiner first trains in.
MODEL_MIB = 16.0
FOUNDERS = 4
JOIN_AT = 3
ROUNDS = 6
TEST_ROUNDS = JOIN_AT
#: Wall-time bound of one run, and of one exchange (a first 16 MiB exchange under load).
RUN_TIMEOUT_S = 900.0
EXCHANGE_TIMEOUT_S = 120.0


def _scenario(path: Path, rounds: int) -> Path:
    path.write_text(
        "name: join-at-round-3\n"
        f"rounds: {rounds}\ninstitutions: {FOUNDERS}\njoiners: 1\n"
        f"events:\n  - {{round: {JOIN_AT}, kind: join, party: {FOUNDERS}}}\n",
        encoding="utf-8",
    )
    return path


def join_figures(lines: list[dict[str, Any]], nodes: int) -> dict[str, Any]:
    """The joiner's first trained round and its time from its first message to that round's
    end, from a run's progress lines (``None`` when it never trained)."""
    at = {int(x["round"]): float(x["time"]) for x in lines}
    trainers = lines[-1].get("trainers_per_round") or [] if lines else []
    first = next((i + 1 for i, n in enumerate(trainers) if n >= nodes), None)
    start = at.get(JOIN_AT - 1)
    end = at.get(first) if first is not None else None
    rounds = sorted(at)
    walls = [at[r] - at[r - 1] for r in rounds if r - 1 in at and r > JOIN_AT + 1]
    return {
        "first_trained_round": first,
        "join_to_trained_s": end - start if end is not None and start is not None else None,
        "trainers_per_round": trainers,
        "round_s_after_join_median": statistics.median(walls) if walls else None,
    }


def run_once(
    mode: str, work: Path, keys: Path, model_mib: float, rounds: int = ROUNDS
) -> dict[str, Any]:
    """One run of the example in ``mode`` (``fedavg`` or ``chaos``) with the join scenario,
    ``rounds`` rounds long."""
    from chaos_flwr.lab.simulation import run_simulation_app

    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    cfg: dict[str, object] = {
        "mode": mode,
        "num-server-rounds": rounds,
        "min-nodes": FOUNDERS,  # the rounds before the join train with the founders
        "hidden": hidden_for_mib(model_mib),
        "round-timeout-s": EXCHANGE_TIMEOUT_S,
        "phase-timeout-s": EXCHANGE_TIMEOUT_S,
        "results-path": str(work / "results.json"),
        "progress-path": str(progress),
        "churn-scenario": str(_scenario(work / "scenario.yaml", rounds)),
        "chaos-keys-dir": str(keys),
        "chaos-state-root": str(work / "state"),
        "chaos-unsigned": False,
    }
    run = run_simulation_app(
        example_dir(), run_config=cfg, num_supernodes=FOUNDERS + 1, timeout_s=RUN_TIMEOUT_S
    )
    if run.returncode != 0:
        raise AssertionError(f"the {mode} run failed (exit {run.returncode}):\n{run.log[-3000:]}")
    lines = read_progress(progress)
    fig = join_figures(lines, FOUNDERS + 1)
    if mode == "chaos":
        joins = [j for r in (lines[-1].get("chaos_rounds") or []) for j in r.get("joins", [])]
        fig["joins"] = [
            {k: j.get(k) for k in ("server_round", "ok", "source", "steps", "pull_s",
                                   "total_bytes", "server_refused")}
            for j in joins
        ]  # fmt: skip
    return fig


def measure(repeats: int = 1, model_mib: float = MODEL_MIB, rounds: int = ROUNDS) -> dict[str, Any]:
    """Interleaved FedAvg/Chaos runs of ``rounds`` rounds; per-mode figures and medians."""
    from chaos_flwr.flower.keys import fedavg_rounds, make_federation

    out: dict[str, Any] = {"model_mib": model_mib, "join_at": JOIN_AT, "rounds": rounds}
    out["loadavg_before"] = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {"fedavg": [], "chaos": []}
    with tempfile.TemporaryDirectory(prefix="chaos-join-timing-") as tmp:
        keys = make_federation(
            Path(tmp) / "keys", FOUNDERS + 1, founders=FOUNDERS, seed="join-timing",
            rounds=fedavg_rounds(),
        )  # fmt: skip
        for rep in range(repeats):
            for mode in runs:
                work = Path(tmp) / f"{mode}-{rep}"
                runs[mode].append(run_once(mode, work, keys, model_mib, rounds))
    out["loadavg_after"] = os.getloadavg()[0]
    out["runs"] = runs
    for mode, figs in runs.items():
        times = [f["join_to_trained_s"] for f in figs if f["join_to_trained_s"] is not None]
        out[mode] = {
            "first_trained_round": [f["first_trained_round"] for f in figs],
            "join_to_trained_s_median": statistics.median(times) if times else None,
        }
    return out


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_a_joiner_through_the_relay_trains_about_when_a_fedavg_joiner_does(
    flower_env: Path,
) -> None:
    fig = measure(repeats=1, rounds=TEST_ROUNDS)
    print(json.dumps(fig, indent=1))  # the measured figures (pytest -s)
    fedavg, chaos = fig["runs"]["fedavg"][0], fig["runs"]["chaos"][0]
    assert fedavg["first_trained_round"] == JOIN_AT
    # Chaos finds it there when round JOIN_AT starts (before, the emulation fails every
    # message to it): it is asked, admitted (its join request goes out with its reply, a
    # sponsor countersigns) and takes round JOIN_AT - 1's state in one message from the
    # ServerApp before the round's training, so it trains in round JOIN_AT, as FedAvg's does
    ((join,),) = [chaos["joins"]]
    assert join["ok"] and join["source"] == "server" and join["steps"] == 1
    assert join["server_round"] == JOIN_AT - 1
    assert join["total_bytes"] >= 0.99 * MODEL_MIB * (1 << 20)
    assert chaos["first_trained_round"] == fedavg["first_trained_round"] == JOIN_AT
    assert chaos["join_to_trained_s"] is not None and fedavg["join_to_trained_s"] is not None


if __name__ == "__main__":
    args = [float(a) for a in sys.argv[1:]]
    reps = int(args[0]) if args else 1
    print(json.dumps(measure(reps, args[1] if len(args) > 1 else MODEL_MIB), indent=1))
