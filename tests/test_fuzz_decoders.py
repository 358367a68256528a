"""Hypothesis fuzzing of the decoders not covered in test_codec.py / test_wire.py.

Every decoder that reads bytes or text from the network or disk must, on any input, either
return a value or raise a :class:`~chaos_flwr.errors.ChaosError` subclass; never another
exception, never accept a mutated signed input. Decoders here: membership records
(``Record.from_wire`` + ``validate_record``), ``Manifest.from_bytes``, round receipts and
equivocation evidence, the pull session's shard input (``PullSession.on_shard``), the
simulator's training messages, charter YAML and scenario YAML.

``CHAOS_FUZZ_EXAMPLES`` (default 700) is the number of cases per test; with test_codec.py
(3 tests) and test_wire.py (4 tests, default 2000) CI runs over 10,000 cases in total.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos_flwr import codec
from chaos_flwr.charter import Charter
from chaos_flwr.errors import ChaosError, CharterError, ConfigError, DecodeError
from chaos_flwr.identity import Identity
from chaos_flwr.membership import Policy, Record, join_body, link_body, validate_record
from chaos_flwr.planner import Donor, plan_transfer
from chaos_flwr.receipts import Equivocation, Receipt, ReceiptLedger
from chaos_flwr.sim.runner import Simulation
from chaos_flwr.sim.scenario import parse_scenario, scenario_from_yaml
from chaos_flwr.sim.trainmodel import TRAIN_TAG
from chaos_flwr.state import Manifest, TrainingState
from chaos_flwr.transfer import PullSession

#: Hypothesis examples per fuzz test; CI raises it with CHAOS_FUZZ_EXAMPLES.
FUZZ_EXAMPLES = int(os.environ.get("CHAOS_FUZZ_EXAMPLES", "700"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

F = [Identity.from_seed(f"fuzz-founder-{i}") for i in range(3)]
J = Identity.from_seed("fuzz-joiner")
CHARTER = Charter.create("fuzz", F, [J])
POLICY = Policy.from_charter(CHARTER)
EDITS = st.lists(
    st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]), st.integers(0, 10**6)),
    min_size=1,
    max_size=4,
)
FILLER = st.binary(min_size=1, max_size=8)


def _mutate(base: bytes, edits: list[tuple[str, int]], filler: bytes) -> bytes:
    data = bytearray(base)
    for op, where in edits:
        if not data:
            break
        i = where % len(data)
        if op == "flip":
            data[i] ^= 1 << (where % 8)
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = filler
        else:
            del data[i]
    return bytes(data)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=40)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)

# --- membership records ------------------------------------------------------------------------

_RECORDS = [
    Record.sign(join_body("fuzz", J.party_id, 0, 1.0), [J, F[0]]),
    Record.sign(link_body("link_up", "fuzz", (F[0].party_id, 0), (F[1].party_id, 0), 3), F[:2]),
]
_RECORD_BYTES = [codec.encode(r.to_wire()) for r in _RECORDS]


def _record_checked(value: Any) -> None:
    try:
        record = Record.from_wire(value)
        validate_record(record, POLICY)
    except ChaosError:
        return


@FUZZ
@given(
    st.fixed_dictionaries(
        {"body": st.dictionaries(st.text(max_size=10), _values, max_size=8) | _scalars},
        optional={"sigs": _values, "signatures": _values},
    )
    | _values
)
def test_fuzz_record_from_wire_structured(value: Any) -> None:
    _record_checked(value)


@FUZZ
@given(st.sampled_from(_RECORD_BYTES), EDITS, FILLER)
def test_fuzz_record_mutated(base: bytes, edits: list[tuple[str, int]], filler: bytes) -> None:
    data = _mutate(base, edits, filler)
    try:
        value = codec.decode(data)
        record = Record.from_wire(value)
        validate_record(record, POLICY)
    except ChaosError:
        return
    # a record that still validates carries exactly the signed body of an original
    assert record.record_id in {r.record_id for r in _RECORDS}


# --- manifests, receipts and evidence ----------------------------------------------------------

_STATE = TrainingState({"w": np.arange(700, dtype=np.float32)}, round=2).to_bytes()
_MANIFEST = Manifest.build(_STATE, 512).to_bytes()
_R1 = Receipt.sign(F[0], 3, hashlib.sha256(b"a").digest())
_R2 = Receipt.sign(F[1], 3, hashlib.sha256(b"b").digest())
_EVIDENCE = Equivocation(_R1, _R2).encode()


@FUZZ
@given(st.one_of(st.binary(max_size=400), st.tuples(EDITS, FILLER)))
def test_fuzz_manifest_from_bytes(case: Any) -> None:
    data = case if isinstance(case, bytes) else _mutate(_MANIFEST, *case)
    try:
        m = Manifest.from_bytes(data)
    except ChaosError:
        return
    assert m.to_bytes() == data  # strict: only canonical bytes decode


@FUZZ
@given(
    st.sampled_from([_R1.encode(), _EVIDENCE]),
    st.one_of(st.binary(max_size=300), st.tuples(EDITS, FILLER)),
)
def test_fuzz_receipts_and_evidence(base: bytes, case: Any) -> None:
    data = case if isinstance(case, bytes) else _mutate(base, *case)
    ledger = ReceiptLedger.from_charter(CHARTER)
    for decode in (Receipt.decode, Equivocation.decode):
        try:
            value = decode(data)
        except ChaosError:
            continue
        try:
            if isinstance(value, Receipt):
                ledger.add(value)
            else:
                ledger.add_evidence(value)
        except ChaosError:
            assert ledger.rounds() == [] and not ledger.equivocations
            continue
        # whatever was accepted is a genuine signed receipt of the originals
        assert {r.signature for r in ledger.receipts(3)} <= {_R1.signature, _R2.signature}


# --- the pull session's shard input --------------------------------------------------------------

_DONORS = [Donor("pa", 1e6, 0.01), Donor("pb", 2e6, 0.01)]
_PLAN = plan_transfer(len(_STATE), _DONORS, max_shards=8, min_shard_bytes=256)
_PULL_MANIFEST = Manifest.build(_STATE, _PLAN.shard_bytes, num_shards=_PLAN.num_shards)


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["pa", "pb", "pz"]),
            st.integers(-2, _PLAN.num_shards + 2),
            st.one_of(st.binary(max_size=600), st.just(None)),
        ),
        max_size=12,
    )
)
def test_fuzz_pull_session_shard_input(replies: list[tuple[str, int, bytes | None]]) -> None:
    """Arbitrary (donor, index, bytes) replies: only typed errors, and never a wrong state."""
    session = PullSession(
        _PULL_MANIFEST,
        _PLAN,
        _DONORS,
        now=0.0,
        expected_digest=hashlib.sha256(_STATE).digest(),
    )
    session.poll(0.0)
    now = 0.0
    for donor, index, data in replies:
        now += 0.01
        if data is None and 0 <= index < _PLAN.num_shards:  # the honest shard
            s, e = _PULL_MANIFEST.shard_range(index)
            data = _STATE[s:e]
        try:
            session.on_shard(donor, index, data or b"", now)
        except ChaosError:
            return
    if session.done:
        assert bytes(session.assemble()) == _STATE


# --- simulator training messages ---------------------------------------------------------------

_SIM = Simulation(parse_scenario({"name": "fuzz", "parties": 4, "training": True}), 0)
_SIM.setup()


@FUZZ
@given(
    st.sampled_from(["relay", _SIM.pids[0], _SIM.pids[3]]),
    st.one_of(
        st.binary(max_size=200),
        st.dictionaries(
            st.sampled_from(["k", "r", "cert", "x", "m", "i", "s", "e", "hx"]), _values
        ),
    ),
)
def test_fuzz_training_messages(dst: str, payload: Any) -> None:
    """The simulated parties and relay drop any malformed training message (counted)."""
    tr = _SIM.trainer
    assert tr is not None
    data = TRAIN_TAG + (payload if isinstance(payload, bytes) else codec.encode(payload))
    before = tr.stats["bad_inputs"]
    tr.deliver(_SIM.pids[1], dst, data)  # must not raise
    assert tr.stats["bad_inputs"] >= before


# --- YAML: charters and scenarios -----------------------------------------------------------------

_CHARTER_YAML = CHARTER.to_yaml()
_SCENARIO_YAML = """name: fuzz
parties: 5
initial: 4
training: true
events:
  - {at: 1, action: join, party: 4}
  - {at: 2, action: crash, party: 2}
  - {at: 3, action: restart, party: 2, disk: false}
  - {at: 4, action: faults, drop: 0.1}
  - {at: 5, action: flap, a: 0, b: 1, down_s: 0.5}
"""
_yaml_text = st.text(
    alphabet=st.sampled_from(list("abcdefghijklmnopqrstuvwxyz0123456789 :-_{}[],.'\"!&*#|>\n\t")),
    max_size=200,
)


def _mutate_text(base: str, edits: list[tuple[str, int]], filler: bytes) -> str:
    return _mutate(base.encode(), edits, filler).decode("utf-8", errors="replace")


@FUZZ
@given(st.one_of(_yaml_text, st.tuples(EDITS, FILLER)))
def test_fuzz_charter_yaml(case: Any) -> None:
    text = case if isinstance(case, str) else _mutate_text(_CHARTER_YAML, *case)
    try:
        charter = Charter.from_yaml(text)
    except CharterError:
        return
    # a charter that still verifies has the founders' signed body
    assert charter.digest == CHARTER.digest


@FUZZ
@given(st.one_of(_yaml_text, st.tuples(EDITS, FILLER)))
def test_fuzz_scenario_yaml(case: Any) -> None:
    text = case if isinstance(case, str) else _mutate_text(_SCENARIO_YAML, *case)
    try:
        sc = scenario_from_yaml(text)
    except ConfigError:
        return
    assert 2 <= sc.parties <= 2000
    assert all(ev.party is None or ev.party < sc.parties for ev in sc.events)


def test_decoders_refuse_the_obvious() -> None:
    """Non-fuzz anchors so a broken strategy cannot make the fuzz tests vacuous."""
    for bad in (b"", _MANIFEST[:-3]):
        try:
            Manifest.from_bytes(bad)
        except DecodeError:
            pass
        else:  # pragma: no cover - a failure message
            raise AssertionError("truncated manifest decoded")
    assert Manifest.from_bytes(_MANIFEST).to_bytes() == _MANIFEST
    assert Equivocation.decode(_EVIDENCE) == Equivocation(_R1, _R2)
    assert Charter.from_yaml(_CHARTER_YAML).digest == CHARTER.digest
    assert scenario_from_yaml(_SCENARIO_YAML).parties == 5
    for text in ("", "[", "parties: 1", "name: x\nparties: 3\nevents: [{at: -1, action: heal}]"):
        try:
            scenario_from_yaml(text)
        except ConfigError:
            continue
        raise AssertionError(f"scenario {text!r} was accepted")
