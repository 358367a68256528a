"""The ``query.chaos`` handling of a party: relay, certify, join and pull messages.

The same in a ClientApp process and in the party daemon (:mod:`.service`); the caller holds
the party's turn (:meth:`~.registry.Parties.turn`).
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, RecordDict

from chaos_flwr.errors import ChaosError, ConfigError
from chaos_flwr.flower.client.registry import Parties
from chaos_flwr.flower.schema import (
    CHAOS_RECORD_KEY,
    PULL_DATA_KEY,
    donor_key,
    read_donor_records,
    split_chaos_content,
)

__all__ = ["chaos_reply"]


def chaos_reply(parties: Parties, content_in: RecordDict, context: Context) -> RecordDict:
    """The reply content of this node's party to a ``query.chaos`` message's content.

    Parameters
    ----------
    parties
        The enabled app's parties (this node's is built or taken up from its disk).
    content_in
        The message's content, Chaos record and audit material included.
    context
        The node's Flower ``Context``.

    Returns
    -------
    RecordDict
        The party's Chaos record, and its pull control, donor requests or served shards;
        the party's state is saved before it is returned.
    """
    record, rest = split_chaos_content(content_in)
    first = next(iter(rest.array_records.values()), None)
    party = parties(context)
    request = rest.get(PULL_DATA_KEY)
    phase = record.get("phase") if record is not None else None
    extra: dict[str, ConfigRecord] = {}
    if record is not None and phase == "join" and isinstance(request, ConfigRecord):
        # this party is the joiner: it pulls before its receipt goes out below
        try:
            ctl, requests = party.join_step(record, request, read_donor_records(rest))
        except ConfigError:  # the node's settings are wrong: the ServerApp is told so
            raise
        except (ChaosError, OSError) as exc:  # the reply still names its party and records
            why = f"{type(exc).__name__}: {exc}"
            party.errors.append(f"join step failed: {why}")
            ctl, requests = ConfigRecord({"status": "failed", "error": why}), {}
            party.joining = None  # a pull that broke halfway is not taken up again
            party.joins_done.append(ctl)
        extra[PULL_DATA_KEY] = ctl
        for donor, req in requests.items():
            extra[donor_key(donor)] = req
    out = party.process(record, first, content_in)
    content = RecordDict({CHAOS_RECORD_KEY: out})
    if record is not None and phase == "pull" and isinstance(request, ConfigRecord):
        served = party.serve(record, request)
        if served is not None:
            content[PULL_DATA_KEY] = served
    for key, rec in extra.items():
        content[key] = rec
    party.persist()  # before any envelope of this reply leaves the process
    return content
