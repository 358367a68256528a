"""The ``chaos-flwr`` command line.

Each command is a thin shell over a library function: the work (and its tests) lives in the
package, the CLI only parses options, shows progress and prints results.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from .defaults import (
    DIRECT_BENCH_MODEL_MIB,
    DIRECT_BENCH_RATES_MB_S,
    DIRECT_BENCH_REPEATS,
    GOSSIP_INTERVAL_S,
    GOSSIP_SUSPECT_S,
)

app = typer.Typer(
    name="chaos-flwr",
    help="Self-healing and autoscaling for Flower federated learning over WANs.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks that print JSON figures.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _print_json(result: Any) -> None:
    typer.echo(json.dumps(result, indent=2, sort_keys=True))


# --- bench planner ---------------------------------------------------------------------------
# (section owned by the planner)


@bench_app.command("planner")
def bench_planner(
    json_out: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
    repeats: int = typer.Option(200, "--repeats", min=1, help="Timed plans per size."),
    milp: bool = typer.Option(True, "--milp/--no-milp", help="Also time the exact MILP."),
) -> None:
    """Time the shard planner (m donors x max_shards) against the exact MILP."""
    from rich.console import Console
    from rich.table import Table

    from .bench.planner import run_planner_bench

    result = run_planner_bench(repeats=repeats, milp=milp)
    if json_out:
        _print_json(result)
        return
    table = Table(title=f"shard planner, pinned core {result['pinned_core']}")
    for col in (
        "m",
        "max_shards",
        "K",
        "makespan s",
        "bound s",
        "median ms",
        "MILP ms",
        "match",
        "speedup",
    ):
        table.add_column(col, justify="right")
    for r in result["results"]:
        mi = r["milp"]
        ok = mi["status"] == "optimal"
        table.add_row(
            str(r["m"]),
            str(r["max_shards"]),
            str(r["num_shards"]),
            f"{r['makespan_s']:.4f}",
            f"{r['lower_bound_s']:.4f}",
            f"{r['median_ms']:.3f}",
            f"{mi['time_ms']:.1f}" if ok else mi["status"],
            str(mi["makespan_match"]) if ok else "-",
            f"{mi['speedup']:.0f}x" if ok else "-",
        )
    Console().print(table)


# --- identity / charter ----------------------------------------------------------------------
# (section owned by identity and charter)


charter_app = typer.Typer(
    help="Create, sign and verify a federation charter.", no_args_is_help=True
)
app.add_typer(charter_app, name="charter")


def _fail(exc: Exception) -> NoReturn:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=1)


@app.command("keygen")
def keygen(
    out: Annotated[Path, typer.Option("--out", help="Directory for <name>.key and <name>.pub.")],
    name: Annotated[
        str | None, typer.Option("--name", help="Key file name (default: party id).")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing key of that name.")
    ] = False,
) -> None:
    """Create an Ed25519 party identity; prints its party id and the key paths."""
    from .errors import ChaosError
    from .identity import Identity

    try:
        ident = Identity.generate(name)
        key_path = ident.save(out, overwrite=force)
    except ChaosError as exc:
        _fail(exc)
    typer.echo(f"party id:    {ident.party_id}")
    typer.echo(f"private key: {key_path}")
    typer.echo(f"public key:  {key_path.with_suffix('.pub')}")


def _members(paths: list[Path]) -> list[Any]:
    from .charter import Member
    from .identity import load_public_key, party_id_of

    members = []
    for path in paths:
        raw = load_public_key(path)
        stem = path.name.split(".")[0]
        try:
            members.append(Member.of(raw, name=stem or None))
        except ValueError:  # the file stem is not a valid member name: use the party id
            members.append(Member.of(raw, name=party_id_of(raw)))
    return members


#: The aggregation rule ``federation new`` writes into a charter unless told otherwise (the
#: shipped FedAvg profile: Flower's FedAvg aggregation, sampling left to the ServerApp).
FEDERATION_DEFAULT_RULE_PROFILE = "fedavg-wan"


def _rounds_of(rule_profile: str | None) -> Any:
    """The charter's ``rounds`` section fixing the profile's inner strategy as the rule."""
    if rule_profile is None:
        return None
    from .charter import RoundRules
    from .flower.rule import rule_of_profile

    return RoundRules(rule=rule_of_profile(rule_profile))


@charter_app.command("init")
def charter_init(
    federation: Annotated[str, typer.Option("--federation", help="Name of the federation.")],
    founder: Annotated[list[Path], typer.Option("--founder", help="A founder's .pub (repeat).")],
    out: Annotated[Path, typer.Option("--out", help="Charter file to write (YAML).")],
    allow: Annotated[
        list[Path] | None, typer.Option("--allow", help="An allowed .pub (repeat).")
    ] = None,
    sponsors_required: Annotated[
        int | None, typer.Option("--sponsors-required", help="Member signatures a join needs.")
    ] = None,
    failure_quorum: Annotated[
        int | None,
        typer.Option("--failure-quorum", help="Suspecting neighbours a fail record needs."),
    ] = None,
    heartbeat_interval: Annotated[
        float | None, typer.Option("--heartbeat-interval", help="Seconds between heartbeats.")
    ] = None,
    suspicion_timeout: Annotated[
        float | None,
        typer.Option("--suspicion-timeout", help="Seconds of silence before suspicion."),
    ] = None,
    replicas: Annotated[
        int | None, typer.Option("--replicas", help="Replicas of the state.")
    ] = None,
    keep_rounds: Annotated[int | None, typer.Option("--keep-rounds", help="Rounds kept.")] = None,
    founder_signatures: Annotated[
        int | None,
        typer.Option(
            "--founder-signatures-required", help="Founder signatures needed (default: all)."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    rule_profile: Annotated[
        str | None,
        typer.Option(
            "--rule-profile",
            help="Profile (name or path) whose inner strategy is the "
            "aggregation rule (rounds.rule).",
        ),
    ] = None,
) -> None:
    """Write an unsigned charter; each founder then runs 'chaos-flwr charter sign'."""
    from . import defaults as d
    from .charter import Charter
    from .errors import ChaosError

    if out.exists() and not force:
        _fail(FileExistsError(f"{out} already exists; pass --force to replace it"))
    try:
        charter = Charter.create(
            federation,
            _members(founder),
            _members(allow or []),
            sponsors_required=d.CHARTER_DEFAULT_SPONSORS_REQUIRED
            if sponsors_required is None
            else sponsors_required,
            failure_quorum=d.CHARTER_DEFAULT_FAILURE_QUORUM
            if failure_quorum is None
            else failure_quorum,
            heartbeat_interval_s=d.CHARTER_DEFAULT_HEARTBEAT_INTERVAL_S
            if heartbeat_interval is None
            else heartbeat_interval,
            suspicion_timeout_s=d.CHARTER_DEFAULT_SUSPICION_TIMEOUT_S
            if suspicion_timeout is None
            else suspicion_timeout,
            replicas=d.CHARTER_DEFAULT_REPLICAS if replicas is None else replicas,
            keep_rounds=d.CHARTER_DEFAULT_KEEP_ROUNDS if keep_rounds is None else keep_rounds,
            founder_signatures_required=founder_signatures,
            rounds=_rounds_of(rule_profile),
        )
        charter.save(out)
    except ChaosError as exc:
        _fail(exc)
    typer.echo(f"wrote {out}: federation {charter.federation!r}, digest {charter.digest.hex()}")
    typer.echo(
        f"{len(charter.founders)} founders, {len(charter.allowlist)} allowlisted; "
        f"{charter.required_signatures} founder signatures required"
    )


@charter_app.command("sign")
def charter_sign(
    file: Annotated[Path, typer.Argument(help="The charter file (rewritten in place).")],
    key: Annotated[Path, typer.Option("--key", help="A founder's private .key file.")],
) -> None:
    """Add a founder's signature to a charter file."""
    from .charter import load_charter
    from .errors import ChaosError
    from .identity import Identity

    try:
        charter = load_charter(file, verify=False)
        charter.verify(source=str(file), complete=False)
        signed = charter.sign(Identity.load(key))
        signed.save(file)
    except ChaosError as exc:
        _fail(exc)
    missing = signed.missing_signatures()
    have = len(signed.signatures)
    typer.echo(f"signed {file}: {have} of {signed.required_signatures} founder signatures required")
    if have < signed.required_signatures:
        typer.echo("still to sign: " + ", ".join(f"{m.name} ({m.party_id})" for m in missing))
    else:
        typer.echo("the charter is complete")


@charter_app.command("verify")
def charter_verify(
    file: Annotated[Path, typer.Argument(help="The charter file.")],
) -> None:
    """Check a charter: schema, values and founder signatures (exit code 1 if refused)."""
    from .charter import load_charter
    from .errors import ChaosError

    try:
        charter = load_charter(file)
    except ChaosError as exc:
        _fail(exc)
    typer.echo(f"OK {file}: federation {charter.federation!r}, digest {charter.digest.hex()}")
    typer.echo(
        f"{len(charter.founders)} founders, {len(charter.allowlist)} allowlisted, "
        f"{len(charter.signatures)} founder signatures"
    )


# --- federation new ----------------------------------------------------------------------------
# (section owned by the Flower integration: a whole federation's keys and charter in one step)


federation_app = typer.Typer(
    help="Create a whole federation (keys + signed charter) in one step.", no_args_is_help=True
)
app.add_typer(federation_app, name="federation")


def _split_names(names: str | None) -> list[str] | None:
    if names is None:
        return None
    return [n.strip() for n in names.split(",") if n.strip()]


def _remove_federation_files(folder: Path) -> None:
    """Delete the keys and charter of an earlier federation in ``folder`` (``--force``), so
    no stale ``party-<i>.key`` outlives it; state directories are left alone."""
    from .defaults import FLOWER_FEDERATION_KEY_PREFIX, IDENTITY_KEY_SUFFIX, IDENTITY_PUB_SUFFIX
    from .flower.keys import charter_path

    for file in folder.glob(f"{FLOWER_FEDERATION_KEY_PREFIX}*"):
        if file.is_file() and file.suffix in (IDENTITY_KEY_SUFFIX, IDENTITY_PUB_SUFFIX):
            file.unlink()
    charter_path(folder).unlink(missing_ok=True)


def _check_new_federation(
    parties: int, names: list[str] | None, allow: int, founders: int | None
) -> None:
    """Refuse counts ``federation new`` cannot make (ConfigError naming the option)."""
    from .errors import ConfigError

    if parties < 1:
        raise ConfigError(f"--parties must be >= 1, got {parties}")
    if allow < 0:
        raise ConfigError(f"--allow must be >= 0, got {allow}")
    if names is not None and len(names) != parties:
        raise ConfigError(f"--names gives {len(names)} names for --parties {parties}")
    if founders is not None and not 1 <= founders <= parties:
        raise ConfigError(f"--founders must be 1..{parties} (the parties), got {founders}")


def _federation_settings(folder: Path, state_root: Path) -> str:
    """What each SuperNode's node config and a simulation's run config need (the printout)."""
    from .charter import load_charter
    from .flower.client.settings import (
        NODE_CHARTER,
        NODE_KEY,
        NODE_STATE_DIR,
        RUN_KEYS_DIR,
        RUN_STATE_ROOT,
        env_name,
    )
    from .flower.keys import charter_path, key_path, load_federation

    fed = load_federation(folder)
    charter = load_charter(charter_path(folder))
    label = {m.party_id: m.name for m in [*charter.founders, *charter.allowlist]}
    founders = set(fed.founders)
    root, charter_file = state_root.resolve(), charter_path(folder).resolve()
    lines = [
        f"federation {charter.federation!r} in {folder.resolve()}: {len(fed.founders)} "
        f"founders signed {charter_file.name} (verified), digest {charter.digest.hex()[:16]}",
        "",
        "Deployment: start each SuperNode with its node config (the state dir is its own):",
    ]
    for pid, party in fed.party_ids.items():
        role = "founder" if party in founders else "allowlisted (joins later)"
        lines.append(f"  # {label.get(party, party)} (party {party}, {role})")
        lines.append(
            f'  --node-config \'{NODE_KEY}="{key_path(folder, pid).resolve()}" '
            f'{NODE_CHARTER}="{charter_file}" '
            f'{NODE_STATE_DIR}="{root / key_path(folder, pid).stem}"\''
        )
    run_cfg = f'{RUN_KEYS_DIR}="{folder.resolve()}" {RUN_STATE_ROOT}="{root}"'
    lines += [
        "",
        f'ServerApp (run config): {NODE_CHARTER}="{charter_file}"',
        "",
        "Simulation (partition i uses party-<i>.key and <state root>/party-<i>):",
        f"  flwr run . --run-config '{run_cfg}'",
        "  or, for a flwr.simulation.run_simulation() script:",
        f"  {env_name(RUN_KEYS_DIR)}={folder.resolve()} {env_name(RUN_STATE_ROOT)}={root} "
        "python your_script.py",
    ]
    return "\n".join(lines)


@federation_app.command("new")
def federation_new(
    parties: Annotated[
        int, typer.Option("--parties", help="Parties that are members from the start.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Folder to write (keys + charter.yaml).")],
    names: Annotated[
        str | None,
        typer.Option("--names", help="Comma-separated party names (one per party), e.g. a,b,c."),
    ] = None,
    allow: Annotated[
        int, typer.Option("--allow", help="Extra allowlisted keys: parties that join later.")
    ] = 0,
    founders: Annotated[
        int | None, typer.Option("--founders", help="How many parties found it (default: all).")
    ] = None,
    federation: Annotated[
        str | None, typer.Option("--federation", help="The federation's name.")
    ] = None,
    state_root: Annotated[
        Path | None,
        typer.Option("--state-root", help="Root of the parties' state dirs (default OUT/state)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the keys and charter in an existing OUT.")
    ] = False,
    rule_profile: Annotated[
        str,
        typer.Option(
            "--rule-profile",
            help="Profile (name or path) whose inner strategy is the federation's aggregation "
            "rule, audited every round by one party; 'none' for no rule (no audits).",
        ),
    ] = FEDERATION_DEFAULT_RULE_PROFILE,
) -> None:
    """Make every party's key and a charter signed by every founder; print the settings.

    The folder holds party-<i>.key/.pub (i = the partition id in simulation) and charter.yaml;
    the printout says what each SuperNode's node config and a simulation's run config need.
    """
    from .defaults import FLOWER_FEDERATION_NAME
    from .errors import ChaosError, ConfigError
    from .flower.keys import make_federation

    name_list = _split_names(names)
    try:
        _check_new_federation(parties, name_list, allow, founders)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} exists and is not a folder")
        if out.exists() and any(out.iterdir()) and not force:
            raise ConfigError(f"--out {out} already exists; pass --force to replace its keys")
        if force and out.is_dir():
            _remove_federation_files(out)
        folder = make_federation(
            out,
            name_list or parties,
            founders=parties if founders is None else founders,
            allowlist_extra=allow,
            federation=federation or FLOWER_FEDERATION_NAME,
            overwrite=force,
            rounds=_rounds_of(None if rule_profile.lower() == "none" else rule_profile),
        )
        text = _federation_settings(folder, state_root or folder / "state")
    except ChaosError as exc:
        _fail(exc)
    typer.echo(text)


@bench_app.command("wire")
def bench_wire(
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Iterations per run.")] = None,
) -> None:
    """Time seal, open and the replay guard (the envelope hot path) per payload size."""
    from .bench.settings import WIRE_BENCH_REPEATS
    from .bench.wire import run_wire

    result = run_wire(repeats=WIRE_BENCH_REPEATS if repeats is None else repeats)
    if as_json:
        _print_json(result)
        return
    for row in result["sizes"]:
        typer.echo(
            f"{row['envelope_bytes']:>8} B  seal {row['seal_us']:.1f} us  open "
            f"{row['open_us']:.1f} us  seal+open+guard {row['roundtrip_us']:.1f} us  "
            f"(Ed25519 sign {row['sign_us']:.1f} / verify {row['verify_us']:.1f} us)"
        )


@bench_app.command("flood")
def bench_flood(
    records: Annotated[
        int | None, typer.Option("--records", help="Records one party mints.")
    ] = None,
    mode: Annotated[str, typer.Option("--mode", help="rec (forwarded batches) or own.")] = "rec",
    limits: Annotated[
        str, typer.Option("--limits", help="default, or none (no budget).")
    ] = "default",
) -> None:
    """One party floods an honest peer with valid records (in process): held, refused, cost."""
    from .bench.flood import FLOOD_BENCH_RECORDS, run_flood

    if mode not in ("rec", "own") or limits not in ("default", "none"):
        raise typer.BadParameter("--mode is rec or own; --limits is default or none")
    _print_json(run_flood(FLOOD_BENCH_RECORDS if records is None else records, mode, limits))


@bench_app.command("rebuild")
def bench_rebuild(
    sizes: Annotated[
        list[int] | None, typer.Option("--size", help="Record count (repeat).")
    ] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Samples per size.")] = None,
) -> None:
    """A party rebuilt in a fresh process from its saved state (sealed, verified), by age,
    against a relay message its daemon answers over the local socket."""
    import tempfile

    from .bench.rebuild import BENCH_REBUILD_REPEATS, BENCH_REBUILD_SIZES, run

    with tempfile.TemporaryDirectory(prefix="chaos-rebuild-") as tmp:
        chosen = tuple(sizes) if sizes else tuple(BENCH_REBUILD_SIZES)
        _print_json(run(chosen, BENCH_REBUILD_REPEATS if repeats is None else repeats, Path(tmp)))


# --- simulate / bench events -----------------------------------------------------------------
# (section owned by the simulator and the peer protocol)


@bench_app.command("events")
def bench_events(
    peers: int = typer.Option(64, "--peers", help="Cluster size (>= 8)."),
    repeats: int | None = typer.Option(None, "--repeats", help="Events of each type."),
    carrier: str = typer.Option("auto", "--carrier", help="grpc, memory, or auto."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the event choices."),
    pin: bool | None = typer.Option(
        None, "--pin/--no-pin", help="Pin each grpc worker process to its own CPU (default on)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Time leave, link-up, link-down and fail from trigger until every member applied it."""
    from .bench.events import run_events
    from .bench.settings import EVENTS_BENCH_PIN_WORKERS, EVENTS_BENCH_REPEATS, EVENTS_BENCH_SEED

    result = run_events(
        peers,
        repeats=EVENTS_BENCH_REPEATS if repeats is None else repeats,
        seed=EVENTS_BENCH_SEED if seed is None else seed,
        carrier=carrier,
        pin=EVENTS_BENCH_PIN_WORKERS if pin is None else pin,
    )
    if as_json:
        _print_json(result)
        return
    typer.echo(f"{result['peers']} peers over the {result['carrier']} carrier")
    for name, row in result["events"].items():
        typer.echo(
            f"  {name:<10} n={row['count']:<4} p50={row['p50_ms']:.3f} ms  "
            f"p99={row['p99_ms']:.3f} ms"
        )


@app.command("simulate")
def simulate(
    scenario: str | None = typer.Option(None, "--scenario", help="Scenario file or shipped name."),
    seed: int = typer.Option(0, "--seed", help="Seed of the run (or first seed of a soak)."),
    soak_runs: int = typer.Option(0, "--soak", min=0, help="Run N random schedules instead."),
    max_parties: int | None = typer.Option(None, "--max-parties", help="Soak: most parties."),
    events: int | None = typer.Option(
        None, "--events", min=1, help="Soak: timeline events per schedule (default 200)."
    ),
    workers: int = typer.Option(1, "--workers", min=1, help="Soak: processes to run seeds in."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Run a deterministic simulation, check its invariants (exit code 1 if one fails).

    With ``--soak N``: N random Jepsen-style schedules (seeds SEED..SEED+N-1) with training,
    relay restarts and equivocation; the report names every failing seed and how to replay it.
    """
    from .errors import ChaosError
    from .sim.runner import run_scenario, soak
    from .sim.settings import SIM_SOAK_EVENTS, SIM_SOAK_MAX_PARTIES

    try:
        if soak_runs:
            result = soak(
                soak_runs,
                seed,
                max_parties or SIM_SOAK_MAX_PARTIES,
                events or SIM_SOAK_EVENTS,
                workers=workers,
            )
        elif scenario is None:
            raise typer.BadParameter("give --scenario FILE_OR_NAME or --soak N")
        else:
            result = run_scenario(scenario, seed)
    except ChaosError as exc:
        _fail(exc)
    if as_json:
        _print_json(result)
    elif soak_runs:
        typer.echo(
            f"soak: seeds {result['seeds'][0]}..{result['seeds'][1]} ({result['runs']} runs, "
            f"{result['parties']['min']}..{result['parties']['max']} parties), "
            f"{result['schedule_events']} schedule events, {result['events']} events, "
            f"{result['events_per_s']:.0f} events/s, {len(result['failures'])} failures"
        )
        for f in result["failures"]:
            typer.echo(f"  FAILED seed {f['seed']}: {f['invariants']} bound={f['bound']}")
            typer.echo(f"    replay: {f['replay']}")
    else:
        verdict = "ok" if result["ok"] else "FAILED"
        typer.echo(f"{result['scenario']} seed {result['seed']}: {verdict}")
        if result["bound"]:
            typer.echo(f"  bound: {result['bound']}")
        for name, inv in result["invariants"].items():
            typer.echo(f"  {name:<16} {'pass' if inv['ok'] else 'FAIL'}  {inv['detail']}")
        typer.echo(f"  {result['events']} events, trace {result['trace_digest']}")
    if not result["ok"]:
        raise typer.Exit(1)


@bench_app.command("sim")
def bench_sim_cmd(
    parties: int = typer.Option(200, "--parties", min=5, help="Simulated parties."),
    runs: int | None = typer.Option(None, "--runs", min=1, help="Runs (median reported)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Simulator throughput: events/s (an event = one delivery, peer tick or timeline action)."""
    from .sim.runner import bench_sim
    from .sim.settings import SIM_BENCH_RUNS

    result = bench_sim(parties, SIM_BENCH_RUNS if runs is None else runs)
    if as_json:
        _print_json(result)
        return
    typer.echo(
        f"{result['parties']} parties: {result['events_per_s']:.0f} events/s (median of "
        f"{result['runs']}), {result['events']} events per run"
    )


# --- bench scale-out -------------------------------------------------------------------------
# (section owned by state transfer)


class _TransferBar:
    """A rich progress bar per transfer: verified bytes, ETA, and the top donors' shares."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description:<18}"),
            BarColumn(),
            DownloadColumn(),
            TextColumn("eta {task.fields[eta]}"),
            TextColumn("{task.fields[donors]}"),
        )
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> _TransferBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def say(self, line: str) -> None:
        self._progress.console.print(line)

    def update(self, label: str, snapshot: Any) -> None:
        task = self._tasks.get(label)
        if task is None:
            task = self._progress.add_task(label, total=snapshot.total_bytes, eta="?", donors="")
            self._tasks[label] = task
        shares = sorted(snapshot.bytes_by_donor.items(), key=lambda kv: -kv[1])
        total = max(snapshot.total_bytes, 1)
        donors = " ".join(f"{d}:{100 * n / total:.0f}%" for d, n in shares[:4] if n)
        eta = "-" if snapshot.eta_s is None else f"{snapshot.eta_s:.1f}s"
        self._progress.update(task, completed=snapshot.bytes_done, eta=eta, donors=donors)


@bench_app.command("scale-out")
def bench_scale_out(
    profile: Annotated[
        Path | None, typer.Option("--profile", help="WAN profile YAML (default: wan8).")
    ] = None,
    wan: Annotated[
        str, typer.Option("--wan", help="Link mode: shaped (token buckets) or netns (tc, root).")
    ] = "shaped",
    state_mib: Annotated[int | None, typer.Option("--state-mib", help="State size, MiB.")] = None,
    runs: Annotated[int | None, typer.Option("--runs", help="Runs of chaos (median).")] = None,
    extras: Annotated[
        bool, typer.Option("--extras/--no-extras", help="Sweep, donor death, bottleneck runs.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Move a real state to a joiner over shaped loopback links: chaos vs the baselines."""
    from .bench.scale_out import ScaleOutSettings, run_scale_out
    from .bench.settings import SCALE_OUT_RUNS, SCALE_OUT_STATE_MIB
    from .errors import ChaosError

    bar = None if as_json else _TransferBar()
    try:
        with bar if bar is not None else contextlib.nullcontext():
            settings = ScaleOutSettings(
                profile_path=profile,
                wan=wan,
                state_mib=SCALE_OUT_STATE_MIB if state_mib is None else state_mib,
                runs=SCALE_OUT_RUNS if runs is None else runs,
                extras=extras,
            )
            result = run_scale_out(
                settings,
                progress=None if bar is None else bar.say,
                on_transfer=None if bar is None else bar.update,
            )
    except ChaosError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        _print_json(result)
        return
    typer.echo(f"{result['state_bytes']} bytes, bound {result['lower_bound_s']:.3f} s")
    for name, row in result["methods"].items():
        typer.echo(
            f"  {name:<10} {row['delay_s']:8.3f} s  x{row['ratio_to_bound']:.2f} of bound  "
            f"idle {row['idle_s']:.1f} s"
        )


# --- demo / status ---------------------------------------------------------------------------
# (section owned by the Flower integration)


@app.command()
def demo(
    out: str = typer.Option(
        "", help="Folder for report.json and report.png (default ./chaos-demo-report)."
    ),
    scenario: str = typer.Option("", help="Churn scenario YAML (default: the example's)."),
    rounds: int = typer.Option(0, help="Override the scenario's rounds (0: keep)."),
    timeout_s: float = typer.Option(0.0, help="Wall-time bound of each run (0: 600 s)."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Skip report.png."),
    workers: int = typer.Option(
        0, help="Simulation workers at once, sharing the CPUs (0: the example's, one)."
    ),
) -> None:
    """Run the multi-institution example under its churn scenario (simulation) and report.

    A churn-free FedAvg run, then ChaosStrategy(FedAvg) under the scenario (a join at round 3,
    a leave, a link drop, a crash, the server killed and restarted, the crashed one back).
    """
    from chaos_flwr.lab.demo import demo_cli
    from chaos_flwr.lab.settings import FLOWER_DEMO_OUT_DIR, FLOWER_DEMO_RUN_TIMEOUT_S

    demo_cli(
        out or FLOWER_DEMO_OUT_DIR,
        scenario=scenario or None,
        rounds=rounds or None,
        timeout_s=timeout_s or FLOWER_DEMO_RUN_TIMEOUT_S,
        plot=not no_plot,
        workers=workers or None,
    )


@app.command()
def status(
    state_dir: str = typer.Option("", help="A party's chaos-state-dir to inspect (optional)."),
) -> None:
    """Show the strategy profiles available and, with --state-dir, a party's replicas (JSON)."""
    from pathlib import Path

    from chaos_flwr.flower.profiles import available_profiles, load_profile

    out: dict[str, Any] = {
        "profiles": {
            name: {"strategy": load_profile(name).strategy, "chaos": load_profile(name).chaos}
            for name in available_profiles()
        }
    }
    if state_dir:
        from chaos_flwr.store import ReplicaStore

        directory = Path(state_dir) / "replicas"
        if not directory.is_dir():
            raise typer.BadParameter(f"no replica store at {directory}", param_hint="--state-dir")
        store = ReplicaStore(directory)
        latest = store.latest()
        out["replicas"] = {
            "rounds": store.rounds(),
            "latest_round": latest.round if latest is not None else None,
            "latest_digest": latest.digest().hex() if latest is not None else None,
        }
    _print_json(out)


@bench_app.command("flower-overhead")
def bench_flower_overhead(
    engine: str = typer.Option("simulation", help="simulation or deployment (127.0.0.1)."),
    rounds: int = typer.Option(6, help="Federated rounds of each run."),
    model_mib: float = typer.Option(0.0, help="Example model size in MiB (0: its own, 27 KB)."),
    repeats: int = typer.Option(1, help="Interleaved FedAvg/Chaos pairs; figures are medians."),
    signed: bool = typer.Option(True, help="Signed parties (keys + default charter)."),
    poll_interval_s: float = typer.Option(
        0.0, help="Both modes' poll interval (0: the engine's own, 0.1 s sim, 3 s deployment)."
    ),
    timeout_s: float = typer.Option(1800.0, help="Wall-time bound of each run."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print all figures as JSON."),
    supernodes: int = typer.Option(5, help="SuperNodes (parties) of every run."),
    audits: bool = typer.Option(
        False,
        "--audits",
        help="Chaos unverified, with audits off (0 auditors), 1 auditor and all (no FedAvg runs).",
    ),
    daemons: bool = typer.Option(
        False,
        "--daemons",
        help="Deployment: every Chaos SuperNode has its party daemon (direct links, and its "
        "protocol messages answered over the local socket).",
    ),
) -> None:
    """ChaosStrategy over plain FedAvg: round time, time to accuracy, ClientApp work per round,
    trainers per round, accuracy and replica disk (a table, or JSON with --json).

    With --audits: Chaos alone, unverified (no charter rule), with audits off (the rule, 0
    auditors), 1 auditor and all, interleaved per repeat: round time and its ratio over audits
    off, time to accuracy, rounds certified, audit bytes.
    """
    from chaos_flwr.errors import ConfigError
    from chaos_flwr.lab.overhead import (
        OverheadSpec,
        audits_table,
        measure_audits,
        measure_overhead,
        summary_table,
    )

    try:
        spec = OverheadSpec(
            engine=engine,
            rounds=rounds,
            model_mib=model_mib or None,
            repeats=repeats,
            signed=signed,
            poll_interval_s=poll_interval_s or None,
            timeout_s=timeout_s,
            num_supernodes=supernodes,
            audits=audits,
            daemons=daemons,
        )
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    fig = measure_audits(spec) if audits else measure_overhead(spec)
    if as_json:
        _print_json(fig)
    else:
        typer.echo(audits_table(fig) if audits else summary_table(fig))


@bench_app.command("flower-churn")
def bench_flower_churn(
    engine: str = typer.Option(
        "deployment", help="deployment (SuperLink + SuperNodes) or simulation (the demo)."
    ),
    work_dir: str = typer.Option("", help="Keep keys, replicas and logs here (default: temp)."),
    as_json: bool = typer.Option(True, "--json/--no-json", help="Print the figures as JSON."),
) -> None:
    """Time for a join to be training and for a restarted server to resume (JSON).

    deployment: a SuperNode started mid-run joins, one is killed -9, the ServerApp is killed
    -9 mid-round and a new run resumes. simulation: the demo's churn scenario.
    """
    import tempfile

    from chaos_flwr.lab.demo import churn_figures

    if engine not in ("deployment", "simulation"):
        raise typer.BadParameter("deployment or simulation", param_hint="--engine")
    with tempfile.TemporaryDirectory(prefix="chaos-flwr-churn-") as tmp:
        result = churn_figures(engine, Path(work_dir) if work_dir else Path(tmp))
    if as_json:
        _print_json(result)
    else:
        for key, value in result.items():
            typer.echo(f"{key}: {value}")


# --- bench long-run --------------------------------------------------------------------------
# (section owned by the long-lived federations work, issue #18)


@bench_app.command("long-run")
def bench_long_run(
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    rounds: int | None = typer.Option(None, "--rounds", min=0, help="Rounds of the soak."),
    events: int | None = typer.Option(None, "--events", min=0, help="Membership events."),
    flood: int = typer.Option(
        0,
        "--flood",
        min=0,
        help="Flood mode: one party mints this many valid records (the issue's figure: "
        "--flood 100000); alone, it skips the soak (give --rounds for both).",
    ),
    samples: int | None = typer.Option(None, "--samples", min=1, help="Samples along the soak."),
    max_seconds: float | None = typer.Option(
        None, "--max-seconds", min=1.0, help="Wall-time budget of the soak (it stops there)."
    ),
    plot: str = typer.Option("", "--plot", help="Also draw the samples to this PNG file."),
    progress: bool | None = typer.Option(
        None, "--progress/--no-progress", help="Progress on stderr (default: unless --json)."
    ),
) -> None:
    """Party state size, RSS, per-message and rebuild time as rounds and events accumulate.

    Prints the least-squares slopes per 1,000 rounds and events and the samples; with --flood,
    a party mints that many valid records and the honest parties' costs are compared with a
    quiet run. Default sizes (10,000 rounds and events) take minutes.
    """
    from .bench.longrun import LongRunSettings, run_long_run, to_stderr
    from .bench.longrun import plot as draw
    from .bench.settings import (
        LONGRUN_BENCH_EVENTS,
        LONGRUN_BENCH_MAX_SECONDS,
        LONGRUN_BENCH_ROUNDS,
        LONGRUN_BENCH_SAMPLES,
    )

    if rounds is None:
        rounds = 0 if flood else LONGRUN_BENCH_ROUNDS
    settings = LongRunSettings(
        rounds=rounds,
        events=LONGRUN_BENCH_EVENTS if events is None else events,
        flood=flood,
        samples=LONGRUN_BENCH_SAMPLES if samples is None else samples,
        max_seconds=LONGRUN_BENCH_MAX_SECONDS if max_seconds is None else max_seconds,
    )
    show = (not as_json) if progress is None else progress
    result = run_long_run(settings, progress=to_stderr if show else None)
    if plot:
        drawn = draw(result, Path(plot))
        result["plot"] = str(drawn) if drawn is not None else None
    if as_json:
        _print_json(result)
        return
    soak = result.get("soak") or {}
    for unit in ("rounds", "events"):
        slopes = soak.get(f"slopes_per_1000_{unit}") or {}
        typer.echo(f"slopes per 1,000 {unit}: " + ", ".join(f"{k} {v}" for k, v in slopes.items()))
    if "flood" in result:
        fl = result["flood"]
        typer.echo(
            f"flood of {fl['records']}: message x{fl['message_ratio']}, rss growth "
            f"x{fl['rss_growth_ratio']}, refused {fl['refused']}, named {fl['named_by_peers']}"
        )


@app.command("party")
def party_daemon(
    key: Annotated[Path, typer.Option(help="The party's key file (its chaos-key).")],
    charter: Annotated[Path, typer.Option(help="The federation's charter (its chaos-charter).")],
    state_dir: Annotated[
        Path, typer.Option(help="The party's state directory (its chaos-state-dir).")
    ],
    listen: Annotated[
        str, typer.Option(help="host:port to serve direct links on, e.g. 0.0.0.0:9300.")
    ],
    gossip: bool = typer.Option(
        True, "--gossip/--no-gossip", help="Gossip records and failure votes with other daemons."
    ),
    gossip_interval_s: float = typer.Option(
        GOSSIP_INTERVAL_S, min=0.05, help="Seconds between gossip rounds."
    ),
    suspect_s: float = typer.Option(
        GOSSIP_SUSPECT_S, min=1.0, help="Silence after which a daemon heard before is suspected."
    ),
    local: bool = typer.Option(
        True,
        "--local/--no-local",
        help="Hold the party and answer its ClientApps' protocol messages on "
        "<state-dir>/party.sock.",
    ),
) -> None:
    """Run an institution's party daemon beside its SuperNode (until SIGTERM or Ctrl-C).

    It serves the party's replicas to the federation's active members over mutually
    authenticated, encrypted links, and gossips membership records and failure votes with
    the other members' daemons (views converge and crashes are declared while the ServerApp
    is down). Set the SuperNode's node_config chaos-direct-addr to the
    address the other institutions reach this one at; the party signs it in its endpoint
    record. See docs/deployment.md for a systemd unit.
    """
    import logging
    import signal
    import threading

    from chaos_flwr.charter import load_charter
    from chaos_flwr.errors import ChaosError
    from chaos_flwr.flower.daemon import serve_party
    from chaos_flwr.flower.direct import on_signals
    from chaos_flwr.identity import Identity
    from chaos_flwr.membership import parse_address

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        parse_address(listen)
        ident = Identity.load(key)
        verified = load_charter(charter)
    except ChaosError as exc:
        raise typer.BadParameter(str(exc)) from None
    except OSError as exc:
        raise typer.BadParameter(f"cannot read the key or charter: {exc}") from None
    stop = threading.Event()
    restore = on_signals(stop, [signal.SIGTERM, signal.SIGINT])
    try:
        server = serve_party(
            state_dir, ident, verified, listen, stop=stop, say=typer.echo,
            gossip=gossip, gossip_interval_s=gossip_interval_s, suspect_s=suspect_s, local=local,
        )  # fmt: skip
    except ChaosError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        restore()
    refused = ", ".join(f"{k} {v}" for k, v in sorted(server.refusals().items())) or "none"
    typer.echo(
        f"stopped: {server.requests_served} requests, {server.bytes_served} bytes served; "
        f"refused: {refused}"
    )


# --- testbed ---------------------------------------------------------------------------------
# (section owned by the multi-site testbed, issue #17)


@app.command("testbed")
def testbed_cmd(
    profile: Annotated[
        Path | None, typer.Option("--profile", help="WAN profile YAML (default: testbed5).")
    ] = None,
    mode: str = typer.Option("fedavg", help="fedavg (plain Flower) or chaos (signed parties)."),
    rounds: int = typer.Option(3, help="Federated rounds."),
    model_mib: float = typer.Option(0.0, help="Example model size in MiB (0: its own, 36 KB)."),
    server: str = typer.Option("superlink", help="The profile's host that runs the SuperLink."),
    institutions: str = typer.Option(
        "", help="Comma-separated hosts running a SuperNode (default: all but the server)."
    ),
    work_dir: str = typer.Option("", help="Keep certificates, keys and logs here (default: temp)."),
    timeout_s: float = typer.Option(900.0, help="Wall-time bound of the run."),
    as_json: bool = typer.Option(False, "--json", help="Print all figures as JSON."),
) -> None:
    """Run the example on a multi-site testbed built on this machine (needs root, ip, tc).

    Every host of the WAN profile gets a network namespace on a bridge (10.77.0.0/24), its
    uplink and downlink shaped with tc tbf; the SuperLink runs at the server's host with TLS
    and SuperNode authentication, one SuperNode per institution in its own namespace. Shows
    each round, then the bytes each host's interface sent and received; everything it made is
    removed on exit, error or Ctrl-C. Latencies are recorded only (netem is missing here).
    """
    import tempfile

    from chaos_flwr.errors import ChaosError
    from chaos_flwr.lab.testbed import load_testbed_profile
    from chaos_flwr.lab.testbed_run import WanRunSpec, bytes_table, run_on_testbed

    try:
        wan = load_testbed_profile(profile)
        spec = WanRunSpec(
            mode=mode, rounds=rounds, model_mib=model_mib or None, server=server,
            institutions=tuple(_split_names(institutions) or ()) or None, timeout_s=timeout_s,
        )  # fmt: skip
    except ChaosError as exc:
        raise typer.BadParameter(str(exc)) from None
    say = (lambda _m: None) if as_json else typer.echo
    with tempfile.TemporaryDirectory(prefix="chaos-flwr-testbed-") as tmp:
        try:
            fig = run_on_testbed(wan, spec, Path(work_dir) if work_dir else Path(tmp), say=say)
        except ChaosError as exc:
            _fail(exc)
    if as_json:
        _print_json(fig)
        return
    typer.echo(bytes_table(fig))
    typer.echo(
        f"{fig['mode']}: {fig['rounds']} rounds, model {fig['model_bytes']} bytes, round wall "
        f"time median {fig['round_wall_s_median']:.1f} s, ClientApp processes per round "
        f"{fig['clientapp_per_round']}, final accuracy {fig['final_accuracy']:.3f}; "
        f"left behind: {len(fig['pids_alive'])} processes, {len(fig['namespaces_left'])} "
        "namespaces"
    )
    typer.echo(fig["testbed"]["latency"])


@bench_app.command("direct-pull")
def bench_direct_pull(
    model_mib: float = typer.Option(DIRECT_BENCH_MODEL_MIB, help="State size in MiB."),
    rates: str = typer.Option(
        ",".join(f"{r:g}" for r in DIRECT_BENCH_RATES_MB_S),
        help="Comma-separated donor uplinks in MB/s (testbed5's donors).",
    ),
    repeats: int = typer.Option(DIRECT_BENCH_REPEATS, min=1, help="Pulls (medians)."),
    as_json: bool = typer.Option(False, "--json", help="Print all figures as JSON."),
) -> None:
    """A joiner's pull over authenticated direct links from donors with paced uplinks (on
    127.0.0.1): wall time against the planner's lower bound, shares, measured link rates."""
    from chaos_flwr.errors import ChaosError
    from chaos_flwr.lab.direct_bench import measure_direct_pull

    try:
        mb_s = [float(r) for r in _split_names(rates) or []]
    except ValueError:
        raise typer.BadParameter(f"--rates must be numbers in MB/s, got {rates!r}") from None
    say = (lambda _m: None) if as_json else typer.echo
    try:
        fig = measure_direct_pull(model_mib, mb_s, repeats=repeats, say=say)
    except ChaosError as exc:
        _fail(exc)
    if as_json:
        _print_json(fig)
        return
    typer.echo(
        f"{fig['model_bytes'] / 1e6:.1f} MB from {len(mb_s)} donors: median "
        f"{fig['median_pull_s']:.3f} s, bound {fig['lower_bound_s']:.3f} s, "
        f"{fig['median_ratio_to_bound']:.2f}x; shares (MB) {fig['runs'][-1]['received_mb']}"
    )


@bench_app.command("flower-wan")
def bench_flower_wan(
    profile: Annotated[
        Path | None, typer.Option("--profile", help="WAN profile YAML (default: testbed5).")
    ] = None,
    model_mib: float = typer.Option(64.0, help="Example model size in MiB."),
    rounds: int = typer.Option(6, help="Rounds of each run (the joiner starts after round 2)."),
    repeats: int = typer.Option(1, help="Interleaved FedAvg/Chaos runs per placement (medians)."),
    joiner: str = typer.Option("inst3", help="The institution that joins mid-run."),
    placement: str = typer.Option(
        "",
        help="Comma-separated name=host placements of the SuperLink (default: "
        "server_at_institution=inst2,server_well_connected=superlink).",
    ),
    work_dir: str = typer.Option("", help="Keep keys, certificates and logs here (default: temp)."),
    parts: str = typer.Option(
        "join,server_loss", help="What to measure: join runs, server-loss runs, or both."
    ),
    disk_loss: bool = typer.Option(
        True, "--disk-loss/--no-disk-loss", help="Lose the SuperLink host's disk too."
    ),
    join_modes: str = typer.Option(
        "fedavg,chaos,direct",
        help="Join runs: plain FedAvg, Chaos through the relay, Chaos with party daemons.",
    ),
    loss_variants: str = typer.Option(
        "chaos,chaos_direct,plain_checkpoint,plain",
        help="Server-loss runs: Chaos (resume through the relay), Chaos with party daemons "
        "(resume over direct links), plain FedAvg with a checkpoint, plain FedAvg.",
    ),
    sponsors: int = typer.Option(
        1,
        "--sponsors",
        min=0,
        help="The Chaos runs' charter's admission.sponsors_required: 0 lets the joiner's own "
        "signed join admit it, so it trains in the round it comes during.",
    ),
    json_file: str = typer.Option("", "--json-file", help="Also write the JSON figures here."),
    plot: str = typer.Option(
        "",
        "--plot",
        help="The timeline PNG (default: flower-wan-timeline.png next to --json-file, else in "
        "the working directory).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print all figures as JSON."),
) -> None:
    """Plain FedAvg vs Chaos on the multi-site testbed (needs root, ip, tc), per placement of
    the SuperLink: a joiner's time from its SuperNode's start to its first training round
    (lower bounds from the link rates), churn-free round time and its ratio, ClientApps per
    round; from a ServerApp SIGKILL, then the SuperLink host's disk loss, to the next finished
    round for Chaos (relay; party daemons) and plain FedAvg with and without a checkpoint
    (rounds lost); a timeline plot. With daemons, pulls go over links between the hosts."""
    import tempfile

    from chaos_flwr.errors import ChaosError
    from chaos_flwr.lab.testbed import load_testbed_profile
    from chaos_flwr.lab.wan_bench import WanBenchSpec, measure_flower_wan

    try:
        wan = load_testbed_profile(profile)
        where = dict(p.split("=", 1) for p in _split_names(placement) or [] if "=" in p)
        spec = WanBenchSpec(model_mib=model_mib, rounds=rounds, repeats=repeats, joiner=joiner,
                            placements=where or None, parts=tuple(_split_names(parts) or []),
                            disk_loss=disk_loss, join_modes=tuple(_split_names(join_modes) or []),
                            loss_variants=tuple(_split_names(loss_variants) or []),
                            sponsors_required=sponsors)  # fmt: skip
    except ChaosError as exc:
        raise typer.BadParameter(str(exc)) from None
    say = (lambda _m: None) if as_json else typer.echo
    with tempfile.TemporaryDirectory(prefix="chaos-flwr-wan-") as tmp:
        try:
            fig = measure_flower_wan(wan, spec, Path(work_dir) if work_dir else Path(tmp), say=say)
        except ChaosError as exc:
            _fail(exc)
    _emit_wan_figures(fig, json_file=json_file, plot=plot, as_json=as_json)


def _emit_wan_figures(fig: dict[str, Any], *, json_file: str, plot: str, as_json: bool) -> None:
    """Plot the testbed timeline, then write and print the figures of ``bench flower-wan``."""
    from chaos_flwr.errors import ChaosError
    from chaos_flwr.lab.wan_bench import wan_table
    from chaos_flwr.lab.wan_plot import WAN_TIMELINE_PNG, plot_timeline, timeline_rows

    default_plot = (Path(json_file).parent if json_file else Path.cwd()) / WAN_TIMELINE_PNG
    try:
        fig["plot"] = str(plot_timeline(timeline_rows(fig), Path(plot) if plot else default_plot))
    except ChaosError as exc:  # the figures are still worth having
        fig["plot"] = None
        fig["not_measured"]["plot"] = str(exc)
    if json_file:
        Path(json_file).write_text(json.dumps(fig, indent=2), encoding="utf-8")
    if as_json:
        _print_json(fig)
    else:
        typer.echo(wan_table(fig))
        typer.echo(f"timeline: {fig['plot']}")


def main() -> None:
    """Run the ``chaos-flwr`` command line."""
    app()


if __name__ == "__main__":
    main()
