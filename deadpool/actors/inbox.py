"""The runtime thread's internal messages, and the inbox every actor reads.

These move between the runtime thread's reader tasks, its router and its
actors, never over the wire (that vocabulary is ``protocol/messages.py``) and
never to the compute thread (``handoff.py``).  An actor's ``Mailbox`` has two
lanes: a local lane for what this process asks of it (the compute thread's
commands, a sibling actor's notices), served first and never refused, and a
bounded peer lane that a reader task fills from the network and that pushes
back on that reader when full, so peer traffic can neither crowd out nor
drop a local command.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from deadpool.protocol.messages import Message
from deadpool.protocol.view import View

log = logging.getLogger("deadpool.actors.inbox")

# The local lane has no hard bound: what enters it is paced by the compute thread (a few items per step or
# per view change, and the pre-step gate waits for the snapshot actor every step).  Past this many waiting
# items the actor is stuck, which is logged (once per crossing) instead of dropping a command.
LOCAL_BACKLOG_WARNING = 256


@dataclass(frozen=True, slots=True)
class Bulk:
    """A message from a peer on the bulk channel, with its payload frames (for the SnapshotActor)."""

    message: Message  # the decoded, authenticated first frame
    frames: list[memoryview]  # the frames after it (a snapshot's or a restore's payload)


@dataclass(frozen=True, slots=True)
class Inbound:
    """A decoded message that arrived from the coordinator (for the MembershipActor)."""

    message: Message  # authenticated, from the control channel


@dataclass(frozen=True, slots=True)
class Outbound:
    """A message for the coordinator, from the compute thread or the SnapshotActor (for the MembershipActor)."""

    message: Message  # sent as is, in the order posted


@dataclass(frozen=True, slots=True)
class ViewChanged:
    """The MembershipActor adopted a newer view (for the SnapshotActor)."""

    view: View  # the view now held


@dataclass(frozen=True, slots=True)
class PrepareArrived:
    """The MembershipActor handed a Prepare to the compute thread (for the SnapshotActor: it may answer now)."""

    epoch: int  # the epoch being prepared


@dataclass(frozen=True, slots=True)
class Drain:
    """A marker behind what was posted before it: `done` runs once each of those messages was handed to the
    transport.  It passes the SnapshotActor (whose PrepareAcks it must follow) and then the MembershipActor.

    ``Handoff.flush`` posts one and waits for it; shutdown waits for one, so a seat's last report
    (``Finished``, posted just before ``rt.finish()``) is sent before the transport closes.
    """

    done: Callable[[], None]  # called on the runtime thread; must not block


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Posted (through the handoff) by ``RuntimeThread.stop``: end the runtime thread after what came before."""

    linger_s: float = 0.0  # snapshot parts already sent to peers still leave within this (a moved member's)


L = TypeVar("L")
P = TypeVar("P")


class Mailbox(Generic[L, P]):
    """One actor's inbox: a local lane (`L`), served first and never refused, and a bounded peer lane (`P`).

    Only the runtime thread's loop touches it, and only its actor reads it.
    """

    def __init__(self, name: str, peer_size: int) -> None:
        self.name = name
        self._local: deque[L] = deque()
        self._peer: asyncio.Queue[P] = asyncio.Queue(maxsize=peer_size)
        self._ready = asyncio.Event()  # set whenever either lane may hold something
        self._backlogged = False

    def post(self, item: L) -> None:
        """Queue an item from this process; never blocks, never raises."""
        self._local.append(item)
        if len(self._local) > LOCAL_BACKLOG_WARNING and not self._backlogged:
            log.error("%s: %d local commands waiting; the actor is stuck", self.name, len(self._local))
        self._backlogged = len(self._local) > LOCAL_BACKLOG_WARNING
        self._ready.set()

    async def put(self, item: P) -> None:
        """Queue an item from a peer, waiting while the peer lane is full (back-pressure on the reader)."""
        await self._peer.put(item)
        self._ready.set()

    async def get(self) -> L | P:
        """The next item: local ones first."""
        while True:
            if self._local:
                return self._local.popleft()
            if not self._peer.empty():
                return self._peer.get_nowait()
            self._ready.clear()
            await self._ready.wait()

    def take_local(self) -> list[L]:
        """Remove and return every waiting local item (an actor's teardown fails the requests among them)."""
        items = list(self._local)
        self._local.clear()
        return items

    def qsize(self) -> tuple[int, int]:
        """(local, peer) items waiting."""
        return len(self._local), self._peer.qsize()
