"""The launcher and its fork server speak one schema: requests and replies round-trip, bad bytes are refused."""

from __future__ import annotations

import msgspec
import pytest

from deadpool.protocol import forks


def test_a_request_and_every_reply_round_trip() -> None:
    request = forks.ForkRequest("train.py", ["--steps", "3"], {"RANK": "0"}, "/tmp")
    assert forks.decode_request(forks.encode(request)) == request
    for reply in (forks.ServerReady(41), forks.Forked(42), forks.ForkRefused("no memory")):
        assert forks.decode_reply(forks.encode(reply)) == reply


def test_malformed_and_mistyped_messages_are_refused_with_a_clear_error() -> None:
    with pytest.raises(forks.ForkProtocolError, match="malformed fork request"):
        forks.decode_request(b"\xc1 not msgpack")
    with pytest.raises(forks.ForkProtocolError, match="malformed fork request"):
        forks.decode_request(forks.encode(forks.Forked(3)))  # a reply where a request belongs
    with pytest.raises(forks.ForkProtocolError, match="malformed fork server reply"):
        forks.decode_reply(msgspec.msgpack.encode({"type": "forked", "pid": "three"}))


def test_an_oversized_request_is_refused_before_it_is_sent() -> None:
    huge = forks.ForkRequest("train.py", [], {"BIG": "x" * forks.MAX_MESSAGE}, "/")
    with pytest.raises(forks.ForkProtocolError, match="over"):
        forks.encode(huge)
