"""SnapshotActor: streams this member's snapshots to its buddy, keeps its wards' copies, serves restores.

The I/O side of the buddy relationship, on the runtime thread.  When the
compute side finishes a local snapshot (``LocalReady``) the actor sends it to
its seat's buddy, one transfer in flight at a time, and publishes the buddy's
ack to the compute thread's pre-step gate; on one host the buddy maps the
ward's slot file instead and later snapshots are confirmed in place, without
a message.  As a buddy it hands each ward header to ``WardCopies`` and acks
it; it answers Prepares (``PrepareReady``) and restore requests from those
copies, and fetches a seat's copy for an adopted spare (``Fetch``).  Peer
messages from a newer view than ours wait until our view catches up.  The
argument for holding a ward's slot without copying it is in
``docs/design/snapshots.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from deadpool.actors.handoff import CHECKS_TOLD, Fetch, Fetched, Handoff, LocalReady, PrepareReady, Progress
from deadpool.actors.inbox import Bulk, Drain, Mailbox, Outbound, PrepareArrived, ViewChanged
from deadpool.errors import ActorStopped, RestoreFailed
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import (
    PeerPaused,
    PrepareAck,
    RestorePart,
    RestoreReply,
    RestoreRequest,
    SnapshotAck,
    SnapshotHeader,
)
from deadpool.protocol.transport import Frame, Transport, TransportClosed, TransportError
from deadpool.protocol.view import View
from deadpool.snapshot import shm
from deadpool.snapshot.arena import Slot
from deadpool.snapshot.statetree import Manifest
from deadpool.snapshot.ward_copies import CHUNK_BYTES, MAX_SNAPSHOT_BYTES, WardCopies, payload_chunks

log = logging.getLogger("deadpool.actors.snapshot_actor")

__all__ = ["CHUNK_BYTES", "Command", "SnapshotActor"]

# the local lane: compute thread, membership
Command = LocalReady | Fetch | PrepareReady | ViewChanged | PrepareArrived | Drain
Restored = concurrent.futures.Future[Fetched]
PARKED = 16  # peer messages from a newer view kept until that view arrives
COPYING_WAIT_S = 2.0  # a part of a step this member is finishing or copying waits this long for its snapshot
FINISHING_WAIT_S = 120.0  # ... and one of a step it is still in (a move's Takeover asks as the step begins)
COPYING = 16  # at most this many such requests wait at once; more are answered at once


@dataclass(slots=True)
class _InFlight:
    slot: Slot
    step: int
    generation: str
    sent_at: float
    attempts: int
    epoch: int  # view epoch when this transfer began: acks for headers from older views do not count
    mapped: tuple[str, str, int] | None = None  # (buddy, slot file, allocation) when the buddy is to map it


class SnapshotActor:
    """Owns the buddy relationship: outgoing copies, incoming ward copies, restores."""

    def __init__(
        self,
        member: str,
        transport: Transport,
        handoff: Handoff,
        progress: Progress,
        events: EventLog,
        secret: bytes | None,
        send_timeout: float,
        resend_after: float = 2.0,
        shm_dir: str = "",
        *,
        to_membership: Callable[[Outbound | Drain], None],
        depth: int = 2,
        on_checked: Callable[[], None] = lambda: None,
    ) -> None:
        self.inbox: Mailbox[Command, Bulk] = Mailbox("snapshot actor", peer_size=64)
        self._member = member
        self._transport = transport
        self._handoff = handoff
        self._progress = progress
        self._events = events
        self._secret = secret
        self._send_timeout = send_timeout
        self._resend_after = resend_after
        self._to_membership = to_membership  # PrepareAcks and drain markers continue there, in order
        self._on_checked = on_checked  # a new replica check: the heartbeat tells it now
        self._view: View | None = None
        self._shm_dir = shm_dir
        self._wards = WardCopies(member, secret, shm_dir, events, depth)
        self._inflight: _InFlight | None = None
        self._next: Slot | None = None
        self._parked: deque[Bulk] = deque(maxlen=PARKED)
        self._fetches: dict[tuple[int, int, RestorePart, bool], Restored] = {}
        self._own: dict[int, Slot] = {}  # this member's local snapshot slots, by index (peers ask for slices)
        self._copying: list[RestoreRequest] = []  # parts asked for of a step whose snapshot is not taken yet
        self._tasks: asyncio.TaskGroup | None = None  # owns every send, so none outlives the actor
        self._replies: set[asyncio.Task[None]] = set()  # restore replies not yet handed to the transport
        self._sender: asyncio.Task[None] | None = None
        self._flight_started = asyncio.Event()  # wakes the resend loop, which sleeps while nothing is in flight
        self._shm_refused: set[str] = set()  # buddies that could not map our slots: they get frames
        self._mapped_by_buddy: set[tuple[str, str, int]] = set()  # (buddy, slot file, allocation) it acked, this view

    # -- life ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Set up, serve the inbox until cancelled by the owner, tear down (pending requests fail)."""
        try:
            async with asyncio.TaskGroup() as tasks:
                self._setup(tasks)
                while True:
                    self._handle(await self.inbox.get())
        finally:
            self._teardown()

    def _setup(self, tasks: asyncio.TaskGroup) -> None:
        self._tasks = tasks
        tasks.create_task(self._resend_loop())

    def _teardown(self) -> None:
        """Fail every restore still waiting (queued or sent) with ActorStopped, and let the wards' copies go."""
        self._tasks = None
        waiting = [item.future for item in self.inbox.take_local() if isinstance(item, Fetch)]
        for future in [*self._fetches.values(), *waiting]:
            _fail(future, ActorStopped(f"{self._member}'s snapshot actor stopped (shutdown) before the restore "
                                       "was answered"))
        self._fetches.clear()
        self._wards.clear()
        self._publish_holdings()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `coroutine` as a task of this actor (a send must not hold up the inbox)."""
        if self._tasks is None:
            coroutine.close()
            raise RuntimeError("the snapshot actor is not running")
        return self._tasks.create_task(coroutine)

    def _handle(self, item: Command | Bulk) -> None:
        if isinstance(item, Bulk):
            self._on_bulk(item)
        elif isinstance(item, LocalReady):
            self._on_local(item.slot)
        elif isinstance(item, ViewChanged):
            self._on_view(item.view)
        elif isinstance(item, Fetch):
            self._on_fetch(item)
        elif isinstance(item, PrepareReady):
            self._on_prepare_ready(item)
        elif isinstance(item, PrepareArrived):
            self._answer_early(item.epoch)
        elif isinstance(item, Drain):
            self._to_membership(item)  # after the PrepareAcks handed over before it
        else:
            log.error("snapshot actor: unexpected %s in its inbox, dropped", type(item).__name__)

    # -- outgoing -----------------------------------------------------------------------------

    def _buddy_addr(self) -> str | None:
        view = self._view
        if view is None:
            return None
        seat = view.seat_of(self._member)
        if seat is None or view.world_size < 2:
            return None
        return view.bulk_addrs.get(view.buddy_member(seat))

    def _on_local(self, slot: Slot) -> None:
        self._progress.snapshot_step = slot.step
        self._own[slot.index] = slot
        view = self._view
        if view is None:
            return
        if slot.generation == view.store_prefix:  # else taken before the current view's rebuild: nobody needs it
            self._publish(slot, view)
        # Parts of it asked for before it was taken: answered now, from its slot file where its head names it.
        for request in [r for r in self._copying if r.step == slot.step]:
            self._copying.remove(request)
            self._on_restore_request(request, view)

    def _publish(self, slot: Slot, view: View) -> None:
        """A snapshot of the current view taken: its replica check to the heartbeats, itself to the buddy."""
        if slot.check is not None:  # the heartbeats carry the newest few to the coordinator (replica checks)
            self._progress.checks = (*self._progress.checks[-(CHECKS_TOLD - 1):], (view.epoch, slot.step, slot.check))
            self._on_checked()
        if view.world_size < 2:
            self._handoff.confirm(slot.generation, slot.step)  # no buddy: local only, nothing to wait for
            return
        if self._inflight is None:
            self._start_send(slot)
        else:
            self._next = slot

    def _start_send(self, slot: Slot) -> None:
        """Send the snapshot to the buddy, or, when the buddy already maps this slot file, only publish
        its header in the file's head block and count it confirmed (no message, no ack)."""
        view = self._view
        seat = view.seat_of(self._member) if view else None
        if view is None or seat is None:
            return
        buddy = view.buddy_member(seat)
        mapped = None
        if self._shares_memory_with(view, buddy, slot):
            frame = self._header_frame(slot, shared=True)
            # A header too large for the head block cannot describe the slot there: frames instead.
            if frame is not None and slot.head is not None and shm.write_head(slot.head, frame):
                mapped = (buddy, slot.shm_path, slot.allocation)
                if mapped in self._mapped_by_buddy:
                    self._confirmed(slot.generation, slot.step)
                    return
        self._inflight = _InFlight(slot, slot.step, slot.generation, time.monotonic(), 1, view.epoch, mapped)
        self._flight_started.set()
        self._sender = self._spawn(self._send_snapshot(self._inflight))

    def _header_frame(self, slot: Slot, shared: bool) -> bytes | None:
        """The encoded header of `slot`'s snapshot: naming its file (`shared`) or followed by the payload."""
        view = self._view
        seat = view.seat_of(self._member) if view else None
        if view is None or seat is None or slot.manifest is None:
            return None
        header = SnapshotHeader(self._member, view.epoch, seat, slot.step, slot.nbytes, slot.manifest.encode(),
                                shm_path=slot.shm_path if shared else "", shm_offset=shm.HEAD_BYTES if shared else 0)
        return codec.encode(header, self._secret)

    def _confirmed(self, generation: str, step: int) -> None:
        self._handoff.confirm(generation, step)
        self._progress.confirmed_step = step

    async def _send_snapshot(self, flight: _InFlight) -> None:
        addr, slot = self._buddy_addr(), flight.slot
        if not slot.complete or slot.step != flight.step or slot.generation != flight.generation:
            return  # the slot was reused: a newer snapshot supersedes this one
        if flight.mapped is not None and flight.mapped[0] in self._shm_refused:
            flight.mapped = None  # the buddy cannot map our slots: it gets frames
        shared = flight.mapped is not None
        frame = self._header_frame(slot, shared)
        if addr is None or frame is None:
            return
        frames: list[Frame] = [frame]
        if not shared:
            frames += payload_chunks(slot.payload())  # what the snapshot holds
        try:
            await self._transport.send(addr, frames, self._send_timeout)
            if not shared:
                self._progress.bytes_sent += slot.nbytes
        except TransportClosed:
            return  # shutting down
        except TransportError as err:
            log.warning("snapshot of step %d not sent to buddy: %s (will retry)", slot.step, err)

    def _shares_memory_with(self, view: View, buddy: str, slot: Slot) -> bool:
        """The buddy can map the slot: same host, the slot is a shared-memory file, and it never refused."""
        host = view.hosts.get(self._member, "")
        return bool(slot.shm_path and host) and host == view.hosts.get(buddy) and buddy not in self._shm_refused

    async def _resend_loop(self) -> None:
        """Resend the transfer in flight when no ack came within `resend_after` of its send.

        With nothing in flight it sleeps until a transfer starts (or `resend_after`
        passed), not in short polls: every wake-up of the runtime thread costs CPU
        that training could use.
        """
        while True:
            flight = self._inflight
            if flight is None:
                self._flight_started.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._resend_after):
                        await self._flight_started.wait()
                continue
            wait = flight.sent_at + self._resend_after - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if self._sender is not None and not self._sender.done():
                await asyncio.sleep(self._resend_after / 4)  # still sending it (a slow buddy): look again later
                continue
            log.info("no ack for snapshot of step %d yet; resending (attempt %d)", flight.step, flight.attempts + 1)
            await self._resend(flight)

    def _resend(self, flight: _InFlight) -> Coroutine[Any, Any, None]:
        flight.sent_at = time.monotonic()
        flight.attempts += 1
        return self._send_snapshot(flight)

    def _on_ack(self, ack: SnapshotAck) -> None:
        view, flight = self._view, self._inflight
        seat = view.seat_of(self._member) if view else None
        if view is None or seat is None or ack.sender != view.buddy_member(seat):
            self._events.emit(schema.Rejected(reason="ack_from_non_buddy", peer=ack.sender))
            return
        if ack.error:
            self._on_shm_refused(ack)
            return
        if flight is None or ack.step != flight.step or ack.header_epoch < flight.epoch:
            return  # a late ack for a superseded transfer (or for an older view's header of the same step)
        if flight.mapped is not None:  # later snapshots in this file are confirmed in place
            buddy, path, _ = flight.mapped
            self._mapped_by_buddy = {m for m in self._mapped_by_buddy if m[:2] != (buddy, path)} | {flight.mapped}
        self._confirmed(flight.generation, flight.step)
        self._inflight = None
        pending, self._next = self._next, None
        if pending is not None and pending.complete:
            self._start_send(pending)

    def _on_shm_refused(self, ack: SnapshotAck) -> None:
        """The buddy could not map our slot: from now on it gets frames, starting with this snapshot."""
        if ack.sender not in self._shm_refused:
            self._shm_refused.add(ack.sender)
            log.warning("buddy %s cannot map this member's snapshot slots (%s); sending copies over the wire",
                        ack.sender, ack.error)
            self._events.emit(schema.SnapshotShmRefused(peer=ack.sender, error=ack.error))
        flight = self._inflight
        if flight is None or ack.step != flight.step:
            return
        self._sender = self._spawn(self._resend(flight))

    # -- views and Prepares -------------------------------------------------------------------

    def _on_view(self, view: View) -> None:
        old = self._view
        self._view = view
        self._mapped_by_buddy.clear()  # the buddy (or its view of us) may have changed: map-and-ack again
        self._wards.on_view(view)
        self._publish_holdings()
        if old is None or old.store_prefix != view.store_prefix:
            self._inflight, self._next = None, None  # the compute side re-announces after its rebuild
        parked, self._parked = list(self._parked), deque(maxlen=PARKED)
        for item in parked:
            self._on_bulk(item)  # handled now, or parked again if still from a newer view

    def _on_prepare_ready(self, ready: PrepareReady) -> None:
        """The compute thread stopped for a Prepare: acknowledge it with what it holds and what we hold for
        our wards, as of now (a same-host ward confirms in place, so only the slot heads say which steps)."""
        ward_steps = self._wards.steps(self._view)
        ack = PrepareAck(self._member, ready.epoch, ready.step, list(ready.local_steps), ward_steps,
                         list(ready.disk_steps), list(ready.dirty_groups))
        self._to_membership(Outbound(ack))
        view = self._view
        if view is not None and ready.peers:  # mesh peers that ran ahead stop waiting on this seat
            paused = codec.encode(PeerPaused(self._member, view.epoch, ready.epoch, ready.begun, ready.abandoned,
                                             ready.in_forward),
                                  self._secret)
            for peer in ready.peers:
                addr = view.bulk_addrs.get(peer)
                if addr is not None:
                    self._spawn(self._send(addr, [paused], f"pause notice to {peer}"))

    def _answer_early(self, epoch: int) -> None:
        """Acknowledge a Prepare now, for the compute thread still in its step, with the newest local snapshot.

        Safe without the compute thread: once the Prepare is handed over no boundary starts a capture, and a
        capture already started writes into the other slot (``SnapshotStore._free_slot``), so that snapshot
        stays.  The coordinator commits on these answers when they name a step every seat holds, and waits for
        the full ones (sent from the boundary) otherwise.  Not with a mesh (``Progress.answers_early``)."""
        view = self._view
        complete = [slot for slot in self._own.values() if slot.complete]
        if not self._progress.answers_early or view is None or view.seat_of(self._member) is None or not complete:
            return
        newest = max(complete, key=lambda slot: slot.sequence)
        ack = PrepareAck(self._member, epoch, self._progress.step, [newest.step], self._wards.steps(view), early=True)
        self._to_membership(Outbound(ack))

    def _publish_holdings(self) -> None:
        """The memory report's counters, for the compute thread (through Progress)."""
        self._progress.bytes_held_for_wards = self._wards.bytes_held
        self._progress.bytes_shared_for_wards = self._wards.bytes_shared

    # -- incoming bulk ------------------------------------------------------------------------

    def _on_bulk(self, item: Bulk) -> None:
        message = item.message
        view = self._view
        epoch = getattr(message, "epoch", 0)
        if view is None or epoch > view.epoch:
            if len(self._parked) == PARKED:
                log.warning("dropping a parked %s: more than %d messages from views not seen yet",
                            type(self._parked[0].message).__name__, PARKED)
            self._parked.append(item)  # from a view we have not heard of yet
            return
        if isinstance(message, SnapshotHeader):
            self._on_ward_copy(message, item.frames, view)
        elif isinstance(message, SnapshotAck):
            self._on_ack(message)
        elif isinstance(message, RestoreRequest):
            self._on_restore_request(message, view)
        elif isinstance(message, RestoreReply):
            self._on_restore_reply(message, item.frames)
        elif isinstance(message, PeerPaused):
            if message.sender in view.seats:
                self._handoff.peer_paused(message.sender, message.prepare_epoch, message.begun, message.abandoned,
                                          message.in_forward)
            else:
                self._events.emit(schema.Rejected(reason="not_in_view", peer=message.sender, kind="peer_paused"))
        else:
            self._events.emit(schema.Rejected(reason="unexpected_type", detail=type(message).__name__))

    def _on_ward_copy(self, header: SnapshotHeader, frames: list[memoryview], view: View) -> None:
        taken = self._wards.take(header, frames, view)
        self._publish_holdings()
        if taken.ack:
            ack = SnapshotAck(self._member, view.epoch, header.seat, header.step, taken.error[:500], header.epoch)
            addr = view.bulk_addrs.get(header.sender)
            if addr is not None:
                self._spawn(self._send(addr, [codec.encode(ack, self._secret)],
                                       f"ack for seat {header.seat} step {header.step}"))

    def _on_restore_request(self, request: RestoreRequest, view: View, wait: bool = True) -> None:
        # A seat asks for its own snapshot (HELD), or a spare chosen for it (its prefetch); any seat of the view
        # for another seat's slice (SLICE).
        seated = request.sender in view.seats or request.sender in view.spares
        asker_ok = request.sender in (view.seats[request.seat], *view.spares) \
            if request.part == RestorePart.HELD and 0 <= request.seat < view.world_size else seated
        if not 0 <= request.seat < view.world_size or not asker_ok:
            self._events.emit(schema.Rejected(reason="not_in_view", peer=request.sender, kind="restore_request"))
            return
        step = None if request.newest else request.step
        if view.seat_of(self._member) == request.seat:  # its slice, or (a move's Takeover) its whole snapshot
            host = view.hosts.get(self._member, "")
            shared = request.shared and bool(host) and view.hosts.get(request.sender) == host
            served = self._own_part(request.seat, step, view.world_size, request.part, shared)
            if isinstance(served, str) and wait and step is not None and len(self._copying) < COPYING and \
                    self._progress.snapshot_step < step <= self._progress.step + 2 * int(request.finishing):
                # Finished and still being copied, or (a planned move's spare asks as the seats finish the step the
                # moving seat leaves after: the one in progress, or the next) still to be finished: answered once
                # copied, or refused after a bound.
                self._copying.append(request)
                self._spawn(self._copying_expires(request))
                return
        else:
            served = self._ward_part(request, step, view)
        ok, error, header, payload = (False, served, None, []) if isinstance(served, str) else (True, "", *served)
        reply = RestoreReply(self._member, request.epoch, request.seat, request.step, ok, error, header,
                             request.part, request.newest)
        frames: list[Frame] = [codec.encode(reply, self._secret), *payload]
        task = self._spawn(self._send(request.reply_to, frames, f"restore reply to {request.sender}"))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def replies_sent(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) until every restore reply already begun has been handed to the transport:
        a moved member exits after that, its spare's parts on their way (its transport lingers until they left)."""
        if self._replies:
            await asyncio.wait(set(self._replies), timeout=timeout)

    async def _copying_expires(self, request: RestoreRequest) -> None:
        await asyncio.sleep(FINISHING_WAIT_S if request.finishing else COPYING_WAIT_S)
        if request in self._copying and self._view is not None:
            self._copying.remove(request)
            self._on_restore_request(request, self._view, wait=False)

    def _ward_part(self, request: RestoreRequest, step: int | None,
                   view: View) -> tuple[SnapshotHeader, list[Frame]] | str:
        """What a ward's copy holds of (seat, `step`; None: the newest), or its slice of the replicated region;
        why not as a str."""
        copy = self._wards.find(request.seat, step, view)
        if copy is None:
            held = self._wards.held_steps(request.seat)
            return f"no copy of seat {request.seat} step {'(newest)' if step is None else step} here (held: {held})"
        # Served as frames even when held in shared memory: the requester may be on another host.
        header = dataclasses.replace(copy.header, shm_path="", shm_offset=0)
        if request.part == RestorePart.HELD:
            return header, list(copy.frames)
        try:
            size = Manifest.decode(header.manifest, MAX_SNAPSHOT_BYTES).replicated // view.world_size
        except ValueError as err:
            return f"the copy of seat {request.seat} step {request.step} has a bad manifest: {err}"
        return dataclasses.replace(header, nbytes=size), _chunks(_tail(copy.frames, size))

    def _own_part(self, seat: int, step: int | None, world: int, part: RestorePart,
                  shared: bool = False) -> tuple[SnapshotHeader, list[Frame]] | str:
        """This member's slice of the replicated region in its own snapshot of `step` (None: the newest), or the
        whole snapshot (`part` HELD), copied now (the slot is reused by a later capture), or, a slice for a
        `shared` asker on this host, named in the slot file whose head says it holds it (the asker reads it
        there; not the whole snapshot, asked of a member that moves away: its files go when it exits); why not
        as a str."""
        held = [slot for slot in self._own.values() if slot.complete and slot.manifest is not None
                and (slot.seat, slot.world) == (seat, world) and step in (None, slot.step)]
        slot = max(held, key=lambda s: s.sequence, default=None)
        if slot is None or slot.manifest is None:
            steps = sorted(s.step for s in self._own.values() if s.complete)
            return f"seat {seat} holds no snapshot of step {'(newest)' if step is None else step} (held: {steps})"
        sequence, served, manifest = slot.sequence, slot.step, slot.manifest
        size = manifest.replicated // world if part == RestorePart.SLICE else slot.nbytes
        view_epoch = self._view.epoch if self._view else 0
        if shared and part == RestorePart.SLICE and slot.shm_path and slot.head is not None and \
                shm.read_head(slot.head) is not None:
            return SnapshotHeader(self._member, view_epoch, seat, served, size, manifest.encode(),
                                  shm_path=slot.shm_path, shm_offset=shm.HEAD_BYTES + slot.nbytes - size), []
        data = bytes(slot.payload()[slot.nbytes - size :])
        if slot.sequence != sequence or not slot.complete:
            return f"seat {seat}'s snapshot of step {served} was replaced while it was being read"
        return SnapshotHeader(self._member, view_epoch, seat, served, size, manifest.encode()), \
            _chunks(data)

    async def _send(self, address: str, frames: list[Frame], what: str) -> None:
        try:
            await self._transport.send(address, frames, self._send_timeout)
        except TransportClosed:
            return  # shutting down
        except TransportError as err:
            log.warning("%s not sent: %s", what, err)

    # -- restores for this member -------------------------------------------------------------

    def _on_fetch(self, fetch: Fetch, shared: bool = True) -> None:
        view = self._view
        addr = view.bulk_addrs.get(fetch.member) if view else None
        if view is None or addr is None:
            _fail(fetch.future, RestoreFailed(f"no address for member {fetch.member}"))
            return
        key = (fetch.seat, fetch.step, fetch.part, fetch.newest)
        older = self._fetches.get(key)
        if older is not None:
            _fail(older, RestoreFailed(f"restore of seat {fetch.seat} step {fetch.step} asked for again"))
        self._fetches[key] = fetch.future
        shared = shared and fetch.part == RestorePart.SLICE and bool(self._shm_dir) and \
            view.hosts.get(fetch.member, "") == view.hosts.get(self._member)
        request = RestoreRequest(self._member, view.epoch, fetch.seat, fetch.step, self._transport.address,
                                 fetch.part, fetch.newest, shared, fetch.finishing)
        self._spawn(self._request_restore(fetch, addr, request))

    async def _request_restore(self, fetch: Fetch, addr: str, request: RestoreRequest) -> None:
        try:
            await self._transport.send(addr, [codec.encode(request, self._secret)], self._send_timeout)
        except TransportError as err:
            key = (fetch.seat, fetch.step, fetch.part, fetch.newest)
            if self._fetches.get(key) is fetch.future:
                del self._fetches[key]
            _fail(fetch.future, RestoreFailed(f"restore request to {fetch.member} failed: {err}"))

    def _on_restore_reply(self, reply: RestoreReply, frames: list[memoryview]) -> None:
        future = self._fetches.pop((reply.seat, reply.step, reply.part, reply.newest), None)
        if future is None or future.done():
            return
        if not reply.ok or reply.header is None:
            _fail(future, RestoreFailed(reply.error or "restore refused"))
            return
        if reply.header.shm_path:
            shared = self._read_shared(reply, reply.header, frames)
            if isinstance(shared, str):  # asked again, for frames: a same-host read is only a shortcut
                log.info("slice of seat %d step %d not read from %s (%s): asking for frames", reply.seat,
                         reply.step, reply.header.shm_path, shared)
                self._on_fetch(Fetch(reply.seat, reply.step, reply.sender, future, reply.part, reply.newest),
                               shared=False)
                return
            frames = shared
        if sum(len(f) for f in frames) != reply.header.nbytes:
            _fail(future, RestoreFailed("restore payload size does not match its header"))
            return
        try:
            manifest = Manifest.decode(reply.header.manifest, MAX_SNAPSHOT_BYTES)
        except ValueError as err:
            _fail(future, RestoreFailed(f"bad manifest in restore reply: {err}"))
            return
        future.set_result(Fetched(reply.header.step, manifest, frames))

    def _read_shared(self, reply: RestoreReply, header: SnapshotHeader,
                     frames: list[memoryview]) -> list[memoryview] | str:
        """A slice a same-host seat named in its slot file, copied out of it, if the slot's head says, before
        and after the copy, that the sender published its snapshot of that step there; why not as a str."""
        if reply.part != RestorePart.SLICE or frames:
            return "a shared reply is for a slice and carries no payload"
        try:
            mapping = shm.map_readonly(header.shm_path, self._shm_dir, header.shm_offset, header.nbytes, None)
        except shm.ShmRefused as err:
            return str(err)
        head = mapping.view[: shm.HEAD_BYTES]
        before = shm.read_head(head)
        data = bytes(mapping.view[header.shm_offset : header.shm_offset + header.nbytes])
        if before is None or shm.read_head(head) != before:
            return "the slot was being rewritten"
        published = codec.decode(before, self._secret)
        if not isinstance(published, SnapshotHeader) or (published.sender, published.seat, published.step,
                                                         published.shm_path) != \
                (reply.sender, header.seat, header.step, header.shm_path) or \
                not published.shm_offset <= header.shm_offset <= header.shm_offset + header.nbytes \
                <= published.shm_offset + published.nbytes:
            return "its head does not publish that snapshot there"
        return [memoryview(data)]


def _chunks(data: bytes) -> list[Frame]:
    """`data` as frames of at most CHUNK_BYTES, like every snapshot: the bulk socket drops larger ones."""
    return list(payload_chunks(memoryview(data)))


def _tail(frames: list[memoryview], size: int) -> bytes:
    """A copy of the last `size` bytes of `frames` (a mapped slot may be rewritten after this returns)."""
    parts: list[memoryview] = []
    for frame in reversed(frames):
        if size <= 0:
            break
        parts.append(frame[max(0, len(frame) - size) :])
        size -= len(parts[-1])
    return b"".join(reversed(parts))


def _fail(future: Restored, error: Exception) -> None:
    """Fail a restore's future unless it is already done (answered, failed or cancelled by its caller)."""
    if not future.done():
        future.set_exception(error)
