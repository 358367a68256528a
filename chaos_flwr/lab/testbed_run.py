"""One run of the multi-institution example on a fresh testbed (``chaos-flwr testbed``).

:func:`run_on_testbed` builds the testbed of a WAN profile
(:func:`~chaos_flwr.lab.testbed.wan_testbed`), starts every institution's SuperNode, runs the
example for a few rounds with plain FedAvg or ChaosStrategy(FedAvg) (signed parties), reports
each round as it finishes, and returns the figures: round wall times, ClientApp processes per
round, the bytes each host's interface sent and received during the run, the shaping in place,
and what was left behind (nothing).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.deployment import clientapp_pids
from chaos_flwr.lab.example import example_dir
from chaos_flwr.lab.launch import read_results
from chaos_flwr.lab.overhead import clientapp_figures, hidden_for_mib, node_configs, run_figures
from chaos_flwr.lab.processes import alive
from chaos_flwr.lab.report import read_progress
from chaos_flwr.lab.settings import (
    FLOWER_CLIENTAPP_SAMPLE_S,
    FLOWER_ENGINE_POLL_S,
    FLOWER_OVERHEAD_DEFAULT_HIDDEN,
    TESTBED_EXCHANGE_TIMEOUT_S,
    TESTBED_ROUNDS,
    TESTBED_RUN_TIMEOUT_S,
)
from chaos_flwr.lab.testbed import DEFAULT_SERVER, WanTestbed, wan_testbed
from chaos_flwr.transport.netns import namespaces
from chaos_flwr.transport.shaping import WanProfile

__all__ = ["MODES", "WanRunSpec", "bytes_table", "run_on_testbed", "start_run"]

MODES = ("fedavg", "chaos")


@dataclass(frozen=True)
class WanRunSpec:
    """One run on the testbed: mode, rounds, model size, where the server is, bounds."""

    mode: str = "fedavg"
    rounds: int = TESTBED_ROUNDS
    model_mib: float | None = None
    server: str = DEFAULT_SERVER
    institutions: tuple[str, ...] | None = None
    timeout_s: float = TESTBED_RUN_TIMEOUT_S
    exchange_timeout_s: float = TESTBED_EXCHANGE_TIMEOUT_S
    app_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode: give one of {MODES}, got {self.mode!r}")
        if self.rounds < 1:
            raise ConfigError(f"rounds: give at least 1, got {self.rounds}")
        if self.model_mib is not None and not self.model_mib > 0:
            raise ConfigError(f"model_mib: give a size > 0 MiB, got {self.model_mib}")

    @property
    def hidden(self) -> int:
        """The example model's layer width for ``model_mib`` (its own default if None)."""
        if self.model_mib is None:
            return FLOWER_OVERHEAD_DEFAULT_HIDDEN
        return hidden_for_mib(self.model_mib)


def _keys(work: Path, n: int) -> Path:
    """A signed federation of ``n`` founders (keys + the default charter)."""
    from chaos_flwr.flower.keys import make_federation

    return make_federation(work / "keys", n, founders=n, seed="testbed")


def run_config(
    spec: WanRunSpec, keys: Path | None, work: Path, min_nodes: int
) -> dict[str, object]:
    """The example's run config for ``spec`` (results and progress files under ``work``)."""
    cfg: dict[str, object] = {
        "mode": spec.mode,
        "num-server-rounds": spec.rounds,
        "min-nodes": min_nodes,
        "local-epochs": 1,
        "hidden": spec.hidden,
        # both modes poll the SuperLink as often as Flower's own deployment grid does
        "poll-interval-s": FLOWER_ENGINE_POLL_S["deployment"],
        "round-timeout-s": spec.exchange_timeout_s,
        "phase-timeout-s": spec.exchange_timeout_s,
        "results-path": str(work / "results.json"),
        "progress-path": str(work / "progress.jsonl"),
    }
    if keys is not None:
        cfg["chaos-keys-dir"] = str(keys)
    return cfg


def start_run(
    bed: WanTestbed, spec: WanRunSpec, work: Path, *, min_nodes: int | None = None
) -> tuple[Any, list[Mapping[str, object]]]:
    """Make the run's keys (chaos: signed parties) and node configs, start ``flwr run``.

    Returns the ``flwr run`` process and one node config per institution (in order); no
    SuperNode is started.
    """
    n = len(bed.institutions)
    keys = _keys(work, n) if spec.mode == "chaos" else None
    nodes = node_configs(n, keys, work / "state")
    cfg = run_config(spec, keys, work, min_nodes if min_nodes is not None else n)
    return bed.cluster.start_run(cfg, "run.log"), nodes


def _follow(
    bed: WanTestbed,
    proc: Any,
    work: Path,
    timeout_s: float,
    say: Callable[[str], None],
    clientapps: dict[int, float],
) -> None:
    """Wait for ``flwr run``; note ClientApp processes, report each finished round."""
    deadline = time.monotonic() + timeout_s
    shown = 0
    nodes = [p.pid for p in bed.cluster.supernodes.values()]
    while True:
        for pid in clientapp_pids(nodes):
            clientapps.setdefault(pid, time.time())
        lines = read_progress(work / "progress.jsonl")
        for line in lines[shown:]:
            acc = line.get("accuracy")
            trainers = (line.get("trainers_per_round") or [None])[-1]
            say(f"round {line['round']}: accuracy {acc if acc is None else f'{acc:.3f}'}, "
                f"trainers {trainers}")  # fmt: skip
        shown = max(shown, len(lines))
        if proc.poll() is not None:
            return
        if time.monotonic() > deadline:
            raise TransportError(
                f"timeout_s: the run did not finish within {timeout_s:.0f} s on the testbed; "
                f"see {bed.cluster.logs}"
            )
        time.sleep(FLOWER_CLIENTAPP_SAMPLE_S)


def _delta(
    after: Mapping[str, Mapping[str, int]], before: Mapping[str, Mapping[str, int]]
) -> dict[str, dict[str, int]]:
    return {h: {k: after[h][k] - before[h][k] for k in after[h]} for h in after}


def run_on_testbed(
    profile: WanProfile,
    spec: WanRunSpec,
    work_dir: Path,
    *,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build the testbed, run the example once on it, tear everything down; return figures.

    Returns
    -------
    dict
        ``mode``, ``rounds``, ``model_bytes``, ``returncode``, ``round_wall_s`` (each round),
        ``round_wall_s_median`` (round 1 left out when there are more), ``final_accuracy``,
        ``clientapp_per_round`` (median ClientApp processes the SuperNodes started per round),
        ``bytes`` (host -> bytes/packets its interface sent and received during the run),
        ``qdiscs`` (host -> ``tc qdisc show`` of its uplink and downlink), ``testbed`` (hosts,
        addresses, rates, latencies), ``pids_alive`` and ``namespaces_left`` (both empty when
        everything was removed).
    """
    tell = say or (lambda _msg: None)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    app = spec.app_dir or example_dir()
    out: dict[str, Any] = {"mode": spec.mode, "rounds": spec.rounds, "hidden": spec.hidden}
    clientapps: dict[int, float] = {}
    with wan_testbed(profile, work / "bed", app_dir=app, server=spec.server,
                 institutions=spec.institutions) as bed:  # fmt: skip
        made = {bed.net.hub, *bed.net.namespaces.values()}
        out["testbed"] = bed.describe()
        tell(f"testbed up: SuperLink at {out['testbed']['superlink']} (TLS, SuperNode auth), "
             f"SuperNodes at {', '.join(bed.institutions)}")  # fmt: skip
        before = bed.counters()
        t0 = time.monotonic()
        proc, nodes = start_run(bed, spec, work)
        for host, node in zip(bed.institutions, nodes, strict=True):
            bed.start_supernode(host, node)
        _follow(bed, proc, work, spec.timeout_s, tell, clientapps)
        out["wall_s"] = time.monotonic() - t0
        out["returncode"] = proc.returncode
        out["bytes"] = _delta(bed.counters(), before)
        out["qdiscs"] = bed.qdiscs()
        results = read_results(work / "results.json")
        logs = bed.cluster.logs
    pids = bed.cluster.close()
    out["pids_alive"] = [p for p in pids if alive(p)]
    out["namespaces_left"] = sorted(namespaces() & made)  # its own (another testbed may run)
    if proc.returncode != 0 or not results:
        with contextlib.suppress(OSError):
            tail = (logs / "run.log").read_text("utf-8", "replace")[-2000:]
            raise TransportError(f"the {spec.mode} run failed (exit {proc.returncode}):\n{tail}")
        raise TransportError(f"the {spec.mode} run failed (exit {proc.returncode})")
    out.update(_figures(results, clientapps, logs))
    return out


def _figures(
    results: Mapping[str, Any], clientapps: Mapping[int, float], logs: Path
) -> dict[str, Any]:
    fig = run_figures(results)
    walls = [float(w) for w in results["round_wall_s"]]
    cap = clientapp_figures(results, clientapps, logs)
    return {
        "model_bytes": results.get("model_bytes"),
        "final_accuracy": fig["final_accuracy"],
        "round_wall_s": walls,
        "round_wall_s_median": statistics.median(walls[1:] if len(walls) > 1 else walls),
        "messages_per_round": results.get("messages_per_round"),
        "trainers_per_round": results.get("trainers_per_round"),
        "clientapp_processes_per_round": cap["clientapp_processes_per_round"],
        "clientapp_per_round": cap["clientapp_processes_per_round_median"],
    }


def _mbit(v: int | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def bytes_table(fig: Mapping[str, Any]) -> str:
    """The bytes each host's interface sent and received, with its rates (a text table)."""
    hosts = fig["testbed"]["hosts"]
    rows = [f"{'host':<12} {'role':<20} {'address':<12} {'up Mbit/s':>10} {'down Mbit/s':>11} "
            f"{'sent MB':>9} {'received MB':>12}"]  # fmt: skip
    for h, info in hosts.items():
        sent, received = fig["bytes"][h]["tx_bytes"] / 1e6, fig["bytes"][h]["rx_bytes"] / 1e6
        rows.append(
            f"{h:<12} {info['role']:<20} {info['address']:<12} {_mbit(info['up_bit_s']):>10} "
            f"{_mbit(info['down_bit_s']):>11} {sent:>9.2f} {received:>12.2f}"
        )
    return "\n".join(rows)
