"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def flower_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Flower offline (no runtime installs, telemetry or update checks) with a private FLWR_HOME."""
    from chaos_flwr.lab.launch import FLOWER_ENV

    for key, value in FLOWER_ENV.items():
        monkeypatch.setenv(key, value)
    home = tmp_path / "flwr-home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    return home
