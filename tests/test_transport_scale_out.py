"""The scale-out benchmark end to end on a tiny state: real donor processes, shaped loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from chaos_flwr.bench.scale_out import run_scale_out
from chaos_flwr.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

PROFILE = {
    "name": "tiny3",
    "parties": {
        "joiner": {"up_mb_s": 50, "down_mb_s": 100, "latency_ms": 1},
        "fast": {"up_mb_s": 8, "latency_ms": 5},
        "mid": {"up_mb_s": 4, "latency_ms": 10},
        "slow": {"up_mb_s": 2, "latency_ms": 20},
    },
    "storage": {"up_mb_s": 20, "down_mb_s": 20, "latency_ms": 2},
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    path = tmp_path_factory.mktemp("prof") / "tiny3.yaml"
    path.write_text(yaml.safe_dump(PROFILE), encoding="utf-8")
    return run_scale_out(profile_path=path, state_mib=4, runs=1, extras=True, sweep_donors=())


def test_every_method_moves_the_whole_state(result: dict[str, object]) -> None:
    total = result["state_bytes"]
    assert isinstance(total, int) and total > 4 * 1024 * 1024 - 8192
    methods = result["methods"]
    assert isinstance(methods, dict)
    assert set(methods) == {"chaos", "uniform", "single", "checkpoint"}
    for name in ("chaos", "uniform", "single"):
        row = methods[name]
        assert sum(row["bytes_by_donor"].values()) == total, name
        assert row["digest_ok"] is True
        assert row["idle_s"] == 0.0
        # shaped links cannot beat the continuous lower bound (a broken shaper would)
        assert row["ratio_to_bound"] >= 1.0, name
    single = methods["single"]["bytes_by_donor"]
    assert single == {"fast": total, "mid": 0, "slow": 0}
    uni = methods["uniform"]["bytes_by_donor"]
    shard = methods["uniform"]["shard_bytes"]
    assert max(uni.values()) - min(uni.values()) <= shard
    chaos = methods["chaos"]["bytes_by_donor"]
    assert chaos["fast"] > chaos["mid"] > chaos["slow"]
    ckpt = methods["checkpoint"]
    assert ckpt["bytes_by_donor"]["fast"] == total
    assert ckpt["idle_s"] == pytest.approx(3 * ckpt["delay_s"])
    # checkpoint writes then reads the whole state at 8 and 20 MB/s at best
    assert ckpt["delay_s"] >= total / 8e6 + total / 20e6
    # the slow donor caps uniform: its equal share crosses a 2 MB/s uplink (64 KiB burst)
    assert methods["uniform"]["delay_s"] >= (uni["slow"] - 64 * 1024) / 2e6
    assert methods["chaos"]["delay_s"] < methods["uniform"]["delay_s"]


def test_joiner_bottleneck_and_donor_death(result: dict[str, object]) -> None:
    bottleneck = result["joiner_bottleneck"]
    assert isinstance(bottleneck, dict)
    cap = bottleneck["down_mb_s"] * 1e6
    total = result["state_bytes"]
    assert isinstance(total, int)
    for name, row in bottleneck["methods"].items():
        assert row["delay_s"] >= 0.9 * total / cap, name  # nobody beats the joiner's downlink
    death = result["donor_death"]
    assert isinstance(death, dict)
    assert death["killed_donor"] == "fast"
    assert death["lost_donors"] == ["fast"]
    assert death["killed_at_fraction"] >= 0.5
    assert death["digest_ok"] is True
    assert sum(death["bytes_by_donor"].values()) == total
    assert death["bytes_by_donor"]["fast"] < total


def test_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="wan"):
        run_scale_out(wan="netns", state_mib=1)
    with pytest.raises(ConfigError, match="state_mib"):
        run_scale_out(state_mib=0)
    with pytest.raises(ConfigError, match="methods"):
        run_scale_out(state_mib=1, methods=("teleport",))
    no_joiner = tmp_path / "p.yaml"
    no_joiner.write_text(yaml.safe_dump({"parties": {"d1": {"up_mb_s": 1}}}), encoding="utf-8")
    with pytest.raises(ConfigError, match="joiner"):
        run_scale_out(profile_path=no_joiner, state_mib=1)
