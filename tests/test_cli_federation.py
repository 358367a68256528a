"""``chaos-flwr federation new``: keys, a founder-signed charter and the settings to use."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from chaos_flwr.charter import load_charter
from chaos_flwr.cli import app
from chaos_flwr.flower.client.settings import (
    NODE_CHARTER,
    NODE_KEY,
    NODE_STATE_DIR,
    RUN_KEYS_DIR,
    RUN_STATE_ROOT,
    env_name,
)
from chaos_flwr.flower.keys import charter_path, key_path, load_federation
from chaos_flwr.identity import Identity

runner = CliRunner()


def _new(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["federation", "new", *args])
    return result.exit_code, result.output


def test_federation_new_writes_a_signed_verified_federation_and_prints_its_settings(
    tmp_path: Path,
) -> None:
    out = tmp_path / "fed"
    code, text = _new(
        "--parties", "3", "--names", "alice,bob,carol", "--allow", "1", "--out", str(out)
    )
    assert code == 0, text
    charter = load_charter(charter_path(out))  # verifies every founder's signature
    assert [m.name for m in charter.founders] == ["alice", "bob", "carol"]
    assert len(charter.allowlist) == 1 and len(charter.signatures) == 3
    fed = load_federation(out)
    assert sorted(fed.party_ids) == [0, 1, 2, 3]
    for pid, party in fed.party_ids.items():
        ident = Identity.load(key_path(out, pid))
        assert ident.party_id == party and charter.keyring()[party] == ident.public_key
    # the node config lines use the settings module's keys, one per party, with real paths
    lines = [ln for ln in text.splitlines() if "--node-config" in ln]
    assert len(lines) == 4
    for pid, line in enumerate(lines):
        found = dict(re.findall(r'([\w-]+)="([^"]+)"', line))
        assert set(found) == {NODE_KEY, NODE_CHARTER, NODE_STATE_DIR}
        assert Path(found[NODE_KEY]) == key_path(out, pid).resolve()
        assert load_charter(found[NODE_CHARTER]).digest == charter.digest
    assert f'{RUN_KEYS_DIR}="{out.resolve()}"' in text and f"{RUN_STATE_ROOT}=" in text
    assert f"{env_name(RUN_KEYS_DIR)}={out.resolve()}" in text
    assert f'{NODE_CHARTER}="{charter_path(out).resolve()}"' in text  # the ServerApp's
    assert "alice" in text and "allowlisted" in text


def test_a_second_run_refuses_without_force_and_force_replaces_the_keys(tmp_path: Path) -> None:
    out = tmp_path / "fed"
    assert _new("--parties", "3", "--out", str(out))[0] == 0
    before = load_charter(charter_path(out)).digest
    code, text = _new("--parties", "2", "--out", str(out))
    assert code == 1 and "already exists; pass --force" in text
    assert load_charter(charter_path(out)).digest == before
    code, text = _new("--parties", "2", "--out", str(out), "--force")
    assert code == 0, text
    assert sorted(load_federation(out).party_ids) == [0, 1]  # no stale party-2 key is left
    assert load_charter(charter_path(out)).digest != before


def test_bad_input_is_refused_with_the_option_named(tmp_path: Path) -> None:
    out = str(tmp_path / "fed")
    cases = [
        (["--parties", "0"], "--parties must be >= 1"),
        (["--parties", "2", "--founders", "3"], "--founders must be 1..2"),
        (["--parties", "3", "--names", "a,b"], "--names gives 2 names for --parties 3"),
        (["--parties", "2", "--names", "a,a"], "repeated: ['a']"),
        (["--parties", "2", "--allow", "-1"], "--allow must be >= 0"),
    ]
    for args, message in cases:
        code, text = _new(*args, "--out", out)
        assert code == 1 and message in text, (args, text)
    assert not Path(out).exists()


def test_founders_sign_and_the_others_are_allowlisted(tmp_path: Path) -> None:
    out = tmp_path / "fed"
    code, text = _new("--parties", "4", "--founders", "2", "--out", str(out))
    assert code == 0, text
    charter = load_charter(charter_path(out))
    assert len(charter.founders) == 2 and len(charter.allowlist) == 2
    assert len(charter.signatures) == 2


def test_federation_new_fixes_an_audited_aggregation_rule_unless_told_none(
    tmp_path: Path,
) -> None:
    code, text = _new("--parties", "2", "--out", str(tmp_path / "a"))
    assert code == 0, text
    policy = load_charter(charter_path(tmp_path / "a")).round_policy()
    assert policy.rule is not None and policy.rule.strategy == "FedAvg"
    assert policy.rule.args == {} and policy.auditors == 1 and len(policy.rule_id) == 32
    code, text = _new(
        "--parties", "2", "--out", str(tmp_path / "b"), "--rule-profile", "fedprox-wan"
    )
    assert code == 0, text
    rule = load_charter(charter_path(tmp_path / "b")).round_policy().rule
    assert rule is not None and rule.strategy == "FedProx" and rule.args == {"proximal_mu": 0.01}
    code, text = _new("--parties", "2", "--out", str(tmp_path / "c"), "--rule-profile", "none")
    assert code == 0, text
    charter = load_charter(charter_path(tmp_path / "c"))
    assert charter.rounds is None and charter.round_policy().auditors == 0
    code, text = _new("--parties", "2", "--out", str(tmp_path / "d"), "--rule-profile", "nope")
    assert code != 0 and "nope" in text and not (tmp_path / "d" / "charter.yaml").exists()
