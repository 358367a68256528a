"""Two processes of one party never handle messages at once (chaos_flwr.flower.client.lock).

Flower's simulation engine runs a node's messages on whichever worker is free: with two workers
(``client-resources-num-cpus = 1`` on two cores) two messages to one node run at the same
time, in two processes, on the same state directory (measured on flwr 1.42: four queries to one
node, two at a time). Each process would load the party's state, sign with the same next
sequence numbers and save over the other's work. The party lock makes the second wait.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from test_flower_durable import PerMessage, _initial

from chaos_flwr.errors import StoreError
from chaos_flwr.flower import durable
from chaos_flwr.flower.client import party_for
from chaos_flwr.flower.client.lock import party_lock
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY, server_record

HOLD_S = 1.0  # how long each process's train handler runs


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _train_message(w: PerMessage, node_id: int) -> Message:
    party = w.party(0)
    arrays = ArrayRecord({n: Array(np.asarray(a.numpy())) for n, a in _initial().items()})
    record = server_record(
        [], phase="relay", server_round=party.held_round, digest=party.held_digest
    )
    content = RecordDict(
        {"arrays": arrays, "config": ConfigRecord({"server-round": 9}), CHAOS_RECORD_KEY: record}
    )
    msg = Message(content, dst_node_id=node_id, message_type="train")
    msg.metadata.__dict__["_message_id"] = f"m-{os.getpid()}-{time.monotonic_ns()}"
    return msg


def _one_process(w: PerMessage, msg: Message, out: Any) -> None:
    """A second worker of the SuperNode: nothing cached, one train message."""
    node = w.nodes[0]
    w.app._chaos_parties.by_node.clear()  # type: ignore[attr-defined]
    times: list[float] = []
    used: list[Any] = []

    def hold() -> None:  # the training: signs a link request (a sequence number) and takes time
        times.append(time.monotonic())
        party = party_for(node.context, w.app)
        party.connect(w.pid(1))
        used.append(party)
        time.sleep(HOLD_S)
        times.append(time.monotonic())

    w.hooks[9] = hold
    w.app(msg, node.context)
    peer = used[0].peer  # the party this message signed and saved with (not a later build)
    out.put((times[0], times[1], (peer.incarnation, peer.seq)))


def test_two_workers_of_one_party_take_turns_and_lose_no_update(tmp_path: Path) -> None:
    w = PerMessage(tmp_path, 3, per_message=False)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
    node = w.nodes[0]
    state_dir = w.party(0).state_dir
    assert state_dir is not None
    msg = _train_message(w, node.node_id)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_one_process, args=(w, msg, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (_, first_end, first), (second_start, _, second) = sorted(got)
    assert first_end <= second_start  # the second process waited for the first one's save
    assert second > first  # so it signed above what the first one signed: no number twice
    saved = durable.load(state_dir, w.pid(0))
    assert saved is not None and (saved.incarnation, saved.seq) == second  # nothing saved over


def _hold(state_dir: Path, held: threading.Event, release: threading.Event) -> None:
    with party_lock(state_dir):
        held.set()
        release.wait(10)


def test_a_process_waits_its_turn_at_most_the_bound_then_refuses(tmp_path: Path) -> None:
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(tmp_path, held, release))
    holder.start()
    try:
        assert held.wait(10)
        t0 = time.monotonic()
        with (
            pytest.raises(StoreError, match=r"held its lock for 0\.3 s"),
            party_lock(tmp_path, wait_s=0.3),
        ):
            pass
        assert time.monotonic() - t0 >= 0.3
    finally:
        release.set()
        holder.join(10)
    with party_lock(tmp_path, wait_s=0.0), party_lock(tmp_path, wait_s=0.0):
        pass  # free again; taken again by the thread holding it, it does not wait on itself


def test_a_child_forked_during_a_turn_does_not_keep_the_party_locked(tmp_path: Path) -> None:
    """A data loader's or a pool's worker forked by the training outlives the message: it
    closes its copy of the lock file, so the next message's turn is not held up by it."""
    ctx = mp.get_context("fork")
    started, stop = ctx.Event(), ctx.Event()

    def child() -> None:  # outlives the turn it was forked in
        started.set()
        stop.wait(20)
        with party_lock(tmp_path, wait_s=5.0):  # its own turn: a real lock, not a no-op
            pass

    with party_lock(tmp_path):
        proc = ctx.Process(target=child)
        proc.start()
        assert started.wait(20)
    try:
        with party_lock(tmp_path, wait_s=1.0):  # the child lives on: the party is free anyway
            pass
        with party_lock(tmp_path):  # and while this thread holds it, the child waits its turn
            stop.set()
            time.sleep(0.3)
            assert proc.is_alive()
    finally:
        stop.set()
        proc.join(20)
    assert proc.exitcode == 0


def test_a_raw_fork_child_leaving_the_turn_closes_nothing_of_its_own(tmp_path: Path) -> None:
    """The child's copy of the lock file was closed when it was forked: when the child leaves
    the block, the lock's descriptor number may be a file of its own, which stays open."""
    from chaos_flwr.flower.client import lock

    (tmp_path / "mine").write_text("x")
    pid, number = -1, -1
    try:
        with party_lock(tmp_path):
            (number,) = lock._FDS
            pid = os.fork()
            if pid == 0:  # the child: a file of its own at that number, then it leaves the turn
                os.dup2(os.open(tmp_path / "mine", os.O_RDONLY), number)
    finally:
        if pid == 0:  # the child, whatever happened: report and exit, never back into pytest
            try:
                code = 0 if os.pread(number, 1, 0) == b"x" else 3
            except BaseException:
                code = 4  # closed by the turn it left
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_party_for_gives_the_newer_save_not_a_stale_cached_party(tmp_path: Path) -> None:
    """What a churn action (party_for without the app) acts on is the state another worker
    saved last: an action on a stale copy would be dropped when the handler takes that save."""
    from chaos_flwr.flower.client import default_party_factory

    w = PerMessage(tmp_path, 3, per_message=False)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
    ctx = w.nodes[0].context
    cached = party_for(ctx)
    other = default_party_factory(ctx)  # another worker of the same SuperNode saves
    other.pending.extend(other.peer.tick(time.time() + 3600))  # type: ignore[union-attr]
    other.persist()
    now = party_for(ctx)
    assert now is not cached and now.is_current()
    assert now.peer.seq == other.peer.seq > cached.peer.seq  # type: ignore[union-attr]


def _take_and_die(state_dir: Path) -> None:
    with party_lock(state_dir):
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_holder_leaves_the_party_unlocked(tmp_path: Path) -> None:
    proc = mp.get_context("fork").Process(target=_take_and_die, args=(tmp_path,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    with party_lock(tmp_path, wait_s=0.0):  # the kernel released its flock
        assert (tmp_path / "party.lock").stat().st_mode & 0o777 == 0o600


def test_a_file_system_without_locks_is_warned_about_and_not_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    ran = []
    with caplog.at_level(logging.WARNING), party_lock(tmp_path):
        ran.append(True)
    assert ran == [True]
    assert "cannot be locked on this file system" in caplog.text


@pytest.mark.timeout(400)
def test_the_signed_example_runs_on_two_simulation_workers(tmp_path: Path) -> None:
    """Two workers share the nodes' messages (the examples keep one: each training uses both
    cores); every party still trains and certifies every round."""
    from chaos_flwr.flower.keys import make_federation
    from chaos_flwr.lab.example import example_dir
    from chaos_flwr.lab.simulation import run_simulation_app

    keys = make_federation(tmp_path / "keys", 5, founders=5, seed="two-workers")
    cfg: dict[str, object] = {
        "mode": "chaos",
        "num-server-rounds": 3,
        "chaos-keys-dir": str(keys),
        "chaos-state-root": str(tmp_path / "state"),
    }
    run = run_simulation_app(example_dir(), run_config=cfg, timeout_s=300, workers=2)
    assert run.returncode == 0, run.log[-3000:]
    rounds = [r for r in run.results["chaos_rounds"] if r["round"] >= 0]  # -1: the hello
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert all(r["holders"] == 5 and r["missing"] == 0 for r in rounds), rounds
    assert all(r["trained"] == 5 for r in rounds[1:]), rounds
    assert "StoreError" not in run.log
    acc = {int(k): v for k, v in run.results["accuracy"].items()}
    assert acc[3] > acc[0] + 0.2


def test_simulation_workers_share_the_cpus_and_a_bad_count_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chaos_flwr.errors import ConfigError
    from chaos_flwr.lab import simulation
    from chaos_flwr.lab.example import example_dir
    from chaos_flwr.lab.simulation import federation_options

    monkeypatch.setattr(simulation, "usable_cpus", lambda: 4)
    app = example_dir()
    assert federation_options(app, None)["client-resources-num-cpus"] == 2  # the file's
    two = federation_options(app, None, 2)
    assert (two["client-resources-num-cpus"], two["init-args-num-cpus"]) == (2, 4)
    three = federation_options(app, 7, 3)
    assert (three["client-resources-num-cpus"], three["init-args-num-cpus"]) == (1, 3)
    assert three["num-supernodes"] == 7
    for bad in (0, 5, -1):
        with pytest.raises(ConfigError, match=rf"workers: {bad}; give 1 to 4"):
            federation_options(app, None, bad)


def test_the_demo_refuses_more_workers_than_cpus_naming_the_option(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from chaos_flwr.cli import app
    from chaos_flwr.lab.simulation import usable_cpus

    too_many = usable_cpus() + 1
    kept = tmp_path / "out" / "work" / "progress-chaos.jsonl"  # an earlier demo's
    kept.parent.mkdir(parents=True)
    kept.write_text("{}\n")
    res = CliRunner().invoke(
        app, ["demo", "--out", str(tmp_path / "out"), "--workers", str(too_many), "--no-plot"]
    )
    assert res.exit_code == 2, res.output
    assert f"workers: {too_many}; give 1 to" in res.output
    assert kept.read_text() == "{}\n"  # refused before the earlier demo's work was cleared
