"""The installable package: public names, import weight, and what the wheel ships."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import chaos_flwr

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves() -> None:
    missing = [name for name in chaos_flwr.__all__ if not hasattr(chaos_flwr, name)]
    assert missing == []
    assert issubclass(chaos_flwr.PlanError, chaos_flwr.ChaosError)


def test_core_imports_without_torch_and_without_flower() -> None:
    # torch is made unimportable; importing the core must not need it, nor load Flower.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import chaos_flwr\n"
        "from chaos_flwr import plan_transfer, Peer, TrainingState, PullSession\n"
        "print('flwr' in sys.modules, 'torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "False"]


def test_wheel_ships_the_strategy_profiles_and_py_typed(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("chaos_flwr-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    profiles = sorted(p.name for p in (ROOT / "strategies").glob("*.yaml"))
    assert profiles, "the repo ships strategy profiles"
    for name in profiles:
        assert f"chaos_flwr/strategies/{name}" in names
    assert "chaos_flwr/py.typed" in names
    assert any(n.endswith("entry_points.txt") for n in names)
