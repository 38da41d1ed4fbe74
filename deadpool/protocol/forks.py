"""The messages between a host's launcher and its fork server, one msgspec schema each, used by both ends.

They travel over one Unix ``SOCK_SEQPACKET`` pair (one datagram per message, the new worker's output pipe
passed beside a request as a file descriptor); see ``deadpool/worker/forkserver.py``.
"""

from __future__ import annotations

import msgspec

from deadpool.errors import DeadPoolError

MAX_MESSAGE = 1 << 20  # bytes: a request carries one worker's whole environment


class ForkRequest(msgspec.Struct, frozen=True, tag="fork"):
    """Start one worker as ``python -u SCRIPT *ARGS`` would, with this environment and working directory."""

    script: str
    args: list[str]
    env: dict[str, str]
    cwd: str


class ServerReady(msgspec.Struct, frozen=True, tag="ready"):
    """The server has imported what every worker needs and takes requests."""

    pid: int


class Forked(msgspec.Struct, frozen=True, tag="forked"):
    """The worker runs, as a child of the launcher (its subreaper), under this pid."""

    pid: int


class ForkRefused(msgspec.Struct, frozen=True, tag="refused"):
    """The request could not be carried out (why says what); no worker was started."""

    why: str


Reply = ServerReady | Forked | ForkRefused
_REPLY: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)  # type: ignore[arg-type]


class ForkProtocolError(DeadPoolError):
    """A message between the launcher and its fork server was malformed or too large."""


def encode(message: ForkRequest | ServerReady | Forked | ForkRefused) -> bytes:
    data = msgspec.msgpack.encode(message)
    if len(data) > MAX_MESSAGE:
        raise ForkProtocolError(f"a {type(message).__name__} of {len(data)} bytes is over {MAX_MESSAGE}")
    return data


def decode_request(data: bytes) -> ForkRequest:
    try:
        return msgspec.msgpack.decode(data, type=ForkRequest)
    except msgspec.DecodeError as err:
        raise ForkProtocolError(f"malformed fork request: {err}") from None


def decode_reply(data: bytes) -> Reply:
    try:
        return _REPLY.decode(data)
    except msgspec.DecodeError as err:
        raise ForkProtocolError(f"malformed fork server reply: {err}") from None
