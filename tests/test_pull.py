"""The pull negotiation (chaos_flwr.pull): messages, the puller's state machine, its saved form.

Holders are plain functions over the state bytes here (no carrier): what the machine decides is
carried out in the test, so every step, plan and request can be counted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pytest

import chaos_flwr.pull.negotiation as negotiation
from chaos_flwr import codec
from chaos_flwr.errors import DecodeError
from chaos_flwr.pull.messages import (
    ManifestReply,
    ManifestRequest,
    Reply,
    Request,
    ShardsReply,
    ShardsRequest,
    SizeReply,
    SizeRequest,
    read_reply,
    read_request,
    serve,
)
from chaos_flwr.pull.negotiation import Decision, LinkResult, PullNegotiation, Stage, Status
from chaos_flwr.pull.saved import load_negotiation, save_negotiation
from chaos_flwr.state import Manifest, TrainingState

ROUND = 7
STATE = TrainingState(
    {"w": np.random.default_rng(3).standard_normal(30_000).astype(np.float32)}, ROUND
)
DATA = STATE.to_bytes()
DIGEST = STATE.digest()

Holder = Callable[[Request], Reply | None]
LAST: list[PullNegotiation] = []


def honest(data: bytes = DATA, direct: str = "") -> Holder:
    return lambda req: serve(data, req, direct_addr=direct)


def run(
    pull: PullNegotiation,
    holders: Mapping[str, Holder],
    *,
    links: Mapping[str, Callable[[ShardsRequest], LinkResult]] | None = None,
    max_steps: int = 20,
    on_step: Callable[[PullNegotiation, int], PullNegotiation] | None = None,
) -> tuple[Decision, list[dict[str, Request]]]:
    """Drive ``pull`` to its end; return the last decision and every relay batch.

    ``on_step`` may replace the pull between steps (a reload); the pull driven last is then
    in ``LAST[0]``.
    """
    batches: list[dict[str, Request]] = []
    decision = pull.start(0.0)
    now = 0.0
    for step in range(max_steps):
        while decision.direct:
            assert links is not None
            got = {}
            for d, (_a, reqs) in decision.direct.items():
                req = ShardsRequest(
                    tuple(r.index for r in reqs),
                    tuple(r.start for r in reqs),
                    tuple(r.end for r in reqs),
                )
                got[d] = links[d](req)
            decision = pull.on_direct(got, now)
        if decision.status != Status.WANT:
            LAST[:] = [pull]
            return decision, batches
        batches.append(dict(decision.relay))
        replies: dict[str, Reply | None] = {}
        lost: set[str] = set()
        for donor, req in decision.relay.items():
            # every message crosses the wire as plain values, both ways
            reply = holders[donor](read_request(req.to_value()))
            if reply is None:
                lost.add(donor)
            else:
                replies[donor] = read_reply(reply.to_value())
        now += 1.0
        if on_step is not None:
            pull = on_step(pull, step)
        decision = pull.on_replies(replies, lost, now)
    raise AssertionError("the pull did not end")


def _done(pull: PullNegotiation, decision: Decision) -> None:
    assert decision.status == Status.DONE, pull.error
    assert pull.state is not None and pull.state.digest() == DIGEST
    assert pull.state.same_as(STATE)


def test_sizes_then_a_manifest_of_the_told_shape_then_shards_from_every_holder() -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b", "c"], min_shard_bytes=1024)
    decision, batches = run(pull, {d: honest() for d in "abc"})
    _done(pull, decision)
    assert [type(r) for r in batches[0].values()] == [SizeRequest] * 3
    (ask,) = batches[1].values()
    assert isinstance(ask, ManifestRequest)
    assert pull.plan is not None
    assert (ask.total, ask.shard_bytes, ask.num_shards) == (
        len(DATA),
        pull.plan.shard_bytes,
        pull.plan.num_shards,
    )
    assert set(batches[2]) == {"a", "b", "c"}  # the shards come from all at once
    assert len(batches) == 3
    assert sum(pull.received.values()) == len(DATA)


def test_a_size_hint_saves_the_size_step() -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024, total_hint=len(DATA))
    decision, batches = run(pull, {d: honest() for d in "ab"})
    _done(pull, decision)
    assert len(batches) == 2
    assert {type(r) for r in batches[0].values()} == {ManifestRequest, SizeRequest}


def test_a_wrong_hint_is_corrected_by_the_holder_and_the_shape_planned_again() -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024, total_hint=999)
    decision, batches = run(pull, {d: honest() for d in "ab"})
    _done(pull, decision)
    asks = [r for b in batches for r in b.values() if isinstance(r, ManifestRequest)]
    assert [a.total for a in asks] == [999, len(DATA)]


def test_the_plan_is_made_at_most_once_per_event(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = negotiation.plan_transfer

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(len(batches_seen))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    batches_seen: list[int] = []
    monkeypatch.setattr(negotiation, "plan_transfer", counting)
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b", "c"], min_shard_bytes=1024)

    def note(p: PullNegotiation, step: int) -> PullNegotiation:
        batches_seen.append(step)
        return p

    decision, _ = run(pull, {d: honest() for d in "abc"}, on_step=note)
    _done(pull, decision)
    assert len(calls) == len(set(calls))  # never twice within one event
    assert len(calls) == 1  # no holder lost, no link measured: the shape's plan is the plan


def test_a_manifest_that_does_not_name_the_digest_loses_its_holder() -> None:
    other = TrainingState({"w": np.zeros(30_000, np.float32)}, ROUND).to_bytes()
    liar = honest(other)
    pull = PullNegotiation(ROUND, DIGEST, ["liar", "b"], min_shard_bytes=1024)
    decision, _ = run(pull, {"liar": liar, "b": honest()})
    _done(pull, decision)
    assert "liar" in pull.lost and pull.received == {"b": len(DATA)}


def test_a_holder_lost_mid_pull_has_its_shards_replanned() -> None:
    shard_calls = {"b": 0}

    def dies(req: Request) -> Reply | None:
        if isinstance(req, ShardsRequest):
            shard_calls["b"] += 1
            return None
        return serve(DATA, req)

    pull = PullNegotiation(ROUND, DIGEST, ["a", "b", "c"], min_shard_bytes=1024)
    decision, _ = run(pull, {"a": honest(), "b": dies, "c": honest()})
    _done(pull, decision)
    assert shard_calls["b"] == 1 and "b" in pull.lost and "b" not in pull.received


def test_a_bad_shard_drops_its_holder_and_another_sends_it() -> None:
    def corrupt(req: Request) -> Reply | None:
        reply = serve(DATA, req)
        if isinstance(req, ShardsRequest):
            assert hasattr(reply, "data")
            data = tuple(b"\x00" * len(d) for d in reply.data)  # type: ignore[union-attr]
            return type(reply)(req.index, data)  # type: ignore[call-arg]
        return reply

    pull = PullNegotiation(ROUND, DIGEST, ["a", "bad"], min_shard_bytes=1024)
    decision, _ = run(pull, {"a": honest(), "bad": corrupt})
    _done(pull, decision)
    assert "bad" in pull.lost and pull.received == {"a": len(DATA)}


def test_no_holder_answers_fails_with_a_reason() -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024)
    decision, _ = run(pull, {"a": lambda r: None, "b": lambda r: None})
    assert decision.status == Status.FAILED and pull.stage == Stage.FAILED
    assert "size" in pull.error
    assert pull.on_replies({}, set(), 9.0).status == Status.FAILED  # ended stays ended


def _link(data: bytes = DATA, *, fail: bool = False) -> Callable[[ShardsRequest], LinkResult]:
    def fetch(req: ShardsRequest) -> LinkResult:
        if fail:
            return LinkResult(error="TransportError: refused")
        shards = tuple(
            (i, data[s:e], 0.001) for i, s, e in zip(req.index, req.start, req.end, strict=True)
        )
        n = sum(len(x) for _, x, _ in shards)
        return LinkResult(shards=shards, nbytes=n, seconds=n / 50e6)

    return fetch


def test_direct_holders_send_their_shares_over_their_links_and_are_timed() -> None:
    holders = {"a": honest(direct="127.0.0.1:1"), "b": honest(direct="127.0.0.1:2"), "c": honest()}
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b", "c"], min_shard_bytes=1024)
    decision, batches = run(pull, holders, links={"a": _link(), "b": _link()})
    _done(pull, decision)
    assert pull.direct_bytes.get("a", 0) > 0 and pull.direct_bytes.get("b", 0) > 0
    # no probe before the plan: the shares start from the assumed rates, and the fetch's
    # own timing (5x the assumed rate) is what the monitor holds afterwards
    assert pull.plan_rates["a"] == pull.plan_rates["c"]
    assert pull.rates()["a"] == pytest.approx(50e6) and pull.rates()["c"] < 50e6
    relayed = {d for b in batches for d, r in b.items() if isinstance(r, ShardsRequest)}
    assert relayed <= {"c"}


def test_a_failed_direct_link_falls_back_to_the_relay() -> None:
    holders = {"a": honest(direct="127.0.0.1:1"), "b": honest()}
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024)
    decision, _ = run(pull, holders, links={"a": _link(fail=True)})
    _done(pull, decision)
    assert "a" in pull.direct_failed and pull.direct_bytes == {}
    assert pull.received.get("a", 0) > 0  # its share came through the relay


def test_a_refused_address_is_never_dialled() -> None:
    def only_loopback(addr: str) -> str:
        from chaos_flwr.errors import ConfigError

        raise ConfigError(f"not a loopback address: {addr}")

    holders = {"a": honest(direct="10.0.0.9:1"), "b": honest()}
    pull = PullNegotiation(
        ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024, address_ok=only_loopback
    )
    decision, _ = run(pull, holders, links={})
    _done(pull, decision)
    assert "a" in pull.direct_failed and not pull.addresses


def test_a_pull_saved_between_steps_goes_on_in_another_process() -> None:
    def reload(p: PullNegotiation, step: int) -> PullNegotiation:
        # through the codec, as the party's state file holds it
        value = codec.decode(codec.encode(save_negotiation(p)))
        assert isinstance(value, dict)
        return load_negotiation(value)

    holders = {d: honest() for d in "abc"}
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b", "c"], min_shard_bytes=1024)
    decision, batches = run(pull, holders, on_step=reload)
    last = LAST[0]
    assert last is not pull  # every step ran on a pull loaded from its saved value
    _done(last, decision)
    assert len(batches) == 3 and sum(last.received.values()) == len(DATA)


def test_a_reloaded_pull_keeps_the_shards_it_had() -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024, total_hint=len(DATA))
    d1 = pull.start(0.0)
    replies1: dict[str, Reply | None] = {k: serve(DATA, r) for k, r in d1.relay.items()}
    d2 = pull.on_replies(replies1, set(), 1.0)
    assert pull.stage == Stage.SHARDS
    # only "a" answers this step; "b"'s reply comes to the next process
    a_req = d2.relay["a"]
    pull.on_replies({"a": serve(DATA, a_req)}, set(), 2.0)
    value = codec.decode(codec.encode(save_negotiation(pull)))
    assert isinstance(value, dict)
    again = load_negotiation(value)
    assert again.received == pull.received and again.session is not None
    assert set(again.session.missing()) == set(pull.session.missing())  # type: ignore[union-attr]
    assert again.stage == Stage.SHARDS


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("v", 99),
        ("stage", "done"),
        ("stage", "nonsense"),
        ("round", "7"),
        ("round", True),
        ("donors", "abc"),
        ("digest", "x"),
        ("got", [-1]),
        ("manifest", b"garbage"),
        ("plan", {"assignment": 1}),
    ],
)
def test_a_saved_pull_with_a_bad_field_is_refused(key: str, bad: object) -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024, total_hint=len(DATA))
    d1 = pull.start(0.0)
    pull.on_replies({k: serve(DATA, r) for k, r in d1.relay.items()}, set(), 1.0)
    value = save_negotiation(pull)
    value[key] = bad
    with pytest.raises(DecodeError):
        load_negotiation(value)


def test_a_finished_pull_is_not_saved() -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a"], min_shard_bytes=1024)
    decision, _ = run(pull, {"a": honest()})
    _done(pull, decision)
    with pytest.raises(DecodeError):
        save_negotiation(pull)


def test_serve_answers_the_shape_it_is_told_and_refuses_amplification() -> None:
    reply = serve(DATA, ManifestRequest(len(DATA), 4096, -(-len(DATA) // 4096)))
    assert isinstance(reply, ManifestReply)
    manifest = Manifest.from_bytes(reply.manifest)
    assert (manifest.shard_bytes, manifest.state_digest) == (4096, DIGEST)
    assert serve(DATA, ManifestRequest(5, 1, 5)) == SizeReply(len(DATA))  # another size
    with pytest.raises(DecodeError):  # a small request asking for the state many times over
        serve(DATA, ShardsRequest((0,) * 10, (0,) * 10, (len(DATA),) * 10))
    with pytest.raises(DecodeError):
        serve(DATA, ShardsRequest((0,), (0,), (len(DATA) + 1,)))
    with pytest.raises(DecodeError):
        read_request({"op": "shards", "index": list(range(5000)), "start": [], "end": []})
    with pytest.raises(DecodeError):
        read_reply({"index": [0], "data": ["not bytes"]})


def test_replies_from_donors_the_puller_never_named_are_ignored() -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024, total_hint=len(DATA))
    d1 = pull.start(0.0)
    bogus: dict[str, Reply | None] = {"zz": SizeReply(1)}
    replies = {**{k: serve(DATA, r) for k, r in d1.relay.items()}, **bogus}
    d2 = pull.on_replies(replies, {"yy"}, 1.0)
    assert d2.status == Status.WANT and pull.stage == Stage.SHARDS
    assert pull.lost == [] and set(pull.live) == {"a", "b"}
    shards: dict[str, Reply | None] = {k: serve(DATA, r) for k, r in d2.relay.items()}
    shards["zz"] = shards[next(iter(shards))]  # a made-up donor's copy of real shards
    assert pull.on_replies(shards, set(), 2.0).status == Status.DONE
    assert "zz" not in pull.received and pull.state is not None


def test_a_size_past_the_bound_loses_its_holder_before_anything_is_allocated() -> None:
    huge = 1 << 50  # a size the relay or a holder made up: 1 PiB

    def liar(req: Request) -> Reply | None:
        return SizeReply(huge) if not isinstance(req, ShardsRequest) else None

    pull = PullNegotiation(ROUND, DIGEST, ["liar", "b"], min_shard_bytes=1024, total_hint=huge)
    decision, batches = run(pull, {"liar": liar, "b": honest()})
    _done(pull, decision)
    assert all(isinstance(r, SizeRequest) for r in batches[0].values())  # the hint was not used
    assert "liar" in pull.lost and pull.received == {"b": len(DATA)}
    alone = PullNegotiation(ROUND, DIGEST, ["liar"], min_shard_bytes=1024)
    decision, _ = run(alone, {"liar": liar})
    assert decision.status == Status.FAILED and "within the bound" in alone.error


def test_a_reply_from_a_donor_lost_before_the_shards_is_ignored() -> None:
    pull = PullNegotiation(ROUND, DIGEST, ["a", "b"], min_shard_bytes=1024)
    d1 = pull.start(0.0)
    d2 = pull.on_replies({"a": serve(DATA, d1.relay["a"])}, {"b"}, 1.0)  # b lost at the sizes
    d3 = pull.on_replies({"a": serve(DATA, d2.relay["a"])}, set(), 2.0)
    assert pull.stage == Stage.SHARDS and d3.status == Status.WANT
    replies: dict[str, Reply | None] = {k: serve(DATA, r) for k, r in d3.relay.items()}
    replies["b"] = ShardsReply((), ())  # the relay answers for the lost donor
    assert pull.on_replies(replies, set(), 3.0).status == Status.DONE


def test_a_manifest_request_for_too_many_shards_is_refused_unanswered() -> None:
    with pytest.raises(DecodeError, match="num-shards"):
        read_request({"op": "manifest", "total": 10, "shard-bytes": 10, "num-shards": 10**6})


def test_a_lost_relay_holder_is_replanned_onto_a_direct_holder() -> None:
    def mute(req: Request) -> Reply | None:
        return None if isinstance(req, ShardsRequest) else serve(DATA, req)

    holders = {"a": honest(direct="127.0.0.1:1"), "c": mute}
    pull = PullNegotiation(
        ROUND, DIGEST, ["a", "c"], min_shard_bytes=1024, rates={"c": 45e6}
    )  # c looks almost as fast as a's link, so a duplicates c's tail in the endgame
    decision, _ = run(pull, holders, links={"a": _link()})
    _done(pull, decision)
    assert "c" in pull.lost and pull.received == {"a": len(DATA)}
