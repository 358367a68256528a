"""The lab's own tunables: launch bounds, churn scenarios, the demo and the deployment figure.

These are used only by :mod:`chaos_flwr.lab` (and its tests); the library's defaults stay in
:mod:`chaos_flwr.defaults`.
"""

from __future__ import annotations

# --- launching Flower ------------------------------------------------------------------------
#: How long the runner waits for a SuperLink it started to answer on /health.
FLOWER_SUPERLINK_STARTUP_TIMEOUT_S: float = 30.0
#: Default wall-time bound of one simulation run started by the runner.
FLOWER_RUN_TIMEOUT_S: float = 300.0
#: Grace between SIGTERM and SIGKILL when the runner stops the processes it started.
FLOWER_STOP_GRACE_S: float = 5.0
#: How often the deployment runner looks for new ClientApp processes below the SuperNodes
#: (when asked to count them), in seconds; each lives for seconds (it imports the app).
FLOWER_CLIENTAPP_SAMPLE_S: float = 0.25
#: Bound of one ``flwr`` CLI command the lab runs (e.g. ``flwr supernode register``).
FLOWER_CLI_TIMEOUT_S: float = 60.0
#: How long the certificates the lab makes for a deployment stay valid, in days.
LAB_TLS_VALID_DAYS: int = 7
#: Virtual SuperNodes of the multi-institution example's simulation federation.
FLOWER_EXAMPLE_SUPERNODES: int = 5

# --- churn scenarios, the demo and its report ------------------------------------------------
#: Largest churn scenario YAML file read, in bytes.
FLOWER_CHURN_MAX_FILE_BYTES: int = 1 << 20
#: ``run_config`` key naming the churn scenario file the ClientApp wrapper applies ("" = none).
FLOWER_CHURN_RUN_CONFIG_KEY: str = "churn-scenario"
#: ``run_config`` key: round a resumed run starts in (rounds of messages that name none).
FLOWER_CHURN_START_ROUND_KEY: str = "churn-start-round"
#: Extra time the train handlers of the server-kill round take in the killed run, in seconds
#: (so the kill lands while the parties train).
FLOWER_CHURN_KILL_TRAIN_DELAY_S: float = 3.0
#: ``run_config`` key: file the example's ServerApp appends one JSON line to per round.
FLOWER_PROGRESS_RUN_CONFIG_KEY: str = "progress-path"
#: How often the demo reads the progress file of a running simulation, in seconds.
FLOWER_DEMO_POLL_S: float = 0.2
#: Default output folder of ``chaos-flwr demo``.
FLOWER_DEMO_OUT_DIR: str = "chaos-demo-report"
#: Largest accuracy gap (churn vs churn-free FedAvg, in accuracy points) the demo calls a match.
FLOWER_DEMO_MAX_ACCURACY_GAP: float = 0.02
#: Wall-time bound of each simulation run of the demo, in seconds.
FLOWER_DEMO_RUN_TIMEOUT_S: float = 600.0
#: Phase deadline of the demo's Chaos runs, in seconds (their first exchange waits for Ray).
FLOWER_DEMO_PHASE_TIMEOUT_S: float = 90.0
#: Founding SuperNodes of the deployment-engine churn figure (one more joins mid-run).
FLOWER_DEPLOY_FOUNDERS: int = 3
#: Rounds of the deployment-engine churn figure's runs (more than the join, the crash and the
#: server kill need: the figure stops once the resumed run has finished a round).
FLOWER_DEPLOY_ROUNDS: int = 12
#: Phase deadline on the deployment engine (a ClientApp process starts per message there).
FLOWER_DEPLOY_PHASE_TIMEOUT_S: float = 40.0
#: Wall-time bound of the whole deployment-engine churn figure, in seconds.
FLOWER_DEPLOY_TIMEOUT_S: float = 660.0
#: Rounds after its start the deployment figure waits for the joiner to train before the crash.
FLOWER_DEPLOY_JOIN_ROUNDS: int = 3
#: Phase deadline of the resumed run of the deployment figure, in phase deadlines (its hello
#: waits while SuperNodes work through the killed run's queued messages).
FLOWER_DEPLOY_RESUME_PHASES: float = 3.0

# --- the overhead bench (chaos-flwr bench flower-overhead) -----------------------------------
#: How often Flower's own grids pull replies: the simulation engine's in-memory grid polls
#: every 0.1 s, the deployment engine's grid every 3 s. Chaos polls at the same interval.
FLOWER_ENGINE_POLL_S: dict[str, float] = {"simulation": 0.1, "deployment": 3.0}
#: Rounds of each run of the overhead bench.
FLOWER_OVERHEAD_ROUNDS: int = 6
#: Wall-time bound of each run of the overhead bench, in seconds (a 64 MiB model on 2 cores).
FLOWER_OVERHEAD_RUN_TIMEOUT_S: float = 1800.0
#: Bound of every exchange, both modes (FedAvg's ``round-timeout-s``, Chaos's first-round
#: deadline ``phase-timeout-s``): the same wait for a node with no history.
FLOWER_OVERHEAD_EXCHANGE_TIMEOUT_S: float = 300.0
#: Example model layer width when no size is asked for (the example's own, about 27 KB).
FLOWER_OVERHEAD_DEFAULT_HIDDEN: int = 64

# --- the multi-site testbed (chaos-flwr testbed, bench flower-wan) ---------------------------
#: Rounds of a ``chaos-flwr testbed`` run.
TESTBED_ROUNDS: int = 3
#: Wall-time bound of one run on the testbed, in seconds.
TESTBED_RUN_TIMEOUT_S: float = 900.0
#: Bound of every exchange on the testbed, both modes (FedAvg's ``round-timeout-s``, Chaos's
#: first-round ``phase-timeout-s``); a ClientApp process starts per message there.
TESTBED_EXCHANGE_TIMEOUT_S: float = 240.0
#: Model size of ``chaos-flwr bench flower-wan``, in MiB (the issue's default).
WAN_BENCH_MODEL_MIB: float = 64.0
#: Rounds of each run of the WAN bench (the joiner starts after WAN_BENCH_JOIN_AFTER_ROUND).
WAN_BENCH_ROUNDS: int = 6
#: Rounds every institution but the joiner trains before the joiner's SuperNode starts.
WAN_BENCH_JOIN_AFTER_ROUND: int = 2
#: The port each institution's party daemon serves direct links on in the WAN bench.
WAN_BENCH_DIRECT_PORT: int = 9300
#: The profile's institution that joins mid-run in the WAN bench.
WAN_BENCH_JOINER: str = "inst3"
#: Placements of the SuperLink in the WAN bench: name -> its host in the profile (testbed5).
WAN_BENCH_PLACEMENTS: dict[str, str] = {
    "server_at_institution": "inst2",
    "server_well_connected": "superlink",
}
#: Rounds of each server-loss run of the WAN bench (the kill, a resumed round, the disk loss).
WAN_LOSS_ROUNDS: int = 5
#: Rounds finished before the WAN bench kills the ServerApp with SIGKILL.
WAN_LOSS_KILL_AFTER_ROUND: int = 2
#: Least adaptive Chaos deadline of the server-loss runs, in seconds: on 2 shared cores a round's
#: replies can take over 1.5x the last round's, and a dropped node is not what is measured here.
WAN_LOSS_DEADLINE_FLOOR_S: float = 120.0
