"""The ClientApp the example runs: ``client_app.app`` under the churn emulation.

The churn wrapper goes *outermost*, around the Chaos-enabled app, so ``client_app.py`` keeps its
two-line Chaos diff. With the run config ``churn-scenario`` empty (the default) the wrapper
passes every message through unchanged; with a path to a scenario YAML (``churn.yaml`` beside
``pyproject.toml``) it makes the scenario's parties join late, leave, drop links and crash.
"""

from __future__ import annotations

from chaos_flwr.lab import churn
from multi_institution.client_app import app

churn.apply(app)

__all__ = ["app"]
