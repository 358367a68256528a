"""What the ServerApp makes of error replies that say a party's settings are wrong: the
reason named in one line, and the error that stops a run none of whose nodes can take part."""

from __future__ import annotations

from collections.abc import Mapping

from chaos_flwr.errors import PartyConfigError
from chaos_flwr.flower.client.settings import CONFIG_ERROR_MARK

__all__ = ["CONFIG_ERRORS_SHOWN", "config_reason", "misconfigured"]

#: Distinct reasons (and nodes per reason) a :class:`PartyConfigError` message spells out; the
#: rest are counted.
CONFIG_ERRORS_SHOWN = 3


def config_reason(node: int, reason: str) -> str | None:
    """``"<who>: <what>"`` of an error reply that says the node's settings are wrong (the
    ClientApp wrapper's ``<mark>: node N (partition-id P): ...`` or Flower's
    ``<class '...ConfigError'>:<'...'>``), else ``None``."""
    if CONFIG_ERROR_MARK not in reason:
        return None
    text = reason.split(CONFIG_ERROR_MARK, 1)[1]
    text = text.removeprefix("'>").removeprefix(":").removeprefix("<'").strip()
    lines = text.removesuffix("'>").strip().splitlines()
    line = lines[0] if lines else CONFIG_ERROR_MARK
    return line if line.startswith(f"node {node}") else f"node {node}: {line}"


def misconfigured(reasons: Mapping[int, str], total: int, why: str) -> PartyConfigError:
    """The error that stops the run: how many nodes, why it cannot go on, each distinct
    reason once with the nodes that gave it."""
    groups: dict[str, list[str]] = {}
    for node in sorted(reasons):
        who, _, what = reasons[node].partition(": ")
        groups.setdefault(what, []).append(who)
    lines = [
        f"{len(reasons)} of {total} nodes cannot take part because of their configuration, "
        f"so the ServerApp stops ({why}):"
    ]
    for what, whos in list(groups.items())[:CONFIG_ERRORS_SHOWN]:
        more = len(whos) - CONFIG_ERRORS_SHOWN
        named = ", ".join(whos[:CONFIG_ERRORS_SHOWN]) + (f" and {more} more" if more > 0 else "")
        lines.append(f"  {named}: {what}")
    if len(groups) > CONFIG_ERRORS_SHOWN:
        lines.append(f"  ... and {len(groups) - CONFIG_ERRORS_SHOWN} more reasons")
    return PartyConfigError("\n".join(lines), dict(reasons))
