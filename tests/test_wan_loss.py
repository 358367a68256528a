"""Server loss on the multi-site testbed and the flower-wan timeline plot.

Fast tests check the pieces (which progress line is a restarted run's next round, the
figures' medians and rounds lost, the spec's refusals, the timeline PNG and its refusals);
the slow root test kills the ServerApp of a Chaos run on a 3-host testbed, then loses the
SuperLink host's disk, and checks the rounds it resumed at and that nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from test_testbed import _namespaces, _root_links

from chaos_flwr.errors import ConfigError
from chaos_flwr.lab.processes import alive, descendants
from chaos_flwr.lab.report import read_progress
from chaos_flwr.lab.wan_loss import LossRunSpec, loss_figures, next_round, server_loss_run
from chaos_flwr.lab.wan_plot import plot_timeline, timeline_rows
from chaos_flwr.transport.shaping import parse_profile

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "multi_institution"
_CAN = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chaos_line(rnd: int, trained: list[int]) -> dict[str, Any]:
    return {
        "round": rnd,
        "time": 100.0 + rnd,
        "node_parties": {"7": "pa", "8": "pb"},
        "chaos_rounds": [{"server_round": rnd, "trained": trained, "errors": {}, "missing": []}],
    }


def test_next_round_is_the_first_trained_or_after_the_checkpoint() -> None:
    chaos = [_chaos_line(3, []), _chaos_line(3, [7, 8]), _chaos_line(4, [7])]
    assert next_round(chaos, "chaos") is chaos[1]  # a round nobody trained in is not one
    assert next_round(chaos[:1], "chaos") is None
    # plain with a checkpoint of round 2: its round-0 evaluation is reported as round 2
    resumed = [{"round": 2, "resumed_from": 2}, {"round": 3, "resumed_from": 2}]
    assert next_round(resumed, "plain_checkpoint") == resumed[1]
    fresh = [{"round": 0, "resumed_from": 0}, {"round": 1, "resumed_from": 0}]
    assert next_round(fresh, "plain") == fresh[1]
    assert next_round(fresh[:1], "plain") is None


def test_loss_figures_take_medians_and_keep_disk_loss_apart() -> None:
    def run(resume: float, rnd: int, before: int, disk: tuple[float, int] | None) -> dict[str, Any]:
        kill = {"resume_s": resume, "rounds_lost": max(0, before - (rnd - 1))}
        lost = None if disk is None else {"resume_s": disk[0], "rounds_lost": disk[1]}
        return {"kill": kill, "disk_loss": lost}

    figs = loss_figures({
        "chaos": [run(30.0, 3, 2, (50.0, 0)), run(10.0, 3, 2, (70.0, 0)),
                  run(20.0, 3, 2, (60.0, 0))],
        "plain_checkpoint": [run(5.0, 3, 2, (9.0, 3))],
        "plain": [run(4.0, 1, 2, None)],
    })  # fmt: skip
    assert figs["chaos_resume_s"] == 20.0 and figs["chaos_rounds_lost"] == 0
    assert figs["chaos_direct_resume_s"] is None  # not run
    assert figs["plain_checkpoint_resume_s"] == 5.0 and figs["plain_checkpoint_rounds_lost"] == 0
    assert figs["plain_rounds_lost"] == 2 and figs["plain_resume_s"] == 4.0
    disk = figs["server_disk_loss"]
    assert disk["chaos_resume_s"] == 60.0 and disk["plain_checkpoint_rounds_lost"] == 3
    assert loss_figures({})["chaos_resume_s"] is None


def test_the_resume_pull_is_read_from_the_resumed_run_s_progress() -> None:
    from chaos_flwr.lab.wan_loss import _resume_pull

    assert _resume_pull([{"round": 3}]) is None  # plain FedAvg: no pull
    pull = {"seconds": 1.5, "exchanges": 0, "shares": {"pa": 600, "pb": 400},
            "direct": {"pa": 600, "pb": 400}, "direct_failed": []}  # fmt: skip
    lines = [{"round": -1, "last_pull": None}, {"round": 3, "last_pull": pull}]
    assert _resume_pull(lines) == {"seconds": 1.5, "exchanges": 0, "bytes": 1000,
                                   "direct_bytes": 1000, "direct_failed": []}  # fmt: skip


def test_server_loss_variants_are_checked_and_the_unasked_named() -> None:
    from chaos_flwr.lab.wan_bench import WanBenchSpec, _unmeasured_loss_keys

    with pytest.raises(ConfigError, match="loss variants"):
        WanBenchSpec(loss_variants=("chaos", "hopeful"))
    with pytest.raises(ConfigError, match="loss variants"):
        WanBenchSpec(loss_variants=())
    unasked = _unmeasured_loss_keys(("chaos_direct",))
    assert set(unasked) == {"chaos_resume_s", "plain_checkpoint_resume_s", "plain_rounds_lost"}
    assert _unmeasured_loss_keys(("chaos", "chaos_direct", "plain_checkpoint", "plain")) == {}


def test_loss_spec_refuses_unknown_variants_and_too_few_rounds() -> None:
    with pytest.raises(ConfigError, match="variant"):
        LossRunSpec(variant="hopeful", model_mib=1.0, server="s", institutions=("a",))
    with pytest.raises(ConfigError, match="rounds"):
        LossRunSpec(variant="chaos", model_mib=1.0, server="s", institutions=("a",), rounds=3)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)


def test_timeline_png_has_a_row_per_run(tmp_path: Path) -> None:
    events = [{"kind": "round", "t": 10.0 * r, "round": r} for r in (1, 2)]
    fig = {"placements": {"server_well_connected": {
        "runs": {"fedavg": [{"events": [*events, {"kind": "join", "t": 21.0, "round": 2},
                                        {"kind": "joined", "t": 40.0, "round": 3}]}],
                 "chaos": [{"events": events}]},
        "loss_runs": {"chaos": [{"events": [*events, {"kind": "kill", "t": 21.0, "round": 2},
                                             {"kind": "resume", "t": 50.0, "round": 3},
                                             {"kind": "disk_loss", "t": 51.0, "round": 3}]}]},
    }}}  # fmt: skip
    rows = timeline_rows(fig)
    assert [r["label"] for r in rows] == [
        "server_well_connected join plain #1",
        "server_well_connected join Chaos #1",
        "server_well_connected loss Chaos #1",
    ]
    small = plot_timeline(rows[:1], tmp_path / "one.png")
    path = plot_timeline(rows, tmp_path / "sub" / "timeline.png", title="t")
    assert path == tmp_path / "sub" / "timeline.png"
    (w1, h1), (w3, h3) = _png_size(small), _png_size(path)
    assert w1 == w3 == 1000 and h3 > h1 > 100  # taller by its two more rows
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([], "no runs"),
        ([{"label": "", "events": []}], "label"),
        ([{"label": "a", "events": [{"kind": "party", "t": 1.0}]}], "unknown event kind"),
        ([{"label": "a", "events": [{"kind": "kill", "t": -1.0}]}], ">= 0"),
        ([{"label": "a", "events": [{"kind": "kill", "t": float("nan")}]}], ">= 0"),
        ([{"label": "a", "events": [{"kind": "kill", "t": "soon"}]}], ">= 0"),
    ],
)
def test_timeline_refuses_what_it_cannot_draw(
    tmp_path: Path, rows: list[dict[str, Any]], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        plot_timeline(rows, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.skipif(not _CAN, reason="the testbed needs root and iproute2 (ip, tc)")
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_chaos_resumes_after_a_serverapp_kill_and_a_server_disk_loss(
    tmp_path: Path, flower_env: Path
) -> None:
    profile = parse_profile({"parties": {
        "inst1": {"up_mb_s": 5.0, "down_mb_s": 10.0},
        "inst2": {"up_mb_s": 2.5, "down_mb_s": 5.0},
        "inst3": {"up_mb_s": 5.0, "down_mb_s": 10.0},
    }})  # fmt: skip
    before_pids = set(descendants(os.getpid()))
    ns_before, links_before = _namespaces(), _root_links()  # a bench may run beside the suite
    spec = LossRunSpec(  # with party daemons: the resumes pull over direct links; the
        # SuperLink at an institution, so its disk loss is also that party's
        variant="chaos_direct", model_mib=2.0, server="inst2",
        institutions=("inst1", "inst2", "inst3"), timeout_s=1700, app_dir=EXAMPLE,
    )  # fmt: skip
    t0 = time.monotonic()
    fig = server_loss_run(profile, spec, tmp_path)
    print(f"server-loss run: {time.monotonic() - t0:.0f} s, {fig['kill']}, {fig['disk_loss']}")
    # killed after round 2: the new run resumed at round 3 from the parties, nothing lost
    assert fig["kill"]["finished_before"] == 2
    assert fig["kill"]["resumed_round"] == 3 and fig["kill"]["rounds_lost"] == 0
    # the SuperLink's state gone: still resumed from the parties, after the last round
    disk = fig["disk_loss"]
    assert disk["resumed_round"] == disk["finished_before"] + 1 and disk["rounds_lost"] == 0
    for part in (fig["kill"], disk):  # each new ServerApp read the state from the daemons
        pull = part["pull"]
        assert pull["exchanges"] == 0 and pull["direct_failed"] == []
        assert pull["direct_bytes"] == pull["bytes"] > 1 << 20
    # inst2's party lost its disk with the server: the resume read only the other two, and
    # it came back through a sponsored pull and trained in the resumed round with them
    assert fig["party_disk_lost"] == "inst2"
    resumed = read_progress(tmp_path / "progress-3.jsonl")
    hello, first = resumed[-1]["chaos_rounds"][:2]
    (join,) = hello["joins"]
    assert join["ok"] and join["source"] == "pull" and join["party"] not in hello["holders"]
    assert sorted(hello["holders"]) == sorted(
        set(resumed[-1]["node_parties"].values()) - {join["party"]}
    )
    assert len(first["trained"]) == 3 and first["server_round"] == disk["resumed_round"]
    kinds = [e["kind"] for e in fig["events"]]
    assert kinds[-4:] == ["kill", "resume", "disk_loss", "resume"]
    assert fig["pids_alive"] == [] and sorted(_namespaces() - ns_before) == []
    assert _root_links() <= links_before
    assert [p for p in descendants(os.getpid()) if p not in before_pids and alive(p)] == []
