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
has a timeout.  Messages to one peer arrive in the order their sends were
issued, also when several sends are in flight at once (a coordinator sends
a message to a full peer as a task): one issued while an earlier one waits
for room queues behind it, and ``try_send`` queues nothing then.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

Frame = bytes | bytearray | memoryview


def address_host(address: str) -> str:
    """The host part of a transport address: ``tcp://10.0.0.1:29400`` -> ``10.0.0.1``."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


class TransportError(Exception):
    """A send could not be completed (timed out, peer unreachable, transport closed)."""


class TransportClosed(TransportError):
    """The transport was closed (shutting down): nothing more will be sent or received."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds every transport enforces."""

    max_frame_bytes: int = 1 << 20  # larger frames are dropped (and the peer disconnected on ZeroMQ)
    max_frames: int = 4  # more frames in one message is a protocol violation
    inbox_size: int = 256  # messages buffered before senders feel back-pressure
    send_hwm: int = 64  # messages queued per destination before send blocks


# The control channel (coordinator, agents, members' membership and heartbeat traffic).  Defined here, not
# beside the runtime thread, so that the launcher, the coordinator and the operator tools import no torch.
CONTROL_LIMITS = Limits(max_frame_bytes=1 << 20, max_frames=1, inbox_size=256, send_hwm=64)
# A host agent's endpoint: the same, but a coordinator's broadcast to pass on is two frames (header, message).
AGENT_LIMITS = Limits(max_frame_bytes=1 << 20, max_frames=2, inbox_size=256, send_hwm=64)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (lower latency heartbeats), the standard loop elsewhere."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


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

    def try_send(self, address: str, frames: Sequence[Frame]) -> bool:
        """Queue one message for `address` now if that needs no wait: no send of ours to it is waiting for room,
        and its queue has some. False: nothing was queued, ``send()`` waits for room (or says what is wrong).

        The usual send, without a task or a timer: a coordinator sends tens of thousands a second.
        """
        ...

    def forget(self, address: str) -> None:
        """Drop any connection state kept for a peer that left."""
        ...

    def dropped(self) -> int:
        """How many inbound messages the limits refused so far."""
        ...

    async def close(self, linger: float = 0.0) -> None:
        """Close sockets first, so that nothing stays blocked on I/O; idempotent.

        Messages that ``send()`` accepted but that have not left yet are dropped,
        unless `linger` > 0: then they are still delivered, for at most `linger`
        seconds, and once the process's last transport closes, ``close()`` returns
        when they have left (or the bound passed), so that a process that exits
        right after (a finished member's last report, the coordinator's Stop)
        does not lose them.
        """
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
