"""Where the lab finds the multi-institution example app of a source checkout."""

from __future__ import annotations

from pathlib import Path

__all__ = ["example_dir"]


def example_dir() -> Path:
    """The multi-institution example of a source checkout."""
    return Path(__file__).resolve().parents[2] / "examples" / "multi_institution"
