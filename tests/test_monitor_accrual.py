"""The accrual detector: parties heard only through a relay, slow but alive, or stopped."""

from __future__ import annotations

import math

import pytest

from chaos_flwr.defaults import MONITOR_MIN_MISSED_CHECKS, MONITOR_PHI_THRESHOLD
from chaos_flwr.errors import ConfigError
from chaos_flwr.monitor import Monitor

FLOOR_S = 5.0  # the charter's default suspicion timeout
HEARTBEAT_S = 1.0


def relay_run(phase_starts: list[float], b_skew: list[float], **kw: int) -> list[float]:
    """Parties ``a`` and ``b`` heard only through a relay, as on Flower.

    Every phase each party handles one message: ``a`` at the phase start, ``b`` at the start
    plus its skew. ``b`` sends a heartbeat when its monitor says one is due; the relay hands it
    to ``a`` with ``a``'s message of the next phase. Returns the times ``a`` suspected ``b``.
    """
    a = Monitor("a", suspicion_timeout_s=FLOOR_S, heartbeat_interval_s=HEARTBEAT_S, **kw)
    b = Monitor("b", suspicion_timeout_s=FLOOR_S, heartbeat_interval_s=HEARTBEAT_S)
    a.watch(["b"], phase_starts[0])
    queued = False
    suspected: list[float] = []
    for start, skew in zip(phase_starts, b_skew, strict=True):
        if queued:
            a.heard_from("b", start)
            queued = False
        suspected.extend(start for _ in a.check(start))
        queued = b.heartbeat_due(start + skew)
    return suspected


def test_round_one_of_a_big_model_no_longer_suspects_a_healthy_party() -> None:
    # what happened on Flower with a 16 MB model: hello at 0, certify of round 0 at 0.5 (b
    # answers it 0.6 s after its hello: no heartbeat due, so a's train message carries
    # nothing from b), train of round 1 at 9.0 (the certify pushed 16 MB to everyone), certify
    # of round 1 at 20.0, then rounds of about 20 s
    starts = [0.0, 0.5, 9.0, 20.0, 29.0, 40.0, 49.0, 60.0]
    skew = [0.0, 0.1, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]
    # the fixed timeout (a single check is evidence) suspected b at the train of round 1
    assert relay_run(starts, skew, min_missed_checks=1) == [9.0]
    assert relay_run(starts, skew) == []


def test_a_party_that_keeps_answering_however_slowly_is_never_suspected() -> None:
    # 200 phases of 3 to 90 s; b's answer often comes right after its previous one (no
    # heartbeat due), so one phase in two or three carries nothing from b
    starts, t = [], 0.0
    for k in range(200):
        starts.append(t)
        t += [3.0, 90.0, 0.4, 30.0, 0.5][k % 5]
    skew = [0.0] * len(starts)
    assert relay_run(starts, skew) == []


def test_a_stopped_party_is_suspected_within_a_bound_of_its_own_history() -> None:
    m = Monitor("a", suspicion_timeout_s=FLOOR_S, heartbeat_interval_s=HEARTBEAT_S)
    m.watch(["b"], 0.0)
    for k in range(1, 31):  # b heard with every delivery, about every 12 s
        t = 12.0 * k + (0.5 if k % 2 else -0.5)
        m.heard_from("b", t)
        assert m.check(t) == []
    last = m.last_heard("b")
    assert last is not None
    bound = m.suspicion_bound("b")
    mean, _std = m.interval_stats("b") or (math.nan, math.nan)
    assert mean == pytest.approx(12.0, abs=0.1)
    # at most a few of its own intervals (mean + z * std with the std at least a quarter)
    assert FLOOR_S < bound < 3.0 * mean
    when = None
    for k in range(1, 10):  # deliveries keep coming every 12 s, with nothing from b
        now = last + 12.0 * k
        if m.check(now):
            when = now
            break
    assert when is not None and bound <= when - last < bound + 12.0
    assert m.suspected() == ["b"]
    assert m.phi("b", when) >= MONITOR_PHI_THRESHOLD


def test_fast_heartbeats_keep_the_charter_floor_and_need_two_missed_checks() -> None:
    m = Monitor("a", suspicion_timeout_s=FLOOR_S, heartbeat_interval_s=HEARTBEAT_S)
    m.watch(["b"], 0.0)
    for k in range(1, 11):
        m.heard_from("b", float(k))
    assert m.suspicion_bound("b") == FLOOR_S  # a 1 s history is far below the floor
    assert MONITOR_MIN_MISSED_CHECKS == 2
    assert m.check(10.0 + FLOOR_S + 1.0) == []  # the first check after silence: one chance
    assert m.check(10.0 + FLOOR_S + 1.5) == []  # within a heartbeat interval: not a chance
    assert m.check(10.0 + FLOOR_S + 2.0) == ["b"]
    m.heard_from("b", 17.5)
    assert m.suspected() == []


def test_phi_grows_with_silence() -> None:
    m = Monitor("a", suspicion_timeout_s=FLOOR_S, heartbeat_interval_s=HEARTBEAT_S)
    m.watch(["b"], 0.0)
    assert m.phi("b", 100.0) == 0.0  # no history yet
    for k in range(1, 6):
        m.heard_from("b", 10.0 * k)
    values = [m.phi("b", 50.0 + s) for s in (5.0, 10.0, 20.0, 30.0)]
    assert values == sorted(values) and values[0] < 1.0 < MONITOR_PHI_THRESHOLD < values[-1]


@pytest.mark.parametrize(
    "kw", [{"phi_threshold": 0.0}, {"phi_threshold": math.nan}, {"min_missed_checks": 0}]
)
def test_bad_detector_settings_raise_config_error(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        Monitor("a", suspicion_timeout_s=FLOOR_S, heartbeat_interval_s=HEARTBEAT_S, **kw)  # type: ignore[arg-type]
