"""A party's settings: where its key, charter and state are, read from Flower's config.

Party settings come from Flower's ``node_config`` (``chaos-key``, ``chaos-charter``,
``chaos-state-dir``); a missing or wrong one is a :class:`~chaos_flwr.errors.ConfigError` that
names it.

Signed runs in simulation
-------------------------
Simulation SuperNodes get only ``node_config = {partition-id, num-partitions}``. For them the
run config may name a federation folder written by
:func:`chaos_flwr.flower.keys.make_federation`:

- ``chaos-keys-dir``: the folder; the party's key is ``party-<partition-id>.key`` in it and
  the charter is its ``charter.yaml``;
- ``chaos-state-root``: the party's state directory is ``<root>/party-<partition-id>``.

A ``node_config`` key (``chaos-key``, ``chaos-charter``, ``chaos-state-dir``) wins over the run
config fallback when both are present.

Disk
----
``chaos-keep-replicas`` (``node_config``, else the run config, else ``$CHAOS_KEEP_REPLICAS``):
how many certified rounds the party's replica store keeps; default
:data:`~chaos_flwr.defaults.STORE_DEFAULT_KEEP_REPLICAS` (2: the newest and the one before it,
what a resume needs). The party's disk is about that many times the model's size (README, Disk).

Scripts that call ``flwr.simulation.run_simulation()``
---------------------------------------------------------
``run_simulation()`` passes no run config at all. Each ``chaos-...`` run config key therefore
falls back to an environment variable of the same name in upper case with ``_`` for ``-``
(:func:`env_name`: ``CHAOS_KEYS_DIR``, ``CHAOS_STATE_ROOT``), read by the process that runs the
ClientApp (set it before ``run_simulation()`` starts Ray: Ray's workers inherit it). The run
config wins when both are set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context

from chaos_flwr.defaults import STORE_DEFAULT_KEEP_REPLICAS
from chaos_flwr.errors import ChaosError, ConfigError

__all__ = [
    "CONFIG_ERROR_MARK",
    "LEFT_MARKER",
    "NODE_CHARTER",
    "NODE_KEEP_REPLICAS",
    "NODE_KEY",
    "NODE_PARTITION_ID",
    "NODE_STATE_DIR",
    "RUN_KEYS_DIR",
    "RUN_STATE_ROOT",
    "RUN_UNSIGNED",
    "PartySettings",
    "env_name",
    "keep_replicas",
    "party_settings",
    "run_setting",
    "state_dir_named",
]

#: ``node_config`` key: path of the party's Ed25519 key file.
NODE_KEY = "chaos-key"
#: ``node_config`` key: path of the federation's signed charter (YAML).
NODE_CHARTER = "chaos-charter"
#: ``node_config`` key: directory of the party's durable state (replicas, records).
NODE_STATE_DIR = "chaos-state-dir"
#: ``run_config`` key: run parties with no identity (relay and receipts *unsigned*), e.g. to
#: measure carrier overhead in simulation, where SuperNodes have no per-node config.
RUN_UNSIGNED = "chaos-unsigned"
#: ``run_config`` key: federation folder (``party-<partition-id>.key`` + ``charter.yaml``) for
#: SuperNodes without per-node Chaos settings (simulation).
RUN_KEYS_DIR = "chaos-keys-dir"
#: ``run_config`` key: root of the parties' state directories (``<root>/party-<partition-id>``).
RUN_STATE_ROOT = "chaos-state-root"
#: ``node_config`` key (run config and ``$CHAOS_KEEP_REPLICAS`` fallbacks): certified rounds the
#: party's replica store keeps (an integer >= 1).
NODE_KEEP_REPLICAS = "chaos-keep-replicas"
#: ``node_config`` key Flower's simulation engine sets on every virtual SuperNode.
NODE_PARTITION_ID = "partition-id"
#: File in a party's state directory that says it left the federation (it stays out).
LEFT_MARKER = "left"
#: How an error reply's reason starts when a party cannot take part because of its settings
#: (the ServerApp looks for it; Flower's own reason for the same exception contains it too).
CONFIG_ERROR_MARK = "chaos_flwr.errors.ConfigError"


@dataclass(frozen=True)
class PartySettings:
    """Where a party's durable things are (from ``node_config``).

    Attributes
    ----------
    key_path, charter_path:
        The party's key and the charter; ``None`` only in unsigned mode.
    state_dir:
        Directory for the party's replica and records (created if missing).
    unsigned:
        True when the run asked for identity-less parties (:data:`RUN_UNSIGNED`).
    direct_addr:
        Where the party serves direct links (``node_config`` ``chaos-direct-addr``,
        ``host:port``, any host; the party signs it in its endpoint record; see
        :mod:`chaos_flwr.flower.direct`), or ``""`` for relay only. Signed parties only.
    keep_replicas:
        Certified rounds its replica store keeps (:data:`NODE_KEEP_REPLICAS`); default
        :data:`~chaos_flwr.defaults.STORE_DEFAULT_KEEP_REPLICAS`.
    """

    key_path: Path | None
    charter_path: Path | None
    state_dir: Path | None
    unsigned: bool
    direct_addr: str = ""
    keep_replicas: int = STORE_DEFAULT_KEEP_REPLICAS


def keep_replicas(context: Context) -> int:
    """Certified rounds the party's store keeps: ``node_config`` ``chaos-keep-replicas``, else
    the run config's, else ``$CHAOS_KEEP_REPLICAS``, else the default.

    Raises
    ------
    ConfigError
        The value is not an integer >= 1; the message names where it came from.
    """
    value: object | None = context.node_config.get(NODE_KEEP_REPLICAS)
    where = f"node_config '{NODE_KEEP_REPLICAS}'"
    if value is None:
        value = run_setting(context.run_config, NODE_KEEP_REPLICAS)
        where = f"run config '{NODE_KEEP_REPLICAS}' (or ${env_name(NODE_KEEP_REPLICAS)})"
    if value is None:
        return STORE_DEFAULT_KEEP_REPLICAS
    try:
        kept = int(str(value).strip()) if not isinstance(value, bool | float) else None
    except ValueError:
        kept = None
    if kept is None or kept < 1:
        raise ConfigError(
            f"{where} must be an integer >= 1 (certified rounds kept on disk), got {value!r}"
        )
    return kept


def _path_setting(context: Context, key: str) -> Path | None:
    value = context.node_config.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"node_config '{key}' must be a non-empty path string, got {value!r}")
    return Path(value).expanduser()


def env_name(key: str) -> str:
    """The environment variable a run config key falls back to: ``chaos-keys-dir`` ->
    ``CHAOS_KEYS_DIR``."""
    return key.upper().replace("-", "_")


def run_setting(run_config: Mapping[str, object], key: str) -> object | None:
    """A run config value, else its environment variable (:func:`env_name`), else ``None``.

    An empty string counts as not set (Flower app configs declare unset paths as ``""``).
    """
    value = run_config.get(key)
    if value is None or value == "":
        value = os.environ.get(env_name(key)) or None
    return value


def _run_path(context: Context, key: str) -> Path | None:
    value = run_setting(context.run_config, key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"run_config '{key}' must be a path string, got {value!r}")
    return Path(value).expanduser()


def _partition_id(context: Context, why: str) -> int:
    value = context.node_config.get(NODE_PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(
            f"node_config '{NODE_PARTITION_ID}' is missing or not an int ({value!r}); run "
            f"config '{why}' needs it to pick this SuperNode's files"
        )
    try:
        pid = int(value)
    except ValueError:
        raise ConfigError(f"node_config '{NODE_PARTITION_ID}' is not an int: {value!r}") from None
    if pid < 0:
        raise ConfigError(f"node_config '{NODE_PARTITION_ID}' must be >= 0, got {pid}")
    return pid


def party_settings(context: Context) -> PartySettings:
    """Read and check the party settings of a SuperNode.

    ``node_config`` keys win; missing ones fall back to the run config's ``chaos-keys-dir`` /
    ``chaos-state-root`` with the node's ``partition-id`` (module docstring).

    Raises
    ------
    ConfigError
        A setting is missing (and the run is not unsigned), or a path does not exist / is not
        what it should be. The message names the ``node_config`` or ``run_config`` key.
    """
    from chaos_flwr.defaults import FLOWER_DIRECT_NODE_KEY, FLOWER_FEDERATION_KEY_PREFIX
    from chaos_flwr.flower.keys import charter_path, key_path

    unsigned = bool(context.run_config.get(RUN_UNSIGNED, False))
    direct = context.node_config.get(FLOWER_DIRECT_NODE_KEY)
    try:
        direct_addr = "" if direct is None else _direct_address(direct, unsigned)
    except ChaosError as exc:
        raise ConfigError(f"node_config '{FLOWER_DIRECT_NODE_KEY}': {exc}") from None
    key = _path_setting(context, NODE_KEY)
    charter = _path_setting(context, NODE_CHARTER)
    state = _path_setting(context, NODE_STATE_DIR)
    src = {NODE_KEY: f"node_config '{NODE_KEY}'", NODE_CHARTER: f"node_config '{NODE_CHARTER}'"}
    src[NODE_STATE_DIR] = f"node_config '{NODE_STATE_DIR}'"
    keys_dir = _run_path(context, RUN_KEYS_DIR)
    state_root = _run_path(context, RUN_STATE_ROOT)
    if keys_dir is not None and (key is None or charter is None):
        if not keys_dir.is_dir():
            raise ConfigError(f"run_config '{RUN_KEYS_DIR}': {keys_dir} is not a directory")
        pid = _partition_id(context, RUN_KEYS_DIR)
        if key is None:
            key = key_path(keys_dir, pid)
            src[NODE_KEY] = f"run_config '{RUN_KEYS_DIR}'"
        if charter is None:
            charter = charter_path(keys_dir)
            src[NODE_CHARTER] = f"run_config '{RUN_KEYS_DIR}'"
    if state is None and state_root is not None:
        pid = _partition_id(context, RUN_STATE_ROOT)
        state = state_root / f"{FLOWER_FEDERATION_KEY_PREFIX}{pid}"
        src[NODE_STATE_DIR] = f"run_config '{RUN_STATE_ROOT}'"
    kept = keep_replicas(context)
    if unsigned and key is None and charter is None:
        return PartySettings(None, None, state, True, direct_addr, kept)
    for name, path in ((NODE_KEY, key), (NODE_CHARTER, charter), (NODE_STATE_DIR, state)):
        if path is None:
            raise ConfigError(
                f"node_config '{name}' is missing: start the SuperNode with --node-config "
                f'\'{NODE_KEY}="..." {NODE_CHARTER}="..." {NODE_STATE_DIR}="..."\' '
                f"(in simulation: run config '{RUN_KEYS_DIR}' and '{RUN_STATE_ROOT}', or "
                f"${env_name(RUN_KEYS_DIR)} and ${env_name(RUN_STATE_ROOT)}; or set "
                f"run config '{RUN_UNSIGNED}=true' for an identity-less test run)"
            )
    assert key is not None and charter is not None and state is not None
    if not key.is_file():
        raise ConfigError(f"{src[NODE_KEY]}: no key file at {key}; run chaos-flwr keygen")
    if not charter.is_file():
        raise ConfigError(f"{src[NODE_CHARTER]}: no charter file at {charter}")
    if state.exists() and not state.is_dir():
        raise ConfigError(f"{src[NODE_STATE_DIR]}: {state} exists and is not a directory")
    return PartySettings(key, charter, state, unsigned, direct_addr, kept)


def _direct_address(value: object, unsigned: bool) -> str:
    """A party's ``chaos-direct-addr`` (``host:port``, any host), in canonical form.

    Direct links are authenticated with the party's keys, so an unsigned party has none.
    """
    from chaos_flwr.membership import endpoint_address, parse_address

    if unsigned:
        raise ConfigError(
            "direct links are authenticated with the party's keys: an unsigned run has none "
            "(remove chaos-direct-addr, or run signed)"
        )
    if not isinstance(value, str):
        raise ConfigError(f"direct address must be 'host:port', got {value!r:.80}")
    return endpoint_address(*parse_address(value))


def state_dir_named(context: Context) -> Path | None:
    """The state directory the node's settings name (:func:`party_settings`).

    Parameters
    ----------
    context
        The node's Flower ``Context``.

    Returns
    -------
    Path or None
        ``None`` when the settings name none, or are wrong (the party's build then says what
        is wrong).
    """
    try:
        return party_settings(context).state_dir
    except ConfigError:
        return None
