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
from collections.abc import Awaitable, Callable

from deadpool.actors.handoff import Handoff
from deadpool.actors.inbox import Drain, Inbound, Mailbox, Outbound, PrepareArrived, ViewChanged
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol import codec, viewsync
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import (
    Audit,
    CommitView,
    Coordinators,
    Fenced,
    Finished,
    Hold,
    Holding,
    Join,
    Leave,
    LeaveAt,
    Message,
    Prepare,
    PrepareAck,
    Rejoin,
    Role,
    Stop,
    Takeover,
    ViewChunk,
    ViewDelta,
    ViewReport,
    ViewRequest,
    Welcome,
)
from deadpool.protocol.transport import Transport, TransportClosed, TransportError
from deadpool.protocol.view import View

log = logging.getLogger("deadpool.actors.membership")


class MembershipActor:
    """Owns this member's copy of the view and the control channel to the coordinator."""

    def __init__(
        self,
        member: str,
        link: CoordinatorLink,
        transport: Transport,
        handoff: Handoff,
        events: EventLog,
        to_snapshots: Callable[[ViewChanged | PrepareArrived], None],
        secret: bytes | None,
        send_timeout: float,
        joined: asyncio.Event,
        reconnected: asyncio.Event,
        identity: tuple[Role, str, int, str, str],
        via_agent: Callable[[bytes], Awaitable[bool]] | None = None,
    ) -> None:
        # Local lane: the compute thread's messages and drain markers (through the SnapshotActor), in order.
        self.inbox: Mailbox[Outbound | Drain, Inbound] = Mailbox("membership actor", peer_size=256)
        self._member = member
        self._link = link
        self._transport = transport
        self._handoff = handoff
        self._events = events
        self._to_snapshots = to_snapshots
        self._secret = secret
        self._send_timeout = send_timeout
        self.view: View | None = None
        self._digest: bytes | None = None  # of the view held (computed when a delta needs it)
        self._pieces = viewsync.Reassembly()  # a whole view arriving in pieces
        self._fenced = False
        self._joined = joined
        self._reconnected = reconnected
        self._identity = identity  # (role, host, pid, control_addr, bulk_addr), for ViewReport
        self._join: Join | None = None
        self._last_step = -1
        self._prepared = (0, 0)  # (term, epoch) of the newest Prepare handed on: its direct resend is a repeat
        # The host agent batches its workers' PrepareAcks (agent/relay.py); the ones it took for the newest
        # Prepare are sent again directly when that Prepare comes again (the coordinator lost the agent).
        self._via_agent = via_agent
        self._acks_via_agent: list[PrepareAck] = []

    async def run(self) -> None:
        """Set up (the rejoin tasks), serve the inbox until cancelled by the owner, tear down."""
        try:
            async with asyncio.TaskGroup() as tasks:
                self._setup(tasks)
                while True:
                    await self._handle(await self.inbox.get())
        finally:
            self._teardown()

    def _setup(self, tasks: asyncio.TaskGroup) -> None:
        tasks.create_task(self._rejoin_until_welcomed())
        tasks.create_task(self._rejoin_after_outages())

    def _teardown(self) -> None:
        """Nobody waits on this actor; what was still queued for the coordinator is only counted."""
        unsent = [item for item in self.inbox.take_local() if isinstance(item, Outbound)]
        if unsent:
            log.info("stopped with %d message(s) for the coordinator unsent: %s", len(unsent),
                     ", ".join(type(item.message).__name__ for item in unsent))

    async def _handle(self, item: Outbound | Drain | Inbound) -> None:
        if isinstance(item, Outbound):
            if isinstance(item.message, Join):
                self._join = item.message
            step = getattr(item.message, "step", None)
            if isinstance(step, int):
                self._last_step = max(self._last_step, step)
            await self._send(item.message)
        elif isinstance(item, Drain):
            item.done()  # every message queued before it was handed to the transport
        elif isinstance(item, Inbound):
            await self._on_message(item.message)
        else:
            log.error("membership actor: unexpected %s in its inbox, dropped", type(item).__name__)

    async def _rejoin_until_welcomed(self) -> None:
        """The coordinator may start after us or drop a Join: repeat it until Welcome arrives."""
        while not self._joined.is_set():
            await asyncio.sleep(0.5)
            if self._join is not None and not self._joined.is_set():
                await self._send(self._join)

    async def _send(self, message: Message, direct: bool = False) -> None:
        if self._fenced:
            return  # a fenced member changes nothing
        try:
            frame = codec.encode(message, self._secret)
            if isinstance(message, PrepareAck) and not direct and self._via_agent and await self._via_agent(frame):
                self._acks_via_agent.append(message)
                return
            await self._transport.send(self._link.active, [frame], self._send_timeout)
            if isinstance(message, Finished) and self._link.standby:
                # A seat's Finished is its last word (the process exits next): the standby keeps it for a
                # coordinator of the next term, should the active one be lost before it counted every seat.
                await self._transport.send(self._link.standby, [frame], self._send_timeout)
        except TransportClosed:
            log.info("%s not sent to the coordinator: shutting down", type(message).__name__)
        except TransportError as err:
            log.warning("could not send %s to the coordinator: %s", type(message).__name__, err)

    async def _follow(self, message: Coordinators) -> None:
        """A newer term (a standby took over) or a new standby: talk to that term's active coordinator.

        A new active knows nobody yet: our Join makes it welcome us, and its Welcome makes us
        report the view we hold, as for a restarted coordinator.
        """
        newer = message.term > self._link.term
        if not self._link.follow(message.term, message.active, message.standby):
            return
        if newer:
            self._events.emit(schema.TermFollowed(term=message.term, active=message.active))
        if self._join is not None:
            await self._send(self._join)

    def _adopt(self, message: CommitView, digest: bytes | None) -> None:
        """A whole committed view, newer than the one held: hand it to the snapshot side and the compute thread."""
        view = message.view
        held = self.view.epoch if self.view else 0
        if view.epoch <= held:
            self._events.emit(schema.Rejected(reason="stale_view", detail=f"view {view.epoch} <= held {held}"))
            return
        self.view, self._digest = view, digest
        self._to_snapshots(ViewChanged(view))  # before the compute thread can act on it (and snapshot in it)
        self._handoff.deliver(message)

    async def _on_delta(self, delta: ViewDelta) -> None:
        """Apply a delta to the view held; without its base (or on a digest mismatch) ask for the whole view."""
        held = self.view.epoch if self.view else 0
        if delta.epoch <= held:
            self._events.emit(schema.Rejected(reason="stale_view", detail=f"view {delta.epoch} <= held {held}"))
            return
        view, why = None, "no view held"
        if self.view is not None:
            if self._digest is None:
                self._digest = viewsync.view_digest(self.view)
            view, why = viewsync.apply_delta(self.view, self._digest, delta)
        if view is None:
            log.info("view %d: %s; asking for the whole view", delta.epoch, why)
            await self._send(ViewRequest(self._member, held))
            return
        self._adopt(CommitView(view, delta.term), delta.digest)

    async def _rejoin_after_outages(self) -> None:
        """After the coordinator was unreachable, join again: it may be a restarted one that knows nobody."""
        while True:
            await self._reconnected.wait()
            self._reconnected.clear()
            if self._join is not None:
                await self._send(self._join)

    async def _on_message(self, message: Message) -> None:
        epoch = self.view.epoch if self.view else 0
        term = getattr(message, "term", 0)
        if self._link.stale(term):
            self._events.emit(schema.Rejected(reason="stale_term", kind=type(message).__name__,
                              detail=f"term {term} < followed {self._link.term}"))
            return
        if isinstance(message, Coordinators):
            await self._follow(message)
        elif isinstance(message, CommitView):
            self._adopt(message, None)
        elif isinstance(message, ViewDelta):
            await self._on_delta(message)
        elif isinstance(message, ViewChunk):
            view, why = self._pieces.add(message)
            if view is not None:
                self._adopt(CommitView(view, message.term), message.digest)
            elif why:
                self._events.emit(schema.Rejected(reason="bad_view_chunk", detail=why))
        elif isinstance(message, Prepare):
            if message.epoch <= epoch:
                self._events.emit(schema.Rejected(reason="stale_prepare", detail=f"prepare {message.epoch} <= {epoch}"))
                return
            if (message.term, message.epoch) <= self._prepared:
                # The same Prepare again, sent directly: its relay or our answers were lost with our agent
                # (coordinator/fanout.py). The compute thread has it; the answers the agent took go again.
                for ack in [a for a in self._acks_via_agent if a.epoch == message.epoch]:
                    await self._send(ack, direct=True)
                return
            self._prepared, self._acks_via_agent = (message.term, message.epoch), []
            self._handoff.deliver(message)
            self._to_snapshots(PrepareArrived(message.epoch))  # after: the compute thread takes no snapshot now
        elif isinstance(message, Fenced):
            if message.member != self._member:
                self._events.emit(schema.Rejected(reason="misaddressed", detail=f"fence for {message.member}"))
                return
            self._fenced = True
            self._events.emit(schema.Fenced(reason=message.reason, fenced_epoch=message.epoch))
            self._handoff.deliver(message)
        elif isinstance(message, Stop):
            self._handoff.deliver(message)
        elif isinstance(message, (Leave, Hold, Takeover, Audit, Rejoin)) and message.member != self._member:
            self._events.emit(schema.Rejected(reason="misaddressed",
                                              detail=f"{type(message).__name__} for {message.member}"))
        elif isinstance(message, Leave):
            step, why = self._handoff.request_leave(message)
            log.info("told to leave: leaving after step %d, %s", step, why)
            epoch = self.view.epoch if self.view else message.epoch
            await self._send(LeaveAt(self._member, epoch, step))  # the others hold after that step
        elif isinstance(message, Hold):
            ended = self._handoff.request_hold(message)
            if ended is not None:  # told too late: the coordinator need not wait for this seat to end that step
                self._events.emit(schema.SeatHeld(step=message.step, late=True))
                await self._send(Holding(self._member, self.view.epoch if self.view else message.epoch, ended))
        elif isinstance(message, Takeover):
            self._handoff.deliver(message)  # the waiting spare's compute thread fetches the seat's state
        elif isinstance(message, Audit):
            self._handoff.request_audit(message)
        elif isinstance(message, Rejoin):
            if self._join is not None:
                log.info("the coordinator (epoch %d) does not know us: joining again", message.epoch)
                await self._send(self._join)  # its Welcome then makes us report our view
        elif isinstance(message, Welcome):
            self._joined.set()
            if message.term:
                self._link.follow(message.term, self._link.active, message.standby)
            if self.view is not None and message.epoch < self.view.epoch:
                # A restarted coordinator: tell it the view we hold (the highest epoch among members wins).
                role, host, pid, control_addr, bulk_addr = self._identity
                await self._send(ViewReport(self._member, role, host, pid, control_addr, bulk_addr,
                                            self._last_step, self.view))
            log.info("welcomed by the coordinator at epoch %d (world size %d)", message.epoch, message.world_size)
        else:
            self._events.emit(schema.Rejected(reason="unexpected_type", detail=type(message).__name__))
