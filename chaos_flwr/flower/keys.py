"""Keys and a signed charter for a whole federation in one call (demos, simulations, tests).

Simulation SuperNodes get no per-node config beyond ``partition-id`` / ``num-partitions``, so a
signed run in simulation reads its identities from one folder named by the run config
(``chaos-keys-dir``, see :mod:`chaos_flwr.flower.client`). :func:`make_federation` writes that
folder::

    <out_dir>/party-0.key, party-0.pub, ..., party-<n-1>.key/.pub
    <out_dir>/charter.yaml          signed by every founder

Parties ``0 .. founders-1`` are the founders; the others (and ``allowlist_extra`` more, numbered
after them) are on the allowlist and join with ``sponsors_required`` sponsors. Given names
(``make_federation(dir, ["alice", "bob"])``) label the parties in the charter; the files keep
the ``party-<partition-id>`` layout, so the same folder serves simulation and deployment.
``chaos-flwr federation new`` is this function on the command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from chaos_flwr.defaults import (
    FLOWER_FEDERATION_CHARTER_FILE,
    FLOWER_FEDERATION_FOUNDERS,
    FLOWER_FEDERATION_KEY_PREFIX,
    FLOWER_FEDERATION_NAME,
)
from chaos_flwr.errors import ConfigError

if TYPE_CHECKING:
    from chaos_flwr.identity import Identity

__all__ = [
    "Federation",
    "charter_path",
    "fedavg_rounds",
    "key_path",
    "load_federation",
    "make_federation",
]

#: Charter policy fields :func:`make_federation` passes on.
_POLICY_FIELDS = frozenset(
    {
        "sponsors_required",
        "failure_quorum",
        "heartbeat_interval_s",
        "suspicion_timeout_s",
        "rounds",
    }
)


def key_path(keys_dir: Path | str, partition_id: int) -> Path:
    """Path of partition ``partition_id``'s private key inside a federation folder."""
    return Path(keys_dir) / f"{FLOWER_FEDERATION_KEY_PREFIX}{partition_id}.key"


def charter_path(keys_dir: Path | str) -> Path:
    """Path of the signed charter inside a federation folder."""
    return Path(keys_dir) / FLOWER_FEDERATION_CHARTER_FILE


@dataclass(frozen=True)
class Federation:
    """What :func:`load_federation` reads back: party ids by partition, founders, keyring."""

    directory: Path
    party_ids: dict[int, str]
    founders: list[str]
    keyring: dict[str, bytes]


def make_federation(
    out_dir: Path | str,
    n_parties: int | Sequence[str],
    *,
    founders: int = FLOWER_FEDERATION_FOUNDERS,
    allowlist_extra: int = 0,
    federation: str = FLOWER_FEDERATION_NAME,
    seed: str | None = None,
    overwrite: bool = False,
    **policy: Any,
) -> Path:
    """Write keys for ``n_parties + allowlist_extra`` parties and a founder-signed charter.

    Parameters
    ----------
    out_dir:
        Folder to write (created if missing).
    n_parties:
        Parties ``party-0 .. party-<n-1>`` (one per simulation partition), or their names in
        the charter (one party per name, in partition order; the files are still
        ``party-<i>.key``).
    founders:
        How many of them (the first ones) found the federation; capped at ``n_parties``.
    allowlist_extra:
        Extra allowlisted keys ``party-<n> ..``: joiners that no partition starts with.
    federation:
        The charter's federation name.
    seed:
        Derive every key from ``seed`` (reproducible federations); random keys if ``None``.
    overwrite:
        Replace key files already in ``out_dir``.
    **policy:
        Charter policy fields, each defaulting to the charter's default: ``sponsors_required``
        (member signatures a non-founder's join needs), ``failure_quorum``,
        ``heartbeat_interval_s``, ``suspicion_timeout_s``, and ``rounds`` (the verifiable
        rounds' rule and auditors, e.g. :func:`fedavg_rounds`; left out: no audits).

    Returns
    -------
    Path
        ``out_dir`` (pass it as run config ``chaos-keys-dir``).

    Raises
    ------
    ConfigError
        A count is out of range, a name is repeated or not a valid name, a policy field is
        unknown, or the files cannot be written.
    """
    from chaos_flwr.charter import Charter, Member
    from chaos_flwr.errors import ChaosError

    names = _names(n_parties)
    count = n_parties if isinstance(n_parties, int) else len(names or [])
    unknown = sorted(set(policy) - _POLICY_FIELDS)
    if unknown:
        raise ConfigError(
            f"unknown charter policy field(s) {unknown}; allowed: {sorted(_POLICY_FIELDS)}"
        )
    if count < 1:
        raise ConfigError(f"n_parties must be >= 1, got {count}")
    if founders < 1:
        raise ConfigError(f"founders must be >= 1, got {founders}")
    if allowlist_extra < 0:
        raise ConfigError(f"allowlist_extra must be >= 0, got {allowlist_extra}")
    n_found = min(founders, count)
    folder = Path(out_dir)
    idents = _identities(count + allowlist_extra, seed)
    labels = (names or []) + [ident.name for ident in idents[len(names or []) :]]
    try:
        members = [Member.of(i, name=label) for i, label in zip(idents, labels, strict=True)]
        charter = Charter.create(federation, members[:n_found], members[n_found:], **policy)
        for founder in idents[:n_found]:
            charter = charter.sign(founder)
        charter.verify(source=str(charter_path(folder)))
        for ident in idents:
            ident.save(folder, overwrite=overwrite)
        charter.save(charter_path(folder))
    except (ChaosError, ValueError) as exc:
        raise ConfigError(f"make_federation({folder}): {exc}") from exc
    return folder


def fedavg_rounds(auditors: int | Literal["all"] = 1) -> Any:
    """A charter ``rounds`` section whose aggregation rule is Flower's FedAvg (its default
    aggregation keys) with ``auditors`` rota auditors per round (an int, or ``"all"``)."""
    from chaos_flwr.charter import AggregationRule, RoundRules

    return RoundRules(rule=AggregationRule(strategy="FedAvg"), auditors=auditors)


def _names(parties: int | Sequence[str]) -> list[str] | None:
    """The party names given instead of a count (``None`` for a count); no repeats."""
    if isinstance(parties, int):
        return None
    names = [str(n) for n in parties]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"party names must differ; repeated: {repeated}")
    return names


def _identities(count: int, seed: str | None) -> list[Identity]:
    """Identities ``party-0 .. party-<count-1>``: derived from ``seed``, else random."""
    from chaos_flwr.identity import Identity

    idents: list[Identity] = []
    for i in range(count):
        name = f"{FLOWER_FEDERATION_KEY_PREFIX}{i}"
        ident = (
            Identity.generate(name)
            if seed is None
            else Identity.from_seed(f"{seed}/{name}".encode(), name=name)
        )
        idents.append(ident)
    return idents


def load_federation(keys_dir: Path | str) -> Federation:
    """Read a folder written by :func:`make_federation` (party ids of every partition key).

    Raises
    ------
    ConfigError
        The folder or its charter is missing or does not verify.
    """
    from chaos_flwr.charter import load_charter
    from chaos_flwr.errors import ChaosError
    from chaos_flwr.identity import Identity

    folder = Path(keys_dir)
    if not folder.is_dir():
        raise ConfigError(f"federation folder {folder} does not exist")
    try:
        charter = load_charter(charter_path(folder))
        ids: dict[int, str] = {}
        for file in folder.glob(f"{FLOWER_FEDERATION_KEY_PREFIX}*.key"):
            stem = file.name.removesuffix(".key").removeprefix(FLOWER_FEDERATION_KEY_PREFIX)
            if stem.isdigit():
                ids[int(stem)] = str(Identity.load(file).party_id)
    except ChaosError as exc:
        raise ConfigError(f"federation folder {folder}: {exc}") from exc
    return Federation(
        directory=folder,
        party_ids=dict(sorted(ids.items())),
        founders=sorted(m.party_id for m in charter.founders),
        keyring=dict(charter.keyring()),
    )
