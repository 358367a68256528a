"""The federation charter: who may take part, with which keys, under which policy.

A charter is a YAML file, validated strictly (unknown fields and bad values are refused with a
message that names the field path) and signed by the federation's founders::

    version: 1
    federation: hospitals-eu
    founders:                        # at least one; they sign the charter
      - name: alice
        public_key: <base64 of the raw 32-byte Ed25519 key>
    allowlist:                       # parties that may join (with sponsors)
      - name: carol
        public_key: ...
    admission:
      sponsors_required: 1           # member signatures a join needs besides the joiner's
    failure_quorum: 2                # suspecting neighbours a fail record needs
    heartbeat_interval_s: 1.0
    suspicion_timeout_s: 5.0         # must exceed heartbeat_interval_s
    replication:
      replicas: 3                    # parties holding a replica of the training state
      keep_rounds: 2                 # certified rounds each replica keeps
    founder_signatures_required: null   # null: every founder must sign
    limits:                          # optional; absent: the defaults (chaos_flwr.defaults)
      records_per_minute: 600        # new records a receiver takes per signer and minute
      record_burst: 1000             # ... and in one burst beyond that rate
    rounds:                          # optional; absent: no aggregation rule (see RoundRules)
      rule:                          # the inner strategy every party recomputes with
        strategy: FedAdam            # a class of flwr.serverapp.strategy (SUPPORTED_STRATEGIES)
        args: {eta: 0.01, beta_1: 0.9}   # its constructor keyword arguments (scalars)
      min_updates: 2                 # fewest signed update commitments a certify carries
      auditors: 1                    # auditors per round (an int >= 0, or "all")
    signatures:                      # party id -> base64 Ed25519 signature
      p0123456789abcdef: ...

The **body** is everything but ``signatures``. Each founder signs
``b"chaos-flwr/charter/v1\\x00" + codec.encode(body)``; :attr:`Charter.digest` is
``sha256(codec.encode(body))``, so two charters with the same content have the same digest
whatever their YAML layout. By default **every founder must sign**; a federation may lower that
with ``founder_signatures_required``. A charter is refused
(:class:`~chaos_flwr.errors.CharterError`) when a founder's signature is missing (beyond that
number) or does not verify, or when it carries a signature of a key that is not a founder.

An absent ``limits`` or ``rounds`` section (or ``null``) is left out of the body, so charters
written before it existed keep their digests and signatures; so are the ``null`` fields inside
``rounds``.

The ``rounds`` section fixes how rounds are verified: the **aggregation rule** (an inner Flower
strategy and its arguments) any party recomputes an aggregate with, the fewest signed update
commitments a certify carries, and the number of auditors per round. :meth:`Charter.round_policy`
resolves it, with the defaults, into a :class:`RoundPolicy`; its ``rule_id`` names the rule in
signed messages.

The admission policy: founders are members by their own signature; a party of the
``allowlist`` joins with ``admission.sponsors_required`` signatures of members. Keys that are
neither founders nor allowlisted cannot join (the charter must be amended and re-signed).
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import codec
from .defaults import (
    CHARTER_DEFAULT_FAILURE_QUORUM,
    CHARTER_DEFAULT_HEARTBEAT_INTERVAL_S,
    CHARTER_DEFAULT_KEEP_ROUNDS,
    CHARTER_DEFAULT_REPLICAS,
    CHARTER_DEFAULT_SPONSORS_REQUIRED,
    CHARTER_DEFAULT_SUSPICION_TIMEOUT_S,
    CHARTER_MAX_FILE_BYTES,
    ROUND_DEFAULT_AUDITORS,
    ROUND_DEFAULT_AUDITORS_WITHOUT_RULE,
    ROUND_DEFAULT_MIN_UPDATES,
)
from .errors import CharterError, SignatureError
from .identity import (
    SIGNATURE_BYTES,
    Identity,
    is_party_id,
    party_id_of,
    public_key_from_b64,
    public_key_to_b64,
    verify_signature,
)
from .localfile import read_local_file

__all__ = [
    "CHARTER_DOMAIN",
    "CHARTER_VERSION",
    "RULE_DOMAIN",
    "SUPPORTED_STRATEGIES",
    "Admission",
    "AggregationRule",
    "Charter",
    "Limits",
    "Member",
    "Replication",
    "RoundPolicy",
    "RoundRules",
    "load_charter",
]

#: Domain separation prefix of charter signatures.
CHARTER_DOMAIN = b"chaos-flwr/charter/v1\x00"
#: Schema version this build reads and writes.
CHARTER_VERSION = 1
#: Domain separation prefix of an aggregation rule's id (:attr:`RoundPolicy.rule_id`).
RULE_DOMAIN = b"chaos-flwr/rule/v1\x00"
#: Classes of ``flwr.serverapp.strategy`` an aggregation rule may name: those whose aggregate
#: a party can recompute from the committed updates and the certified state alone (FedAvgM's
#: server momentum and the differential-privacy wrappers' noise are not carried or not
#: reproducible, so they are not listed).
SUPPORTED_STRATEGIES: tuple[str, ...] = (
    "FedAvg",
    "FedProx",
    "FedAdam",
    "FedYogi",
    "FedAdagrad",
    "Krum",
    "MultiKrum",
    "FedMedian",
    "FedTrimmedAvg",
)
#: Range of integer rule arguments (the canonical codec's signed 64-bit integers).
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1

_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"
_FEDERATION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class Member(BaseModel):
    """A party named by the charter.

    Attributes
    ----------
    name : str
        Human-readable name (letters, digits, ``.``, ``_``, ``-``).
    public_key : str
        Canonical standard base64 of the raw 32-byte Ed25519 public key.
    """

    model_config = _STRICT

    name: str = Field(pattern=_NAME_PATTERN)
    public_key: str

    @field_validator("public_key")
    @classmethod
    def _valid_key(cls, value: str) -> str:
        try:
            public_key_from_b64(value)
        except SignatureError as exc:
            raise ValueError(str(exc)) from None
        return value

    @property
    def key(self) -> bytes:
        """The raw 32-byte public key."""
        return public_key_from_b64(self.public_key)

    @property
    def party_id(self) -> str:
        """The party id derived from the key."""
        return party_id_of(self.key)

    @classmethod
    def of(cls, party: Identity | Member | bytes, name: str | None = None) -> Member:
        """Make a member from an identity, a raw public key (named by its party id) or a member."""
        if isinstance(party, Member):
            return party if name is None else cls(name=name, public_key=party.public_key)
        if isinstance(party, Identity):
            return cls(name=name or party.name, public_key=party.public_key_b64)
        raw = bytes(party)
        return cls(name=name or party_id_of(raw), public_key=public_key_to_b64(raw))


class Admission(BaseModel):
    """Admission policy: ``sponsors_required`` member signatures a join needs (besides the
    joiner's own) for a party of the allowlist."""

    model_config = _STRICT

    sponsors_required: int = Field(default=CHARTER_DEFAULT_SPONSORS_REQUIRED, ge=0)


class Replication(BaseModel):
    """Replication settings of the training state."""

    model_config = _STRICT

    replicas: int = Field(default=CHARTER_DEFAULT_REPLICAS, ge=1)
    keep_rounds: int = Field(default=CHARTER_DEFAULT_KEEP_ROUNDS, ge=1)


class Limits(BaseModel):
    """Flood limits (:mod:`chaos_flwr.flood`): the records a receiving peer takes per signer.

    A field left ``None`` takes its default (``FLOOD_RECORDS_PER_MINUTE``; a burst of
    ``FLOOD_RECORD_BURST_BASE + FLOOD_RECORD_BURST_PER_PARTY`` per charter party).
    """

    model_config = _STRICT

    records_per_minute: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    record_burst: int | None = Field(default=None, ge=1)


class AggregationRule(BaseModel):
    """The federation's aggregation rule: an inner Flower strategy and its arguments.

    Attributes
    ----------
    strategy : str
        A class name of ``flwr.serverapp.strategy`` listed in :data:`SUPPORTED_STRATEGIES`.
    args : dict[str, int | float | bool | str]
        The strategy's constructor keyword arguments (finite numbers, bools, strings); the
        arguments left out take the strategy's defaults.
    """

    model_config = _STRICT

    strategy: str
    args: dict[str, int | float | bool | str] = Field(default_factory=dict)

    @field_validator("strategy")
    @classmethod
    def _supported(cls, value: str) -> str:
        if value not in SUPPORTED_STRATEGIES:
            raise ValueError(
                f"unknown or unsupported strategy {value!r}; use one of "
                f"{', '.join(SUPPORTED_STRATEGIES)}"
            )
        return value

    @field_validator("args")
    @classmethod
    def _scalar_args(
        cls, value: dict[str, int | float | bool | str]
    ) -> dict[str, int | float | bool | str]:
        for key, arg in value.items():
            if not key.isidentifier():
                raise ValueError(f"{key!r} is not an argument name")
            if isinstance(arg, float) and not math.isfinite(arg):
                raise ValueError(f"{key}: {arg!r} is not a finite number")
            if isinstance(arg, int) and not _I64_MIN <= arg <= _I64_MAX:
                raise ValueError(f"{key}: {arg} does not fit a signed 64-bit integer")
        return value

    @property
    def rule_id(self) -> bytes:
        """SHA-256 of :data:`RULE_DOMAIN` + ``codec.encode({"strategy": ..., "args": ...})``."""
        value = {"strategy": self.strategy, "args": dict(self.args)}
        return hashlib.sha256(RULE_DOMAIN + codec.encode(value)).digest()


class RoundRules(BaseModel):
    """The charter's ``rounds`` section: how rounds are verified.

    A field left ``None`` takes its default (see :meth:`Charter.round_policy`).

    Attributes
    ----------
    rule : AggregationRule or None
        The aggregation rule every party recomputes an aggregate with (``None``: no rule).
    min_updates : int or None
        Fewest signed update commitments a certify must carry (``None``:
        ``ROUND_DEFAULT_MIN_UPDATES``).
    auditors : int, ``"all"`` or None
        Auditors per round (``None``: ``ROUND_DEFAULT_AUDITORS`` with a rule,
        ``ROUND_DEFAULT_AUDITORS_WITHOUT_RULE`` without one). Audits recompute with the rule, so
        auditors without a rule are refused.
    """

    model_config = _STRICT

    rule: AggregationRule | None = None
    min_updates: int | None = Field(default=None, ge=1)
    auditors: Annotated[int, Field(ge=0)] | Literal["all"] | None = None

    @model_validator(mode="after")
    def _auditors_need_rule(self) -> RoundRules:
        if self.rule is None and self.auditors not in (None, 0):
            raise ValueError(
                f"auditors ({self.auditors!r}) needs a rule: auditors recompute the aggregate "
                "with rounds.rule"
            )
        return self


@dataclass(frozen=True)
class RoundPolicy:
    """The charter's ``rounds`` section with its defaults applied (:meth:`Charter.round_policy`).

    Attributes
    ----------
    rule : AggregationRule or None
        The aggregation rule, or ``None`` when the charter fixes none.
    rule_id : bytes
        :attr:`AggregationRule.rule_id` (32 bytes), ``b""`` without a rule.
    min_updates : int
        Fewest signed update commitments a certify must carry.
    auditors : int or None
        Auditors per round; ``None`` means every active party.
    """

    rule: AggregationRule | None
    rule_id: bytes
    min_updates: int
    auditors: int | None


class Charter(BaseModel):
    """A federation charter (see the module docstring for the file format and signing rules).

    Build one with :meth:`create`, read one with :func:`load_charter` or :meth:`from_yaml`,
    add signatures with :meth:`sign`, check them with :meth:`verify`. Instances are immutable:
    :meth:`sign` returns a new charter.
    """

    model_config = _STRICT

    version: Literal[1] = 1
    federation: str = Field(pattern=_FEDERATION_PATTERN)
    founders: list[Member] = Field(min_length=1)
    allowlist: list[Member] = Field(default_factory=list)
    admission: Admission = Field(default_factory=Admission)
    failure_quorum: int = Field(default=CHARTER_DEFAULT_FAILURE_QUORUM, ge=1)
    heartbeat_interval_s: float = Field(
        default=CHARTER_DEFAULT_HEARTBEAT_INTERVAL_S, gt=0, allow_inf_nan=False
    )
    suspicion_timeout_s: float = Field(
        default=CHARTER_DEFAULT_SUSPICION_TIMEOUT_S, gt=0, allow_inf_nan=False
    )
    replication: Replication = Field(default_factory=Replication)
    founder_signatures_required: int | None = Field(default=None, ge=1)
    #: Optional; ``None`` is left out of the body (digests of older charters are unchanged).
    limits: Limits | None = None
    #: Optional; ``None`` is left out of the body (digests of older charters are unchanged).
    rounds: RoundRules | None = None
    signatures: dict[str, str] = Field(default_factory=dict)

    @field_validator("signatures")
    @classmethod
    def _valid_signatures(cls, value: dict[str, str]) -> dict[str, str]:
        for pid, sig in value.items():
            if not is_party_id(pid):
                raise ValueError(f"key {pid!r} is not a party id ('p' + 16 hex digits)")
            try:
                raw = base64.b64decode(sig.encode("ascii"), validate=True)
            except (ValueError, UnicodeEncodeError):
                raise ValueError(f"signature of {pid} is not valid base64") from None
            if len(raw) != SIGNATURE_BYTES or base64.b64encode(raw).decode("ascii") != sig:
                raise ValueError(
                    f"signature of {pid} must be canonical base64 of {SIGNATURE_BYTES} bytes"
                )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Charter:
        names: dict[str, str] = {}
        keys: dict[str, str] = {}
        for section in ("founders", "allowlist"):
            for i, member in enumerate(getattr(self, section)):
                where = f"{section}.{i}"
                if member.name in names:
                    raise ValueError(
                        f"{where}.name {member.name!r} is also used at {names[member.name]}; "
                        "names must be unique"
                    )
                if member.public_key in keys:
                    raise ValueError(
                        f"{where}.public_key is the same key as {keys[member.public_key]}; "
                        "each party appears once (a founder need not be allowlisted)"
                    )
                names[member.name] = where
                keys[member.public_key] = where
        if self.suspicion_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"suspicion_timeout_s ({self.suspicion_timeout_s}) must be larger than "
                f"heartbeat_interval_s ({self.heartbeat_interval_s}), or every party is suspected"
            )
        required = self.founder_signatures_required
        if required is not None and required > len(self.founders):
            raise ValueError(
                f"founder_signatures_required ({required}) exceeds the number of founders "
                f"({len(self.founders)})"
            )
        return self

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        federation: str,
        founders: Sequence[Identity | Member | bytes],
        allowlist: Sequence[Identity | Member | bytes] = (),
        *,
        sponsors_required: int = CHARTER_DEFAULT_SPONSORS_REQUIRED,
        failure_quorum: int = CHARTER_DEFAULT_FAILURE_QUORUM,
        heartbeat_interval_s: float = CHARTER_DEFAULT_HEARTBEAT_INTERVAL_S,
        suspicion_timeout_s: float = CHARTER_DEFAULT_SUSPICION_TIMEOUT_S,
        replicas: int = CHARTER_DEFAULT_REPLICAS,
        keep_rounds: int = CHARTER_DEFAULT_KEEP_ROUNDS,
        founder_signatures_required: int | None = None,
        rounds: RoundRules | None = None,
        sign: bool = True,
    ) -> Charter:
        """Build a charter in memory (tests, simulations, ``chaos-flwr charter init``).

        Parameters
        ----------
        federation
            The federation's name.
        founders
            Founding parties: identities (they can sign), members, or raw public keys.
        allowlist
            Parties that may join with sponsors.
        sponsors_required, failure_quorum, heartbeat_interval_s, suspicion_timeout_s, replicas,
        keep_rounds, founder_signatures_required
            The policy fields (see the module docstring).
        rounds
            The ``rounds`` section (aggregation rule, minimum updates, auditors), or ``None``.
        sign
            Sign with every founder given as an :class:`~chaos_flwr.identity.Identity`.

        Returns
        -------
        Charter
            The charter (verified when every founder was an identity and ``sign`` is true).

        Raises
        ------
        CharterError
            If a field is invalid (the message names it).
        """
        data: dict[str, Any] = {
            "version": CHARTER_VERSION,
            "federation": federation,
            "founders": [Member.of(f).model_dump() for f in founders],
            "allowlist": [Member.of(a).model_dump() for a in allowlist],
            "admission": {"sponsors_required": sponsors_required},
            "failure_quorum": failure_quorum,
            "heartbeat_interval_s": float(heartbeat_interval_s),
            "suspicion_timeout_s": float(suspicion_timeout_s),
            "replication": {"replicas": replicas, "keep_rounds": keep_rounds},
            "founder_signatures_required": founder_signatures_required,
            "signatures": {},
        }
        if rounds is not None:
            data["rounds"] = rounds.model_dump(mode="python")
        charter = cls.from_dict(data, verify=False, source="Charter.create")
        if sign:
            for founder in founders:
                if isinstance(founder, Identity):
                    charter = charter.sign(founder)
        return charter

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, verify: bool = True, source: str = "charter"
    ) -> Charter:
        """Validate a charter from plain data (as YAML gives it).

        Raises
        ------
        CharterError
            If a field is missing, unknown or invalid (the message names its path), or, with
            ``verify``, if the founders' signatures do not check out.
        """
        if not isinstance(data, Mapping):
            raise CharterError(f"{source}: a charter must be a mapping, got {type(data).__name__}")
        try:
            charter = cls.model_validate(dict(data))
        except ValidationError as exc:
            raise CharterError(f"{source}: invalid charter: {_describe(exc)}") from None
        if verify:
            charter.verify(source=source)
        return charter

    @classmethod
    def from_yaml(cls, text: str, *, verify: bool = True, source: str = "charter") -> Charter:
        """Parse and validate a charter from YAML text (duplicate keys are refused).

        Raises
        ------
        CharterError
            If the YAML is malformed, or as :meth:`from_dict`.
        """
        try:
            data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
        except RecursionError:
            raise CharterError(
                f"{source}: nested too deeply to be a charter (a charter is a few levels deep)"
            ) from None
        except yaml.YAMLError as exc:
            raise CharterError(f"{source}: not valid YAML: {exc}") from None
        if data is None:
            raise CharterError(f"{source}: the charter is empty")
        return cls.from_dict(data, verify=verify, source=source)

    # --- signing ----------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The signed content: every field but ``signatures``, as codec values."""
        return self._dump({"signatures"})

    def _dump(self, fields: set[str]) -> dict[str, Any]:
        """The fields but ``fields`` and the optional sections that are absent (never in body
        or file); inside ``rounds``, the ``None`` fields are left out too."""
        absent = {name for name in ("limits", "rounds") if getattr(self, name) is None}
        data = self.model_dump(mode="python", exclude=fields | absent)
        if self.rounds is not None:
            data["rounds"] = self.rounds.model_dump(mode="python", exclude_none=True)
        return data

    @cached_property
    def _body_bytes(self) -> bytes:
        return codec.encode(self.body())

    @property
    def signing_bytes(self) -> bytes:
        """The bytes each founder signs: the charter domain + ``codec.encode(body)``."""
        return CHARTER_DOMAIN + self._body_bytes

    @property
    def digest(self) -> bytes:
        """``sha256(codec.encode(body))``: identifies the charter's content (32 bytes)."""
        return hashlib.sha256(self._body_bytes).digest()

    def sign(self, identity: Identity) -> Charter:
        """Return a copy signed (also) by ``identity``, which must be a founder.

        Raises
        ------
        CharterError
            If ``identity`` is not a founder.
        """
        if not self.is_founder(identity.party_id):
            raise CharterError(
                f"signatures: {identity.name} ({identity.party_id}) is not a founder of "
                f"federation {self.federation!r}; only founders sign the charter"
            )
        member = self._founder_by_id[identity.party_id]
        if member.key != identity.public_key:  # pragma: no cover - party ids are key digests
            raise CharterError(f"signatures: key of {identity.party_id} differs from the charter")
        sig = base64.b64encode(identity.sign(self.signing_bytes)).decode("ascii")
        data = self.model_dump(mode="python")
        data["signatures"] = {**self.signatures, identity.party_id: sig}
        return type(self).from_dict(data, verify=False, source="Charter.sign")

    @property
    def required_signatures(self) -> int:
        """How many founder signatures the charter needs (all founders unless lowered)."""
        if self.founder_signatures_required is None:
            return len(self.founders)
        return self.founder_signatures_required

    def missing_signatures(self) -> list[Member]:
        """Founders that have not signed (valid or not)."""
        return [f for f in self.founders if f.party_id not in self.signatures]

    def verify(self, *, source: str = "charter", complete: bool = True) -> None:
        """Check the founders' signatures.

        Parameters
        ----------
        source
            Where the charter came from (prefixes error messages).
        complete
            Also require :attr:`required_signatures` founder signatures (``False`` checks only
            the signatures present, e.g. while founders are still signing).

        Raises
        ------
        CharterError
            If a signature is by a non-founder or does not verify, or (with ``complete``) fewer
            founders signed than :attr:`required_signatures`.
        """
        message = self.signing_bytes
        for pid, sig_b64 in sorted(self.signatures.items()):
            founder = self._founder_by_id.get(pid)
            if founder is None:
                raise CharterError(
                    f"{source}: signatures.{pid} is by a key that is not a founder of "
                    f"federation {self.federation!r}; remove it (only founders sign)"
                )
            try:
                verify_signature(founder.key, base64.b64decode(sig_b64), message)
            except SignatureError:
                raise CharterError(
                    f"{source}: signatures.{pid}: the signature of founder {founder.name!r} does "
                    "not verify; the charter changed after it was signed (ask the founders to "
                    "sign again) or the signature is corrupt"
                ) from None
        have = len(self.signatures)
        if complete and have < self.required_signatures:
            missing = ", ".join(f"{m.name} ({m.party_id})" for m in self.missing_signatures())
            raise CharterError(
                f"{source}: signatures: {have} of the {self.required_signatures} founder "
                f"signatures required; missing: {missing}; sign with "
                "'chaos-flwr charter sign FILE --key KEYFILE'"
            )

    @property
    def is_verified(self) -> bool:
        """Whether :meth:`verify` passes."""
        try:
            self.verify()
        except CharterError:
            return False
        return True

    # --- policy lookups ---------------------------------------------------------------------

    @cached_property
    def _founder_by_id(self) -> dict[str, Member]:
        return {m.party_id: m for m in self.founders}

    @cached_property
    def _keyring(self) -> dict[str, bytes]:
        return {m.party_id: m.key for m in [*self.founders, *self.allowlist]}

    def keyring(self) -> dict[str, bytes]:
        """Party id -> raw public key of every party the charter names (founders, allowlist)."""
        return dict(self._keyring)

    def is_founder(self, party_id: str) -> bool:
        """Whether ``party_id`` is a founder."""
        return party_id in self._founder_by_id

    def member(self, party_id: str) -> Member | None:
        """The charter entry of ``party_id`` (founder or allowlisted), or ``None``."""
        for m in (*self.founders, *self.allowlist):
            if m.party_id == party_id:
                return m
        return None

    def round_policy(self) -> RoundPolicy:
        """The ``rounds`` section with its defaults applied.

        Returns
        -------
        RoundPolicy
            The rule (or ``None``) and its id (``b""`` without a rule), the fewest update
            commitments a certify carries, and the auditors per round (``None``: all).
        """
        rounds = self.rounds or RoundRules()
        rule = rounds.rule
        if rounds.auditors == "all":
            auditors: int | None = None
        elif rounds.auditors is not None:
            auditors = rounds.auditors
        else:
            auditors = (
                ROUND_DEFAULT_AUDITORS if rule is not None else ROUND_DEFAULT_AUDITORS_WITHOUT_RULE
            )
        return RoundPolicy(
            rule=rule,
            rule_id=rule.rule_id if rule is not None else b"",
            min_updates=rounds.min_updates or ROUND_DEFAULT_MIN_UPDATES,
            auditors=auditors,
        )

    # --- files ------------------------------------------------------------------------------

    def to_yaml(self) -> str:
        """The charter as YAML (fields in schema order); :meth:`from_yaml` reads it back."""
        header = (
            f"# chaos-flwr charter of federation {self.federation!r}\n"
            f"# digest sha256:{self.digest.hex()}\n"
        )
        return header + yaml.safe_dump(
            self._dump(set()),
            sort_keys=False,
            allow_unicode=True,
        )

    def save(self, path: Path | str) -> Path:
        """Write :meth:`to_yaml` to ``path`` atomically (a temporary file renamed into place).

        Raises
        ------
        CharterError
            If the file cannot be written.
        """
        file = Path(path)
        try:
            fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(self.to_yaml())
                os.chmod(tmp, 0o644)
                os.replace(tmp, file)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise CharterError(f"cannot write the charter to {file}: {exc}") from exc
        return file


def load_charter(path: Path | str, *, verify: bool = True) -> Charter:
    """Read, validate and (by default) verify a charter file.

    Parameters
    ----------
    path
        The YAML file.
    verify
        Check the founders' signatures (turn off only to add signatures).

    Returns
    -------
    Charter
        The charter.

    Raises
    ------
    CharterError
        If the file is missing, unreadable, too large, not YAML, has missing, unknown or bad
        fields (the message names the field path), or is not properly signed by its founders.
    """
    file = Path(path)
    try:
        raw = read_local_file(
            file, what="charter", error=CharterError, max_bytes=CHARTER_MAX_FILE_BYTES
        )
    except FileNotFoundError:
        raise CharterError(
            f"no charter file at {file}; create one with 'chaos-flwr charter init'"
        ) from None
    except OSError as exc:
        raise CharterError(f"cannot read the charter file {file}: {exc}") from exc
    if len(raw) > CHARTER_MAX_FILE_BYTES:
        raise CharterError(f"{file} is larger than {CHARTER_MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CharterError(f"{file} is not UTF-8 text") from None
    return Charter.from_yaml(text, verify=verify, source=str(file))


class _StrictLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses duplicate mapping keys."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.Node) -> dict[Any, Any]:
    if not isinstance(node, yaml.MappingNode):  # pragma: no cover - registered for mappings
        raise yaml.constructor.ConstructorError(None, None, "expected a mapping", node.start_mark)
    loader.flatten_mapping(node)
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key is not hashable", key_node.start_mark
            ) from None
        if key in result:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        result[key] = loader.construct_object(value_node, deep=True)
    return result


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (remove it or check its spelling)"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)
