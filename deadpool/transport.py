"""The transport protocol: how actors move frames between processes.

A transport is one bound endpoint: it receives messages (lists of frames) from
anyone into a bounded inbox, and sends messages to any other endpoint's
address.  Actors only ever see this protocol, so adding a transport (a fourth
URL scheme) never touches an actor.  Implementations live in the top-level
``transports/`` folder, packaged as ``deadpool.transports``:

- ``tcp://host:port`` and ``ipc:///path``: ZeroMQ (``transports/zmq_transport.py``)
- ``inproc://name``: asyncio queues inside one process, for deterministic
  protocol tests and simulations (``transports/inproc.py``)

Limits are part of the contract: every frame larger than ``max_frame_bytes``
is dropped before it reaches an actor, the inbox holds at most
``inbox_size`` messages (a full inbox pushes back on senders), and every send
has a timeout.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

Frame = bytes | bytearray | memoryview


class TransportError(Exception):
    """A send could not be completed (timed out, peer unreachable, transport closed)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds every transport enforces."""

    max_frame_bytes: int = 1 << 20  # larger frames are dropped (and the peer disconnected on ZeroMQ)
    max_frames: int = 4  # more frames in one message is a protocol violation
    inbox_size: int = 256  # messages buffered before senders feel back-pressure
    send_hwm: int = 64  # messages queued per destination before send blocks


@runtime_checkable
class Transport(Protocol):
    """One bound endpoint."""

    @property
    def address(self) -> str:
        """The address other endpoints send to (with the real port once bound)."""
        ...

    async def run(self) -> None:
        """Read from the wire into the inbox until closed; owned by the caller's TaskGroup."""
        ...

    async def recv(self) -> list[memoryview]:
        """Next message from the inbox; safe to cancel (timeouts go here)."""
        ...

    def pending(self) -> int:
        """Messages waiting in the inbox (so a consumer can drain before acting on time)."""
        ...

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        """Send one message to `address`.

        Raises:
            TransportError: not delivered to the peer's queue within `timeout`, or closed.
        """
        ...

    def forget(self, address: str) -> None:
        """Drop any connection state kept for a peer that left."""
        ...

    def dropped(self) -> int:
        """How many inbound messages the limits refused so far."""
        ...

    async def close(self) -> None:
        """Close sockets first, so that nothing stays blocked on I/O; idempotent."""
        ...


_SCHEMES = {
    "tcp": "deadpool.transports.zmq_transport:ZmqTransport",
    "ipc": "deadpool.transports.zmq_transport:ZmqTransport",
    "inproc": "deadpool.transports.inproc:InProcTransport",
}


def open_transport(url: str, limits: Limits | None = None) -> Transport:
    """Bind a transport for `url` (``tcp://127.0.0.1:0`` binds a free port).

    Raises:
        ValueError: the URL's scheme is not one DeadPool knows.
    """
    scheme = url.split("://", 1)[0] if "://" in url else ""
    target = _SCHEMES.get(scheme)
    if target is None:
        raise ValueError(f"unknown transport URL {url!r}: use one of {', '.join(s + '://' for s in _SCHEMES)}")
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    transport: Transport = cls(url, limits or Limits())
    return transport
