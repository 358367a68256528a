"""The exception tree of chaos-flwr.

Every error raised on purpose by chaos-flwr is a :class:`ChaosError`, so a caller can catch the
whole family in one place. Each subclass names one kind of failure and carries a message that
says what was wrong and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "ChaosError",
    "CharterError",
    "ConfigError",
    "DaemonMismatchError",
    "DecodeError",
    "EncodeError",
    "EndpointError",
    "EquivocationError",
    "FederationMismatchError",
    "KeyFileError",
    "LinkAuthError",
    "LinkBusyError",
    "LinkError",
    "LinkLimitError",
    "LinkQuotaError",
    "NetnsError",
    "NotMemberError",
    "OversizeError",
    "PartyConfigError",
    "PlanError",
    "PolicyError",
    "ProfileError",
    "ReplayError",
    "ReplyTooLargeError",
    "RequestTooLargeError",
    "ResumeError",
    "ShardIntegrityError",
    "SignatureError",
    "StaleIncarnationError",
    "StoreError",
    "TransferError",
    "TransportError",
    "UnknownPartyError",
]


class ChaosError(Exception):
    """Base class of every error chaos-flwr raises on purpose."""


class PlanError(ChaosError, ValueError):
    """The shard planner was given input it cannot plan for (the message names the field)."""


class DecodeError(ChaosError, ValueError):
    """Bytes from the network or disk are truncated, malformed or not canonical."""


class OversizeError(DecodeError):
    """Input is larger than the configured limit and was refused before it was parsed."""


class SignatureError(ChaosError):
    """A signature is missing, malformed, or does not verify under the claimed key."""


class UnknownPartyError(SignatureError):
    """A message claims a sender whose public key this party does not know."""


class ReplayError(ChaosError):
    """An envelope was already seen (same sender, incarnation and sequence number) or is too old."""


class StaleIncarnationError(ReplayError):
    """An envelope or record carries an incarnation older than the one already known."""


class PolicyError(ChaosError):
    """A record or request does not carry what the federation's charter demands."""


class CharterError(ChaosError, ValueError):
    """A charter file is malformed, has unknown or bad fields, or is not signed by its founders."""


class KeyFileError(ChaosError, OSError):
    """A key file is missing, unreadable, has the wrong type, or is not an Ed25519 key."""


class ShardIntegrityError(ChaosError):
    """A shard, manifest or state does not match the digest it was certified with."""


class EquivocationError(ChaosError):
    """The relay (or a party) showed different content for one round to different parties."""


class StoreError(ChaosError, OSError):
    """A replica file is missing, corrupt, foreign, or could not be written safely."""


class TransferError(ChaosError):
    """A state transfer cannot finish: no live donor holds the missing shards."""


class TransportError(ChaosError, OSError):
    """A carrier could not deliver bytes (peer unreachable, link closed)."""


class ProfileError(ChaosError, ValueError):
    """A strategy profile is missing, malformed, or names an unknown strategy or field."""


class ConfigError(ChaosError, ValueError):
    """A party setting (Flower ``node_config``, scenario, WAN profile) is missing or wrong."""


class EncodeError(ChaosError, ValueError):
    """A value cannot be sealed or encoded (the message names the field and the limit)."""


class NetnsError(TransportError):
    """Network namespaces or tc shaping cannot be set up (not root, ``ip``/``tc`` missing, ...)."""


class FederationMismatchError(PolicyError):
    """A verified envelope was sealed for another federation (another charter digest)."""


class PartyConfigError(ConfigError):
    """Parties cannot take part because of their settings, so the ServerApp stops.

    Attributes
    ----------
    reasons:
        Node id -> the one-line reason its ClientApp gave (it names the setting).
    """

    def __init__(self, message: str, reasons: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.reasons: dict[int, str] = dict(reasons or {})


class DaemonMismatchError(ConfigError):
    """The party daemon on a state directory's local socket holds another party (another
    state directory or key) than the message's node names; it did nothing, and the ClientApp
    handles the message itself."""


class ResumeError(ChaosError):
    """A run that must resume (``chaos-resume = require``) found no certified state to resume."""


class FloodError(ChaosError):
    """Records were refused because every one of their signers is out of its record budget.

    A party signed more records than the charter's ``limits`` allow a receiver to take (see
    :mod:`chaos_flwr.flood`); the records are not held, and are taken when offered again later.

    Attributes
    ----------
    signers:
        Party ids of the refused records' signers (sorted).
    refused:
        How many records were refused.
    """

    def __init__(self, message: str, *, signers: tuple[str, ...] = (), refused: int = 0) -> None:
        super().__init__(message)
        self.signers: tuple[str, ...] = signers
        self.refused: int = refused


class ProofError(ChaosError):
    """A certify's proof does not hold (:mod:`chaos_flwr.rounds`): its base is not the held
    state, its round is not the base's next, a commitment does not verify, too few updates, a
    different aggregation rule, or a base that is not final. The party takes up nothing."""


class AuditError(ChaosError):
    """An aggregate cannot be recomputed with the federation's rule (e.g. the rule's strategy
    aggregates the given updates to nothing), or a recomputed aggregate differs from the one
    certified."""


class LinkError(ChaosError):
    """A direct link (:mod:`chaos_flwr.flower.direct`) refused a request or cannot be set up.

    A donor refuses with one of the subclasses and the dialler raises the same class."""


class LinkAuthError(LinkError, SignatureError):
    """A link peer did not prove a party identity: no or a malformed binding, a binding that
    does not verify under the charter key of the party it names, a binding copied from another
    certificate, or a TLS handshake that failed (the peer's certificate is not the one its
    signed endpoint names, or ours was not accepted)."""


class NotMemberError(LinkError, PolicyError):
    """A link peer is not a charter party, or not an active member in the donor's view."""


class EndpointError(LinkError, PolicyError):
    """An address no verified endpoint record of an active member names (e.g. one the relay
    supplied), or an endpoint record that is malformed."""


class LinkLimitError(LinkError):
    """A link request was refused by one of the donor's limits (see the subclasses)."""


class LinkBusyError(LinkLimitError):
    """The donor already serves its maximum of concurrent link requests; retry later."""


class LinkQuotaError(LinkLimitError):
    """The requesting party used up its bytes for the donor's current window; retry later."""


class RequestTooLargeError(LinkLimitError, OversizeError):
    """A link request message is larger than the donor accepts."""


class ReplyTooLargeError(LinkLimitError):
    """A link request asks for more reply bytes than one request may (an amplifying request);
    split it into smaller ranges."""
