"""The audits around a verified round: whether a round can be certified on its base, and
asking a round's audit again when none came back with its certify replies."""

from __future__ import annotations

from logging import INFO

from flwr.serverapp import Grid
from flwr.supercore import log

from chaos_flwr.flower.server.courier import Courier, PhaseSpec
from chaos_flwr.flower.server.logs import RoundLog
from chaos_flwr.flower.server.proofs import RoundProofs
from chaos_flwr.flower.server.view import ServerView

__all__ = ["audit_again", "not_certifiable"]


def not_certifiable(
    proofs: RoundProofs, base: tuple[int, bytes], active: list[str], updates: int
) -> str:
    """Why a round on ``base`` with ``updates`` signed updates cannot be certified ("": it can)."""
    if updates < proofs.min_updates:
        return f"{updates} signed update(s) < {proofs.min_updates} the charter asks for"
    verdict = proofs.verdict(base[0], base[1], active)
    if verdict is False:
        return f"round {base[0]} was audited false"
    if verdict is None:
        return f"the audit of round {base[0]} has not come in"
    return ""


def audit_again(
    courier: Courier, view: ServerView | None, grid: Grid, timeout: float, rnd: int, digest: bytes
) -> None:
    """When no audit of the round came back with its certify replies (its auditor crashed,
    or a differing view put another party on the rota), ask again at once, the spare rota
    position too: an exchange with the auditors only, and only on that event, so the state
    is final before the next round (and before any kill of this ServerApp)."""
    proofs = courier.proofs
    if proofs is None or view is None:
        return
    job = proofs.audit_job(sorted(view.active()))
    if job is None:
        return
    spec = PhaseSpec("relay", rnd, digest, audit=job)
    known = list(grid.get_node_ids())
    courier.phase(grid, [], known, spec, timeout=timeout, log_=RoundLog(rnd))
    verdict = proofs.verdict(rnd, digest, sorted(view.active()))
    log(
        INFO, "Chaos: the audit of round %d, asked again of %s: %s", rnd,
        ", ".join(sorted(job.parties)),
        {True: "final", False: "REFUTED", None: "did not come in"}[verdict],
    )  # fmt: skip
