"""The grpc carrier: two OS processes, ordering, large messages, typed failures."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.transport import GrpcCarrier

pytestmark = pytest.mark.timeout(60)

# The child process: a carrier "b" that replies "<seq>:<sha256 of request>", records the order it
# handled requests in, and on "call-back" makes a request of its own to the parent ("a").
_CHILD = textwrap.dedent(
    """
    import asyncio, hashlib, sys
    from chaos_flwr.transport import GrpcCarrier

    async def main():
        seen = []
        carrier = GrpcCarrier("b", {"a": sys.argv[1]})
        stop = asyncio.Event()

        async def handle(src, data):
            if data == b"call-back":
                reply = await carrier.request("a", b"hello from b")
                return b"a said " + reply
            if data == b"order?":
                return ",".join(seen).encode()
            if data == b"stop":
                stop.set()
                return b"bye"
            if data.startswith(b"big:"):
                return bytes([7]) * int(data[4:])
            seen.append(data.decode())
            return f"{len(seen)}:{src}:".encode() + hashlib.sha256(data).hexdigest().encode()

        await carrier.start(handle)
        print(carrier.address, flush=True)
        await asyncio.wait_for(stop.wait(), 50)
        await carrier.close()

    asyncio.run(main())
    """
)


@pytest.fixture
def child_env() -> Iterator[dict[str, str]]:
    env = dict(os.environ)
    env.pop("http_proxy", None)
    env.pop("https_proxy", None)
    yield env


def _start_child(parent_addr: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, parent_addr],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("127.0.0.1:"):
        proc.kill()
        raise AssertionError(
            f"child did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        )
    return proc, line


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_two_processes_exchange_in_order_and_both_ways(child_env: dict[str, str]) -> None:
    async def run() -> None:
        a = GrpcCarrier("a")

        async def handle_a(src: str, data: bytes) -> bytes:
            return f"a got {data.decode()} from {src}".encode()

        await a.start(handle_a)
        assert a.address is not None
        proc, addr = await asyncio.to_thread(_start_child, a.address, child_env)
        try:
            a.add_peer("b", addr)
            msgs = [f"m{i}".encode() for i in range(40)]
            for i, m in enumerate(msgs):
                reply = await a.request("b", m)
                expected = f"{i + 1}:a:".encode() + hashlib.sha256(m).hexdigest().encode()
                assert reply == expected
            assert await a.request("b", b"order?") == b",".join(msgs)
            # b calls a back while serving a's request: traffic flows both ways
            assert await a.request("b", b"call-back") == b"a said a got hello from b from b"
            # a 64 MiB + 1 reply crosses the process boundary intact
            n = 64 * 1024 * 1024 + 1
            big = await a.request("b", f"big:{n}".encode(), timeout=30)
            assert len(big) == n and big == bytes([7]) * n
            assert await a.request("b", b"stop") == b"bye"
            await asyncio.to_thread(proc.wait, 20)
            assert proc.returncode == 0
            # the child is gone: the next request is a typed failure naming the peer
            with pytest.raises(TransportError, match="'b'"):
                await a.request("b", b"anyone?", timeout=5)
        finally:
            _stop(proc)
            await a.close()

    asyncio.run(run())


def test_failures_are_transport_errors() -> None:
    async def run() -> None:
        async def boom(src: str, data: bytes) -> bytes:
            raise ValueError("no such shard")

        a = GrpcCarrier("a", max_message_bytes=1024)
        b = GrpcCarrier("b")
        await a.start(boom)
        await b.start(boom)
        try:
            assert a.address is not None
            with pytest.raises(TransportError, match="not in 'b'"):
                await b.request("nobody", b"x")
            b.add_peer("a", a.address)
            with pytest.raises(TransportError, match="no such shard"):
                await b.request("a", b"x")
            with pytest.raises(TransportError, match="max_message_bytes"):
                await a.request("b", b"x" * 2048)
            # a port where nothing listens (one we bound and released)
            free = GrpcCarrier("c")
            await free.start(boom)
            dead_addr = free.address
            await free.close()
            assert dead_addr is not None
            b.add_peer("c", dead_addr)
            with pytest.raises(TransportError, match="UNAVAILABLE"):
                await b.request("c", b"x", timeout=5)
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


def test_slow_handler_times_out_and_bad_config_is_refused() -> None:
    async def run() -> None:
        async def slow(src: str, data: bytes) -> bytes:
            await asyncio.sleep(5)
            return b"late"

        a = GrpcCarrier("a")
        b = GrpcCarrier("b")
        await a.start(slow)
        try:
            assert a.address is not None
            b.add_peer("a", a.address)
            with pytest.raises(TransportError, match="DEADLINE_EXCEEDED"):
                await b.request("a", b"x", timeout=0.3)
            with pytest.raises(TransportError, match="already started"):
                await a.start(slow)
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())
    with pytest.raises(ConfigError, match="party_id"):
        GrpcCarrier("")
    with pytest.raises(ConfigError, match="chunk_bytes"):
        GrpcCarrier("a", chunk_bytes=0)


def test_a_restarted_peer_is_reached_at_its_new_address() -> None:
    async def run() -> None:
        def replier(tag: bytes):  # type: ignore[no-untyped-def]
            async def handle(src: str, data: bytes) -> bytes:
                return tag + data

            return handle

        old = GrpcCarrier("x")
        await old.start(replier(b"old:"))
        caller = GrpcCarrier("y")
        try:
            assert old.address is not None
            caller.add_peer("x", old.address)
            assert await caller.request("x", b"1") == b"old:1"
            await old.close()
            with pytest.raises(TransportError):
                await caller.request("x", b"2", timeout=5)
            new = GrpcCarrier("x")
            await new.start(replier(b"new:"))
            assert new.address is not None and new.address != old.address
            caller.add_peer("x", new.address)
            assert await caller.request("x", b"3") == b"new:3"
            await new.close()
        finally:
            await caller.close()

    asyncio.run(run())


# --- push streams ------------------------------------------------------------------------------


def test_push_batches_keep_order_and_reach_the_push_handler() -> None:
    async def run() -> None:
        got: list[tuple[str, list[bytes]]] = []

        async def no_requests(src: str, data: bytes) -> bytes:
            return b"reply"

        a = GrpcCarrier("a")
        b = GrpcCarrier("b")
        await a.start(no_requests)
        await b.start(no_requests, push_handler=lambda src, items: got.append((src, items)))
        try:
            assert b.address is not None
            a.add_peer("b", b.address)
            items = [hashlib.sha256(str(i).encode()).digest() * (1 + i % 5) for i in range(500)]
            for item in items:
                a.push("b", item)
            assert a.pending() == 500  # nothing goes out before the event loop runs
            for _ in range(2000):
                if sum(len(batch) for _, batch in got) == len(items):
                    break
                await asyncio.sleep(0.005)
            assert [x for _, batch in got for x in batch] == items  # all, once, in order
            assert {src for src, _ in got} == {"a"}
            assert a.pushed == 500 and a.push_lost == 0 and a.pending() == 0
            assert 1 <= a.batches_sent == b.batches_received < 500  # queued items share a batch
            # the request path still works beside the push stream
            assert await a.request("b", b"x") == b"reply"
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


def test_push_failures_are_typed_or_counted() -> None:
    from chaos_flwr.transport.grpc_carrier import pack_batch, unpack_batch

    items = [b"", b"one", bytes(range(256)) * 3]
    assert unpack_batch(pack_batch(items)) == items
    with pytest.raises(TransportError, match="truncated"):
        unpack_batch(pack_batch(items)[:-1])
    with pytest.raises(TransportError, match="truncated"):
        unpack_batch(b"\x00\x00")

    async def run() -> None:
        async def no_requests(src: str, data: bytes) -> bytes:
            return b""

        a = GrpcCarrier("a", max_message_bytes=1024)
        b = GrpcCarrier("b")  # started without a push handler: its streams are refused
        await a.start(no_requests)
        await b.start(no_requests)
        dead = GrpcCarrier("c")
        await dead.start(no_requests)
        dead_addr = dead.address
        await dead.close()
        try:
            with pytest.raises(TransportError, match="not in 'a'"):
                a.push("nobody", b"x")
            assert b.address is not None and dead_addr is not None
            a.add_peer("b", b.address)
            a.add_peer("c", dead_addr)
            with pytest.raises(TransportError, match="max_message_bytes"):
                a.push("b", b"x" * 2048)
            a.push("c", b"to a stopped carrier")
            a.push("b", b"to a carrier that takes no pushes")
            for _ in range(1000):
                if a.push_lost + a.pushed == 2 and a.pending() == 0:
                    break
                await asyncio.sleep(0.01)
            # at most once, never raised: the stopped carrier's item is lost and counted
            assert a.pending() == 0 and a.push_lost + a.pushed == 2 and a.push_lost >= 1
            assert b.batches_received == 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())
