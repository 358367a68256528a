"""A holder's answer to malformed pull requests: typed errors, never a stray exception."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

from chaos_flwr.errors import DecodeError
from chaos_flwr.flower.client.donor import serve_request

STATE = bytes(range(256)) * 4


def test_shard_request_returns_the_requested_ranges() -> None:
    reply = serve_request(
        STATE, ConfigRecord({"op": "shards", "index": [0, 3], "start": [0, 100], "end": [10, 164]})
    )
    assert reply["index"] == [0, 3]
    assert reply["data"] == [STATE[0:10], STATE[100:164]]


@pytest.mark.parametrize(
    "request_fields",
    [
        {"op": "shards", "index": [0, 1], "start": [0], "end": [10]},  # lists of unequal length
        {"op": "shards", "index": [0], "start": [0, 5], "end": [10, 20]},
        {"op": "shards", "index": ["x"], "start": [0], "end": [10]},  # index not an int
        {"op": "shards", "index": [True], "start": [0], "end": [10]},
        {"op": "shards", "index": [0], "start": [20], "end": [10]},  # end before start
        {"op": "shards", "index": 0, "start": [0], "end": [10]},
        {"op": "manifest", "shard-bytes": "64", "num-shards": 16},
        {"op": "plan-manifest", "donors": 0, "min-shard": 64},
        {"op": "delete"},
    ],
)
def test_malformed_requests_raise_decode_error(request_fields: dict[str, object]) -> None:
    with pytest.raises(DecodeError):
        serve_request(STATE, ConfigRecord(request_fields))  # type: ignore[arg-type]
