"""Progress of a running transfer: the engine's snapshots reach the caller and the CLI's bar."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from chaos_flwr.bench.scale_out import run_scale_out
from chaos_flwr.cli import app
from chaos_flwr.transfer import Progress

pytestmark = pytest.mark.timeout(120)

PROFILE = {
    "name": "tiny2",
    "parties": {
        "joiner": {"up_mb_s": 50, "down_mb_s": 100, "latency_ms": 1},
        "fast": {"up_mb_s": 6, "latency_ms": 5},
        "slow": {"up_mb_s": 2, "latency_ms": 10},
    },
    "storage": {"up_mb_s": 20, "down_mb_s": 20, "latency_ms": 2},
}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prof") / "tiny2.yaml"
    path.write_text(yaml.safe_dump(PROFILE), encoding="utf-8")
    return path


def test_snapshots_grow_to_the_whole_state_with_per_donor_shares(profile_path: Path) -> None:
    seen: list[tuple[str, Progress]] = []
    result = run_scale_out(
        profile_path=profile_path,
        state_mib=2,
        runs=1,
        methods=("chaos",),
        extras=False,
        on_transfer=lambda label, snap: seen.append((label, snap)),
    )
    assert seen, "a running transfer reports progress"
    assert {label for label, _ in seen} == {"chaos#0"}
    done = [snap.bytes_done for _, snap in seen]
    assert done == sorted(done)  # never goes backwards
    last = seen[-1][1]
    assert last.bytes_done == last.total_bytes == result["state_bytes"]
    assert last.eta_s == 0.0
    assert sum(last.bytes_by_donor.values()) == last.total_bytes
    assert last.bytes_by_donor == result["methods"]["chaos"]["bytes_by_donor"]
    # Both donors carried a share, the faster one the larger.
    assert last.bytes_by_donor["fast"] > last.bytes_by_donor["slow"] > 0


def test_cli_shows_the_transfer_and_the_summary(profile_path: Path) -> None:
    out = CliRunner().invoke(
        app,
        [
            "bench", "scale-out", "--profile", str(profile_path), "--state-mib", "2",
            "--runs", "1", "--no-extras",
        ],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "chaos#0" in out.output  # the progress bar's row (and the per-run line)
    assert "fast:" in out.output  # donor shares on the bar
    for method in ("chaos", "uniform", "single", "checkpoint"):
        assert f"  {method}" in out.output
    assert "of bound" in out.output


def test_cli_refuses_a_bad_wan_mode_with_its_name() -> None:
    out = CliRunner().invoke(app, ["bench", "scale-out", "--wan", "carrier-pigeon", "--json"])
    assert out.exit_code == 2
    assert "carrier-pigeon" in out.output
