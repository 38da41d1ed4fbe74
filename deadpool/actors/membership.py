"""MembershipActor: the worker's side of the membership protocol.

It holds the newest view this member has heard of, accepts only views with a
higher epoch, drops (and logs) stale or foreign messages, and turns the
coordinator's Prepare / CommitView / Stop / Fenced into commands for the
compute thread (through the Handoff).  Messages the compute thread wants to
send to the coordinator (acks, failure reports, recoveries, the final digest)
pass through here too, so one place owns the control connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from deadpool.actors.handoff import Handoff
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import (
    CommitView,
    Fenced,
    Join,
    Message,
    Prepare,
    Rejoin,
    Role,
    Stop,
    ViewReport,
    Welcome,
)
from deadpool.protocol.transport import Transport, TransportError
from deadpool.protocol.view import View

log = logging.getLogger("deadpool.actors.membership")


@dataclass(frozen=True, slots=True)
class Outbound:
    """A message the compute thread asks to send to the coordinator."""

    message: Message


@dataclass(frozen=True, slots=True)
class Inbound:
    """A decoded message that arrived from the coordinator."""

    message: Message


@dataclass(frozen=True, slots=True)
class Drain:
    """Queued behind the compute thread's messages: `done` runs once each of them was handed to the transport.

    Shutdown waits for it, so a seat's last report (``Finished``, posted just before
    ``rt.finish()``) is sent before the transport closes instead of racing the close.
    """

    done: Callable[[], None]


@dataclass(frozen=True, slots=True)
class ViewChanged:
    """Sent to the SnapshotActor when a newer view is adopted."""

    view: View


class MembershipActor:
    """Owns this member's copy of the view and the control channel to the coordinator."""

    def __init__(
        self,
        member: str,
        coordinator: str,
        transport: Transport,
        handoff: Handoff,
        events: EventLog,
        snapshot_inbox: asyncio.Queue[object],
        secret: bytes | None,
        send_timeout: float,
        joined: asyncio.Event,
        reconnected: asyncio.Event,
        identity: tuple[Role, str, int, str, str],
    ) -> None:
        self.inbox: asyncio.Queue[Inbound | Outbound | Drain] = asyncio.Queue(maxsize=256)
        self._member = member
        self._coordinator = coordinator
        self._transport = transport
        self._handoff = handoff
        self._events = events
        self._snapshot_inbox = snapshot_inbox
        self._secret = secret
        self._send_timeout = send_timeout
        self.view: View | None = None
        self._fenced = False
        self._joined = joined
        self._reconnected = reconnected
        self._identity = identity  # (role, host, pid, control_addr, bulk_addr), for ViewReport
        self._join: Join | None = None
        self._last_step = -1

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._rejoin_until_welcomed())
            tasks.create_task(self._rejoin_after_outages())
            while True:
                item = await self.inbox.get()
                if isinstance(item, Outbound):
                    if isinstance(item.message, Join):
                        self._join = item.message
                    step = getattr(item.message, "step", None)
                    if isinstance(step, int):
                        self._last_step = max(self._last_step, step)
                    await self._send(item.message)
                elif isinstance(item, Drain):
                    item.done()
                else:
                    await self._on_message(item.message)

    async def _rejoin_until_welcomed(self) -> None:
        """The coordinator may start after us or drop a Join: repeat it until Welcome arrives."""
        while not self._joined.is_set():
            await asyncio.sleep(0.5)
            if self._join is not None and not self._joined.is_set():
                await self._send(self._join)

    async def _send(self, message: Message) -> None:
        if self._fenced:
            return  # a fenced member changes nothing
        try:
            await self._transport.send(self._coordinator, [codec.encode(message, self._secret)], self._send_timeout)
        except TransportError as err:
            log.warning("could not send %s to the coordinator: %s", type(message).__name__, err)

    async def _rejoin_after_outages(self) -> None:
        """After the coordinator was unreachable, join again: it may be a restarted one that knows nobody."""
        while True:
            await self._reconnected.wait()
            self._reconnected.clear()
            if self._join is not None:
                await self._send(self._join)

    async def _on_message(self, message: Message) -> None:
        epoch = self.view.epoch if self.view else 0
        if isinstance(message, CommitView):
            view = message.view
            if view.epoch <= epoch:
                self._events.emit(Event.REJECTED, reason="stale_view", detail=f"view {view.epoch} <= held {epoch}")
                return
            self.view = view
            await self._snapshot_inbox.put(ViewChanged(view))
            self._handoff.deliver(message)
        elif isinstance(message, Prepare):
            if message.epoch <= epoch:
                self._events.emit(Event.REJECTED, reason="stale_prepare", detail=f"prepare {message.epoch} <= {epoch}")
                return
            self._handoff.deliver(message)
        elif isinstance(message, Fenced):
            if message.member != self._member:
                self._events.emit(Event.REJECTED, reason="misaddressed", detail=f"fence for {message.member}")
                return
            self._fenced = True
            self._events.emit(Event.FENCED, reason=message.reason, fenced_epoch=message.epoch)
            self._handoff.deliver(message)
        elif isinstance(message, Stop):
            self._handoff.deliver(message)
        elif isinstance(message, Rejoin):
            if message.member != self._member:
                self._events.emit(Event.REJECTED, reason="misaddressed", detail=f"rejoin for {message.member}")
                return
            if self._join is not None:
                log.info("the coordinator (epoch %d) does not know us: joining again", message.epoch)
                await self._send(self._join)  # its Welcome then makes us report our view
        elif isinstance(message, Welcome):
            self._joined.set()
            if self.view is not None and message.epoch < self.view.epoch:
                # A restarted coordinator: tell it the view we hold (the highest epoch among members wins).
                role, host, pid, control_addr, bulk_addr = self._identity
                await self._send(ViewReport(self._member, role, host, pid, control_addr, bulk_addr,
                                            self._last_step, self.view))
            log.info("welcomed by the coordinator at epoch %d (world size %d)", message.epoch, message.world_size)
        else:
            self._events.emit(Event.REJECTED, reason="unexpected_type", detail=type(message).__name__)
