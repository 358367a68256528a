"""A suspect that answers, however late, is waited for again (the churn demo's flake).

A node becomes a suspect when it misses an exchange; suspects are not waited for. Its late
reply clears the suspicion, but it is collected *during* the next exchange, whose wait set was
already fixed without the node: if the node answers that exchange too after the others, it was
marked missing, hence a suspect, again, for ever. On the simulation engine one worker runs the
messages one after another, so a joiner whose messages come last stayed a suspect, was never
sampled and never pulled (tests/test_flower_churn.py: "join p5 @r3" unsettled).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.serverapp.strategy import FedAvg
from test_flower_strategy import VClock, _grid, _initial

from chaos_flwr.flower.server import ChaosStrategy, PhaseSettings


class _LastButInTime:
    """The courier's exchange; after it the slow node answers within the deadline but after
    the others, and time passes before the next exchange (training, aggregation)."""

    def __init__(self, exchange: Any, node: Any, clock: VClock) -> None:
        self.exchange, self.node, self.clock = exchange, node, clock

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        res = self.exchange(*args, **kwargs)
        self.node.delay_s, self.clock.t = 0.3, self.clock.t + 0.5
        return res


def test_a_suspect_that_answers_after_the_others_is_waited_for_and_trains_again(
    flower_env: Path,
) -> None:
    clock = VClock()
    grid = _grid(True, n=3, clock=clock)
    slow = sorted(grid.get_node_ids())[-1]
    grid.node(slow).delay_s = 5.0  # its first reply misses the deadline: a suspect
    inner = FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2)
    phases = PhaseSettings(phase_timeout_s=1.0)
    strategy = ChaosStrategy(inner, phases=phases, clock=clock, sleep=clock.sleep)
    courier = strategy.courier
    courier.exchange = _LastButInTime(courier.exchange, grid.node(slow), clock)  # type: ignore[method-assign]
    strategy.start(grid, _initial(), num_rounds=4, timeout=60)
    assert slow in strategy.rounds[0].missing  # it did miss the first deadline
    last = strategy.rounds[-1]
    assert slow in last.trained and slow not in last.missing  # it answers: it is waited for
